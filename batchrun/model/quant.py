"""Quantized linear and embedding layers, and `quantize_model`, which swaps them into a loaded decoder.

Modes (`engine.quantization`):

- `int8`: weight-only int8 in groups along K (`group_size`; 32 is GGUF's Q8_0) (W8A16). Halves bf16
  weight bytes. Per output channel was the first design, but on SmolLM2 its top-1 agreement fell
  just short of the 97% bound (96.7% vs 98.3% for groups of 32). The CPU dequantizes into a bf16/fp32
  GEMM, so it is a memory mode there (per-channel int8 rows still take torch's packed kernel at
  <= 4 rows); on the GPU a Triton dequantize-GEMM.
- `w8a8`: int8 weights per channel and int8 activations per token, an exact int32 GEMM
  (torch._int_mm: VNNI on x86 CPUs), after SmoothQuant moves activation outliers into the weights
  (calibrated at load on 1k tokens of built-in text); the `outlier_channels` input channels of each
  projection whose range is still largest stay in float (`split_outlier_channels`). In bf16 on a
  CPU with AVX512-VNNI and AVX512-BF16 one native kernel does it all (kernels/quant.py: w8a8_matmul_native).
  Measured on SmolLM2 with 2 cores: 64 float channels (the default) 97.9% top-1 agreement at
  1.21x bf16's summarize tokens/s; none 94.7% at 1.26x (python -m batchrun.bench.quant).
- `int4`: weight-only asymmetric int4 in groups along K (`group_size`), packed two per byte.
- `w4a8`: int4 weights in groups of 32 (GGUF's Q4_0/Q4_1 blocks kept as they are) and int8
  activations quantized per group of 32 on the fly, an exact integer dot product per group, scaled
  and summed in float32 (llama.cpp's Q4_1 x Q8_1 scheme). The CPU throughput mode for int4: in bf16
  on a CPU with AVX512-VNNI and AVX512-BF16 one native kernel (kernels/w4a8.py: w4a8_matmul_native), where `int4`
  dequantizes into a bf16 GEMM. Per-group activation scales are what keep quality without
  SmoothQuant (which would move the weights off the Q4 grid): simulated on SmolLM2 (the reference
  being the dequantized Q4_1 model, teacher-forced) per-token int8 activations give 91.0% top-1
  agreement, groups of 32 97.2% with perplexity +0.28%.
- `fp8`: e4m3 weights per channel; on Hopper-class GPUs per-token e4m3 activations and
  torch._scaled_mm. Elsewhere a dequantizing reference (slow: the CPU has no fp8 GEMM).
- `gguf`: keep a GGUF file's own blocks where they map onto ours (Q4_0/Q4_1 -> int4 in groups of
  32, Q8_0 -> int8 in groups of 32) instead of converting through float (see `gguf_quant`).

Only the decoder's projections (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`) are swapped;
MoE routers and stacked expert weights stay float, and so do the token embedding and LM head unless
`include_embeddings` (then one per-row int8 matrix, fp8 in fp8 mode, shared when tied). Measured on
SmolLM2 (teacher-forced, float32): a per-row int8 LM head alone takes top-1 agreement from 98.3% to
96.7% (its logits feed the argmax directly), and with per-token int8 activations (W8A8) perplexity
rises 2.2% instead of 0.7%; a grouped int8 head would dequantize the whole vocabulary matrix every
step on the CPU. So the vocabulary matrix stays in the model dtype by default.

Quality on SmolLM2-135M (tests/test_quant_quality.py; the unquantized reference is itself the
dequantized Q4_1 GGUF, so int4 in groups of 32 reproduces its grid exactly, which is not evidence
about int4 in general: at group 64 agreement is 75% and perplexity +37%): see the tests' bounds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch import nn

from batchrun.kernels import cpu_native
from batchrun.kernels import elementwise as ew
from batchrun.kernels import quant as qk
from batchrun.kernels.quant import w4a8 as w4

log = logging.getLogger("batchrun.model.quant")

QUANT_MODES = ("none", "int8", "int4", "w8a8", "w4a8", "fp8", "gguf")
INT4_GROUP_SIZES = (32, 64, 128, 256)
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Fused module -> the HF modules it concatenates along the output dim, in order (see DecoderLM).
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Up to this many rows torch's packed W8A16 CPU kernel beats dequantize-then-bf16-GEMM (measured on
# a 576x1536 weight: 50 us vs 82 us bf16 at 1 row, 430 us vs 240 us at 16 rows).
CPU_INT8PACK_MAX_ROWS = 4


def _triton_ok(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class QuantizedWeight:
    """One weight matrix (N, K) in a canonical format of `batchrun.kernels.quant`."""

    format: str  # "int8" | "int4" | "fp8"
    qweight: torch.Tensor  # int8 (N, K) | uint8 (N, K // 2) | float8_e4m3fn (N, K)
    scales: torch.Tensor  # (N, num_groups): float32 for int8 and fp8, float16 for int4
    mins: Optional[torch.Tensor] = None  # int4 only: (N, num_groups) float16
    in_features: int = 0

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.format == "int8":
            return qk.dequantize_int8(self.qweight, self.scales, dtype)
        if self.format == "int4":
            return qk.dequantize_int4(self.qweight, self.scales, self.mins, dtype)
        return qk.dequantize_fp8(self.qweight, self.scales, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack along the output dim (fusing q/k/v or gate/up); formats and groups must agree."""
        first = parts[0]
        assert all(p.format == first.format and p.in_features == first.in_features
                   and p.scales.shape[1] == first.scales.shape[1] for p in parts), "cannot fuse mixed formats"
        mins = torch.cat([p.mins for p in parts]) if first.mins is not None else None
        return QuantizedWeight(first.format, torch.cat([p.qweight for p in parts]),
                               torch.cat([p.scales for p in parts]), mins, first.in_features)


