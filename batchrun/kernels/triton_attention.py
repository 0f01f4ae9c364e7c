"""Triton paged attention for the GPU: batched decode (split-K) and varlen prefill over a paged cache.

Same signature and result as `batchrun.kernels.attention_torch.paged_attention_reference`, which the
tests compare against (on CPU tensors in Triton's interpreter, TRITON_INTERPRET=1, and on a GPU when there is
one). Both kernels read K/V straight from the paged cache (num_blocks, block_size, num_kv_heads,
head_dim) through the block tables, one token tile at a time: a tile's tokens may span several
cache blocks, so the tile size does not depend on the cache's block size.

- Decode: one query token per sequence. A program owns one (sequence, KV head, split): the query
  heads sharing that KV head are the rows of one tile (padded to 16 on the GPU for tl.dot), so each
  K/V byte is read once per group, whatever the GQA ratio. Long contexts are cut into `num_splits`
  ranges (split-K, flash-decoding) so a small batch still fills the GPU; each split writes its
  normalized partial output and log-sum-exp, and a second kernel merges them. The split count
  depends only on shapes (batch size, block-table width), never on values, so the launch can be
  captured in a CUDA graph.
- Prefill: query tiles of one sequence and one head over the flattened batch; keys are the
  sequence's cached prefix plus its own new tokens (causal), clipped to the sliding window.

Visibility is the reference's: key j is visible to the query at position i when j <= i and, with a
window W, j > i - W. Softmax runs in float32 in the exp2 domain.

An int8/fp8 cache (engine.kv_cache_dtype, kernels/quant/kv.py: QuantizedKVCache) is read as it is
stored: each K/V tile is loaded as int8/float8 and cast to the query's dtype (exact), with its
per-(slot, head) float32 scales (`_load_kv_tile`); q @ K_codes.T is scaled per column by the K
scales, and the probabilities per column by the V scales before p @ V_codes, which is the product
with the dequantized tiles up to float32 rounding, at one multiply per token instead of one per
element.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, TypeVar

import torch
import triton
import triton.language as tl

from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.target import GpuTarget
from batchrun.kernels.triton_kv import kv_cache_args

log = logging.getLogger(__name__)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_f32(dtype: torch.dtype) -> bool:
    # Triton's interpreter multiplies bf16 tiles as raw 16-bit integers (numpy has no bf16), so
    # there the operands are upcast first; compiled kernels feed bf16 to the tensor cores.
    return dtype == torch.bfloat16 and _interpreting()


@triton.jit
def _scores(
    q, k, scale, softcap, HAS_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr, IS_QUANT: tl.constexpr
):
    """(rows, BLOCK_N) logits in the log2 domain: q @ k.T * scale, soft-capped if asked. Over a
    quantized cache k holds the stored codes and scale is per column (BLOCK_N,): the softmax scale
    times each token's K scale, folded into the scores instead of into every element of K."""
    if DOT_F32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if IS_QUANT:
        s = s * scale[None, :]
    else:
        s = s * scale
    if HAS_SOFTCAP:
        # softcap * tanh(s / softcap), with tanh(x) = 2 sigmoid(2x) - 1 (tl has no tanh of its own)
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    return s * 1.4426950408889634  # to the exp2 domain


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    table,
    pos,
    p_ok,
    d,
    d_ok,
    kv_head,
    block_size,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_sb,
    stride_st,
    stride_sh,
    IS_QUANT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """(k, v, k_scale, v_scale): K and V of one KV head at token positions `pos` (BLOCK_N,) of a
    sequence, through its block table; (BLOCK_N, HEAD_DIM_PAD) each, zero where ~p_ok or past
    head_dim. From an int8/fp8 cache (IS_QUANT) k and v are the stored codes cast to OUT_DTYPE (the
    query's; exact: int8 and e4m3 values are bf16, fp16 and float32 values) and k_scale, v_scale
    their per-token float32 scales (BLOCK_N,), 0 where ~p_ok, which the caller folds into the score
    columns and the probabilities: one multiply per token instead of a dequantization per element,
    so the tile costs what its bytes cost. Else the scales are 1.0 and unused."""
    block = tl.load(table + pos // block_size, mask=p_ok, other=0).to(tl.int64)
    offset = (pos % block_size).to(tl.int64)
    kv_head = kv_head.to(tl.int64)  # kv_head * stride_kh passes 2**31 on large caches
    kv_mask = p_ok[:, None] & d_ok[None, :]
    k = tl.load(
        k_cache_ptr + (block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None] + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr + (block * stride_vb + offset * stride_vt + kv_head * stride_vh)[:, None] + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    k_scale = 1.0
    v_scale = 1.0
    if IS_QUANT:
        at = block * stride_sb + offset * stride_st + kv_head * stride_sh  # (BLOCK_N,)
        k_scale = tl.load(k_scale_ptr + at, mask=p_ok, other=0.0)
        v_scale = tl.load(v_scale_ptr + at, mask=p_ok, other=0.0)
        # through float32 (exact both ways): the interpreter has no direct int8 -> bf16 cast
        k = k.to(tl.float32).to(OUT_DTYPE)
        v = v.to(tl.float32).to(OUT_DTYPE)
    return k, v, k_scale, v_scale


@triton.jit
def _accumulate(acc, p, v, v_scale, DOT_F32: tl.constexpr, IEEE: tl.constexpr, IS_QUANT: tl.constexpr):
    """acc + p @ V; over a quantized cache v holds the codes and v_scale (BLOCK_N,) the per-token
    scales, folded into the probabilities' columns (after their row sums were taken)."""
    if IS_QUANT:
        p = p * v_scale[None, :]
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32))
    elif IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc + pv


