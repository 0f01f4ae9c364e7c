"""One decoder-only transformer, driven by an HF config, over a flattened batch with paged KV.

Families: Llama (and SmolLM2), Mistral (sliding window), Qwen2 (QKV bias), Qwen3 (q/k norms),
Phi-3 with a plain rope (Llama's blocks, q/k/v and gate/up fused in its checkpoint),
Gemma 3 text (hybrid sliding/global layers, (1 + w) norms, scaled embeddings, sandwich norms),
and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE (MoE layers use batchrun.model.moe).
Parameter names follow HF's so checkpoints load by name; q/k/v and gate/up are fused at load time
because one wide matmul beats three narrow ones on every backend.

Every module that runs a kernel holds the model's kernel set (kernels/kernel_set.py: KernelSet),
given at construction and again by `DecoderLM.use_kernels` (build_decoder binds the set for the
model's device and dtype; engine start-up binds its own, then the tuned one), and calls its
fields: no module asks which device it runs on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from batchrun.kernels import elementwise as ew
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.binding import default_kernels, reference_kernels
from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.qkv_heads import QKVHeads
from batchrun.model.kernel_user import KernelUser
from batchrun.model.moe import (
    SparseMoeBlock,
    expert_token_counts,
    fused_moe_weights,
    moe_config_fields,
    reset_expert_token_counts,
)
from batchrun.model.tensor_parallel import TensorParallel, local_spec, local_vocab_size

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe")


def is_native_phi3(config: Any) -> bool:
    """Phi-3 with a plain rope (every dimension rotated, no longrope/su/linear scaling): Llama's
    blocks, its checkpoint's q/k/v and gate/up already fused (qkv_proj, gate_up_proj) as this
    decoder holds them; its residual dropouts are identities at inference. Any other Phi-3 runs on
    the generic path (model/generic.py)."""
    if getattr(config, "model_type", None) != "phi3":
        return False
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return rope_type == "default" and float(factor if factor is not None else 1.0) == 1.0


@dataclass(frozen=True)
class DecoderSpec:
    """What differs between the families, read once from the HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str
    qkv_bias: bool
    qk_norm: bool
    gemma_norms: bool  # (1 + w) RMSNorm, sandwich norms around attention and MLP, sqrt(d) embedding scale
    attn_scale: float
    layer_windows: tuple[Optional[int], ...]  # per layer: sliding window or None for global
    layer_rope_keys: tuple[str, ...]  # per layer: which rope table it uses
    tie_word_embeddings: bool
    final_logit_softcap: Optional[float]
    attn_logit_softcap: Optional[float]
    max_position_embeddings: int
    # Mixture of experts (see batchrun.model.moe); num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = False  # renormalize the top-k routing weights to sum to 1
    moe_weights_fp32: bool = False  # keep routing weights in float32 (Mixtral) instead of the model dtype
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse MoE block (True) or dense MLP
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert; 0 = none
    # Tensor parallelism (model/tensor_parallel.py: local_spec): this rank of a group of tp_size. A
    # rank's spec counts its own heads and MLP slice; vocab_size stays the whole vocabulary.
    tp_rank: int = 0
    tp_size: int = 1
    tp_kv_copies: int = 1  # ranks that hold each KV head (more than 1 with fewer KV heads than ranks)

    @staticmethod
    def from_hf(config: Any) -> DecoderSpec:
        mt = config.model_type
        if mt not in SUPPORTED_MODEL_TYPES and not is_native_phi3(config):
            raise ValueError(f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_layers = config.num_hidden_layers
        layer_types = list(getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None)
        if mt in ("mistral", "mixtral", "qwen3_moe", "phi3"):  # one window (or none) for every layer
            layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
        if not layer_types:
            layer_types = ["full_attention"] * num_layers
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        is_gemma = mt == "gemma3_text"
        scale = (config.query_pre_attn_scalar**-0.5) if is_gemma else head_dim**-0.5
        rope_params = getattr(config, "rope_parameters", None) or {}
        per_type_rope = (
            isinstance(rope_params, dict)
            and all(isinstance(v, dict) for v in rope_params.values())
            and bool(rope_params)
        )
        rope_keys = tuple(t if per_type_rope else "default" for t in layer_types)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if not isinstance(act, str):
            raise ValueError(f"activation {act!r} is not supported")
        return DecoderSpec(
            model_type=mt,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            activation=act,
            qkv_bias=mt == "qwen2"
            or bool(getattr(config, "attention_bias", False))
            or (mt == "qwen2_moe" and bool(getattr(config, "qkv_bias", True))),
            qk_norm=mt in ("qwen3", "gemma3_text", "qwen3_moe"),
            gemma_norms=is_gemma,
            attn_scale=scale,
            layer_windows=windows,
            layer_rope_keys=rope_keys,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            final_logit_softcap=getattr(config, "final_logit_softcapping", None),
            attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
            max_position_embeddings=config.max_position_embeddings,
            **moe_config_fields(config, num_layers),
        )


class RMSNorm(KernelUser):
    """RMSNorm computed in float32, as HF does; Gemma scales by (1 + w) instead of w."""

    def __init__(self, dim: int, eps: float, is_gemma: bool, kernels: Optional[KernelSet] = None) -> None:
        super().__init__(kernels)
        self.weight = nn.Parameter(torch.zeros(dim) if is_gemma else torch.ones(dim))
        self.eps = eps
        self.is_gemma = is_gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps, self.is_gemma)

    def add_forward(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + h), residual + h), one pass; `residual` may be updated in place."""
        assert not self.is_gemma, "Gemma adds its sublayer outputs after their own norms"
        return self.kernels.add_rms_norm(h, residual, self.weight, self.eps)

    def into(self, linear: Optional[nn.Module], h: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[Any, Any]:
        """(norm(residual + h), residual + h) as the input of `linear`, the one layer it feeds
        (`add_forward`; without a residual norm(h) and h). Where `linear` takes its input quantized
        per token (fp8 / W8A8 on a GPU say so by `input_quant`: their kernel takes quantized rows,
        and the kernel set has the norm that writes them), the rows come with their codes from this
        same pass (QuantizedRows), and the linear skips its own quantization kernel."""
        input_quant: Optional[Callable[[torch.Tensor], Any]] = getattr(linear, "input_quant", None)
        quant = None
        if (
            input_quant is not None
            and h.dim() == 2
            and h.stride(1) == 1
            and (residual is None or (residual.stride(1) == 1 and residual.shape == h.shape))
        ):
            quant = input_quant(h)
        if quant is not None:
            rms_norm_quant = self.kernels.rms_norm_quant
            assert rms_norm_quant is not None, "a linear takes quantized rows where no norm writes them"
            return rms_norm_quant(h, residual, self.weight, self.eps, quant)
        if residual is None:
            return self(h), h
        return self.add_forward(h, residual)


class RotaryTables:
    """cos/sin per rope variant ("default", or per layer type for Gemma 3), computed like HF."""

    def __init__(self, config: Any, spec: DecoderSpec) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.inv_freq: dict[str, torch.Tensor] = {}
        self.scaling: dict[str, float] = {}
        rope_params = getattr(config, "rope_parameters", None) or {}
        for key in set(spec.layer_rope_keys):
            params = rope_params.get(key, rope_params) if key != "default" else rope_params
            rope_type = (params or {}).get("rope_type", "default")
            if rope_type == "default":
                base = (params or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
                dim = spec.head_dim
                inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
                self.inv_freq[key], self.scaling[key] = inv, 1.0
            else:
                fn = ROPE_INIT_FUNCTIONS[rope_type]
                kwargs = {"layer_type": key} if key != "default" else {}
                inv, factor = fn(config, None, **kwargs)
                self.inv_freq[key], self.scaling[key] = inv.float(), float(factor)

        self.num_positions = spec.max_position_embeddings
        self._tables: dict[tuple[torch.dtype, torch.device], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def tables(self, dtype: torch.dtype, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per rope variant (cos, sin), each (num_positions, head_dim) in `dtype`: row p is position p's.
        Computed once per dtype and device (build_decoder does it at load, for the device as its
        tensors name it, e.g. "cuda:0", which is what a step's positions name, so no step computes
        them and a CUDA graph never captures their computation). Each element is the one a
        computation over only this step's positions gives (the ops are elementwise), which is HF's."""
        key = (dtype, torch.device(device))
        if key not in self._tables:
            positions = torch.arange(self.num_positions, device=device)
            out = {}
            for name, inv in self.inv_freq.items():
                freqs = positions[:, None].float() * inv[None, :].to(device)  # (num_positions, head_dim / 2)
                emb = torch.cat((freqs, freqs), dim=-1)  # (num_positions, head_dim)
                scaling = self.scaling[name]
                out[name] = ((emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype))
            self._tables[key] = out
        return self._tables[key]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per rope variant (cos, sin) rows of `positions`, each (num_tokens, head_dim)."""
        tables = self.tables(dtype, positions.device)
        return {name: (cos[positions], sin[positions]) for name, (cos, sin) in tables.items()}

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype, reads_tables: bool) -> dict[str, Rope]:
        """What each layer's qkv_norm_rope_write takes this step. Where it reads the tables by
        position itself (`reads_tables`: the Triton kernels), the tables and the positions (no
        gather kernels per step); elsewhere the rows, gathered once per step rather than once per layer."""
        if reads_tables:
            tables = self.tables(dtype, positions.device)
            return {name: Rope(cos, sin, positions) for name, (cos, sin) in tables.items()}
        return {name: Rope(cos, sin, None) for name, (cos, sin) in self.cos_sin(positions, dtype).items()}


@dataclass(frozen=True)
class Rope:
    """Rotary inputs of one step: per-token rows (num_tokens, head_dim) with `positions` None, or
    per-position tables (num_positions, head_dim) and the tokens' positions (num_tokens,)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: Optional[torch.Tensor]