def effective_group_size(in_features: int, group_size: int) -> int:
    """`group_size`, halved until it divides in_features (SmolLM2's 576 takes 64 for 128)."""
    g = group_size
    while g > 2 and in_features % g:
        g //= 2
    return g if in_features % g == 0 else in_features


def quantize_weight(w: torch.Tensor, fmt: str, group_size: Optional[int] = None) -> QuantizedWeight:
    """Float (N, K) -> QuantizedWeight; int8 is per channel unless `group_size` is given."""
    k = w.shape[1]
    if fmt == "int8":
        qw, s = qk.quantize_int8(w, effective_group_size(k, group_size) if group_size else None)
        return QuantizedWeight("int8", qw, s, None, k)
    if fmt == "int4":
        qw, s, m = qk.quantize_int4(w, effective_group_size(k, group_size or 32))
        return QuantizedWeight("int4", qw, s, m, k)
    if fmt == "fp8":
        qw, s = qk.quantize_fp8(w)
        return QuantizedWeight("fp8", qw, s, None, k)
    raise ValueError(f"unknown weight format {fmt!r}")


# ---------------------------------------------------------------------------------------------
# layers


class QuantLinear(nn.Module):
    """Base of the quantized linears: y = x @ W.T (+ bias) in x's dtype; W is held quantized."""

    def __init__(self, in_features: int, out_features: int, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantLinear):
    """W8A16: int8 weights (per channel, or in groups for GGUF Q8_0), activations in the model dtype."""

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> None:
        assert weight.format == "int8"
        super().__init__(weight.in_features, weight.out_features, bias)
        self.register_buffer("qweight", weight.qweight)  # (N, K) int8
        self.register_buffer("scales", weight.scales)  # (N, num_groups) float32
        self.is_per_channel = weight.scales.shape[1] == 1
        self.format_key = "int8" if self.is_per_channel else f"int8/g{weight.group_size}"
        # torch's packed CPU kernel takes its per-channel scales in bf16.
        self._scales_bf16 = weight.scales[:, 0].to(torch.bfloat16) if self.is_per_channel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if _triton_ok(x2):
            from batchrun.kernels.quant.triton_gemm import w8a16_matmul
            y = w8a16_matmul(x2, self.qweight, self.scales, self.bias)
        elif (not x2.is_cuda and x2.dtype == torch.bfloat16 and self.is_per_channel
              and x2.shape[0] <= CPU_INT8PACK_MAX_ROWS):
            y = qk.int8_weight_matmul_cpu(x2, self.qweight, self._scales_bf16)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = qk.int8_weight_matmul(x2, self.qweight, self.scales, self.bias)
        return y.reshape(*shape[:-1], self.out_features)


