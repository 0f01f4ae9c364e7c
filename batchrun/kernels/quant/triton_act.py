"""Triton kernels around the GPU's 8-bit GEMMs: per-token activation quantization in one launch, and
W8A8's epilogue in one launch, so that a linear is at most 3 kernels (fp8: quantize + torch._scaled_mm;
W8A8: quantize + torch._int_mm + epilogue).

`quantize_rows` is `quantize_per_token_int8` (int8) or `quantize_per_token_fp8` (float8_e4m3fn) of
kernels/quant, bitwise: one program per row loads it once, takes its amax, the scale
`activation_scale` (formats.py: max(amax / qmax, MIN_SCALE), a correctly rounded division as the
CPU torch code does it) and x / scale rounded as the torch cast does (kernels/quant/triton_codes.py:
kv_quantize, shared with the KV cache's writes). W8A8's outlier channels count as 0 there. The
row's quantization is one Triton function, `quantize_row`, which the RMSNorm before qkv and gate/up
also calls (kernels/triton_elementwise.py: rms_norm_quant): those linears then take their input as
QuantizedRows (kernels/quant/act.py) and skip the quantization launch (fp8: torch._scaled_mm alone;
W8A8: torch._int_mm + epilogue).

`w8a8_epilogue` turns the int32 product into the output: acc * w_scale * x_scale (the order
`w8a8.py: _w8a8_epilogue` multiplies in, so without float channels it is bitwise that), plus W8A8's
float channels x[:, index] @ W[:, index].T accumulated in float32 in the same program (no second
GEMM), one rounding to the output dtype, then the bias in that dtype as torch adds it.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from batchrun.kernels.quant.act import INT_MM_MIN_ROWS, QuantizedRows
from batchrun.kernels.quant.formats import FP8_E4M3_MAX, INT8_MAX, MIN_SCALE
from batchrun.kernels.quant.triton_codes import kv_quantize

_INT8_MAX = tl.constexpr(INT8_MAX)
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)

__all__ = ["INT_MM_MIN_ROWS", "fp8_linear", "quantize_row", "quantize_rows", "w8a8_epilogue", "w8a8_linear"]


@triton.jit
def activation_scale(amax, IS_INT8: tl.constexpr):
    """formats.activation_scale in a kernel: max(amax / qmax, MIN_SCALE), amax float32, the division
    correctly rounded (div_rn) as CPU torch divides a tensor by a Python float."""
    qmax = _INT8_MAX if IS_INT8 else _FP8_MAX
    return tl.maximum(tl.math.div_rn(amax, qmax), _MIN_SCALE)


@triton.jit
def quantize_row(x, skip_ptr, offs, k_ok, IS_INT8: tl.constexpr, HAS_SKIP: tl.constexpr):
    """(codes, scale) of one row: x (BLOCK,) float32, zero past the row's end (k_ok false); with
    HAS_SKIP the columns whose skip_ptr entry is set count as 0 (and their codes are 0). The codes
    are float32 values exact in int8 / float8_e4m3fn. The one quantization of an activation row:
    `_quantize_rows_kernel` and the RMSNorm that quantizes its output
    (kernels/triton_elementwise.py) both call it, so their codes and scales are bitwise equal."""
    if HAS_SKIP:
        skip = tl.load(skip_ptr + offs, mask=k_ok, other=0).to(tl.int32)
        x = tl.where(skip != 0, 0.0, x)
    scale = activation_scale(tl.max(tl.abs(x), axis=0), IS_INT8)
    return kv_quantize(x, scale, IS_INT8), scale


@triton.jit
def _round_to_bf16(x):
    """float32 x rounded to the nearest bfloat16 value, ties to even, still float32 (so the cast
    after it is exact): what the compiled cast does; Triton's interpreter truncates instead."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # -65536: the int32 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_output(y, dtype: tl.constexpr):
    """float32 y in the output `dtype`, rounded to nearest even."""
    if dtype == tl.bfloat16:
        y = _round_to_bf16(y)
    return y.to(dtype)


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_kernel(
    x_ptr,
    skip_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    IS_INT8: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per row of q (M_pad >= M rows): rows past M are written as zeros (int_mm's
    padding), their scale is not stored. x (M, K), q (M_pad, K), s (M,) float32."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    k_ok = offs < K
    row_ok = (tl.zeros_like(offs) + row) < M  # as a vector: the interpreter takes no scalar in a mask
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + offs, mask=k_ok & row_ok, other=0.0).to(tl.float32)
    q, scale = quantize_row(x, skip_ptr, offs, k_ok, IS_INT8, HAS_SKIP)  # outlier channels: 0
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=k_ok)
    tl.store(s_ptr + row, scale)  # a padding row's too (MIN_SCALE): s has M_pad entries