class Attention(KernelUser):
    tp: Optional[TensorParallel] = None  # a rank of a group: o_proj's partial sums are all-reduced

    def __init__(self, spec: DecoderSpec, layer_idx: int, kernels: Optional[KernelSet] = None) -> None:
        super().__init__(kernels)
        self.spec = spec
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.gemma_norms, kernels)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.gemma_norms, kernels)
        self.window = spec.layer_windows[layer_idx]
        self.rope_key = spec.layer_rope_keys[layer_idx]

    def _heads(self) -> QKVHeads:
        # Made per call: the norms' weights are replaced when the model gets its storage.
        s = self.spec
        q_norm, k_norm = (self.q_norm.weight, self.k_norm.weight) if s.qk_norm else (None, None)
        return QKVHeads(s.num_heads, s.num_kv_heads, s.head_dim, q_norm, k_norm, s.rms_norm_eps, s.gemma_norms)

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        rope = cos_sin[self.rope_key]
        k_cache, v_cache = kv_cache
        # The projection, then q/k-norm, rotary and the KV write: on the GPU one fused kernel for the
        # latter three, or one for all four (kernels/fused_projections.py); the separate ops elsewhere
        ks = self.kernels
        q, k, v = ks.qkv_project(
            x, self.qkv_proj, self._heads(), rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping, rope.positions
        )
        o = ks.paged_attention(q, k_cache, v_cache, meta, s.attn_scale, self.window, s.attn_logit_softcap, k, v)
        out = self.o_proj(o.reshape(-1, self.q_size))  # (num_tokens, hidden_size); a partial sum in a group
        if self.tp is not None:
            self.tp.comm.all_reduce(out)
        return out


