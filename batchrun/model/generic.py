"""The generic serving path: any HF causal LM outside the native families, run by its own
transformers class over batchrun's paged KV cache.

`GenericLM` holds the model's `*ForCausalLM` (built from the config and the state dict batchrun read
from the local safetensors: no hub, never remote code) with its attention implementation set to
"batchrun_paged", a function registered in transformers' AttentionInterface. No mask function is
registered under that name, so HF builds no mask: the paged attention is causal (and windowed where
the layer passes a sliding window) per sequence of the flattened batch. A step's tokens go through
the base model as one (1, num_tokens) sequence with their own positions; each attention layer writes
its K/V into its cache blocks and attends over its sequence's cached context, reading the step's
metadata and its layer's cache from the context `forward` sets.

What the generic path does not do: tensor parallelism, quantized weights, self-speculation,
pooling tasks, batch-invariant numerics (refused at start-up, engine/tasks.py) and CUDA graphs
(the GPU runner runs it eagerly). Where the kernel set packs float linears (bf16 on the CPU), HF's
nn.Linear modules get their packed twins (`pack_linears`: the packed modules take HF's
(1, num_tokens, in) rows as they are); start-up tuning does not time them per row count, and a
silu MLP's gate/up stay two projections (fusing is the native decoder's MLP layout).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.binding import reference_kernels
from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.kv_layout import new_kv_cache
from batchrun.model.decoder import SUPPORTED_MODEL_TYPES, DecoderSpec, is_native_phi3
from batchrun.model.prepare import prepare_linears
from batchrun.model.quant import QuantizationSummary

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "batchrun_paged"
# Rope types whose HF tables follow the longest position of the forward (dynamic NTK; longrope's
# short/long factors switch past original_max_position_embeddings): a step runs several sequences
# as one, so a row's rope then follows its batch's longest sequence.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Layer types of a config's `layer_types` that are attention layers (anything else: mamba, linear
# attention, convolutions: a state the paged cache does not hold).
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class GenericModelError(ValueError):
    """A model the generic path cannot serve; the message names the config key or class."""


def serving_path(hf_config: Any) -> str:
    """How a config's model is served: "native" for the native decoder families (and plain-rope
    Phi-3), else "generic"."""
    if getattr(hf_config, "model_type", None) in SUPPORTED_MODEL_TYPES or is_native_phi3(hf_config):
        return "native"
    return "generic"


def causal_lm_class(hf_config: Any) -> Any:
    """The transformers `*ForCausalLM` class of `hf_config`, or GenericModelError saying why the
    generic path cannot serve it: custom code (auto_map), no causal LM class, a class without the
    attention interface, or layers that are not all attention."""
    from transformers import AutoModelForCausalLM

    model_type = getattr(hf_config, "model_type", None)
    auto_map = getattr(hf_config, "auto_map", None)
    if auto_map:
        raise GenericModelError(
            f"config.json auto_map: model_type {model_type!r} asks for custom modeling code, and batchrun never "
            "runs remote code (trust_remote_code)"
        )
    layer_types = [str(t) for t in (getattr(hf_config, "layer_types", None) or [])]
    other = sorted({t for t in layer_types if t not in _ATTENTION_LAYER_TYPES})
    if other:
        raise GenericModelError(
            f"config.json layer_types: model_type {model_type!r} has layers that are not attention "
            f"({', '.join(other)}); the paged KV cache holds attention layers only"
        )
    cls: Any
    try:
        cls = AutoModelForCausalLM._model_mapping[type(hf_config)]
    except KeyError:
        raise GenericModelError(
            f"config.json model_type {model_type!r}: transformers has no causal LM class for it"
        ) from None
    if not getattr(cls, "_supports_attention_backend", False):
        raise GenericModelError(
            f"config.json model_type {model_type!r}: transformers' {cls.__name__} does not take a custom attention "
            "implementation (_supports_attention_backend is false), so its attention cannot read a paged KV cache"
        )
    return cls


@dataclass(frozen=True)
class LayerAttention:
    """What one attention layer hands its attention function (found by `probe_attention`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: Optional[int]
    softcap: Optional[float]


def generic_spec(hf_config: Any, layers: list[LayerAttention]) -> DecoderSpec:
    """The DecoderSpec fields the engine reads (the KV cache's sizes, the vocabulary, positions),
    the attention's from what the layers hand their attention function (`layers`, one per layer:
    a config's own names for them differ between families); the native decoder's switches are
    left off."""
    first = layers[0]
    for i, layer in enumerate(layers):
        if (layer.num_kv_heads, layer.head_dim) != (first.num_kv_heads, first.head_dim):
            raise GenericModelError(
                f"model_type {hf_config.model_type!r}: layer {i} has {layer.num_kv_heads} KV heads of "
                f"{layer.head_dim}, layer 0 {first.num_kv_heads} of {first.head_dim}; one paged cache "
                "holds one shape"
            )
    num_layers = len(layers)
    return DecoderSpec(
        model_type=str(hf_config.model_type),
        vocab_size=int(hf_config.vocab_size),
        hidden_size=int(hf_config.hidden_size),
        intermediate_size=int(getattr(hf_config, "intermediate_size", None) or 0),
        num_layers=num_layers,
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        rms_norm_eps=0.0,
        activation="",
        qkv_bias=False,
        qk_norm=False,
        gemma_norms=False,
        attn_scale=first.scale,
        layer_windows=tuple(layer.window for layer in layers),
        layer_rope_keys=("default",) * num_layers,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        final_logit_softcap=None,
        attn_logit_softcap=first.softcap,
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", None) or 2048),
    )


@dataclass(frozen=True)
class _Step:
    """What the attention layers of one forward read."""

    kv_caches: list[tuple[Any, Any]]  # per layer (k_cache, v_cache)
    meta: Optional[AttentionMetadata]
    kernels: KernelSet
    # `probe_attention`'s forward: each layer records what it hands its attention here (by
    # layer_idx) and nothing is attended
    probe: Optional[dict[int, LayerAttention]] = None


_STEP: contextvars.ContextVar[_Step] = contextvars.ContextVar("batchrun_generic_step")


@contextmanager
def _step(step: _Step) -> Iterator[None]:
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (1, num_heads, num_tokens, head_dim)
    key: torch.Tensor,  # (1, num_kv_heads, num_tokens, head_dim)
    value: torch.Tensor,  # (1, num_kv_heads, num_tokens, head_dim)
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over batchrun's paged cache: the layer's K/V are
    written at the step's slots, then each token attends causally over its own sequence's context.
    Returns ((1, num_tokens, num_heads, head_dim), None) as HF's implementations do."""
    step = _STEP.get(None)
    if step is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention runs only inside GenericLM.forward")
    if kwargs.get("s_aux") is not None:
        raise GenericModelError("attention sinks (s_aux) are not supported by batchrun's paged attention")
    assert query.shape[0] == 1, "the generic path runs a step as one flattened sequence"
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise GenericModelError(f"{type(module).__name__} has no layer_idx: its KV cache cannot be found")
    head_dim = query.shape[-1]
    if not key.shape[-1] == value.shape[-1] == head_dim:
        raise GenericModelError(
            f"{type(module).__name__}: query/key/value heads of {head_dim}/{key.shape[-1]}/{value.shape[-1]}; "
            "the paged cache holds one head width"
        )
    cap = softcap if softcap is not None else kwargs.get("softcapping")
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    if step.probe is not None:
        step.probe[layer] = LayerAttention(query.shape[1], key.shape[1], head_dim, scale, sliding_window or None, cap)
        return query.new_zeros(query.shape).transpose(1, 2), None
    assert step.meta is not None
    k_cache, v_cache = step.kv_caches[layer]
    q = query[0].transpose(0, 1).contiguous()  # (num_tokens, num_heads, head_dim)
    k = key[0].transpose(0, 1).contiguous()  # (num_tokens, num_kv_heads, head_dim)
    v = value[0].transpose(0, 1).contiguous()
    ks = step.kernels
    ks.write_kv_cache(k_cache, v_cache, k, v, step.meta.slot_mapping)
    out = ks.paged_attention(q, k_cache, v_cache, step.meta, scale, sliding_window or None, cap or None, k, v)
    return out[None], None  # (1, num_tokens, num_heads, head_dim)


def register_attention() -> None:
    """Register "batchrun_paged" in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@functools.cache
def _given_output_class() -> type:
    """A base-model output whose every other field (cross_attentions, ...) reads None: a CausalLM's
    head code reads whichever its own base returns. One class (ModelOutput subclasses register a
    pytree node each)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class GivenOutput(BaseModelOutputWithPast):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return GivenOutput


class _GivenHidden(nn.Module):
    """Stands in for a CausalLM's base model while its head runs on hidden states already computed."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden  # (1, num_rows, hidden_size)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _given_output_class()(last_hidden_state=self.hidden)


def base_model(hf_model: nn.Module) -> nn.Module:
    """The module a CausalLM runs its tokens through before its head: what `get_decoder()` returns
    (OPT's `model.decoder`), else `.model` (Llama 4 text and Mllama name a `base_model_prefix`
    their __init__ never sets, so get_decoder answers the CausalLM itself); GenericModelError
    where there is neither."""
    found: Any = None
    get_decoder = getattr(hf_model, "get_decoder", None)
    if callable(get_decoder):
        try:
            found = get_decoder()
        except Exception:  # a class whose lookup raises: try .model
            found = None
    if not isinstance(found, nn.Module) or found is hf_model:
        found = getattr(hf_model, "model", None)
    if not isinstance(found, nn.Module) or found is hf_model:
        raise GenericModelError(
            f"model_type {getattr(hf_model.config, 'model_type', None)!r}: transformers' {type(hf_model).__name__} "
            "has no base model batchrun can find (neither get_decoder() nor .model)"
        )
    return found


def base_model_path(hf_model: nn.Module) -> str:
    """`base_model(hf_model)`'s name in `hf_model.named_modules()` ("model", "model.decoder")."""
    base = base_model(hf_model)
    for name, module in hf_model.named_modules():
        if module is base and name:
            return name
    raise GenericModelError(f"{type(hf_model).__name__}: its base model is not one of its submodules")


class GenericLM(nn.Module):
    """An HF causal LM with the surface of DecoderLM the engine uses (.spec, .kernels, use_kernels,
    forward, compute_logits, expert counters). `hf_model` is the `*ForCausalLM` itself, so its
    module names are HF's (and PEFT's)."""

    tp = None  # never a tensor-parallel rank

    def __init__(self, hf_model: nn.Module, spec: DecoderSpec, kernels: Optional[KernelSet] = None) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.spec = spec
        self.kernels = kernels if kernels is not None else reference_kernels()
        # where the base model sits in hf_model (a path, not a second registration of the module)
        self.base_path = base_model_path(hf_model)

    @property
    def base(self) -> nn.Module:
        """The module the CausalLM runs the tokens through before its head (`base_model_path`)."""
        return self.hf_model.get_submodule(self.base_path)

    def use_kernels(self, kernels: KernelSet) -> None:
        self.kernels = kernels

    def pack_linears(self, kernels: KernelSet) -> QuantizationSummary:
        """Give HF's float nn.Linear modules the kernel set's packed twins (model/prepare.py; a no-op
        where it packs none). A head tied to the embedding stays as it is: packing it would hold a
        second copy of the vocabulary matrix."""
        hf_model: Any = self.hf_model
        head, embed = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
        tied = head is not None and embed is not None and head.weight is embed.weight
        root = self.base if tied else self.hf_model
        return prepare_linears(root, "none", kernels=kernels)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[tuple[Any, Any]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
        num_layers: Optional[int] = None,
    ) -> torch.Tensor:
        """(num_tokens, hidden_size): the base model's last hidden states (its final norm applied)."""
        assert num_layers is None, "the generic path runs every layer (self-speculation is refused)"
        with _step(_Step(kv_caches, meta, self.kernels)):
            out = self.base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out[0][0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, vocab_size) float32: the CausalLM's own forward after its base model (LM head,
        logit scaling, final soft-capping: whatever the class applies), on `hidden` (num_rows,
        hidden_size), with the base model replaced (at its parent's attribute: OPT's CausalLM calls
        `self.model.decoder`) by one that returns `hidden`."""
        parent_path, _, attr = self.base_path.rpartition(".")
        parent, base = self.hf_model.get_submodule(parent_path), self.base
        num_rows = hidden.shape[0]
        dummy_ids = torch.zeros((1, num_rows), dtype=torch.long, device=hidden.device)
        setattr(parent, attr, _GivenHidden(hidden[None]))
        try:
            out = self.hf_model(input_ids=dummy_ids, use_cache=False, logits_to_keep=0)
        finally:
            setattr(parent, attr, base)
        return out.logits[0].float()

    def expert_token_counts(self) -> Optional[list[list[int]]]:
        return None

    def reset_expert_token_counts(self) -> None:
        pass


def build_generic(
    hf_config: Any,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: Any,
    kernels: Optional[KernelSet] = None,
) -> GenericLM:
    """GenericLM over the config's transformers class with the weights of `state_dict` (HF names,
    as read from the local safetensors; emptied here), in `dtype` on `device`, in eval mode."""
    cls = causal_lm_class(hf_config)
    register_attention()
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_types = {p.get("rope_type") for p in params.values() if isinstance(p, dict)} | {params.get("rope_type")}
    for rope_type in sorted(t for t in rope_types if t in _LENGTH_DEPENDENT_ROPE):
        log.warning(
            "rope_type %s: its tables follow the longest position of a step, so a sequence batched with one "
            "longer than original_max_position_embeddings (%s) is rotated as that one (HF rotates each alone)",
            rope_type,
            getattr(hf_config, "original_max_position_embeddings", None),
        )
    sd = dict(state_dict)
    state_dict.clear()
    hf_model, info = cls.from_pretrained(
        None,
        config=hf_config,
        state_dict=sd,
        dtype=dtype,
        attn_implementation=ATTN_IMPLEMENTATION,
        output_loading_info=True,
    )
    del sd
    if info.get("missing_keys"):  # transformers would leave them randomly initialized
        missing = sorted(info["missing_keys"])
        raise GenericModelError(f"checkpoint lacks parameters of {cls.__name__}: {missing[:8]}")
    hf_model = hf_model.to(device).eval()
    if hf_model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise GenericModelError(f"transformers' {cls.__name__} did not take the {ATTN_IMPLEMENTATION} attention")
    model = GenericLM(hf_model, generic_spec(hf_config, probe_attention(hf_model)), kernels)
    check_head(model)
    check_positions(model)
    return model


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def check_head(model: GenericLM) -> None:
    """The CausalLM's head once on a dummy row, so a class whose forward reaches past its base
    model's output (what compute_logits stands in for) is refused at start-up, not in the first
    step."""
    hf_model: Any = model.hf_model
    device = next(hf_model.parameters()).device
    width = int(getattr(hf_model.get_output_embeddings(), "in_features", 0) or model.spec.hidden_size)
    try:
        logits = model.compute_logits(torch.zeros((1, width), dtype=hf_model.dtype, device=device))
    except Exception as e:
        raise GenericModelError(
            f"model_type {model.spec.model_type!r}: its CausalLM head cannot run on the base model's hidden states "
            f"alone ({_first_line(e)}); not supported on the generic path"
        ) from None
    if tuple(logits.shape) != (1, model.spec.vocab_size):
        raise GenericModelError(
            f"model_type {model.spec.model_type!r}: its CausalLM head gave logits of shape {tuple(logits.shape)} "
            f"for one row (want (1, {model.spec.vocab_size})); not supported on the generic path"
        )


# check_positions: how far (the largest row's ||batched - alone|| / ||alone||) a batched forward's
# hidden states may be from each sequence's alone, per parameter dtype (else 16-bit): the kernels'
# batched and single-sequence paths round differently, a self-counted position is off by far more.
_POSITION_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_POSITION_TOLERANCE_16BIT = 0.1  # tiny bf16 models: up to 0.013; Llama 4's temperature: 0.28


@torch.inference_mode()
def check_positions(model: GenericLM) -> None:
    """The self-check that every position the layers use comes from position_ids (and the KV
    cache): sequences A (6 tokens) and B (3) each alone, then A's first 5 and B in one flattened
    step, then A's last token as a decode at offset 5 must give the same hidden states. A model
    that counts positions itself (arange over the forward's tokens plus a cache length it keeps,
    as Llama 4 text's attention temperature does) sees B at 5..7 and the decode at 0, and is
    refused. Four 16-token cache blocks per layer; every forward a few tokens."""
    s = model.spec
    param = next(model.hf_model.parameters())
    device, dtype = param.device, param.dtype
    block = 16
    shape = (4, block, s.num_kv_heads, s.head_dim)
    kv = [(new_kv_cache(*shape, dtype, device), new_kv_cache(*shape, dtype, device)) for _ in range(s.num_layers)]
    seq_a = [(37 * i + 11) % s.vocab_size for i in range(6)]
    seq_b = [(53 * i + 29) % s.vocab_size for i in range(3)]

    def run(rows: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """Hidden states of one step; a row: (new tokens, tokens already cached, its cache block)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts = [0]
        for tokens, done, blk in rows:
            ids += tokens
            pos += range(done, done + len(tokens))
            slots += [blk * block + p for p in range(done, done + len(tokens))]
            starts.append(starts[-1] + len(tokens))
        seq_lens = [done + len(tokens) for tokens, done, _ in rows]
        decode = [i for i, (tokens, _, _) in enumerate(rows) if len(tokens) == 1]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=torch.tensor([[blk] for _, _, blk in rows], device=device),
            block_size=block,
            decode_seq_ids=torch.tensor(decode, dtype=torch.long, device=device),
            decode_seq_lens=torch.tensor([seq_lens[i] for i in decode], dtype=torch.long, device=device),
            prefill_seq_ids=[i for i, (tokens, _, _) in enumerate(rows) if len(tokens) > 1],
        )
        return model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), kv, meta).float()

    alone = torch.cat([run([(seq_a, 0, 0)]), run([(seq_b, 0, 1)])])
    batched = torch.cat([run([(seq_a[:5], 0, 2), (seq_b, 0, 3)]), run([(seq_a[5:], 5, 2)])])
    alone = alone[[0, 1, 2, 3, 4, 6, 7, 8, 5]]  # A's first 5, B's 3, A's decode
    off = float(((batched - alone).norm(dim=-1) / alone.norm(dim=-1).clamp_min(1e-6)).max())
    if not off <= _POSITION_TOLERANCE.get(dtype, _POSITION_TOLERANCE_16BIT):
        raise GenericModelError(
            f"model_type {s.model_type!r} computes positions from its own token count (sequences batched in one "
            f"step differ from each alone by {off:.2g} of their norm); not supported on the generic path"
        )


@torch.inference_mode()
def probe_attention(hf_model: nn.Module) -> list[LayerAttention]:
    """Per layer, what it hands its attention function: one token through the base model, each
    attention call recorded and answered with zeros. Every layer must call it once (a layer that
    does not keeps a state the paged cache does not hold)."""
    base = base_model(hf_model)
    device = next(hf_model.parameters()).device
    found: dict[int, LayerAttention] = {}
    with _step(_Step([], None, reference_kernels(), probe=found)):
        base(
            input_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
            position_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
            use_cache=False,
        )
    config: Any = hf_model.config
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if sorted(found) != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(found))
        raise GenericModelError(
            f"model_type {config.model_type!r}: layers {missing[:8]} never call the attention "
            "implementation (not attention layers, or attention transformers does not route through it)"
        )
    return [found[i] for i in range(num_layers)]