class W8A8Linear(QuantLinear):
    """int8 weights per channel and int8 activations per token, integer GEMM; `outliers`, if given,
    are input channels kept in float (their columns of `weight` are zero).

    For bf16 on a CPU where the native kernel serves the shape (kernels/quant.py:
    w8a8_native_supported), the weight is held only in that kernel's tiles (and the float channels'
    weight in bf16 tiles), and every call runs it; otherwise torch._int_mm and the epilogue."""

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None,
                 outliers: Optional[qk.OutlierChannels] = None, compute_dtype: Optional[torch.dtype] = None) -> None:
        assert weight.format == "int8" and weight.scales.shape[1] == 1, "W8A8 needs per-channel int8"
        super().__init__(weight.in_features, weight.out_features, bias)
        num_float = 0 if outliers is None else outliers.index.numel()
        self.is_native = (weight.qweight.device.type == "cpu" and compute_dtype == torch.bfloat16
                          and qk.w8a8_native_supported(weight.out_features, weight.in_features, num_float))
        self.register_buffer("scales", weight.scales)  # (N, 1) float32
        if self.is_native:
            from batchrun.kernels.cpu_linear import pack_native_weight

            self.register_buffer("packed_qweight", qk.pack_w8a8_weight(weight.qweight))  # (N, K) uint8 tiles
            packed_out = None
            if outliers is not None:  # (N, num_float) bf16 tiles; the (num_float, N) copy is not kept
                packed_out = pack_native_weight(outliers.weight_t.t().to(torch.bfloat16).contiguous())
                outliers = qk.OutlierChannels(outliers.index, outliers.skip, outliers.weight_t.new_empty((0, weight.out_features)))
            self.register_buffer("packed_outlier_weight", packed_out)
        else:
            self.register_buffer("qweight", weight.qweight)  # (N, K) int8
        self.outliers = outliers
        if outliers is not None:  # buffers, so .to() and the weight-bytes count see them
            self.register_buffer("outlier_index", outliers.index)
            self.register_buffer("outlier_skip", outliers.skip)
            self.register_buffer("outlier_weight_t", outliers.weight_t)
        self.format_key = "w8a8" if outliers is None else f"w8a8/float{num_float}"
        self._refresh()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh())

    def _refresh(self) -> None:
        """Keep `outliers` pointing at the current buffers and, for the native kernel, rebuild the
        float32 copies it reads (per-channel scales, bias) and the check that its buffers are still
        the dtypes it reads (a later .to(dtype/device) may change them: then the reference path)."""
        if self.outliers is not None:
            self.outliers = qk.OutlierChannels(self.outlier_index, self.outlier_skip, self.outlier_weight_t)
        if self.is_native:
            self._scales_f32 = self.scales[:, 0].detach().float().contiguous()
            self._bias_f32 = None if self.bias is None else self.bias.detach().float().contiguous()
            out = self.packed_outlier_weight
            self._kernel_ok = (self.packed_qweight.dtype == torch.uint8 and self.packed_qweight.device.type == "cpu"
                               and self.scales.device.type == "cpu"
                               and (out is None or (out.dtype == torch.bfloat16 and out.device.type == "cpu")))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._refresh()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_native:
            if (x.dtype == torch.bfloat16 and x.stride(-1) == 1 and not x.is_cuda and self._kernel_ok
                    and cpu_native.enabled()):
                return qk.w8a8_matmul_native(x, self.packed_qweight, self._scales_f32, self._bias_f32, self.outliers,
                                             self.packed_outlier_weight)
            return self._reference(x)  # kernels switched off since load, or an odd input
        return qk.w8a8_matmul(x, self.qweight, self.scales, self.bias, self.outliers)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        """w8a8_matmul over the unpacked weights (slow; only when the native kernel cannot run)."""
        from batchrun.kernels.cpu_linear import unpack_native_weight

        outliers = self.outliers
        if outliers is not None:
            weight_t = unpack_native_weight(self.packed_outlier_weight).t().contiguous()
            outliers = qk.OutlierChannels(outliers.index, outliers.skip, weight_t)
        return qk.w8a8_matmul(x, qk.unpack_w8a8_weight(self.packed_qweight), self.scales, self.bias, outliers)


