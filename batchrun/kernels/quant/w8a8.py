"""W8A8: int8 weights per output channel and int8 activations per token (row), an exact int32 GEMM.

A row's activations are quantized with one float32 scale of their own, so its result never depends
on what else is in the batch. `OutlierChannels` are input channels left out of that quantization
(so they no longer set every token's step) and multiplied in float. `w8a8_matmul` runs
torch._int_mm (VNNI on x86 CPUs) and an epilogue; `w8a8_matmul_native` is one native kernel
(csrc/linear.cpp: batchrun_w8a8_linear) over the weight in its own tiles (`pack_w8a8_weight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from batchrun.kernels import cpu_native
from batchrun.kernels.cpu_linear import pack_tiles, unpack_tiles
from batchrun.kernels.cpu_native import DTYPE_CODES
from batchrun.kernels.quant.formats import INT8_MAX, activation_scale


def quantize_per_token_int8(
    x: torch.Tensor, skip: Optional[torch.Tensor] = None, native: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q int8 (M, K), scale float32 (M, 1)) with x ~= x_q * scale row by row.

    `skip`: a (K,) bool mask of columns left out (W8A8's outlier channels, which run in float):
    they count as 0 for the scale and come out as 0. `native`: the native kernels are built and on
    (the kernel set's choice): one native pass where it takes x (`native_rows`), bitwise this code.

    Written as few full passes as torch allows: it runs before every W8A8 GEMM, and on a CPU these
    elementwise passes cost about as much as the int8 GEMM saves (abs().amax() rather than
    linalg.vector_norm(inf), which is much slower here).
    """
    if native and native_rows(x):
        xq, scale, _ = _quantize_per_token_int8_native(x, skip)
        return xq, scale
    xf = x.float()
    if skip is not None:
        xf = xf.masked_fill(skip, 0.0)
    scale = activation_scale(xf.abs().amax(dim=-1, keepdim=True), INT8_MAX)  # (M, 1)
    # |x / scale| <= 127 by construction, so no clamp is needed before the cast; divide in place
    # when x.float() made a copy.
    xs = xf.div_(scale) if xf.data_ptr() != x.data_ptr() else xf / scale
    return xs.round_().to(torch.int8), scale


def native_rows(x: torch.Tensor) -> bool:
    """Whether the native quantization passes take x: a float32/bf16 matrix with unit column stride."""
    return x.dtype in DTYPE_CODES and x.dim() == 2 and x.stride(1) == 1


def _quantize_per_token_int8_native(
    x: torch.Tensor, skip: Optional[torch.Tensor], gather: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """quantize_per_token_int8 in one pass (csrc/quant.cpp); bitwise equal to the torch code. With
    `gather` ((n,) int64 column indices) also x[:, gather], copied in the same pass (else None)."""
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.int8)
    scale = torch.empty((m, 1), dtype=torch.float32)
    # A contiguous bool mask is read as its bytes (0/1): no conversion on this per-projection path.
    skip = None if skip is None else skip.contiguous()  # held until the call returns
    gathered = None if gather is None else torch.empty((m, gather.numel()), dtype=x.dtype)  # (m, n)
    cpu_native.loaded().batchrun_quantize_per_token_int8(
        x.data_ptr(),
        DTYPE_CODES[x.dtype],
        m,
        k,
        x.stride(0),
        None if skip is None else skip.data_ptr(),
        xq.data_ptr(),
        scale.data_ptr(),
        None if gather is None else gather.data_ptr(),
        0 if gather is None else gather.numel(),
        None if gathered is None else gathered.data_ptr(),
        torch.get_num_threads(),
    )
    return xq, scale, gathered


