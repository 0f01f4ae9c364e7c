"""Quantized weight and KV formats, their (de)quantization, and the matmuls over them in plain torch.

Canonical formats (what GGUF blocks map onto, what the Triton kernels read, what tests check):

- int8: `qweight` int8 (N, K), `scales` float32 (N, K // group_size); w = q * scale. A group size
  of K is per-output-channel (what we quantize to); 32 is GGUF's Q8_0.
- int4: `qweight` uint8 (N, K // 2), byte j of a row holds k = 2j in its low nibble and k = 2j + 1
  in its high nibble; `scales` and `mins` float16 (N, K // group_size); w = q * scale + min with q
  in [0, 15]. Asymmetric like GGUF's Q4_1 (d, m); Q4_0 is the case min = -8 * scale.
- fp8: `qweight` float8_e4m3fn (N, K), `scales` float32 (N, 1); w = q * scale.
- Activations for W8A8: int8 per token (row) with a float32 scale per row, so a row's result never
  depends on what else is in the batch (the int32 accumulation is exact).
- KV cache: int8 or float8_e4m3fn (..., head_dim) with one float32 scale per (token, head).

The `*_matmul` functions here are the references (the CPU path for float32 activations, and what the
GPU kernels in `batchrun.kernels.triton_quant` are checked against). `int8_weight_matmul_cpu` and
`int4_matmul_cpu` are torch's own packed CPU kernels, which need bf16 activations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from batchrun.kernels import cpu_native
from batchrun.kernels.cpu_linear import pack_tiles, unpack_tiles
from batchrun.kernels.cpu_native import DTYPE_CODES
from batchrun.kernels.kv_layout import from_head_major, slots_by_head

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
# A group or row of all zeros gets this scale instead of 0, so dividing by it stays finite.
MIN_SCALE = 1e-10

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


# ---------------------------------------------------------------------------------------------
# int8 weights


def quantize_int8(w: torch.Tensor, group_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8, one scale per `group_size` inputs (None: per output channel)."""
    n, k = w.shape
    g = group_size or k
    assert k % g == 0, f"in_features {k} is not a multiple of group_size {g}"
    wg = w.float().reshape(n, k // g, g)  # (N, num_groups, group_size)
    scales = (wg.abs().amax(dim=-1) / INT8_MAX).clamp_(min=MIN_SCALE)  # (N, num_groups)
    q = torch.round(wg / scales[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(n, k), scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = qweight.shape
    num_groups = scales.shape[1]
    w = qweight.float().reshape(n, num_groups, k // num_groups) * scales.float()[..., None]
    return w.reshape(n, k).to(dtype)  # (N, K)


def int8_weight_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference W8A16: y = x @ dequant(W).T in x's dtype."""
    if scales.shape[1] == 1:
        # A per-channel scale factors out of the sum over k, so the weight is only cast, not scaled.
        y = torch.nn.functional.linear(x, qweight.to(x.dtype)) * scales[:, 0].to(x.dtype)
    else:
        # Dequantized straight into x's dtype (|q| <= 127 is exact in bf16): two passes over the
        # weight instead of four through float32; the same float32 numbers when x is float32.
        n, k = qweight.shape
        num_groups = scales.shape[1]
        w = qweight.to(x.dtype).view(n, num_groups, k // num_groups) * scales.to(x.dtype)[..., None]
        y = torch.nn.functional.linear(x, w.view(n, k))
    return y if bias is None else y + bias


def int8_weight_matmul_cpu(x: torch.Tensor, qweight: torch.Tensor, scales_bf16: torch.Tensor) -> torch.Tensor:
    """torch's packed W8A16 CPU kernel (bf16 x, per-channel scales (N,) in bf16): fastest at a few rows."""
    return torch._weight_int8pack_mm(x, qweight, scales_bf16)


# ---------------------------------------------------------------------------------------------
# W8A8: int8 weights and per-token int8 activations


def quantize_per_token_int8(x: torch.Tensor, skip: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q int8 (M, K), scale float32 (M, 1)) with x ~= x_q * scale row by row.

    `skip`: a (K,) bool mask of columns left out (W8A8's outlier channels, which run in float):
    they count as 0 for the scale and come out as 0.

    Written as few full passes as torch allows: it runs before every W8A8 GEMM and on a CPU these
    elementwise passes cost about as much as the int8 GEMM saves (linalg.vector_norm(inf) alone
    was 7x slower than abs().amax() here).
    """
    if native_rows(x):
        return _quantize_per_token_int8_native(x, skip)
    xf = x.float()
    if skip is not None:
        xf = xf.masked_fill(skip, 0.0)
    scale = xf.abs().amax(dim=-1, keepdim=True).div_(INT8_MAX).clamp_(min=MIN_SCALE)  # (M, 1)
    # |x / scale| <= 127 by construction, so no clamp is needed before the cast; divide in place
    # when x.float() made a copy.
    xs = xf.div_(scale) if xf.data_ptr() != x.data_ptr() else xf / scale
    return xs.round_().to(torch.int8), scale


def native_rows(x: torch.Tensor) -> bool:
    """Whether the native quantization pass serves x: kernels on, a float32/bf16 CPU matrix with unit column stride."""
    return cpu_native.usable(x) and x.dtype in DTYPE_CODES and x.dim() == 2 and x.stride(1) == 1


def _quantize_per_token_int8_native(x: torch.Tensor, skip: Optional[torch.Tensor],
                                    gather: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """quantize_per_token_int8 in one pass (csrc/quant.cpp); bitwise equal to the torch code. With
    `gather` ((n,) int64 column indices) also returns x[:, gather], copied in the same pass."""
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.int8)
    scale = torch.empty((m, 1), dtype=torch.float32)
    # A contiguous bool mask is read as its bytes (0/1): no conversion on this per-projection path.
    skip = None if skip is None else skip.contiguous()  # held until the call returns
    gathered = None if gather is None else torch.empty((m, gather.numel()), dtype=x.dtype)  # (m, n)
    cpu_native.library().batchrun_quantize_per_token_int8(
        x.data_ptr(), DTYPE_CODES[x.dtype], m, k, x.stride(0), None if skip is None else skip.data_ptr(),
        xq.data_ptr(), scale.data_ptr(), None if gather is None else gather.data_ptr(),
        0 if gather is None else gather.numel(), None if gathered is None else gathered.data_ptr(),
        torch.get_num_threads())
    return (xq, scale) if gather is None else (xq, scale, gathered)


def quantize_with_outliers(x: torch.Tensor, outliers: OutlierChannels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_q, scale) of quantize_per_token_int8(x, outliers.skip), and x[:, outliers.index] for the
    float product: one native pass where the kernels serve x, else the torch code and an index_select."""
    if native_rows(x) and outliers.index.dtype == torch.int64 and outliers.index.is_contiguous():
        return _quantize_per_token_int8_native(x, outliers.skip, outliers.index)
    xq, scale = quantize_per_token_int8(x, outliers.skip)
    return xq, scale, x.index_select(1, outliers.index)


def _w8a8_epilogue(acc: torch.Tensor, w_scales: torch.Tensor, x_scales: torch.Tensor, bias: Optional[torch.Tensor],
                   dtype: torch.dtype) -> torch.Tensor:
    """((acc float32 * w_scales) * x_scales).to(dtype) (+ bias), the torch way or in one native pass."""
    if (cpu_native.usable(acc) and dtype in DTYPE_CODES and acc.is_contiguous() and w_scales.dtype == torch.float32
            and x_scales.dtype == torch.float32 and (bias is None or bias.dtype == dtype)):
        m, n = acc.shape
        y = torch.empty((m, n), dtype=dtype)
        ws, xs = w_scales.reshape(-1).contiguous(), x_scales.reshape(-1).contiguous()
        b = bias.contiguous() if bias is not None else None
        cpu_native.library().batchrun_w8a8_epilogue(acc.data_ptr(), m, n, ws.data_ptr(), xs.data_ptr(),
                                                    b.data_ptr() if b is not None else None, y.data_ptr(),
                                                    DTYPE_CODES[dtype], torch.get_num_threads())
        return y
    # Convert first, then scale in place: mixed-dtype multiplies (int32 * float, or a float32
    # result into a bf16 out=) take torch's slow casting path, 3.5x slower here in total.
    y = acc.to(torch.float32).mul_(w_scales.reshape(-1)).mul_(x_scales).to(dtype)
    return y + bias if bias is not None else y


@dataclass
class OutlierChannels:
    """W8A8's input channels that stay in float: their activations are left out of the per-token int8
    quantization (so they no longer set every token's step) and multiply `weight_t` in x's dtype."""

    index: torch.Tensor  # (k,) int64 input channels
    skip: torch.Tensor  # (K,) bool: True at those channels
    weight_t: torch.Tensor  # (k, N) in the compute dtype: W[:, index].T


def w8a8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: Optional[torch.Tensor] = None, outliers: Optional[OutlierChannels] = None) -> torch.Tensor:
    """y = (q_x @ q_W.T) * s_x * s_W with an exact int32 accumulation (torch._int_mm; VNNI on x86),
    plus x[:, outliers] @ W[:, outliers].T in x's dtype when some channels stay in float (their
    columns of q_W are zero).

    `scales` is per output channel (N, 1).
    """
    assert scales.shape[1] == 1, "W8A8 needs per-channel weight scales"
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if outliers is None:
        xq, sx = quantize_per_token_int8(x2)
    else:
        xq, sx, x_float = quantize_with_outliers(x2, outliers)  # x_float: (M, num_outliers)
    m = xq.shape[0]
    if xq.is_cuda and m <= 16:  # cuBLAS int8 GEMM wants more than 16 rows
        xq = torch.nn.functional.pad(xq, (0, 0, 0, 17 - m))
    acc = torch._int_mm(xq, qweight.t())[:m]  # (M, N) int32
    y = _w8a8_epilogue(acc, scales[:, 0], sx, bias, x.dtype)
    if outliers is not None:
        y = torch.addmm(y, x_float, outliers.weight_t.to(x.dtype))
    return y.reshape(*shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------------------------
# W8A8 through the native kernel (csrc/linear.cpp: batchrun_w8a8_linear)
#
# torch._int_mm hands oneDNN a plain int8 weight on every call (reordered each time, as F.linear's
# bf16 weights were), writes an int32 (M, N) product that the epilogue then reads back, and the
# float channels are a second GEMM whose bf16 result is read and written again. The native kernel
# keeps the weight in its own tiles (Wq + 128 as unsigned bytes, vpdpbusd's unsigned operand),
# prefetches the next tile while it computes, and finishes each 32-column tile in registers: scales,
# the float channels as bf16 dot products into the same float32 sums, bias, one bf16 rounding.
# Measured on SmolLM2's 120 projections (2 cores): 8.0 ms at 32 rows against 16.5 through
# _int_mm and 10.4 for bf16; with 64 float channels 10.4 against 24.5; at 512 rows 72 and 88 ms
# against 83 and 116 (bf16: 123).

def w8a8_native_supported(out_features: int, in_features: int, num_float_channels: int = 0) -> bool:
    """Whether batchrun_w8a8_linear serves this weight here (kernels on and built with AVX512-VNNI
    and BF16; out_features a multiple of 32, in_features of 4, an even number of float channels)."""
    if not (cpu_native.enabled() and cpu_native.available()):
        return False
    return bool(cpu_native.library().batchrun_w8a8_linear_supported(out_features, in_features, num_float_channels))


def pack_w8a8_weight(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> the kernel's tiles [N / 32][K / 4][32][4] of Wq + 128 (uint8), shaped (N, K)."""
    return pack_tiles((qweight.to(torch.int16) + 128).to(torch.uint8), 4)


def unpack_w8a8_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_w8a8_weight: the plain (N, K) int8 weight."""
    return (unpack_tiles(packed, 4).to(torch.int16) - 128).to(torch.int8)


def w8a8_matmul_native(x: torch.Tensor, packed: torch.Tensor, w_scales: torch.Tensor, bias_f32: Optional[torch.Tensor],
                       outliers: Optional[OutlierChannels], packed_outliers: Optional[torch.Tensor]) -> torch.Tensor:
    """w8a8_matmul for a bf16 CPU x through the native kernel. `packed`: pack_w8a8_weight's tiles;
    `w_scales`: (N,) float32; `packed_outliers`: the float channels' weight (N, num_outliers) in
    kernels/cpu_linear.py's bf16 tiles (with `outliers`). The per-token quantization is the code of
    w8a8_matmul's native pass (csrc/quant_rows.h), run by the kernel itself where it can read x, so
    the int32 sums are identical; the float channels are added before the single rounding instead
    of after one (more exact)."""
    shape = x.shape
    if shape[-1] != packed.shape[1]:  # the kernel takes K from the input: a wrong width would read past W
        raise ValueError(f"input has {shape[-1]} features, the weight {packed.shape[1]}")
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    n = packed.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    if not m:
        return y.reshape(*shape[:-1], n)
    num_float = 0 if outliers is None else outliers.index.numel()
    # The kernel quantizes x itself where it can read x as it is (one call instead of two: what a
    # decode step's small projections need); a contiguous bool mask is read as its bytes (0/1).
    self_quantized = x2.dtype == torch.bfloat16 and x2.stride(1) == 1 and (outliers is None or (
        outliers.index.dtype == torch.int64 and outliers.index.is_contiguous() and outliers.skip.is_contiguous()))
    xq = sx = xo = None
    if not self_quantized:
        xq, sx, xo = quantize_with_outliers(x2, outliers) if outliers is not None else (*quantize_per_token_int8(x2), None)
        sx = sx.reshape(-1).contiguous()
    rc = cpu_native.library().batchrun_w8a8_linear(
        None if xq is None else xq.data_ptr(), m, k, 0 if xq is None else xq.stride(0),
        None if sx is None else sx.data_ptr(), x2.data_ptr() if self_quantized else None, x2.stride(0),
        outliers.skip.data_ptr() if self_quantized and outliers is not None else None,
        outliers.index.data_ptr() if self_quantized and outliers is not None else None,
        packed.data_ptr(), w_scales.data_ptr(), n, None if xo is None else xo.data_ptr(), num_float,
        0 if xo is None else xo.stride(0), None if packed_outliers is None else packed_outliers.data_ptr(),
        None if bias_f32 is None else bias_f32.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"batchrun_w8a8_linear failed ({rc}) for weight {tuple(packed.shape)}")
    return y.reshape(*shape[:-1], n)


# ---------------------------------------------------------------------------------------------
# int4 weights (packed two per byte, groups along K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 15] -> (N, K // 2) uint8, even k in the low nibble."""
    assert q.shape[-1] % 2 == 0
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K // 2) uint8 -> (N, K) uint8 values in [0, 15]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest int4 per group: (packed (N, K//2), scales, mins (N, K//g) float16)."""
    n, k = w.shape
    assert k % group_size == 0 and group_size % 2 == 0, f"in_features {k} vs group_size {group_size}"
    wg = w.float().reshape(n, k // group_size, group_size)
    lo = wg.amin(dim=-1)
    hi = wg.amax(dim=-1)
    # Quantize against the float16 values that are stored, so dequantization reproduces them.
    scales = ((hi - lo) / 15.0).clamp_(min=1e-7).to(torch.float16)
    mins = lo.to(torch.float16)
    q = torch.round((wg - mins.float()[..., None]) / scales.float()[..., None]).clamp_(0, 15)
    return pack_int4(q.reshape(n, k)), scales, mins


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = packed.shape[0]
    q = unpack_int4(packed).float()
    num_groups = scales.shape[1]
    w = q.reshape(n, num_groups, -1) * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(n, -1).to(dtype)  # (N, K)


def int4_weight_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference W4A16: y = x @ dequant(W).T in x's dtype."""
    y = torch.nn.functional.linear(x, dequantize_int4(qweight, scales, mins, x.dtype))
    return y if bias is None else y + bias


def int4_pack_for_cpu(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 layout -> torch's CPU int4 kernel layout: (packed weight, scales_and_zeros bf16 (G, N, 2)).

    torch's kernel computes w = (q - 8) * scale + zero, so zero = min + 8 * scale. Scales and zeros
    become bf16 there (a relative error of 2^-9, small against the half-step of rounding to int4).
    """
    q = unpack_int4(qweight).to(torch.int32)  # (N, K)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    zeros = mins.float() + 8.0 * scales.float()
    scales_zeros = torch.stack((scales.float().t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros


def int4_matmul_cpu(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """torch's packed W4A16 CPU kernel; x is bf16 (M, K)."""
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)


# ---------------------------------------------------------------------------------------------
# fp8 (e4m3) weights


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3: (qweight float8_e4m3fn (N, K), scales float32 (N, 1))."""
    scales = (w.float().abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp_(min=MIN_SCALE)
    return (w.float() / scales).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scales


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (qweight.float() * scales).to(dtype)


def fp8_weight_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference fp8 weight-only matmul (runs anywhere; the CPU has no fast fp8 GEMM)."""
    y = torch.nn.functional.linear(x, qweight.to(x.dtype)) * scales[:, 0].to(x.dtype)
    return y if bias is None else y + bias


def fp8_scaled_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W8A8-FP8 for Hopper-class GPUs: per-token e4m3 activations, torch._scaled_mm (row-wise scales)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    amax = torch.linalg.vector_norm(x2, float("inf"), dim=-1, keepdim=True).float()
    sx = (amax / FP8_E4M3_MAX).clamp_(min=MIN_SCALE)  # (M, 1)
    xq = (x2.float() / sx).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    y = torch._scaled_mm(xq, qweight.t(), scale_a=sx, scale_b=scales.t().contiguous(), out_dtype=out_dtype).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------------------------
# KV cache


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, num_kv_heads, head_dim) float -> (same shape in `dtype`, scales (num_tokens, num_kv_heads))."""
    qmax = INT8_MAX if dtype == torch.int8 else FP8_E4M3_MAX
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1).float()
    scale = (amax / qmax).clamp_(min=MIN_SCALE)  # (num_tokens, num_kv_heads)
    xs = (x.float() / scale[..., None]).clamp_(-qmax, qmax)
    q = torch.round(xs).to(dtype) if dtype == torch.int8 else xs.to(dtype)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_kv for any leading shape: q (..., head_dim), scale (...)."""
    return (q.to(torch.float32) * scale[..., None]).to(dtype)


class QuantizedKVCache:
    """One layer's K (or V) cache held as int8/fp8 with a float32 scale per (slot, head).

    It stands in for the float cache tensor in `paged_attention`: `.shape` is the logical
    (num_blocks, block_size, num_kv_heads, head_dim), the storage is head-major like the float
    cache's (kernels/attention.py), and `gather_blocks` / `gather_slots` return the gathered
    entries dequantized to `out_dtype`, so attention reads floats and the float path keeps its code.
    `write_kv_cache` quantizes new entries on the way in.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> None:
        assert data.shape[:-1] == scale.shape
        self.data = data  # (num_blocks, block_size, num_kv_heads, head_dim) int8 | float8_e4m3fn
        self.scale = scale  # (num_blocks, block_size, num_kv_heads) float32
        self.out_dtype = out_dtype

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: torch.dtype, out_dtype: torch.dtype,
              device: torch.device) -> "QuantizedKVCache":
        num_blocks, block_size, num_kv_heads, head_dim = shape
        data = torch.zeros((num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device)
        scale = torch.ones((num_kv_heads, num_blocks, block_size), dtype=torch.float32, device=device)
        return QuantizedKVCache(from_head_major(data), from_head_major(scale), out_dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def gather_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """(num_kv_heads, len(slots), head_dim) dequantized."""
        data, scale = slots_by_head(self.data), slots_by_head(self.scale)
        q = data.view(torch.uint8) if data.dtype != torch.int8 else data  # no float8 index kernel on CPU
        q = q.index_select(1, slots)
        return dequantize_kv(q.view(data.dtype), scale.index_select(1, slots), self.out_dtype)

    def gather_blocks(self, tables: torch.Tensor) -> torch.Tensor:
        """(num_kv_heads, num_seqs, num_blocks * block_size, head_dim) dequantized, like attention.gather_blocks."""
        block_size = self.data.shape[1]
        offsets = torch.arange(block_size, device=tables.device)
        slots = (tables[:, :, None] * block_size + offsets).flatten()
        out = self.gather_slots(slots)
        return out.view(out.shape[0], tables.shape[0], -1, out.shape[-1])

    def __getitem__(self, index) -> torch.Tensor:
        """Indexing the logical (num_blocks, block_size, num_kv_heads, head_dim) shape, dequantized."""
        return dequantize_kv(self.data[index], self.scale[index], self.out_dtype)

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize (num_tokens, num_kv_heads, head_dim) and store it at the given flat slots."""
        q, scale = quantize_kv(x, self.data.dtype)
        # index_copy_ has no float8 kernel on the CPU; the bytes are the same through a uint8 view.
        flat = self.data.flatten(0, 1)
        if flat.dtype != torch.int8:
            flat, q = flat.view(torch.uint8), q.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, q)
        self.scale.flatten(0, 1).index_copy_(0, slot_mapping, scale)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def kv_bytes_per_token_head(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) costs for one head in the cache, scales included."""
    if kv_dtype in (torch.int8, torch.float8_e4m3fn):
        return head_dim + 4
    return head_dim * torch.finfo(kv_dtype).bits // 8
