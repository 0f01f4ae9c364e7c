"""Triton grouped GEMM for MoE experts: one launch covers every expert's segment, no host sync.

Same signature and result as `batchrun.kernels.moe.grouped_gemm_reference`. Rows are already
sorted by expert (`sort_by_expert`); each program computes a (BLOCK_M, BLOCK_N) tile of one
expert's segment. The tile-to-expert map is built on the device from the segment offsets, and the
grid is sized by the worst case (`cdiv(num_rows, BLOCK_M) + num_experts` row tiles), so the launch
needs no host read of the counts (and can be captured in a CUDA graph). Tiles past the last real
one are fully masked. The optional `row_ids` gather is fused into the A loads, so the sorted copy
of the hidden states is never materialized.

The tile sizes are fixed (never picked by the row count) and each program walks K in order with no
split, so a row's result does not depend on the other rows of the launch: what
engine.batch_invariant relies on.

On a CPU machine the tests run this in Triton's interpreter (TRITON_INTERPRET=1) at small sizes.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    row_ids_ptr,
    expert_offsets_ptr,
    tile_expert_ptr,
    expert_first_tile_ptr,
    num_experts,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_om,
    stride_on,
    HAS_ROW_IDS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    is_real = expert < num_experts
    e = tl.minimum(expert, num_experts - 1)
    seg_lo = tl.load(expert_offsets_ptr + e)
    seg_hi = tl.where(is_real, tl.load(expert_offsets_ptr + e + 1), 0)  # a tail tile masks every row
    first_tile = tl.load(expert_first_tile_ptr + e)
    rows = seg_lo + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) output rows
    row_mask = rows < seg_hi
    if HAS_ROW_IDS:
        src = tl.load(row_ids_ptr + rows, mask=row_mask, other=0)
    else:
        src = rows
    # int64 columns (rows are cast where used): cols * stride_bn spans an expert's whole weight.
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # (BLOCK_N,)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + src[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        b = tl.load(
            b_ptr + e.to(tl.int64) * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk,
            mask=col_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # (BLOCK_K, BLOCK_N)
        if DOT_F32:  # the interpreter only: exact upcasts (see grouped_gemm)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE_FP32 or DOT_F32:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def grouped_gemm(
    a: torch.Tensor,  # (num_rows_a, K): input rows
    b: torch.Tensor,  # (num_experts, N, K): one weight matrix per expert, nn.Linear layout
    expert_offsets: torch.Tensor,  # (num_experts + 1,) int64: output row segments per expert
    row_ids: Optional[torch.Tensor] = None,  # (num_rows,) int64: input row of each output row; None = identity
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 32,
) -> torch.Tensor:
    """out[i] = a[row_ids[i]] @ b[e].T for the expert e whose segment holds row i."""
    num_experts, n, k = b.shape
    assert a.shape[1] == k, f"a has K={a.shape[1]}, b has K={k}"
    num_rows = row_ids.shape[0] if row_ids is not None else a.shape[0]
    out = a.new_empty((num_rows, n))  # (num_rows, N)
    if num_rows == 0:
        return out
    counts = expert_offsets[1:] - expert_offsets[:-1]  # (num_experts,)
    tiles = (counts + block_m - 1) // block_m  # (num_experts,) row tiles per expert
    tile_end = torch.cumsum(tiles, 0)  # (num_experts,)
    first_tile = tile_end - tiles  # (num_experts,)
    max_tiles = triton.cdiv(num_rows, block_m) + num_experts  # worst case, known without a host read
    # (max_tiles,) expert of each row tile; num_experts for the unused tail
    tile_expert = torch.searchsorted(tile_end, torch.arange(max_tiles, device=a.device), right=True)
    grid = (max_tiles, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        b,
        out,
        row_ids if row_ids is not None else expert_offsets,
        expert_offsets,
        tile_expert,
        first_tile,
        num_experts,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        HAS_ROW_IDS=row_ids is not None,
        IEEE_FP32=a.dtype == torch.float32,
        # Triton's interpreter multiplies bf16 tiles as raw 16-bit integers (numpy has no bf16);
        # compiled kernels feed bf16 to the tensor cores.
        DOT_F32=a.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