def quantize_rows(
    x: torch.Tensor, dtype: torch.dtype, skip: Optional[torch.Tensor] = None, min_rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (max(M, min_rows), K) in `dtype` (int8 or float8_e4m3fn), scale (M, 1) float32) of x (M, K)
    in one launch; rows past M are zeros. `skip`: (K,) bool, columns counted as 0."""
    assert dtype in (torch.int8, torch.float8_e4m3fn) and x.dim() == 2
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    rows = max(m, min_rows)
    q = torch.empty((rows, k), dtype=dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(rows,)](
        x,
        skip if skip is not None else x,
        q,
        scale,
        m,
        k,
        x.stride(0),
        q.stride(0),
        IS_INT8=dtype == torch.int8,
        HAS_SKIP=skip is not None,
        BLOCK_K=block,
        num_warps=4 if block <= 2048 else (8 if block <= 8192 else 16),
        enable_fp_fusion=False,
    )
    return q, scale[:m]


@triton.jit(do_not_specialize=["M"])
def _w8a8_epilogue_kernel(
    acc_ptr,
    ws_ptr,
    xs_ptr,
    b_ptr,
    x_ptr,
    idx_ptr,
    ow_ptr,
    y_ptr,
    M,
    N,
    num_float,
    stride_am,
    stride_xm,
    stride_ow,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    HAS_FLOAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y (M, N) = ((acc * ws) * xs + x[:, idx] @ ow) in y's dtype (+ bias). acc (M, N) int32, ws (N,)
    and xs (M,) float32, idx (num_float,) int64, ow (num_float, N) in any float dtype."""
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    mask = m_ok[:, None] & n_ok[None, :]
    acc = tl.load(acc_ptr + offs_m[:, None] * stride_am + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
    y = (acc * ws[None, :]) * xs[:, None]
    if HAS_FLOAT:  # the float channels: a rank-1 update each, in float32
        f = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in range(num_float):
            col = tl.load(idx_ptr + j)
            xj = tl.load(x_ptr + offs_m * stride_xm + col, mask=m_ok, other=0.0).to(tl.float32)
            wj = tl.load(ow_ptr + j * stride_ow + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            f += xj[:, None] * wj[None, :]
        y = y + f
    out = _to_output(y, y_ptr.dtype.element_ty)
    if HAS_BIAS:  # added in the output dtype, as torch's y + bias
        b = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        out = _to_output(out.to(tl.float32) + b[None, :], y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=mask)


def w8a8_epilogue(
    acc: torch.Tensor,
    w_scales: torch.Tensor,
    x_scales: torch.Tensor,
    bias: Optional[torch.Tensor],
    dtype: torch.dtype,
    x: Optional[torch.Tensor] = None,
    index: Optional[torch.Tensor] = None,
    weight_t: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """acc (M, N) int32 (unit column stride), w_scales (N,), x_scales (M, 1) float32 -> (M, N) in
    `dtype`; with x (M, K), index (num_float,) int64 and weight_t (num_float, N) the float channels'
    product is added before the rounding."""
    m, n = acc.shape
    assert acc.stride(1) == 1
    y = torch.empty((m, n), dtype=dtype, device=acc.device)
    if m == 0:
        return y
    num_float = index.numel() if index is not None else 0
    has_float = num_float > 0
    if has_float:
        assert x is not None and weight_t is not None and x.stride(1) == 1 and weight_t.stride(1) == 1
    block_m = 16 if m <= 16 else 32
    block_n = 128
    _w8a8_epilogue_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        acc,
        w_scales,
        x_scales,
        bias if bias is not None else w_scales,
        x if has_float else acc,
        index if has_float else acc,
        weight_t if has_float else acc,
        y,
        m,
        n,
        num_float,
        acc.stride(0),
        x.stride(0) if x is not None and has_float else 0,
        weight_t.stride(0) if weight_t is not None and has_float else 0,
        y.stride(0),
        HAS_BIAS=bias is not None,
        HAS_FLOAT=has_float,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return y


def w8a8_linear(
    x: Union[torch.Tensor, QuantizedRows],
    qweight: torch.Tensor,
    w_scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    index: Optional[torch.Tensor] = None,
    skip: Optional[torch.Tensor] = None,
    weight_t: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`w8a8.w8a8_matmul` in 3 kernels: x (M, K) quantized per token (outlier columns `skip` left
    out), torch._int_mm against qweight (N, K) int8, the epilogue (w_scales (N,) float32, the float
    channels `index`/`weight_t`, bias). Without float channels bitwise w8a8_matmul's torch path.
    x given as QuantizedRows (int8, `skip` left out, INT_MM_MIN_ROWS rows at least: what the norm
    before the linear wrote) skips the quantization: 2 kernels."""
    if isinstance(x, QuantizedRows):
        xq, sx, x = x.q, x.scale, x.x
    else:
        xq, sx = quantize_rows(x, torch.int8, skip, min_rows=INT_MM_MIN_ROWS)
    m = x.shape[0]
    acc = torch._int_mm(xq, qweight.t())[:m]  # (M, N) int32
    return w8a8_epilogue(acc, w_scales, sx, bias, x.dtype, x if x.stride(1) == 1 else x.contiguous(), index, weight_t)


def fp8_linear(
    x: Union[torch.Tensor, QuantizedRows],
    qweight: torch.Tensor,
    scale_b: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`weight_only.fp8_scaled_matmul` in 2 kernels for a bf16/fp16 x (M, K): the per-token e4m3
    quantization, torch._scaled_mm with row-wise scales (scale_b: (1, N) float32) and the bias
    (its epilogue takes a bias in the output dtype). x given as QuantizedRows (e4m3 codes, from the
    norm before the linear): torch._scaled_mm alone."""
    if isinstance(x, QuantizedRows):
        xq, sx, x = x.q, x.scale, x.x
    else:
        xq, sx = quantize_rows(x, torch.float8_e4m3fn)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    fused_bias = bias if bias is not None and bias.dtype == out_dtype == torch.bfloat16 else None
    y = torch._scaled_mm(xq, qweight.t(), scale_a=sx, scale_b=scale_b, bias=fused_bias, out_dtype=out_dtype)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if bias is not None and fused_bias is None:
        y = y + bias
    return y