class MLP(KernelUser):
    gate_up_proj: nn.Module  # nn.Linear, or the packed/quantized module model/prepare.py puts there
    down_proj: nn.Module
    tp: Optional[TensorParallel] = None  # a rank of a group: down_proj's partial sums are all-reduced

    def __init__(self, spec: DecoderSpec, kernels: Optional[KernelSet] = None) -> None:
        super().__init__(kernels)
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.activation = spec.activation
        ew.activation(spec.activation)  # an unsupported name fails at construction
        self.fused_act = False  # gate_up_proj returns act(gate) * up itself (model/prepare.py decides)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_act:
            out = self.down_proj(self.gate_up_proj(x))
        else:
            out = self.down_proj(self.kernels.gate_up_act(x, self.gate_up_proj, self.activation))
        if self.tp is not None:
            self.tp.comm.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, kernels: Optional[KernelSet] = None) -> None:
        super().__init__()
        self.spec = spec
        self.self_attn = Attention(spec, layer_idx, kernels)
        is_moe = bool(spec.moe_layers) and spec.moe_layers[layer_idx]
        self.mlp = SparseMoeBlock(spec, ew.activation(spec.activation), kernels) if is_moe else MLP(spec, kernels)
        g = spec.gemma_norms
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, g, kernels)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, g, kernels)
        if g:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, g, kernels)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, g, kernels)

    def forward(
        self, x, residual, cos_sin, kv_cache, meta, normed: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(x, residual) -> (x', residual'): the hidden state is x + residual, or x where residual is
        None. The add of each sublayer's output is left to the next norm, which fuses it. `normed`:
        input_layernorm(x), already computed (with the embedding, for layer 0), residual None."""
        if self.spec.gemma_norms:
            if residual is not None:
                x = x + residual
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), None
        if residual is None and normed is not None:  # layer 0's norm, fused with the embedding
            h, residual = normed, x
        else:
            h, residual = self.input_layernorm.into(self.self_attn.qkv_proj, x, residual)
        h = self.self_attn(h, cos_sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.into(getattr(self.mlp, "gate_up_proj", None), h, residual)
        return self.mlp(h), residual


def build_decoder(
    config: Any,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: Any,
    kernels: Optional[KernelSet] = None,
    tp: Optional[TensorParallel] = None,
) -> DecoderLM:
    """The model with its weights from an HF-named `state_dict` (emptied as it is copied in), each
    allocated once, in `dtype` on `device`, running `kernels` (None: the set bound for `device` and
    `dtype`). `tp`: this rank's part of a tensor-parallel group; `state_dict` then holds this
    rank's slices (model/tensor_parallel.py: ShardSlicer). It is built on the meta device (no
    memory, no random init) and then given storage: a model built in float32 and cast afterwards
    holds a float32 copy of every weight on the way, which on a GPU stays in the allocator's cache,
    out of the KV cache's reach."""
    kernels = kernels if kernels is not None else default_kernels(device, dtype)
    with torch.device("meta"):
        model = DecoderLM(config, kernels, tp)
    model = model.to(dtype).to_empty(device=device)
    for buf in model.buffers():
        buf.zero_()  # the buffers made at construction are counters that start at zero
    if model.spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty gave each its own storage
    with torch.device(device):
        model.rope = RotaryTables(config, model.spec)  # computed on meta above: no values
        # at load, not in a step (or a graph capture), for the device as a tensor names it ("cuda:0")
        model.rope.tables(dtype, model.embed_tokens.weight.device)
    model.load_hf_state_dict(state_dict, consume=True)
    return model


