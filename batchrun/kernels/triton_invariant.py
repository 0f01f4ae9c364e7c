"""A dense Triton matmul whose rows do not depend on how many rows run with them (y = x @ W.T + b).

What engine.batch_invariant asks of every linear layer on the GPU path: row r of an M-row product
is bitwise the row computed alone. cuBLAS (F.linear) does not promise that: its kernel, tile shape
and split-K factor are picked per call from the whole problem shape, M included, and each changes
the order a row's K products are summed in. Here the order is pinned:

- The tile config comes from (N, K, dtype) only (`invariant_tiles`), never from M: every product
  with the same weight runs the same compiled kernel with the same BLOCK_K.
- No split-K: each program owns a whole (BLOCK_M, BLOCK_N) output tile and walks K from 0 upward
  in BLOCK_K steps, one float32 accumulator, so an output element is the same chain of tl.dot
  steps whatever M is and wherever its row falls inside a tile (a dot's per-element arithmetic does
  not depend on the other rows of the tile). The K tail is masked to zeros, which add exactly.
- M is not specialized on (`do_not_specialize`): M = 1 or a multiple of 16 would otherwise compile
  variants of their own. The input's base pointer is kept 16-byte aligned for the same reason.
- float32 inputs dot in IEEE precision (no TF32); 16-bit inputs accumulate in float32. The bias is
  added in float32 and the result rounded once to the output dtype.

The grid is 1-D over output tiles, grouped GROUP_M row tiles at a time so that consecutive programs
reuse weight tiles in L2; the order programs run in does not touch any element's arithmetic.
`matmul_reference` is the torch product the tests compare with (within float32 summation order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

GROUP_M = 8  # row tiles per group of the program order (L2 reuse of the weight tiles)


def _interpreting() -> bool:
    # Triton's interpreter multiplies bf16 tiles as raw 16-bit integers (numpy has no bf16), so
    # there the operands are upcast first; compiled kernels feed bf16 to the tensor cores.
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class InvariantTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def invariant_tiles(n: int, k: int, dtype: torch.dtype) -> InvariantTiles:
    """The one tile config of every product with an (n, k) weight in `dtype`; M plays no part.

    16-bit inputs: 64-row tiles (a decode step's rows fit one tile; the weight stream, not the
    wasted rows, bounds those steps), 64-wide K steps, and 32-wide column tiles for narrow weights
    (more programs where N alone sets the parallelism), 64 up to 8192 columns, 128 beyond (the LM
    head). float32 (IEEE dots on the CUDA cores, operands held in registers): smaller tiles that
    keep the register file from spilling."""
    if dtype == torch.float32:
        return InvariantTiles(32, 32 if n <= 2048 else 64, 32, 4, 2)
    block_n = 32 if n <= 2048 else (64 if n <= 8192 else 128)
    return InvariantTiles(64, block_n, 64, 4, 3)


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # (BLOCK_N,)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K order 0, BLOCK_K, ...: the same chain for every row
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_F32:  # the interpreter only: exact upcasts, products exact in float32
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE_FP32 or DOT_F32:
            acc += tl.dot(x, w, input_precision="ieee")  # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_N)
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _aligned_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as a contiguous (M, k) with a 16-byte aligned base (a copy only where x is not): the row
    stride and the pointer's alignment are part of the compiled variant, which must not change with
    the batch."""
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    return x2


def invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    tiles: Optional[InvariantTiles] = None,
) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T + bias (N,), shaped (..., N) in x's dtype, each row's result
    independent of the other rows (see the module doc). weight in x's dtype, unit last stride.
    `tiles`: only for tests that show what another K step does; None is `invariant_tiles`."""
    n, k = weight.shape
    assert x.shape[-1] == k, f"x has K={x.shape[-1]}, weight has K={k}"
    assert weight.dtype == x.dtype and weight.stride(1) == 1, (weight.dtype, x.dtype, weight.stride())
    assert bias is None or bias.is_contiguous()
    x2 = _aligned_rows(x, k)  # (M, K)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # (M, N)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    t = tiles if tiles is not None else invariant_tiles(n, k, x.dtype)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _invariant_matmul_kernel[grid](
        x2,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE_FP32=x.dtype == torch.float32,
        DOT_F32=x.dtype == torch.bfloat16 and _interpreting(),
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        GROUP=GROUP_M,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return out.reshape(*x.shape[:-1], n)


def matmul_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 product rounded once to x's dtype: what `invariant_matmul` computes up to the
    order of its float32 sums."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
