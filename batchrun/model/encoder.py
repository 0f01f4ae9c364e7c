"""The BERT encoder family (BERT, and MiniLM, BGE, E5, GTE checkpoints built on HF's BertModel) over
packed variable-length rows: no padding, rows back to back in one (num_tokens, hidden) batch.

Per row, absolute positions restart at 0; attention is bidirectional within a row (one varlen
attention call per layer over the whole batch). What HF's BertModel does that this module does not
(relative positions, decoder or cross-attention layers) is refused by config field at construction,
so a checkpoint is never run with part of its architecture left out. Parameters are created
uninitialized: a module holds a model only after `load_hf_state_dict` (or `build_encoder`).

Speed on a CPU: the projections run on the packed rows as they are (F.linear, i.e. oneDNN), and in
bf16 `build_encoder(..., pack_onednn=True)` packs their weights once and fuses the GELU into the up
projection. float32 stays on F.linear: the path held to HF's outputs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels import cpu_linear as ck
from batchrun.kernels.varlen_attention import varlen_attention

# (q, k, v, seq_lens, scale, causal) -> out: kernels/varlen_attention.py's signature
VarlenAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int], float, bool], torch.Tensor]

# config.hidden_act -> the function HF's ACT2FN applies (the tanh approximations are one formula).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
ENCODER_MODEL_TYPES = ("bert",)
# config.hidden_act -> oneDNN's (attr, algorithm) post-op of the same function
_ONEDNN_ACTIVATIONS = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
    "relu": ("relu", ""),
}
_IGNORED_PREFIXES = ("cls.", "pooler.", "classifier.")  # heads a bare encoder does not run


def check_encoder_config(config: Any) -> None:
    """Refuse, naming the config field, what BertEncoder does not implement."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ENCODER_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r}: the encoder family runs {ENCODER_MODEL_TYPES} models")
    position_type = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if position_type != "absolute":
        raise ValueError(f"position_embedding_type={position_type!r}: only 'absolute' positions are supported")
    for field in ("is_decoder", "add_cross_attention"):
        if getattr(config, field, False):
            raise ValueError(f"{field}=True: the encoder runs bidirectional self-attention only")
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={config.hidden_act!r}: supported are {sorted(_ACTIVATIONS)}")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size={config.hidden_size} is not a multiple of num_attention_heads={config.num_attention_heads}"
        )
    embedding_size = getattr(config, "embedding_size", None)
    if embedding_size is not None and embedding_size != config.hidden_size:
        raise ValueError(f"embedding_size={embedding_size}: embeddings narrower than hidden_size are not supported")


def _empty(*shape: int) -> nn.Parameter:
    # Uninitialized: every parameter is filled by load_hf_state_dict, and init costs seconds on large models.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features)
        self.bias = _empty(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _OneDNNLinear(nn.Module):
    """y = post_op(x @ W.T + b) with W packed once in oneDNN's layout (kernels/cpu_linear.py): no
    reorder of the weight per call, and the activation applied in the GEMM's store (bf16 on a CPU)."""

    def __init__(self, linear: _Linear, batch_hint: int, post_op: tuple[str, str] = ("none", "")) -> None:
        super().__init__()
        self.register_buffer("packed_weight", ck.mkldnn_pack(linear.weight.detach(), batch_hint))
        self.register_buffer("bias", linear.bias.detach())  # (out_features,)
        self.attr, self.algorithm = post_op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, self.attr, [], self.algorithm)


class _LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _empty(size)
        self.bias = _empty(size)
        self.eps = float(eps)