class DecoderLM(nn.Module):
    """The whole model: embeddings, decoder layers, final norm and LM head."""

    def __init__(self, config: Any, kernels: Optional[KernelSet] = None, tp: Optional[TensorParallel] = None) -> None:
        """`kernels`: the kernel set every module runs (None: the references, until `use_kernels`);
        `tp`: this rank's part of a tensor-parallel group (None: the whole model in one process)."""
        super().__init__()
        self.kernels = kernels if kernels is not None else reference_kernels()
        spec = DecoderSpec.from_hf(config)
        if tp is not None:
            tp = dataclasses.replace(tp, vocab_size=spec.vocab_size)
            spec = local_spec(spec, tp.shard)
        self.spec = spec
        self.tp = tp
        vocab_rows = local_vocab_size(spec.vocab_size, spec.tp_size)  # this rank's slice, padded
        self.embed_tokens = nn.Embedding(vocab_rows, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, self.kernels) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.gemma_norms, self.kernels)
        self.lm_head = nn.Linear(spec.hidden_size, vocab_rows, bias=False)
        if tp is not None:
            for module in self.modules():
                if isinstance(module, (Attention, MLP, SparseMoeBlock)):
                    module.tp = tp
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryTables(config, spec)

    def use_kernels(self, kernels: KernelSet) -> None:
        """Give every module its callables from `kernels` (a set for the same target and options as
        the one the linears were prepared with: a quantized layer keeps the weight layout it holds)."""
        self.kernels = kernels
        for module in self.modules():
            use = getattr(module, "use_kernels", None)
            if module is not self and callable(use):
                use(kernels)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
        num_layers: Optional[int] = None,  # run only the first layers (self-speculative drafts)
    ) -> torch.Tensor:
        tp = self.tp
        if tp is not None and tp.link is not None:
            tp.link.ship_forward(input_ids, positions, meta, num_layers)  # the followers run it beside us
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        # Layer 0's norm with the embedding gather in one kernel where the kernel set has one: (normed,
        # x), each (num_tokens, hidden_size). Not Gemma's (its embedding is scaled in between), and only
        # for a plain norm feeding a float qkv projection (a quantized one may take its input otherwise).
        fused = None
        embed_norm = self.kernels.embed_norm
        if (
            embed_norm is not None
            and tp is None
            and not self.spec.gemma_norms
            and len(layers) > 0
            and type(layers[0].input_layernorm) is RMSNorm
            and type(getattr(layers[0].self_attn, "qkv_proj", None)) is nn.Linear
        ):
            norm = layers[0].input_layernorm
            fused = embed_norm(input_ids, self.embed_tokens, norm.weight, norm.eps)
        if fused is not None:
            normed, x = fused
        elif tp is not None:
            normed, x = None, tp.vocab_parallel_embedding(self.embed_tokens, input_ids)
        else:
            normed, x = None, self.embed_tokens(input_ids)  # (num_tokens, hidden_size)
        if self.spec.gemma_norms:
            x = x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype)
        cos_sin = self.rope.for_step(positions, x.dtype, self.kernels.rope_reads_tables)
        residual: Optional[torch.Tensor] = None
        for layer, kv in zip(layers, kv_caches):
            x, residual = layer(x, residual, cos_sin, kv, meta, normed)
            normed = None
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, vocab_size) float32 logits of `hidden` (num_rows, hidden_size). In a group every
        rank computes its vocabulary slice of rank 0's rows, gathered on rank 0; a follower gets None
        (typed as a tensor: only rank 0's callers read it)."""
        tp = self.tp
        if tp is not None and tp.link is not None:
            tp.link.ship_logits(hidden.shape[0])
            hidden = hidden.contiguous()
            tp.comm.broadcast(hidden)
        logits = self.kernels.lm_head_logits(hidden, self.lm_head)  # (num_rows, vocab rows held) float32
        if tp is not None:
            gathered = tp.gather_logits(logits, self.spec.vocab_size)
            if gathered is None:
                return logits  # a follower's slice: nobody reads it
            logits = gathered
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def expert_token_counts(self) -> Optional[list[list[int]]]:
        """Per MoE layer, tokens routed to each expert since construction; None for dense models."""
        return expert_token_counts(self)

    def reset_expert_token_counts(self) -> None:
        """Zero the expert-load counters (after warm-up or profiling forwards, which are not real tokens)."""
        reset_expert_token_counts(self)

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor], consume: bool = False) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up; every parameter must be filled. With
        `consume`, `state_dict` is emptied and each checkpoint tensor dropped once copied, so the
        checkpoint and the model are not both held whole."""
        own = dict(self.named_parameters())
        filled: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            param = own[name]
            assert param.shape == tensor.shape, (
                f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(param.shape)}"
            )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            filled.add(name)

        sd = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in state_dict.items()}
        if consume:
            state_dict.clear()
        is_fused = self.spec.model_type == "phi3"  # the checkpoint holds qkv_proj and gate_up_proj
        for i in range(self.spec.num_layers):
            p = f"layers.{i}."
            if is_fused:
                put(p + "self_attn.qkv_proj.weight", sd.pop(p + "self_attn.qkv_proj.weight"))
                put(p + "mlp.gate_up_proj.weight", sd.pop(p + "mlp.gate_up_proj.weight"))
                continue
            put(
                p + "self_attn.qkv_proj.weight",
                torch.cat([sd.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0),
            )
            if self.spec.qkv_bias:
                put(
                    p + "self_attn.qkv_proj.bias",
                    torch.cat([sd.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0),
                )
            if isinstance(self.layers[i].mlp, SparseMoeBlock):
                for name, tensor in fused_moe_weights(
                    sd, p, self.spec.num_experts, self.spec.shared_expert_intermediate_size > 0
                ).items():
                    put(name, tensor)
                continue
            put(
                p + "mlp.gate_up_proj.weight",
                torch.cat([sd.pop(p + "mlp.gate_proj.weight"), sd.pop(p + "mlp.up_proj.weight")], dim=0),
            )
        if "lm_head.weight" not in sd or self.spec.tie_word_embeddings:
            sd["lm_head.weight"] = sd["embed_tokens.weight"]
        for name in list(sd):
            tensor = sd.pop(name)
            if name in own:
                put(name, tensor)
            del tensor
        missing = set(own) - filled
        if missing:
            raise ValueError(f"checkpoint lacks parameters: {sorted(missing)[:8]}")
