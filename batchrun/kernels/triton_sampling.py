"""The GPU's sampling kernels: the Gumbel-max race, and the top-p thresholds of spilled rows.

The race: one program per row, one pass over its logits. Each program derives its row's key from
the packed (seed, position, temperature bits), then walks the vocabulary in blocks, keeping the
running maximum of the race key (s - log E, or the raw logit for a greedy row) and its first index,
and the first NaN. Hash, constants and float32 rounding are those of `batchrun.kernels.sampling`
(the module doc there); the launch turns multiply-add fusion off, and the division by temperature
is div_rn, so every value rounds as the torch reference's.

The spilled rows' thresholds (`sampling.spill_thresholds_reference` defines them): one program per
row of the truncated rows, which returns at once unless its row spilled, so the launch costs
nothing on a step where no nucleus is wider than the candidates, and the host never learns which
rows spilled. A spilled row's threshold is the smallest present s whose mass above stays below the
limit; that mass only falls as the candidate threshold rises, so the program searches the ordered
32-bit patterns of float32 values: each pass over the row sums the mass above SPLIT points at once
and keeps the interval where the answer lies, 1 / (SPLIT + 1) of the last, so the search takes a
handful of passes.

Every integer argument that changes from step to step (the row count) is `do_not_specialize`d:
the warm-up's variants serve every step (engine/warmup.py: warm_sampler).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from batchrun.kernels.race_hash import C_POS, C_SEED, C_TOKEN, MIX_A, MIX_B, SMALL_U, THIRD

_BLOCK = 2048  # logits per iteration: 8 KiB of float32 in flight per program
# The shared constants, as compile-time constants of the kernel.
_MIX_A = tl.constexpr(MIX_A)
_MIX_B = tl.constexpr(MIX_B)
_C_SEED = tl.constexpr(C_SEED)
_C_POS = tl.constexpr(C_POS)
_C_TOKEN = tl.constexpr(C_TOKEN)
_SMALL_U = tl.constexpr(SMALL_U)
_THIRD = tl.constexpr(THIRD)


@triton.jit
def _mix(x):
    """sampling.mix32 on uint32 words (the multiplies wrap mod 2**32, the shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * _MIX_A
    x = x ^ (x >> 15)
    x = x * _MIX_B
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["num_rows"])
def _gumbel_sample_kernel(
    logits_ptr,
    stride_row,
    rows_ptr,  # (3, B) int64: seed, position, temperature float32 bits
    threshold_ptr,  # (B,) float32, read only when HAS_THRESHOLD
    out_ptr,  # (B,) int64
    num_rows,
    vocab,
    HAS_THRESHOLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    seed = tl.load(rows_ptr + row)
    position = tl.load(rows_ptr + num_rows + row)
    temperature = tl.load(rows_ptr + 2 * num_rows + row).to(tl.int32).to(tl.float32, bitcast=True)
    lo = seed.to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    key = _mix(_mix(hi ^ _C_SEED) ^ lo)
    key = _mix(key ^ _mix(position.to(tl.uint32) ^ _C_POS))
    greedy = temperature == 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    threshold = float("-inf")
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = float("-inf")
    best_idx = 0
    nan_idx = vocab
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        live = cols < vocab
        x = tl.load(base + cols, mask=live, other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(x, divisor)
        h = _mix(key ^ _mix(cols.to(tl.uint32) ^ _C_TOKEN))
        u = ((h >> 1).to(tl.float32) + 0.5) * 4.656612873077393e-10  # 2**-31
        e = tl.where(u < _SMALL_U, u * (1.0 + u * (0.5 + u * _THIRD)), -tl.log(1.0 - u))
        k = s - tl.log(e)
        k = tl.where(s >= threshold, k, float("-inf"))
        k = tl.where(greedy, x, k)
        k = tl.where(live, k, float("-inf"))
        nan_idx = tl.minimum(nan_idx, tl.min(tl.where(x != x, cols, vocab), 0))
        m = tl.max(tl.where(x != x, float("-inf"), k), 0)
        first = tl.min(tl.where(k == m, cols, vocab), 0)
        better = m > best
        best_idx = tl.where(better, first, best_idx)
        best = tl.where(better, m, best)
    token = tl.where(nan_idx < vocab, nan_idx, best_idx)
    tl.store(out_ptr + row, token.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, rows: torch.Tensor, threshold: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sampling.gumbel_sample on the GPU (or in Triton's interpreter): one launch."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, "rows of contiguous logits"
    num_rows, vocab = logits.shape
    assert rows.shape == (3, num_rows) and rows.dtype == torch.int64 and rows.is_contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    _gumbel_sample_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        rows,
        threshold if threshold is not None else out,
        out,
        num_rows,
        vocab,
        HAS_THRESHOLD=threshold is not None,
        BLOCK=block,
        num_warps=8 if block >= 1024 else 4,
        enable_fp_fusion=False,
    )
    return out


_SPILL_BLOCK = 256  # logits per iteration of the spilled rows' passes
_SPLIT = 16  # points of the threshold's interval each pass evaluates


@triton.jit
def _ordered(bits):
    """int32 float32 bit patterns -> int32 keys ordered as the floats (an involution)."""
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _spill_threshold_kernel(
    s_ptr,  # (R, V) float32 scaled logits
    stride_row,
    vocab,
    kth_ptr,  # (R,) float32: the top-k boundary, -inf where top-k is off
    top_p_ptr,  # (R,) float64
    spill_ptr,  # (R,) int8: 1 where the row's threshold is redone
    threshold_ptr,  # (R,) float32, written where spill
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
):
    row = tl.program_id(0)
    if tl.load(spill_ptr + row) != 0:
        base = s_ptr + row.to(tl.int64) * stride_row
        kth = tl.load(kth_ptr + row)
        peak = tl.full((), float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
            peak = tl.maximum(peak, tl.max(x, 0))
        total = tl.zeros((), dtype=tl.float64)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
            w = tl.where(x >= kth, tl.exp(x - peak), 0.0)
            total += tl.sum(w.to(tl.float64), 0)
        limit = tl.load(top_p_ptr + row) * total
        # The answer is the smallest key in (lo, hi] whose mass above is below the limit: hi, the
        # row's largest s, has none above it; lo, just under kth, is never evaluated.
        lo = _ordered(kth.to(tl.int32, bitcast=True)).to(tl.int64) - 1
        hi = _ordered(peak.to(tl.int32, bitcast=True)).to(tl.int64)
        points = tl.arange(0, SPLIT).to(tl.int64)
        while hi - lo > 1:
            keys = lo + 1 + ((hi - lo - 1) * points) // SPLIT  # (SPLIT,) ascending, in (lo, hi)
            taus = _ordered(keys.to(tl.int32)).to(tl.float32, bitcast=True)
            above = tl.zeros((SPLIT,), dtype=tl.float64)
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
                w = tl.where(x >= kth, tl.exp(x - peak), 0.0).to(tl.float64)
                above += tl.sum(tl.where(x[:, None] > taus[None, :], w[:, None], 0.0), 0)
            below = above < limit
            hi = tl.min(tl.where(below, keys, hi), 0)
            lo = tl.max(tl.where(below, lo, keys), 0)
        tl.store(threshold_ptr + row, _ordered(hi.to(tl.int32)).to(tl.float32, bitcast=True))


def spill_thresholds(
    s: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor, spill: torch.Tensor, threshold: torch.Tensor
) -> torch.Tensor:
    """sampling.spill_thresholds_reference on the GPU (or in Triton's interpreter): one launch,
    no host sync; the rows not spilled keep `threshold`."""
    assert s.dim() == 2 and s.stride(-1) == 1 and s.dtype == torch.float32
    num_rows, vocab = s.shape
    out = threshold.to(torch.float32).contiguous().clone()
    if num_rows == 0:
        return out
    _spill_threshold_kernel[(num_rows,)](
        s,
        s.stride(0),
        vocab,
        kth.to(torch.float32).contiguous(),
        top_p.to(torch.float64).contiguous(),
        spill.to(torch.int8),
        out,
        BLOCK=_SPILL_BLOCK,
        SPLIT=_SPLIT,
        num_warps=8,
        enable_fp_fusion=False,
    )
    return out


_GATHER_BLOCK = 128


@triton.jit(do_not_specialize=["n"])
def _gather_in_place_kernel(ids_ptr, src_ptr, n, BLOCK: tl.constexpr):
    # Element i is read and written by the same thread (the same offset), and src is another
    # tensor: no program or thread can see a row already overwritten.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    rows = tl.load(ids_ptr + offs, mask=ok, other=0)
    tl.store(ids_ptr + offs, tl.load(src_ptr + rows, mask=ok, other=0), mask=ok)


def gather_in_place(ids: torch.Tensor, src: torch.Tensor) -> None:
    """sampling.gather_in_place on the GPU (or in Triton's interpreter): one launch, one variant
    whatever the row count."""
    assert ids.dim() == 1 and ids.is_contiguous() and ids.dtype == torch.int64
    assert src.dim() == 1 and src.is_contiguous() and src.dtype == torch.int64
    n = ids.shape[0]
    if n:
        _gather_in_place_kernel[(triton.cdiv(n, _GATHER_BLOCK),)](ids, src, n, BLOCK=_GATHER_BLOCK)