class Int4Linear(QuantLinear):
    """W4A16 in groups along K. On a CPU with bf16 activations the weight is held only in torch's
    packed int4 layout (its kernel); otherwise in our canonical layout (Triton on GPU, reference on CPU)."""

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        assert weight.format == "int4"
        super().__init__(weight.in_features, weight.out_features, bias)
        self.group_size = weight.group_size
        self.format_key = f"int4/g{self.group_size}"
        self.is_cpu_packed = (weight.qweight.device.type == "cpu" and compute_dtype == torch.bfloat16
                              and self.group_size in INT4_GROUP_SIZES)
        if self.is_cpu_packed:
            packed, scales_zeros = qk.int4_pack_for_cpu(weight.qweight, weight.scales, weight.mins)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", scales_zeros)  # (num_groups, N, 2) bf16
        else:
            self.register_buffer("qweight", weight.qweight)  # (N, K // 2) uint8
            self.register_buffer("scales", weight.scales)  # (N, num_groups) float16
            self.register_buffer("mins", weight.mins)  # (N, num_groups) float16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.is_cpu_packed:
            y = qk.int4_matmul_cpu(x2.to(torch.bfloat16), self.packed, self.group_size, self.scales_zeros).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        elif _triton_ok(x2):
            from batchrun.kernels.quant.triton_gemm import w4a16_matmul
            y = w4a16_matmul(x2, self.qweight, self.scales, self.mins, self.bias)
        else:
            y = qk.int4_weight_matmul(x2, self.qweight, self.scales, self.mins, self.bias)
        return y.reshape(*shape[:-1], self.out_features)