class BertLayer(nn.Module):
    """Self-attention (fused qkv) + residual LayerNorm, then the MLP + residual LayerNorm (post-norm)."""

    def __init__(self, config: Any, attention: VarlenAttention) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim**-0.5
        self.attention = attention
        self.hidden_act = config.hidden_act
        # None once `up` applies the activation itself (pack_onednn)
        self.act: Optional[Callable[[torch.Tensor], torch.Tensor]] = _ACTIVATIONS[config.hidden_act]
        self.qkv: nn.Module = _Linear(hidden, 3 * hidden)  # rows: q, then k, then v
        self.attn_out: nn.Module = _Linear(hidden, hidden)
        self.attn_norm = _LayerNorm(hidden, eps)
        self.up: nn.Module = _Linear(hidden, config.intermediate_size)
        self.down: nn.Module = _Linear(config.intermediate_size, hidden)
        self.out_norm = _LayerNorm(hidden, eps)

    def pack_onednn(self, batch_hint: int) -> None:
        """Hold the projections in oneDNN's packed layout, the activation fused into `up`."""
        assert self.act is not None, "packed already"
        self.qkv = _OneDNNLinear(self.qkv, batch_hint)  # type: ignore[arg-type]
        self.attn_out = _OneDNNLinear(self.attn_out, batch_hint)  # type: ignore[arg-type]
        self.up = _OneDNNLinear(self.up, batch_hint, _ONEDNN_ACTIVATIONS[self.hidden_act])  # type: ignore[arg-type]
        self.down = _OneDNNLinear(self.down, batch_hint)  # type: ignore[arg-type]
        self.act = None

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """(num_tokens, hidden) -> (num_tokens, hidden)."""
        num_tokens, hidden = x.shape
        qkv = self.qkv(x).view(num_tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # (num_tokens, num_heads, head_dim) views
        attended = self.attention(q, k, v, seq_lens, self.scale, False).reshape(num_tokens, hidden)
        h = self.attn_out(attended)
        x = F.layer_norm(h + x, (hidden,), self.attn_norm.weight, self.attn_norm.bias, self.attn_norm.eps)
        inner = self.up(x)  # (num_tokens, intermediate)
        if self.act is not None:
            inner = self.act(inner)
        h = self.down(inner)
        return F.layer_norm(h + x, (hidden,), self.out_norm.weight, self.out_norm.bias, self.out_norm.eps)


def _strip_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names with the `bert.` prefix (task models) or without (BertModel); old TF-converted
    checkpoints' LayerNorm gamma/beta read as weight/bias, as HF's loader reads them."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        name = name[len("bert.") :] if name.startswith("bert.") else name
        name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
        name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
        out[name] = tensor
    return out


class BertEncoder(nn.Module):
    """HF BertModel's last_hidden_state over packed rows. `attention`: the varlen attention callable
    (kernels/varlen_attention.py's signature; default the torch reference)."""

    def __init__(self, config: Any, attention: Optional[VarlenAttention] = None) -> None:
        super().__init__()
        check_encoder_config(config)
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = _empty(config.vocab_size, hidden)
        self.position_embeddings = _empty(config.max_position_embeddings, hidden)
        self.token_type_embeddings = _empty(config.type_vocab_size, hidden)
        self.embed_norm = _LayerNorm(hidden, config.layer_norm_eps)
        attend = attention if attention is not None else varlen_attention
        self.layers = nn.ModuleList(BertLayer(config, attend) for _ in range(config.num_hidden_layers))

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def _hf_names(self) -> dict[str, list[str]]:
        """Own parameter name -> the HF names that fill it (several: concatenated along dim 0)."""
        names = {
            "word_embeddings": ["embeddings.word_embeddings.weight"],
            "position_embeddings": ["embeddings.position_embeddings.weight"],
            "token_type_embeddings": ["embeddings.token_type_embeddings.weight"],
            "embed_norm.weight": ["embeddings.LayerNorm.weight"],
            "embed_norm.bias": ["embeddings.LayerNorm.bias"],
        }
        for i in range(len(self.layers)):
            hf = f"encoder.layer.{i}."
            for kind in ("weight", "bias"):
                names[f"layers.{i}.qkv.{kind}"] = [f"{hf}attention.self.{p}.{kind}" for p in ("query", "key", "value")]
                names[f"layers.{i}.attn_out.{kind}"] = [f"{hf}attention.output.dense.{kind}"]
                names[f"layers.{i}.attn_norm.{kind}"] = [f"{hf}attention.output.LayerNorm.{kind}"]
                names[f"layers.{i}.up.{kind}"] = [f"{hf}intermediate.dense.{kind}"]
                names[f"layers.{i}.down.{kind}"] = [f"{hf}output.dense.{kind}"]
                names[f"layers.{i}.out_norm.{kind}"] = [f"{hf}output.LayerNorm.{kind}"]
        return names

    def _ignored(self, name: str) -> bool:
        return name.startswith(_IGNORED_PREFIXES) or name.endswith("position_ids")

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from HF BertModel / Bert*For* names (with or without `bert.`), q, k and
        v fused; heads this module does not build (pooler, classifier, MLM `cls.`) are ignored, any
        other unknown name or a missing one is an error."""
        hf = _strip_prefix(state_dict)
        own = dict(self.named_parameters())
        used: set[str] = set()
        missing: list[str] = []
        for name, sources in self._hf_names().items():
            absent = [s for s in sources if s not in hf]
            if absent:
                missing.extend(absent)
                continue
            tensor = torch.cat([hf[s] for s in sources]) if len(sources) > 1 else hf[sources[0]]
            if tensor.shape != own[name].shape:
                raise ValueError(f"{sources}: shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
            with torch.no_grad():
                own[name].copy_(tensor)
            used.update(sources)
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} encoder tensors, e.g. {missing[:4]}")
        unknown = sorted(n for n in hf if n not in used and not self._ignored(n))
        if unknown:
            raise ValueError(f"state dict holds tensors the encoder does not implement, e.g. {unknown[:4]}")

    def pack_onednn(self, batch_hint: int = 4096) -> None:
        """bf16 on a CPU: every layer's projections in oneDNN's packed layout (the same kernel as
        F.linear without its per-call weight reorder) and the activation fused into the up
        projection. After load_hf_state_dict, once."""
        for layer in self.layers:
            assert isinstance(layer, BertLayer)
            layer.pack_onednn(batch_hint)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        token_type_ids: Optional[torch.Tensor],  # (num_tokens,) or None: all 0
        seq_lens: list[int],
    ) -> torch.Tensor:
        """(num_tokens, hidden) last hidden states of the packed rows (lengths `seq_lens`, in order)."""
        num_tokens = input_ids.shape[0]
        assert sum(seq_lens) == num_tokens, "seq_lens must cover the packed tokens exactly"
        if seq_lens and max(seq_lens) > self.position_embeddings.shape[0]:
            raise ValueError(
                f"a row of {max(seq_lens)} tokens exceeds max_position_embeddings="
                f"{self.position_embeddings.shape[0]}; truncate it first"
            )
        device = input_ids.device
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)  # (num_rows,)
        row_starts = torch.cumsum(lens, 0) - lens  # (num_rows,)
        positions = torch.arange(num_tokens, device=device) - torch.repeat_interleave(row_starts, lens)  # (T,)
        x = F.embedding(input_ids, self.word_embeddings) + F.embedding(positions, self.position_embeddings)
        if token_type_ids is None:
            x = x + self.token_type_embeddings[0]
        else:
            x = x + F.embedding(token_type_ids, self.token_type_embeddings)  # (num_tokens, hidden)
        norm = self.embed_norm
        x = F.layer_norm(x, (x.shape[1],), norm.weight, norm.bias, norm.eps)
        for layer in self.layers:
            x = layer(x, seq_lens)
        return x


class BertClassifier(nn.Module):
    """HF BertForSequenceClassification: the encoder, then the pooler (dense + tanh) on each row's
    first token, then the classifier linear; scores are the raw logits, float32."""

    def __init__(self, config: Any, attention: Optional[VarlenAttention] = None) -> None:
        super().__init__()
        self.encoder = BertEncoder(config, attention)
        self.pooler = _Linear(config.hidden_size, config.hidden_size)
        self.classifier = _Linear(config.hidden_size, config.num_labels)

    @property
    def num_labels(self) -> int:
        return int(self.classifier.weight.shape[0])

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """As BertEncoder's, and the pooler and classifier must be there too."""
        self.encoder.load_hf_state_dict(state_dict)
        hf = _strip_prefix(state_dict)
        sources = {
            self.pooler.weight: "pooler.dense.weight",
            self.pooler.bias: "pooler.dense.bias",
            self.classifier.weight: "classifier.weight",
            self.classifier.bias: "classifier.bias",
        }
        missing = [s for s in sources.values() if s not in hf]
        if missing:
            raise ValueError(f"state dict lacks the classification head's {missing}")
        for param, source in sources.items():
            if hf[source].shape != param.shape:
                raise ValueError(f"{source}: shape {tuple(hf[source].shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(hf[source])

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        token_type_ids: Optional[torch.Tensor],  # (num_tokens,) or None: all 0
        seq_lens: list[int],
    ) -> torch.Tensor:
        """(num_rows, num_labels) float32 logits, one row per packed row."""
        hidden = self.encoder(input_ids, token_type_ids, seq_lens)  # (num_tokens, hidden)
        lens = torch.tensor(seq_lens, dtype=torch.long, device=hidden.device)  # (num_rows,)
        first = hidden.index_select(0, torch.cumsum(lens, 0) - lens).float()  # (num_rows, hidden)
        pooled = torch.tanh(F.linear(first, self.pooler.weight.float(), self.pooler.bias.float()))
        return F.linear(pooled, self.classifier.weight.float(), self.classifier.bias.float())


def is_classifier_config(config: Any) -> bool:
    """True for a checkpoint saved as *ForSequenceClassification (the architectures field says)."""
    return any(str(a).endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or [])


def build_encoder(
    config: Any,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    attention: Optional[VarlenAttention] = None,
    classifier: Optional[bool] = None,
    pack_onednn: bool = False,
) -> BertEncoder | BertClassifier:
    """The model in eval mode with its parameters in `dtype`, on the CPU: a BertClassifier when
    `classifier` (None: when config.architectures names a *ForSequenceClassification), else a
    BertEncoder. `pack_onednn` (bf16 only, where the CPU kernel set packs float linears:
    KernelSet.linear_float.mode != "none"): projections packed for oneDNN, GELU fused; the module
    then stays on the CPU. Without it, F.linear: float32 is the path held to HF's outputs."""
    with_head = is_classifier_config(config) if classifier is None else classifier
    module: BertEncoder | BertClassifier = (
        BertClassifier(config, attention) if with_head else BertEncoder(config, attention)
    )
    module.to(dtype)
    module.load_hf_state_dict(state_dict)
    if pack_onednn:
        if dtype != torch.bfloat16 or not ck.packing_available():
            raise ValueError(f"pack_onednn needs bf16 and a torch with oneDNN's packing ops (dtype {dtype})")
        (module.encoder if isinstance(module, BertClassifier) else module).pack_onednn()
    return module.eval().requires_grad_(False)
