"""Quantizing one projection or the embeddings of a loaded decoder, as `prepare_linears`
(model/prepare.py) asks, and what it did (`QuantizationSummary`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.quant import w4a8 as w4
from batchrun.model.quant.layers import QuantEmbedding, make_linear
from batchrun.model.quant.smoothquant import smooth_activations, split_outlier_channels
from batchrun.model.quant.weights import QuantizedWeight, quantize_weight, to_device

QUANT_MODES = ("none", "int8", "int4", "w8a8", "w4a8", "fp8", "gguf")
# Fused module -> the HF modules it concatenates along the output dim, in order (see DecoderLM).
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass
class QuantizationSummary:
    """What prepare_linears did, for logs, the run manifest and the benchmark table."""

    mode: str  # the requested mode
    group_size: int  # the requested int4 group size
    num_quantized: int = 0  # linear and embedding modules replaced
    num_from_gguf: int = 0  # of those, taken from the GGUF file's own blocks
    formats: dict[str, int] = field(default_factory=dict)  # "int4/g64" -> modules in that format
    notes: list[str] = field(default_factory=list)  # fallbacks worth knowing (requantized, group size changed)
    num_packed: int = 0  # float linears swapped for a packed twin (model/linear.py), fused gate/up included


def _weight_format(mode: str) -> str:
    return {"int8": "int8", "w8a8": "int8", "int4": "int4", "w4a8": "int4", "fp8": "fp8"}[mode]


def _fused_gguf_weight(name: str, prequantized: dict[str, QuantizedWeight]) -> Optional[QuantizedWeight]:
    """The GGUF blocks for one of our (possibly fused) modules, by HF name; None if not all present."""
    for fused, parts in FUSED_PROJECTIONS.items():
        if name.endswith(fused):
            prefix = name[: -len(fused)]
            found = [prequantized.get(f"{prefix}{p}") for p in parts]
            got = [g for g in found if g is not None]
            if len(got) != len(found):
                return None
            if len({(g.format, g.scales.shape[1]) for g in got}) != 1:
                return None
            return QuantizedWeight.cat(got)
    return prequantized.get(name)


class ProjectionQuantizer:
    """Quantizes the decoder's projections one by one for a mode (`quantize`), recording into `summary`.

    `prequantized` maps HF module names without the "model." prefix (`layers.0.self_attn.q_proj`,
    `lm_head`, `embed_tokens`) to weights read from a GGUF file; mode "gguf" uses them where present
    and int8 in groups for any other projection, w4a8 where they are Q4 blocks. `input_absmax` (from
    collect_input_absmax) turns on SmoothQuant for W8A8 (applied to the whole model here, before any
    projection is quantized), and with `outlier_channels` > 0 that many input channels of each
    projection stay in float (split_outlier_channels). `kernels`: the kernel set whose linear kernels
    the layers take (None: the one bound for each weight's device and dtype)."""

    def __init__(
        self,
        model: nn.Module,
        mode: str,
        group_size: int,
        summary: QuantizationSummary,
        prequantized: Optional[dict[str, QuantizedWeight]] = None,
        input_absmax: Optional[dict[str, torch.Tensor]] = None,
        outlier_channels: int = 0,
        kernels: Optional[KernelSet] = None,
    ) -> None:
        if mode == "gguf" and not prequantized:
            raise ValueError("quantization 'gguf' needs a GGUF model whose tensors are Q8_0, Q4_0 or Q4_1")
        self.mode, self.group_size, self.summary = mode, group_size, summary
        self.prequantized = prequantized or {}
        self.outlier_channels = outlier_channels
        self.kernels = kernels
        self.tp = getattr(model, "tp", None)  # a tensor-parallel rank's model (model/tensor_parallel.py)
        self.fmt = "int8" if mode == "gguf" else _weight_format(mode)
        self.smoothed: dict[str, torch.Tensor] = {}
        if mode == "w8a8" and input_absmax:
            self.smoothed = dict(input_absmax)  # smooth_activations leaves the smoothed ranges here
            smooth_activations(model, self.smoothed)

    def record(self, module: nn.Module, from_gguf: bool) -> None:
        summary = self.summary
        summary.num_quantized += 1
        summary.num_from_gguf += int(from_gguf)
        kind = "embedding" if isinstance(module, QuantEmbedding) else "linear"
        key = f"{kind}:{module.format_key}"
        summary.formats[key] = summary.formats.get(key, 0) + 1

    def quantize(self, name: str, linear: nn.Linear) -> nn.Module:
        """The quantized layer for the float projection `name`."""
        mode, group_size, summary = self.mode, self.group_size, self.summary
        dtype = linear.weight.dtype
        qw = _fused_gguf_weight(name, self.prequantized) if mode in ("gguf", "w4a8") else None
        if mode == "w4a8" and qw is not None and (qw.format != "int4" or qw.group_size != w4.W4A8_GROUP):
            qw = None  # only Q4_0/Q4_1 blocks are W4A8's weight as they are; anything else from float
        from_gguf = qw is not None
        outliers = None
        if qw is None:
            weight = linear.weight.data
            if mode == "w8a8" and self.outlier_channels > 0 and name in self.smoothed:
                weight, outliers = split_outlier_channels(weight, self.smoothed[name], self.outlier_channels)
            # W8A8's single integer GEMM needs per-channel weight scales; fp8 is per channel.
            grouped = mode in ("int8", "int4", "gguf")
            row_absmax = self._row_absmax(name, weight) if self.fmt == "fp8" else None
            qw = quantize_weight(
                weight, self.fmt, w4.W4A8_GROUP if mode == "w4a8" else group_size if grouped else None, row_absmax
            )
            if mode == "w4a8" and qw.group_size != w4.W4A8_GROUP:
                summary.notes.append(
                    f"{name}: int4 weight-only in groups of {qw.group_size} ({linear.in_features} "
                    f"is not a multiple of W4A8's group of {w4.W4A8_GROUP})"
                )
            if grouped and qw.group_size != group_size:
                summary.notes.append(
                    f"{name}: group size {qw.group_size} ({linear.in_features} is not a multiple of {group_size})"
                )
        qw = to_device(qw, linear.weight.device)
        module = make_linear(qw, mode, linear.bias, dtype, outliers, kernels=self.kernels)
        self.record(module, from_gguf)
        return module

    def _row_absmax(self, name: str, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """(N, 1): a row-parallel projection's row magnitudes over every rank's columns, so a
        tensor-parallel rank's per-channel fp8 scales are one process's (None: no group, or a
        projection whose rows a rank holds whole). Every rank quantizes its projections in the same
        order, so the all-reduces pair up."""
        if self.tp is None or not name.endswith(("o_proj", "down_proj")):
            return None
        absmax = weight.float().abs().amax(dim=1, keepdim=True)
        self.tp.comm.all_reduce_max(absmax)
        return absmax

    def quantize_embeddings(self, model: nn.Module) -> None:
        """Embedding and LM head as one per-row 8-bit matrix (fp8 in fp8 mode), shared when tied."""
        mode = self.mode
        embed = model.embed_tokens
        assert isinstance(embed, nn.Embedding)  # prepare_linears quantizes embeddings only then
        lm_head = getattr(model, "lm_head", None)
        dtype, device = embed.weight.dtype, embed.weight.device
        row_fmt = "fp8" if mode == "fp8" else "int8"
        per_row = to_device(quantize_weight(embed.weight.data, row_fmt), device)
        model.embed_tokens = QuantEmbedding(per_row, dtype)
        self.record(model.embed_tokens, False)
        if not isinstance(lm_head, nn.Linear):
            return
        tied = lm_head.weight is embed.weight
        head_weight = per_row if tied else to_device(quantize_weight(lm_head.weight.data, row_fmt), device)
        head_mode = "w8a8" if mode == "w8a8" else "int8"
        model.lm_head = make_linear(head_weight, head_mode, lm_head.bias, dtype, kernels=self.kernels)
        self.record(model.lm_head, False)