class W4A8Linear(QuantLinear):
    """int4 weights in groups of 32 (w = q * scale + min: GGUF's Q4_1 grid) and int8 activations
    quantized in groups of 32 on the fly, an exact integer dot product per group (llama.cpp's
    Q4_1 x Q8_1). For bf16 on a CPU with AVX512-VNNI and AVX512-BF16 the weight is held only in the native kernel's
    nibble tiles (kernels/w4a8.py: w4a8_matmul_native); elsewhere the reference (w4a8_matmul,
    which dequantizes the weight on every call: slow, for checks and float32 models)."""

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None,
                 compute_dtype: Optional[torch.dtype] = None) -> None:
        assert weight.format == "int4" and weight.group_size == w4.W4A8_GROUP, "W4A8 needs int4 in groups of 32"
        super().__init__(weight.in_features, weight.out_features, bias)
        self.format_key = f"w4a8/g{w4.W4A8_GROUP}"
        self.is_native = (weight.qweight.device.type == "cpu" and compute_dtype == torch.bfloat16
                          and w4.w4a8_native_supported(weight.out_features, weight.in_features))
        if self.is_native:
            packed, w_scales, w_mins = w4.pack_w4a8_weight(weight.qweight, weight.scales, weight.mins)
            self.register_buffer("packed_qweight", packed)  # (N, K // 2) uint8 nibble tiles
            self.register_buffer("packed_scales", w_scales)  # (N, K // 32) float32, per tile
            self.register_buffer("packed_mins", w_mins)
        else:
            self.register_buffer("qweight", weight.qweight)  # (N, K // 2) uint8
            self.register_buffer("scales", weight.scales)  # (N, K // 32) float16
            self.register_buffer("mins", weight.mins)
        self._refresh()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh())

    def _refresh(self) -> None:
        """The float32 bias the kernel reads, and whether its buffers are still what it reads."""
        if self.is_native:
            self._bias_f32 = None if self.bias is None else self.bias.detach().float().contiguous()
            self._kernel_ok = all(t.device.type == "cpu" and t.is_contiguous() for t in
                                  (self.packed_qweight, self.packed_scales, self.packed_mins)) \
                and self.packed_qweight.dtype == torch.uint8 and self.packed_scales.dtype == torch.float32 \
                and self.packed_mins.dtype == torch.float32

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._refresh()
        return self

    def int4_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed (N, K // 2), scales, mins (N, K // 32) float16): our canonical int4 layout."""
        if self.is_native:
            return w4.unpack_w4a8_weight(self.packed_qweight, self.packed_scales, self.packed_mins)
        return self.qweight, self.scales, self.mins

    def _native_ok(self, x: torch.Tensor) -> bool:
        return (self.is_native and self._kernel_ok and x.dtype == torch.bfloat16 and not x.is_cuda
                and x.stride(-1) == 1 and cpu_native.enabled())

    def forward(self, x: Union[torch.Tensor, w4.GroupQuantized]) -> torch.Tensor:
        """x: activations, or activations already quantized in groups (W4A8SiluMulLinear's output)."""
        if isinstance(x, w4.GroupQuantized):
            native = self.is_native and self._kernel_ok and x.dtype == torch.bfloat16 and cpu_native.enabled()
        else:
            native = self._native_ok(x)
        if native:
            return w4.w4a8_matmul_native(x, self.packed_qweight, self.packed_scales, self.packed_mins, self._bias_f32)
        qweight, scales, mins = self.int4_weight()
        return w4.w4a8_matmul(x, qweight, scales, mins, self.bias)


class W4A8SiluMulLinear(W4A8Linear):
    """A silu MLP's W4A8 gate/up projection that returns silu(gate) * up already quantized in groups
    of 32 for its down projection (kernels/w4a8.py: w4a8_silu_quant_native: one pass, bitwise the
    projection, the activation and the quantization done apart). Its rows are held in silu pair
    order (kernels/cpu_linear.py: silu_pair_order); `int4_weight()` gives the plain order back.
    Where the kernel cannot run (switched off, another dtype) it returns silu(gate) * up as a
    tensor, from the reference projection, and the down projection quantizes it itself."""

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> None:
        from batchrun.kernels.cpu_linear import silu_pair_order

        order = silu_pair_order(weight.out_features // 2)
        permuted = QuantizedWeight("int4", weight.qweight[order], weight.scales[order], weight.mins[order],
                                   weight.in_features)
        super().__init__(permuted, None if bias is None else bias[order], torch.bfloat16)
        assert self.is_native, "W4A8SiluMulLinear needs the native kernel"
        self.register_buffer("_plain_order", torch.argsort(order), persistent=False)

    def int4_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qweight, scales, mins = super().int4_weight()
        o = self._plain_order
        return qweight[o], scales[o], mins[o]

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, w4.GroupQuantized]:
        if self._native_ok(x):
            return w4.w4a8_silu_quant_native(x, self.packed_qweight, self.packed_scales, self.packed_mins,
                                             self._bias_f32)
        qweight, scales, mins = self.int4_weight()
        bias = None if self.bias is None else self.bias[self._plain_order]
        return ew.act_mul(w4.w4a8_matmul(x, qweight, scales, mins, bias), "silu")


def fuse_w4a8_mlps(model: nn.Module) -> int:
    """Swap the gate/up projection of every silu MLP whose two projections run the native W4A8
    kernel for a W4A8SiluMulLinear (and mark the MLP `fused_act`); returns how many."""
    count = 0
    for mlp in model.modules():
        gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        if (getattr(mlp, "activation", None) in ("silu", "swish") and hasattr(mlp, "fused_act")
                and type(gate_up) is W4A8Linear and type(down) is W4A8Linear and gate_up.is_native and down.is_native
                and gate_up.out_features == 2 * down.in_features and down.in_features % w4.W4A8_GROUP == 0):
            qweight, scales, mins = gate_up.int4_weight()
            weight = QuantizedWeight("int4", qweight, scales, mins, gate_up.in_features)
            mlp.gate_up_proj, mlp.fused_act = W4A8SiluMulLinear(weight, gate_up.bias), True
            count += 1
    return count


class Fp8Linear(QuantLinear):
    """e4m3 weights per channel: W8A8-FP8 through torch._scaled_mm on GPUs with fp8 tensor cores
    (compute capability 8.9+), a dequantizing reference elsewhere."""

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> None:
        assert weight.format == "fp8"
        super().__init__(weight.in_features, weight.out_features, bias)
        self.register_buffer("qweight", weight.qweight)  # (N, K) float8_e4m3fn
        self.register_buffer("scales", weight.scales)  # (N, 1) float32
        self.format_key = "fp8"
        self.use_scaled_mm = weight.qweight.is_cuda and torch.cuda.get_device_capability(weight.qweight.device) >= (8, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_scaled_mm:
            return qk.fp8_scaled_matmul(x, self.qweight, self.scales, self.bias)
        return qk.fp8_weight_matmul(x, self.qweight, self.scales, self.bias)


class QuantEmbedding(nn.Module):
    """Token embedding held as int8 (or fp8) rows with a scale per row (per row or per group):
    a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        assert weight.format in ("int8", "fp8")
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = dtype
        per_row = weight.scales.shape[1] == 1
        self.format_key = weight.format if per_row else f"{weight.format}/g{weight.group_size}"
        self.register_buffer("qweight", weight.qweight)  # (vocab, hidden)
        self.register_buffer("scales", weight.scales)  # (vocab, num_groups) float32

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        q = self.qweight[input_ids].float()  # (num_tokens, hidden)
        s = self.scales[input_ids]  # (num_tokens, num_groups)
        return (q.reshape(*s.shape, -1) * s[..., None]).reshape(q.shape).to(self.dtype)


def make_linear(weight: QuantizedWeight, mode: str, bias: Optional[torch.Tensor], compute_dtype: torch.dtype,
                outliers: Optional[qk.OutlierChannels] = None) -> QuantLinear:
    if weight.format == "int4":
        if mode == "w4a8" and weight.group_size == w4.W4A8_GROUP:
            return W4A8Linear(weight, bias, compute_dtype)
        return Int4Linear(weight, bias, compute_dtype)
    if weight.format == "fp8":
        return Fp8Linear(weight, bias)
    if mode == "w8a8" and weight.scales.shape[1] == 1:
        return W8A8Linear(weight, bias, outliers, compute_dtype)
    return Int8Linear(weight, bias)


def split_outlier_channels(weight: torch.Tensor, input_absmax: torch.Tensor,
                           num_channels: int) -> tuple[torch.Tensor, qk.OutlierChannels]:
    """The `num_channels` input channels (at most an eighth of them) with the largest calibrated |x|
    (after SmoothQuant) kept in float: (the weight with their columns zeroed, for int8 per channel,
    and the OutlierChannels).

    Why: with per-token int8 activations one step serves a whole token, and the few channels that
    stay large after smoothing set that step for all the others. Measured on SmolLM2 (teacher-forced
    top-1 agreement with float32 over 2,044 positions of pydoc text; simulated quantization): 95.3%
    with none kept, 97.0% with 16, 97.9% with 64; on 4,088 other positions 94.6% -> 97.1% with 64,
    where int8 weights alone (float activations) give 97.2%.
    """
    k = min(num_channels, max(1, weight.shape[1] // 8))
    index = torch.sort(input_absmax.to(weight.device).topk(k).indices).values
    skip = torch.zeros(weight.shape[1], dtype=torch.bool, device=weight.device)
    skip[index] = True
    return (weight.masked_fill(skip[None, :], 0.0),
            qk.OutlierChannels(index, skip, weight[:, index].t().contiguous()))


# ---------------------------------------------------------------------------------------------
# calibration: SmoothQuant for W8A8


def calibration_token_ids(tokenizer, num_seqs: int = 2, seq_len: int = 512) -> list[list[int]]:
    """Real English text shipped with CPython (pydoc topics), taken from the END of the sorted list
    so it stays disjoint from the text the quality tests and benchmark evaluate on (the start)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics, reverse=True):
        ids = tokenizer.encode(topics[key], add_special_tokens=False)
        if len(ids) >= seq_len:
            out.append(ids[:seq_len])
        if len(out) == num_seqs:
            break
    return out


def _projections(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in _PROJECTIONS]


@torch.inference_mode()
def collect_input_absmax(model: nn.Module, run_forward: Callable[[list[int]], None],
                         sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """Module name -> (in_features,) largest |x| per input channel of each projection, over
    `run_forward(token_ids)` of every sequence (hooks on the projections' inputs)."""
    absmax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, linear in _projections(model):
        def hook(_module, inputs, _output, name=name):
            a = inputs[0].reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
            absmax[name] = torch.maximum(absmax[name], a) if name in absmax else a
        hooks.append(linear.register_forward_hook(hook))
    try:
        for ids in sequences:
            run_forward(ids)
    finally:
        for h in hooks:
            h.remove()
    return absmax


def smooth_activations(model: nn.Module, input_absmax: dict[str, torch.Tensor], alpha: float = 0.5) -> int:
    """SmoothQuant: move activation outliers into the weights before W8A8 quantizes both.

    For a projection fed by a norm, x_j is divided by s_j = max|x_j|^alpha / max|W_j|^(1-alpha) and
    W's column j multiplied by it, the division folded into the norm's weight; for down_proj it is
    folded into up_proj's rows (down's input is act(gate) * up). Exact in real arithmetic; it
    evens out per-token int8 steps (SmolLM2's qkv inputs have a max/rms of ~20 per token).
    Measured on SmolLM2 (teacher-forced, vs float): W8A8 top-1 agreement 91% -> 95%, perplexity
    +3.5% -> +0.6%. Returns the number of projections smoothed.
    """
    modules = dict(model.named_modules())
    count = 0

    def factors(name: str, linear: nn.Linear) -> torch.Tensor:
        a = input_absmax[name].clamp(min=1e-5)
        w = linear.weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
        return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp(min=1e-5)  # (in_features,)

    def apply(name: str, linear: nn.Linear, s: torch.Tensor) -> None:
        nonlocal count
        with torch.no_grad():
            linear.weight.mul_(s.to(linear.weight.dtype)[None, :])
        input_absmax[name] = input_absmax[name] / s
        count += 1

    def fold_into_norm(norm: nn.Module, s: torch.Tensor) -> None:
        with torch.no_grad():
            if getattr(norm, "is_gemma", False):  # scales by (1 + w)
                norm.weight.copy_(((1.0 + norm.weight.float()) / s - 1.0).to(norm.weight.dtype))
            else:
                norm.weight.copy_((norm.weight.float() / s).to(norm.weight.dtype))

    for prefix, layer in ((n, m) for n, m in modules.items() if n.startswith("layers.") and n.count(".") == 1):
        qkv_name = f"{prefix}.self_attn.qkv_proj"
        if qkv_name in input_absmax:
            qkv = modules[qkv_name]
            s = factors(qkv_name, qkv)
            fold_into_norm(layer.input_layernorm, s)
            apply(qkv_name, qkv, s)
        gate_up_name, down_name = f"{prefix}.mlp.gate_up_proj", f"{prefix}.mlp.down_proj"
        if gate_up_name in input_absmax and down_name in input_absmax:
            gate_up, down = modules[gate_up_name], modules[down_name]
            norm = layer.pre_feedforward_layernorm if hasattr(layer, "pre_feedforward_layernorm") \
                else layer.post_attention_layernorm
            s = factors(gate_up_name, gate_up)
            fold_into_norm(norm, s)
            apply(gate_up_name, gate_up, s)
            s = factors(down_name, down)
            with torch.no_grad():  # the up half of gate_up's rows feeds down's input channels
                gate_up.weight[down.in_features:].div_(s.to(gate_up.weight.dtype)[:, None])
            apply(down_name, down, s)
    return count


# ---------------------------------------------------------------------------------------------
# swapping


@dataclass
class QuantizationSummary:
    """What quantize_model did, for logs, the run manifest and the benchmark table."""

    mode: str  # the requested mode
    group_size: int  # the requested int4 group size
    num_quantized: int = 0  # linear and embedding modules replaced
    num_from_gguf: int = 0  # of those, taken from the GGUF file's own blocks
    formats: dict[str, int] = field(default_factory=dict)  # "int4/g64" -> modules in that format
    notes: list[str] = field(default_factory=list)  # fallbacks worth knowing (requantized, group size changed)


def _weight_format(mode: str) -> str:
    return {"int8": "int8", "w8a8": "int8", "int4": "int4", "w4a8": "int4", "fp8": "fp8"}[mode]


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def _fused_gguf_weight(name: str, prequantized: dict[str, QuantizedWeight]) -> Optional[QuantizedWeight]:
    """The GGUF blocks for one of our (possibly fused) modules, by HF name; None if not all present."""
    for fused, parts in FUSED_PROJECTIONS.items():
        if name.endswith(fused):
            prefix = name[: -len(fused)]
            got = [prequantized.get(f"{prefix}{p}") for p in parts]
            if any(g is None for g in got):
                return None
            if len({(g.format, g.scales.shape[1]) for g in got}) != 1:
                return None
            return QuantizedWeight.cat(got)
    return prequantized.get(name)


def quantize_model(model: nn.Module, mode: str, group_size: int = 32, include_embeddings: bool = False,
                   prequantized: Optional[dict[str, QuantizedWeight]] = None,
                   input_absmax: Optional[dict[str, torch.Tensor]] = None,
                   outlier_channels: int = 0) -> QuantizationSummary:
    """Swap the decoder's projections (and embedding/LM head) for quantized modules, in place.

    Call after the float weights are loaded and the model is on its device and dtype. `prequantized`
    maps HF module names without the "model." prefix (`layers.0.self_attn.q_proj`, `lm_head`,
    `embed_tokens`) to weights read from a GGUF file; mode "gguf" uses them where present and int8
    in groups for any other projection. `input_absmax` (from collect_input_absmax) turns on
    SmoothQuant for W8A8, and with `outlier_channels` > 0 keeps that many input channels of each
    projection in float (split_outlier_channels).
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization mode must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    summary = QuantizationSummary(mode, group_size)
    if mode == "none":
        return summary
    if mode == "gguf" and not prequantized:
        raise ValueError("quantization 'gguf' needs a GGUF model whose tensors are Q8_0, Q4_0 or Q4_1")
    prequantized = prequantized or {}
    fmt = "int8" if mode == "gguf" else _weight_format(mode)

    def record(module: nn.Module, from_gguf: bool) -> None:
        summary.num_quantized += 1
        summary.num_from_gguf += int(from_gguf)
        kind = "embedding" if isinstance(module, QuantEmbedding) else "linear"
        key = f"{kind}:{module.format_key}"
        summary.formats[key] = summary.formats.get(key, 0) + 1

    smoothed: dict[str, torch.Tensor] = {}
    if mode == "w8a8" and input_absmax:
        smoothed = dict(input_absmax)  # smooth_activations leaves the smoothed ranges here
        smooth_activations(model, smoothed)
    for name, linear in _projections(model):
        dtype = linear.weight.dtype
        qw = _fused_gguf_weight(name, prequantized) if mode in ("gguf", "w4a8") else None
        if mode == "w4a8" and qw is not None and (qw.format != "int4" or qw.group_size != w4.W4A8_GROUP):
            qw = None  # only Q4_0/Q4_1 blocks are W4A8's weight as they are; anything else from float
        from_gguf = qw is not None
        outliers = None
        if qw is None:
            weight = linear.weight.data
            if mode == "w8a8" and outlier_channels > 0 and name in smoothed:
                weight, outliers = split_outlier_channels(weight, smoothed[name], outlier_channels)
            # W8A8's single integer GEMM needs per-channel weight scales; fp8 is per channel.
            grouped = mode in ("int8", "int4", "gguf")
            qw = quantize_weight(weight, fmt, w4.W4A8_GROUP if mode == "w4a8" else group_size if grouped else None)
            if mode == "w4a8" and qw.group_size != w4.W4A8_GROUP:
                summary.notes.append(f"{name}: int4 weight-only in groups of {qw.group_size} ({linear.in_features} "
                                     f"is not a multiple of W4A8's group of {w4.W4A8_GROUP})")
            if grouped and qw.group_size != group_size:
                summary.notes.append(f"{name}: group size {qw.group_size} ({linear.in_features} "
                                     f"is not a multiple of {group_size})")
        qw = _to(qw, linear.weight.device)
        module = make_linear(qw, mode, linear.bias, dtype, outliers)
        _set_module(model, name, module)
        record(module, from_gguf)

    if mode == "w4a8":
        fuse_w4a8_mlps(model)
        slow = [m for m in model.modules() if isinstance(m, W4A8Linear) and not m.is_native]
        if slow and slow[0].qweight.device.type == "cpu":
            summary.notes.append(f"w4a8: {len(slow)} projections run the reference path (a float32 matmul over "
                                 "the weight dequantized on every call, slower than int4): the native kernel "
                                 "needs a bf16 model and a CPU with AVX512-VNNI and AVX512-BF16")
            log.warning(summary.notes[-1])
    if include_embeddings and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
        _quantize_embeddings(model, mode, record)
    log.info("quantized %d modules (%s)%s", summary.num_quantized, mode,
             f"; {len(summary.notes)} notes" if summary.notes else "")
    return summary


def _to(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    return QuantizedWeight(w.format, w.qweight.to(device), w.scales.to(device),
                           None if w.mins is None else w.mins.to(device), w.in_features)


def _quantize_embeddings(model: nn.Module, mode: str, record: Callable[[nn.Module, bool], None]) -> None:
    """Embedding and LM head as one per-row 8-bit matrix (fp8 in fp8 mode), shared when tied."""
    embed: nn.Embedding = model.embed_tokens
    lm_head = getattr(model, "lm_head", None)
    dtype, device = embed.weight.dtype, embed.weight.device
    row_fmt = "fp8" if mode == "fp8" else "int8"
    per_row = _to(quantize_weight(embed.weight.data, row_fmt), device)
    model.embed_tokens = QuantEmbedding(per_row, dtype)
    record(model.embed_tokens, False)
    if not isinstance(lm_head, nn.Linear):
        return
    tied = lm_head.weight is embed.weight
    head_weight = per_row if tied else _to(quantize_weight(lm_head.weight.data, row_fmt), device)
    model.lm_head = make_linear(head_weight, "w8a8" if mode == "w8a8" else "int8", lm_head.bias, dtype)
    record(model.lm_head, False)


def module_weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers, counting shared storage once (tied embeddings)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_mkldnn:  # oneDNN-packed weights (kernels/cpu_linear.py): opaque, never shared
            total += t.numel() * t.element_size()
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total
