"""Triton dequantize-GEMMs for the GPU: W8A16 (int8 weights) and W4A16 (packed int4 in groups).

Same signatures and formats as the torch references in `batchrun.kernels.quant.weight_only`
(`int8_weight_matmul`, `int4_weight_matmul`), which the tests compare them with, on CPU tensors in
Triton's interpreter (TRITON_INTERPRET=1) and on a GPU when there is one. Each program computes a
(BLOCK_M, BLOCK_N) tile of y = x @ W.T: it loads the quantized weight tile, dequantizes it in
registers and feeds tl.dot, so the weight crosses memory at 1 or 0.5 bytes per element.

int4 tiles are split by parity: a packed byte holds k = 2j (low nibble) and 2j + 1 (high), so the
even and odd columns of x meet the two nibble planes in two dots, with no interleaving in registers.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])  # the step's token count: one compiled variant for all
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_ym,
    stride_yn,
    IS_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 rows and columns: offs_m * stride_xm and offs_n * stride_wn pass 2**31 on a long batch
    # or a wide vocabulary, where an int32 product wraps.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )  # (BLOCK_M, BLOCK_K)
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + k[:, None] * stride_wk, mask=n_ok[None, :] & k_ok[:, None], other=0
        )  # (BLOCK_K, BLOCK_N) int8
        wf = w.to(tl.float32)
        if not IS_PER_CHANNEL:
            s = tl.load(
                s_ptr + offs_n[None, :] * stride_sn + (k // group_size)[:, None],
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            wf = wf * s
        acc += tl.dot(x, wf.to(x.dtype))
    if IS_PER_CHANNEL:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit(do_not_specialize=["M"])  # the step's token count: one compiled variant for all
def _w4a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 rows and columns: offs_m * stride_xm and offs_n * stride_wn pass 2**31 on a long batch
    # or a wide vocabulary, where an int32 product wraps.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_K // 2)  # packed byte (k pair) within the tile
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_even = k0 + 2 * offs_j
        k_ok = k_even < K  # K is even, so k_even + 1 is in range with it
        x_lo = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k_even[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K // 2)
        x_hi = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (k_even + 1)[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        packed = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + (k_even // 2)[:, None] * stride_wk,
            mask=n_ok[None, :] & k_ok[:, None],
            other=0,
        )  # (BLOCK_K // 2, BLOCK_N) uint8
        g = (k_even // group_size)[:, None]
        s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g, mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(
            tl.float32
        )
        z = tl.load(z_ptr + offs_n[None, :] * stride_sn + g, mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(
            tl.float32
        )
        w_lo = (packed & 0xF).to(tl.float32) * s + z
        w_hi = (packed >> 4).to(tl.float32) * s + z
        acc += tl.dot(x_lo, w_lo.to(x_lo.dtype))
        acc += tl.dot(x_hi, w_hi.to(x_hi.dtype))
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def _block_m(m: int) -> int:
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def w8a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    block_m: Optional[int] = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequant(qweight int8 (N, K), scales (N, num_groups)).T, in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    num_groups = scales.shape[1]
    scales = scales.float().contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm = block_m or _block_m(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, block_n))
    _w8a16_kernel[grid](
        x,
        qweight,
        scales,
        bias if bias is not None else scales,
        y,
        m,
        n,
        k,
        k // num_groups,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        y.stride(0),
        y.stride(1),
        IS_PER_CHANNEL=num_groups == 1,
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    block_m: Optional[int] = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequant(qweight uint8 (N, K // 2), scales, mins (N, num_groups)).T."""
    m, k = x.shape
    n = qweight.shape[0]
    group_size = k // scales.shape[1]
    assert k % 2 == 0 and group_size % 2 == 0
    scales, mins = scales.contiguous(), mins.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm = block_m or _block_m(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x,
        qweight,
        scales,
        mins,
        bias if bias is not None else scales,
        y,
        m,
        n,
        k,
        group_size,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        y.stride(0),
        y.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y