def quantize_with_outliers(
    x: torch.Tensor, outliers: OutlierChannels, native: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_q, scale) of quantize_per_token_int8(x, outliers.skip), and x[:, outliers.index] for the
    float product: with `native`, one native pass where it takes x, else the torch code and an
    index_select."""
    if native and native_rows(x) and outliers.index.dtype == torch.int64 and outliers.index.is_contiguous():
        xq, scale, gathered = _quantize_per_token_int8_native(x, outliers.skip, outliers.index)
        assert gathered is not None
        return xq, scale, gathered
    xq, scale = quantize_per_token_int8(x, outliers.skip, native)
    return xq, scale, x.index_select(1, outliers.index)


def _w8a8_epilogue(
    acc: torch.Tensor,
    w_scales: torch.Tensor,
    x_scales: torch.Tensor,
    bias: Optional[torch.Tensor],
    dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    """((acc float32 * w_scales) * x_scales).to(dtype) (+ bias), the torch way or (`native`) in one
    native pass."""
    if (
        native
        and dtype in DTYPE_CODES
        and acc.is_contiguous()
        and w_scales.dtype == torch.float32
        and x_scales.dtype == torch.float32
        and (bias is None or bias.dtype == dtype)
    ):
        m, n = acc.shape
        y = torch.empty((m, n), dtype=dtype)
        ws, xs = w_scales.reshape(-1).contiguous(), x_scales.reshape(-1).contiguous()
        b = bias.contiguous() if bias is not None else None
        cpu_native.loaded().batchrun_w8a8_epilogue(
            acc.data_ptr(),
            m,
            n,
            ws.data_ptr(),
            xs.data_ptr(),
            b.data_ptr() if b is not None else None,
            y.data_ptr(),
            DTYPE_CODES[dtype],
            torch.get_num_threads(),
        )
        return y
    # Convert first, then scale in place: mixed-dtype multiplies (int32 * float, or a float32
    # result into a bf16 out=) take torch's slow casting path.
    y = acc.to(torch.float32).mul_(w_scales.reshape(-1)).mul_(x_scales).to(dtype)
    return y + bias if bias is not None else y


@dataclass
class OutlierChannels:
    """W8A8's input channels that stay in float: their activations are left out of the per-token int8
    quantization (so they no longer set every token's step) and multiply `weight_t` in x's dtype."""

    index: torch.Tensor  # (k,) int64 input channels
    skip: torch.Tensor  # (K,) bool: True at those channels
    weight_t: torch.Tensor  # (k, N) in the compute dtype: W[:, index].T


def w8a8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    outliers: Optional[OutlierChannels] = None,
    native: bool = False,
    min_rows: int = 0,
) -> torch.Tensor:
    """y = (q_x @ q_W.T) * s_x * s_W with an exact int32 accumulation (torch._int_mm; VNNI on x86),
    plus x[:, outliers] @ W[:, outliers].T in x's dtype when some channels stay in float (their
    columns of q_W are zero).

    `scales` is per output channel (N, 1). `native`: the quantization and the epilogue run their
    native passes where they take the tensors (bitwise the torch code; a CPU kernel set with the
    kernels on binds it so). `min_rows`: the fewest rows torch._int_mm takes (cuBLAS: more than
    16, INT_MM_MIN_ROWS); fewer are padded with zero rows.
    """
    assert scales.shape[1] == 1, "W8A8 needs per-channel weight scales"
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if outliers is None:
        xq, sx = quantize_per_token_int8(x2, None, native)
    else:
        xq, sx, x_float = quantize_with_outliers(x2, outliers, native)  # x_float: (M, num_outliers)
    m = xq.shape[0]
    if m < min_rows:
        xq = torch.nn.functional.pad(xq, (0, 0, 0, min_rows - m))
    acc = torch._int_mm(xq, qweight.t())[:m]  # (M, N) int32
    y = _w8a8_epilogue(acc, scales[:, 0], sx, bias, x.dtype, native)
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
# Figures: docs/benchmarks.md.


def w8a8_native_supported(out_features: int, in_features: int, num_float_channels: int = 0) -> bool:
    """Whether batchrun_w8a8_linear takes this weight (built with AVX512-VNNI and BF16; out_features
    a multiple of 32, in_features of 4, an even number of float channels). Asked where the kernels
    are built and on (a CPU kernel set that packs for them)."""
    return bool(cpu_native.loaded().batchrun_w8a8_linear_supported(out_features, in_features, num_float_channels))


def pack_w8a8_weight(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> the kernel's tiles [N / 32][K / 4][32][4] of Wq + 128 (uint8), shaped (N, K)."""
    return pack_tiles((qweight.to(torch.int16) + 128).to(torch.uint8), 4)


def unpack_w8a8_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_w8a8_weight: the plain (N, K) int8 weight."""
    return (unpack_tiles(packed, 4).to(torch.int16) - 128).to(torch.int8)


def w8a8_matmul_native(
    x: torch.Tensor,
    packed: torch.Tensor,
    w_scales: torch.Tensor,
    bias_f32: Optional[torch.Tensor],
    outliers: Optional[OutlierChannels],
    packed_outliers: Optional[torch.Tensor],
) -> torch.Tensor:
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
    self_quantized = (
        x2.dtype == torch.bfloat16
        and x2.stride(1) == 1
        and (
            outliers is None
            or (
                outliers.index.dtype == torch.int64 and outliers.index.is_contiguous() and outliers.skip.is_contiguous()
            )
        )
    )
    xq = sx = xo = None
    if not self_quantized:
        xq, sx, xo = (
            quantize_with_outliers(x2, outliers, True)
            if outliers is not None
            else (*quantize_per_token_int8(x2, None, True), None)
        )
        sx = sx.reshape(-1).contiguous()
    rc = cpu_native.loaded().batchrun_w8a8_linear(
        None if xq is None else xq.data_ptr(),
        m,
        k,
        0 if xq is None else xq.stride(0),
        None if sx is None else sx.data_ptr(),
        x2.data_ptr() if self_quantized else None,
        x2.stride(0),
        outliers.skip.data_ptr() if self_quantized and outliers is not None else None,
        outliers.index.data_ptr() if self_quantized and outliers is not None else None,
        packed.data_ptr(),
        w_scales.data_ptr(),
        n,
        None if xo is None else xo.data_ptr(),
        num_float,
        0 if xo is None else xo.stride(0),
        None if packed_outliers is None else packed_outliers.data_ptr(),
        None if bias_f32 is None else bias_f32.data_ptr(),
        y.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"batchrun_w8a8_linear failed ({rc}) for weight {tuple(packed.shape)}")
    return y.reshape(*shape[:-1], n)