# Ints that change from step to step are not specialized on (Triton would otherwise compile a variant
# per value class, e.g. a block-table width divisible by 16 or not, inside timed runs).
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_ids_ptr,
    seq_lens_ptr,
    q_rows_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    softcap,
    window,
    block_size,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_sb,
    stride_st,
    stride_sh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    HAS_Q_ROWS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_F32: tl.constexpr,
    IEEE: tl.constexpr,
    IS_QUANT: tl.constexpr,
):
    # Offsets are products in int64 (an int32 one wraps on caches past 2**31 elements).
    i = tl.program_id(0)  # index into the decode list
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq = tl.load(seq_ids_ptr + i)
    seq_len = tl.load(seq_lens_ptr + i).to(tl.int32)
    if HAS_Q_ROWS:
        row = tl.load(q_rows_ptr + i)
    else:
        row = i
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # This split's token range: the visible span cut into equal, tile-aligned pieces.
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g  # (GROUP_PAD,) query heads of this KV head
    heads64 = heads.to(tl.int64)
    q = tl.load(
        q_ptr + row.to(tl.int64) * stride_qt + heads64[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (GROUP_PAD, HEAD_DIM_PAD)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM_PAD), tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) token positions
        p_ok = pos < end
        k, v, k_scale, v_scale = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            table,
            pos,
            p_ok,
            d,
            d_ok,
            kv_head,
            block_size,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            stride_sb,
            stride_st,
            stride_sh,
            IS_QUANT,
            q_ptr.dtype.element_ty,
        )  # (BLOCK_N, HEAD_DIM_PAD)
        s = _scores(q, k, k_scale * scale, softcap, HAS_SOFTCAP, DOT_F32, IEEE, IS_QUANT)  # (GROUP_PAD, BLOCK_N)
        s = tl.where(p_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = _accumulate(acc * alpha[:, None], p, v, v_scale, DOT_F32, IEEE, IS_QUANT)
        m = m_new
    has_any = l > 0.0  # an empty split (or a padded batch row with seq_len 0) writes zeros
    out = acc / tl.where(has_any, l, 1.0)[:, None]
    if IS_SPLIT:
        # part_out (num_decode, num_heads, num_splits, HEAD_DIM_PAD), part_lse (num_decode, num_heads, num_splits)
        num_heads = tl.num_programs(1) * GROUP
        base = (i.to(tl.int64) * num_heads + heads64) * num_splits + split  # (GROUP_PAD,)
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM_PAD + d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(has_any, m + tl.log2(tl.where(has_any, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + base, lse, mask=g_ok)
    else:
        tl.store(
            out_ptr + row.to(tl.int64) * stride_ot + heads64[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    q_rows_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_Q_ROWS: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1)
    if HAS_Q_ROWS:
        row = tl.load(q_rows_ptr + i)
    else:
        row = i
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = s < num_splits
    base = (i * num_heads + head) * num_splits + s  # (SPLITS_PAD,)
    lse = tl.load(part_lse_ptr + base, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)  # (SPLITS_PAD,) 0 for empty splits
    o = tl.load(part_out_ptr + base[:, None] * HEAD_DIM_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    merged = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # (HEAD_DIM_PAD,)
    tl.store(
        out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + d,
        merged.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    block_tables_ptr,
    seq_ids_ptr,
    query_start_ptr,
    seq_lens_ptr,
    scale,
    softcap,
    window,
    block_size,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_sb,
    stride_st,
    stride_sh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_F32: tl.constexpr,
    IEEE: tl.constexpr,
    IS_QUANT: tl.constexpr,
    FIXED_KV_GRID: tl.constexpr = False,
):
    tile = tl.program_id(0)
    seq = tl.load(seq_ids_ptr + tl.program_id(1))
    head = tl.program_id(2).to(tl.int64)  # int64: the offsets below are products with strides
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    num_cached = seq_len - q_len  # keys before this step's first query token
    local = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query index within the sequence
    m_ok = local < q_len
    q_pos = num_cached + local  # (BLOCK_M,) query positions
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    rows = (q_start + local).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0
    )  # (BLOCK_M, HEAD_DIM_PAD)
    # Keys this tile can see: up to its last query, from the first query's window start.
    hi = tl.minimum(num_cached + (tile + 1) * BLOCK_M, seq_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(num_cached + tile * BLOCK_M - window + 1, 0)
        if FIXED_KV_GRID:
            # Key tiles on a grid from position 0: a row's tiles (and so its online-softmax order)
            # do not depend on the query tile it came in (engine.batch_invariant).
            lo = lo // BLOCK_N * BLOCK_N
    hi = tl.where(tile * BLOCK_M < q_len, hi, lo)  # a tile past this sequence's queries does nothing
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        p_ok = pos < hi
        k, v, k_scale, v_scale = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            table,
            pos,
            p_ok,
            d,
            d_ok,
            kv_head,
            block_size,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            stride_sb,
            stride_st,
            stride_sh,
            IS_QUANT,
            q_ptr.dtype.element_ty,
        )  # (BLOCK_N, HEAD_DIM_PAD)
        s = _scores(q, k, k_scale * scale, softcap, HAS_SOFTCAP, DOT_F32, IEEE, IS_QUANT)  # (BLOCK_M, BLOCK_N)
        visible = p_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = _accumulate(acc * alpha[:, None], p, v, v_scale, DOT_F32, IEEE, IS_QUANT)
        m = m_new
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


# ---------------------------------------------------------------------------------------------
# launchers


def _num_sms(gpu: Optional[GpuTarget]) -> int:
    # the interpreter: a couple of splits, so the merge runs in tests too
    return gpu.num_sms if gpu is not None else 4


def default_num_splits(
    num_decode: int, num_kv_heads: int, max_context: int, gpu: Optional[GpuTarget], block_n: Optional[int] = None
) -> int:
    """Splits per (sequence, KV head) on `gpu` (None: the interpreter): enough programs for about
    two waves of the GPU, each split at least four tiles of `block_n` (None: the GPU's default
    decode tile) long. A function of shapes only (graph-capturable)."""
    if block_n is None:
        block_n = decode_tiles(gpu)[0]
    programs = max(1, num_decode * num_kv_heads)
    wanted = triton.cdiv(2 * _num_sms(gpu), programs)
    longest = max(1, triton.cdiv(max_context, 4 * block_n))
    return max(1, min(wanted, longest, 32))


def _pad(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


# Bytes the compiler adds to the tiles `shared_bytes` counts (row maxima, layout conversions of
# vectors); the estimate must stay an upper bound of the compiled kernel's shared memory.
_SHARED_SLACK = 256

# The tiles a launch tries on a GPU, first to last: the defaults, then smaller ones (each at least
# 16, tl.dot's smallest operand). A launcher takes the first that fits the GPU's shared memory.
_PREFILL_TILES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16))  # (BLOCK_M, BLOCK_N)
_DEFAULT_STAGES = 2


def decode_tiles(target: Optional[GpuTarget], kv_row_bytes: int = 0) -> tuple[int, ...]:
    """The decode BLOCK_N candidates for a GPU, first to last (the first is the default): the one
    table of them, which the split count, the CUDA-graph plan (engine/warmup.py) and the launcher
    all read. On sm_90 (H100/H200) 128-token tiles read closest to copy bandwidth both at a large
    batch and at a few long sequences (`python -m benchmarks.gpu`'s decode sweep), while a
    token's K row takes at most 256 bytes (`kv_row_bytes`: head_dim padded times the cache's
    element size; bf16 head_dim 128, or int8/fp8 up to 256); wider rows keep 64, whose tiles hold
    as many bytes and do not spill. Elsewhere, unmeasured, 64. Off a GPU (the interpreter) one small
    tile. The split count reads the default without `kv_row_bytes` (a function of the device
    only), as it ignores a tile shared memory shrinks."""
    if target is None:
        return (16,)
    if target.capability >= (9, 0) and kv_row_bytes <= 256:
        return (128, 64, 32, 16)
    return (64, 32, 16)


def shared_bytes(
    target: GpuTarget,
    rows: int,
    block_n: int,
    head_dim_pad: int,
    num_stages: int,
    elem_size: int,
    is_quant: bool,
    is_prefill: bool,
) -> int:
    """Shared memory one program of `_decode_kernel` (rows = GROUP_PAD) or `_prefill_kernel` (rows =
    BLOCK_M) takes on `target`, as Triton lays the kernel out: the query tile (rows, HEAD_DIM_PAD),
    the K and V tiles (BLOCK_N, HEAD_DIM_PAD) as the cache stores them, the probabilities (rows,
    BLOCK_N) staged for the second dot, and a quantized cache's per-token scales. `elem_size` is the
    query's element size (2 or 4). An upper bound of the compiler's figure, checked against every
    variant tests/kernels/test_triton_compile.py compiles."""
    kv_size = 1 if is_quant else elem_size
    # Only sm_90's 16-bit prefill (wgmma takes both operands from shared memory) keeps num_stages
    # copies of K and V in flight; the other variants stage one copy of each.
    wgmma = is_prefill and target.capability >= (9, 0) and elem_size == 2
    copies = num_stages if wgmma else 1
    per_dim = rows * elem_size + 2 * block_n * kv_size * copies
    if is_quant and elem_size == 4:
        per_dim += 2 * block_n * 4  # the dequantized float32 K and V tiles the IEEE dots read
    elif is_quant and wgmma:
        per_dim += block_n * elem_size  # the dequantized tile wgmma reads
    total = head_dim_pad * per_dim
    if not (is_quant and elem_size == 4):  # that variant keeps the probabilities in registers
        total += rows * block_n * elem_size
    if is_quant:
        total += 2 * block_n * 4  # float32 K and V scales, one per token
    return total + _SHARED_SLACK


_Tile = TypeVar("_Tile", bound=tuple[int, ...])  # a launch setting: (BLOCK_N, stages) or (BLOCK_M, BLOCK_N, stages)


def _fitting(
    target: Optional[GpuTarget], candidates: Sequence[_Tile], estimate: Callable[[GpuTarget, _Tile], int]
) -> _Tile:
    """The first candidate whose `estimate` (its shared memory per block on the GPU) fits the GPU's;
    the first one off a GPU (the interpreter has no limit); the last (smallest) when none fits, so
    the compiler reports the overflow."""
    if target is None:
        return candidates[0]
    for c in candidates:
        if estimate(target, c) <= target.max_shared:
            return c
    log.warning(
        "no attention tile fits %d B of shared memory per block; launching %s", target.max_shared, candidates[-1]
    )
    return candidates[-1]


def _pinned(value: Optional[int], default: tuple[int, ...]) -> tuple[int, ...]:
    return default if value is None else (value,)


def decode_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache,  # (num_blocks, block_size, num_kv_heads, head_dim) tensor, or a QuantizedKVCache
    v_cache,  # the same kind and layout as k_cache
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int
    seq_ids: torch.Tensor,  # (num_decode,) row of block_tables of each decode
    seq_lens: torch.Tensor,  # (num_decode,) context length, this step's token included
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    q_rows: Optional[torch.Tensor] = None,  # (num_decode,) query row of each decode; None = row i
    out: Optional[torch.Tensor] = None,  # (num_tokens, num_heads, head_dim), written at the decode rows
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,  # None: the first of decode_tiles() the GPU's shared memory holds
    num_warps: int = 4,
    num_stages: Optional[int] = None,  # None: 2, fewer only where the tile needs it
    gpu: Optional[GpuTarget] = None,  # the GPU the launch is sized for; None: Triton's interpreter
) -> torch.Tensor:
    """Single-query attention of every decode over its paged context (GQA/MQA, window, split-K)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1
    c = kv_cache_args(k_cache, v_cache)
    assert not c.is_quant or k_cache.out_dtype == q.dtype, "tiles dequantize to the query's dtype"
    group = num_heads // num_kv_heads
    num_decode = seq_ids.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_decode == 0:
        return out
    target = gpu
    on_gpu = target is not None  # tiles for the GPU's tensor cores, not the interpreter
    if num_splits is None:
        # From the default tile, not the one shared memory leaves: the split count stays a function
        # of shapes and the GPU only, which is what engine/warmup.py plans its captures by.
        num_splits = default_num_splits(
            num_decode, num_kv_heads, block_tables.shape[1] * k_cache.shape[1], target, block_n
        )
    head_dim_pad = _pad(head_dim, 16 if on_gpu else 1)
    group_pad = _pad(group, 16 if on_gpu else 1)
    candidates = [
        (n, st)
        for n in _pinned(block_n, decode_tiles(target, head_dim_pad * c.k.element_size()))
        for st in _pinned(num_stages, (_DEFAULT_STAGES, 1))
    ]
    block_n, num_stages = _fitting(
        target,
        candidates,
        lambda gpu, tile: shared_bytes(
            gpu, group_pad, tile[0], head_dim_pad, tile[1], q.element_size(), c.is_quant, False
        ),
    )
    is_split = num_splits > 1
    if is_split:
        part_out = torch.empty((num_decode, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_decode, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    dot_f32 = _dot_f32(q.dtype)
    _decode_kernel[(num_decode, num_kv_heads, num_splits)](
        q,
        c.k,
        c.v,
        c.k_scale,
        c.v_scale,
        block_tables,
        seq_ids,
        seq_lens,
        q_rows if q_rows is not None else seq_ids,
        out,
        part_out,
        part_lse,
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        k_cache.shape[1],
        q.stride(0),
        q.stride(1),
        *c.read_strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_N=block_n,
        IS_SPLIT=is_split,
        HAS_Q_ROWS=q_rows is not None,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        DOT_F32=dot_f32,
        IEEE=on_gpu and q.dtype == torch.float32,
        IS_QUANT=c.is_quant,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if is_split:
        _merge_splits_kernel[(num_decode, num_heads)](
            part_out,
            part_lse,
            q_rows if q_rows is not None else seq_ids,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=_pad(num_splits),
            HAS_Q_ROWS=q_rows is not None,
        )
    return out


def prefill_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache,  # (num_blocks, block_size, num_kv_heads, head_dim) or a QuantizedKVCache, this step's keys written
    v_cache,  # the same kind and layout as k_cache
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int: where each sequence's query rows start
    seq_lens: torch.Tensor,  # (num_seqs,) int: context length after this step
    seq_ids: torch.Tensor,  # (num_prefill,) the sequences to attend (more than one query token each)
    max_query_len: int,  # longest query of those (sizes the grid)
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    block_m: Optional[int] = None,  # None (each of the three): the first of _PREFILL_TILES, with
    block_n: Optional[int] = None,  # 2 stages, else 1, that the GPU's shared memory holds
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    fixed_kv_grid: bool = False,
    gpu: Optional[GpuTarget] = None,  # the GPU the launch is sized for; None: Triton's interpreter
) -> torch.Tensor:
    """Causal attention of each listed sequence's query tokens over its cached prefix and themselves.

    Each row's keys go in BLOCK_N tiles from its first visible one, in order, float32 online softmax;
    the tiles depend on the GPU only (`_fitting`), not on the batch. `fixed_kv_grid` puts the tiles
    on a grid from position 0 under a sliding window too, so a row's result is the same whatever
    query tile, chunk or verification block it is computed in (engine.batch_invariant)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1
    c = kv_cache_args(k_cache, v_cache)
    assert not c.is_quant or k_cache.out_dtype == q.dtype, "tiles dequantize to the query's dtype"
    if out is None:
        out = torch.empty_like(q)
    num_prefill = seq_ids.shape[0]
    if num_prefill == 0 or max_query_len == 0:
        return out
    target = gpu
    on_gpu = target is not None  # tiles for the GPU's tensor cores, not the interpreter
    head_dim_pad = _pad(head_dim, 16 if on_gpu else 1)
    default = 64 if on_gpu else 16
    tiles = [(m, n) for m, n in _PREFILL_TILES if block_m in (None, m) and block_n in (None, n)]
    if not on_gpu or not tiles:  # the interpreter's tiles, or a size given outside the table
        tiles = [(block_m or default, block_n or default)]
    candidates = [(m, n, st) for m, n in tiles for st in _pinned(num_stages, (_DEFAULT_STAGES, 1))]
    block_m, block_n, num_stages = _fitting(
        target,
        candidates,
        lambda gpu, tile: shared_bytes(
            gpu, tile[0], tile[1], head_dim_pad, tile[2], q.element_size(), c.is_quant, True
        ),
    )
    if num_warps is None:
        num_warps = 8 if head_dim_pad >= 128 else 4
    grid = (triton.cdiv(max_query_len, block_m), num_prefill, num_heads)
    _prefill_kernel[grid](
        q,
        c.k,
        c.v,
        c.k_scale,
        c.v_scale,
        out,
        block_tables,
        seq_ids,
        query_start_loc,
        seq_lens,
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        k_cache.shape[1],
        q.stride(0),
        q.stride(1),
        *c.read_strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        DOT_F32=_dot_f32(q.dtype),
        IEEE=on_gpu and q.dtype == torch.float32,
        IS_QUANT=c.is_quant,
        FIXED_KV_GRID=fixed_kv_grid,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------
# the reference's signature


@dataclass
class _StepTensors:
    """Device copies of a step's host-side lists, made once per step and shared by every layer."""

    decode_rows: torch.Tensor  # (num_decode,) query rows
    query_start_loc: torch.Tensor  # (num_seqs + 1,)
    seq_lens: torch.Tensor  # (num_seqs,)
    prefill_seq_ids: torch.Tensor  # (num_prefill,)
    max_prefill_len: int


def _step_tensors(meta: AttentionMetadata, device: torch.device) -> Optional[_StepTensors]:
    """None for a pure decode step (what CUDA graphs replay): sequence i is query row i, nothing to
    copy. Otherwise the step prefills some sequence."""
    key = ("triton",)
    if key not in meta._memo:
        if not meta.prefill_seq_ids:
            meta._memo[key] = None
        else:
            starts = meta.query_start_loc
            decode_ids = meta.decode_seq_ids.tolist()
            meta._memo[key] = _StepTensors(
                decode_rows=torch.tensor([starts[i] for i in decode_ids], dtype=torch.long, device=device),
                query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
                seq_lens=torch.tensor(meta.seq_lens, dtype=torch.long, device=device),
                prefill_seq_ids=torch.tensor(meta.prefill_seq_ids, dtype=torch.long, device=device),
                max_prefill_len=max(starts[i + 1] - starts[i] for i in meta.prefill_seq_ids),
            )
    return meta._memo[key]


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache,  # (num_blocks, block_size, num_kv_heads, head_dim) or a QuantizedKVCache, this step's keys written
    v_cache,  # the same kind and layout as k_cache
    meta: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    k_new: Optional[torch.Tensor] = None,  # unused: the kernels read every key from the cache
    v_new: Optional[torch.Tensor] = None,
    *,
    gpu: Optional[GpuTarget] = None,  # the GPU the launches are sized for; None: Triton's interpreter
) -> torch.Tensor:
    """kernels/attention.py's paged attention on Triton kernels (float, int8 or fp8 caches; fp8 on a
    GPU that has it). meta.batch_invariant lists every sequence as a prefill: the split-K decode
    kernel, whose splits follow the batch size, is not used, and the prefill kernel keeps a fixed
    key grid."""
    out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
    t = _step_tensors(meta, q.device)
    if meta.decode_seq_ids.shape[0] > 0:
        decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.decode_seq_ids,
            meta.decode_seq_lens,
            scale,
            sliding_window,
            softcap,
            q_rows=None if t is None else t.decode_rows,
            out=out,
            gpu=gpu,
        )
    if t is not None:  # some sequence prefills
        prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            t.query_start_loc,
            t.seq_lens,
            t.prefill_seq_ids,
            t.max_prefill_len,
            scale,
            sliding_window,
            softcap,
            out=out,
            fixed_kv_grid=meta.batch_invariant,
            gpu=gpu,
        )
    return out
