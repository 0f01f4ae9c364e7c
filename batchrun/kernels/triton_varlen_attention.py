"""Triton flash attention over packed variable-length rows, for the encoder (model/encoder.py) on a GPU.

Same signature and result as `batchrun.kernels.varlen_attention.varlen_attention`, the torch
reference the tests compare against (in Triton's interpreter on CPU tensors, TRITON_INTERPRET=1,
and compiled for sm_90 without a GPU): q, k and v hold the rows back to back without padding,
(num_tokens, num_heads, head_dim), row i's tokens at cu_seqlens[i]:cu_seqlens[i + 1]. A token
attends to every token of its own row (bidirectional) or to those at or before it (`causal`), never
to another row's.

One program per (query tile, row, head): it loads its BLOCK_M queries once and walks the row's keys
in BLOCK_N tiles (causal: only up to its last query), online softmax in float32 in the exp2 domain
(triton_attention's `_scores` and `_accumulate`), the output written in the query's dtype. The grid
is sized by the longest row; the tiles past a shorter row's end do nothing. K/V may have fewer heads
than q (grouped-query attention): query head h reads KV head h // (num_heads // num_kv_heads).

The host turns `seq_lens` into the cu_seqlens tensor on the device once per distinct batch (a layer
stack calls with the same list in every layer): `_cu_seqlens`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from batchrun.kernels.target import GpuTarget
from batchrun.kernels.triton_attention import _accumulate, _dot_f32, _fitting, _pad, _pinned, _scores, shared_bytes

# (BLOCK_M, BLOCK_N) a GPU launch tries, first to last; the first whose shared memory fits is taken.
# float32 starts at 64x64: its IEEE dots hold their tiles in registers, and 128x64 spills there
# (sm_90 compile-only: 896 B local per thread at head_dim 64; 64x64 with 8 warps, 24 B).
_TILES = ((128, 64), (64, 64), (64, 32), (32, 32), (16, 16))
_TILES_FP32 = _TILES[1:]
_DEFAULT_STAGES = 2


@triton.jit
def _varlen_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    row = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)  # int64: the offsets below are products with strides
    kv_head = head // GROUP
    start = tl.load(cu_seqlens_ptr + row).to(tl.int32)
    length = tl.load(cu_seqlens_ptr + row + 1).to(tl.int32) - start
    local = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query index within the row
    m_ok = local < length
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    rows = (start + local).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0
    )  # (BLOCK_M, HEAD_DIM_PAD)
    hi = length
    if CAUSAL:
        hi = tl.minimum((tile + 1) * BLOCK_M, length)  # keys up to the tile's last query
    hi = tl.where(tile * BLOCK_M < length, hi, 0)  # a tile past this row's end does nothing
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key index within the row
        p_ok = pos < hi
        keys = (start + pos).to(tl.int64)
        kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + keys[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + keys[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, scale, 1.0, False, DOT_F32, IEEE, False)  # (BLOCK_M, BLOCK_N), log2 domain
        visible = p_ok[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= local[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = _accumulate(acc * alpha[:, None], p, v, 1.0, DOT_F32, IEEE, False)
        m = m_new
    out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


@functools.lru_cache(maxsize=8)
def _cu_seqlens(seq_lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(num_rows + 1,) int32 row starts on `device`, made once per batch: every layer of a forward
    passes the same list (a copy to the GPU each time would be a host sync per layer)."""
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def varlen_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim); num_heads a multiple of num_kv_heads
    v: torch.Tensor,  # as k
    seq_lens: list[int],  # each row's token count, in order; they sum to num_tokens
    scale: float,
    causal: bool,
    *,
    out: Optional[torch.Tensor] = None,
    block_m: Optional[int] = None,  # None (each of the four): the first of _TILES, with 2 stages,
    block_n: Optional[int] = None,  # else 1, that the GPU's shared memory holds (the interpreter: 16)
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    gpu: Optional[GpuTarget] = None,  # the GPU the launch is sized for; None: Triton's interpreter
) -> torch.Tensor:
    """Attention of each row's tokens over its own row (module doc): (num_tokens, num_heads, head_dim)
    in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k.shape == v.shape and k.shape[0] == num_tokens and k.shape[2] == head_dim
    assert sum(seq_lens) == num_tokens, f"seq_lens sum to {sum(seq_lens)}, not the {num_tokens} tokens"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    if num_tokens == 0:
        return out
    on_gpu = gpu is not None  # tiles for the GPU's tensor cores, not the interpreter
    head_dim_pad = _pad(head_dim, 16 if on_gpu else 1)
    table = _TILES_FP32 if q.dtype == torch.float32 else _TILES
    tiles = [(m, n) for m, n in table if block_m in (None, m) and block_n in (None, n)]
    if not on_gpu or not tiles:  # the interpreter's tiles, or a size given outside the table
        tiles = [(block_m or (128 if on_gpu else 16), block_n or (64 if on_gpu else 16))]
    candidates = [(m, n, st) for m, n in tiles for st in _pinned(num_stages, (_DEFAULT_STAGES, 1))]
    # the same tiles as triton_attention's prefill kernel (query, K, V, probabilities), no cache
    block_m, block_n, num_stages = _fitting(
        gpu,
        candidates,
        lambda target, t: shared_bytes(target, t[0], t[1], head_dim_pad, t[2], q.element_size(), False, True),
    )
    if num_warps is None:
        num_warps = 8 if block_m >= 64 else 4
    cu_seqlens = _cu_seqlens(tuple(seq_lens), q.device)
    grid = (triton.cdiv(max(seq_lens), block_m), len(seq_lens), num_heads)
    _varlen_attention_kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        float(scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        DOT_F32=_dot_f32(q.dtype),
        IEEE=on_gpu and q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
