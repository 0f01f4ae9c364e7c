"""One token per row by the Gumbel-max trick: greedy, temperature, and a threshold mask, in one pass.

A sampled row with temperature t draws token argmax_v (s_v - log E_v) over the tokens it keeps
(s_v >= threshold), where s = logits / t and E_v is an exponential variate: the winner of this
"exponential race" is distributed as softmax(s) renormalized over the kept tokens, and a row needs
no sort, no prefix sum and no second pass. A greedy row (t == 0) takes argmax_v logits_v, the
first index among equal maxima, as torch.argmax does; a row holding NaN logits takes its first NaN,
also as argmax does.

Randomness is a counter-based hash, a pure function of (the row's 64-bit seed, the position of the
token sampled, the token id), so a row's draw depends on nothing else in the batch. The hash works
on 32-bit unsigned words with multipliers below 2**31: the Triton kernel computes it in uint32,
the torch reference in int32 (wrapping multiply, masked logical shifts) or int64, and all give the
same bits. Per token:

    key  = mix(mix(mix(seed_hi ^ C_SEED) ^ seed_lo) ^ mix(position ^ C_POS))   (per row)
    h    = mix(key ^ mix(token ^ C_TOKEN))                                      (32 bits)
    u    = ((h >> 1) + 0.5) * 2**-31                                            (float32, in (0, 1])
    E    = u * (1 + u * (0.5 + u / 3))   if u < 2**-7   else   -log(1 - u)       (float32)

E is -log(1 - u) (an exponential variate) written so small values keep their relative precision
(1 - u rounds away the low bits of a small u): the winner of a race has a small E, so that is where
precision matters. u == 1 (a rounding of the largest h) gives E = inf: that token loses the race.

This is the engine's one sampling algorithm, on every device: the Triton kernel
(kernels/triton_sampling.py) on a GPU, the native CPU kernel (csrc/sampling.cpp,
`gumbel_sample_native`) on the CPU, and the torch reference here, which is the specification, the
test oracle and the fallback where the native kernels are not built. They round every float32
operation the same way (no fused multiply-add, the division by temperature correctly rounded), so
for the same logits they pick the same tokens, with one exception: `log`'s last bit. The reference
takes torch's `log` (SLEEF on the CPU, which misses the correctly rounded value by one unit in the
last place on a small share of inputs), the native kernel the correctly rounded one, the GPU its
own, the interpreter numpy's; a token differs only where the best two race keys of a row are within
that rounding of each other (docs/design.md says how rare that is).

A top-k/top-p row's threshold comes from engine/sampler.py out of a fixed number of candidates;
`spill_thresholds_reference` defines the thresholds of the rows whose kept set reaches past them,
which the GPU finds in one Triton launch (kernels/triton_sampling.py) and the CPU on the host.
Which race and spill serve a step is the kernel set's choice (kernels/kernel_set.py: KernelSet.sample
and .spill, bound at engine start-up); `cpu_race` is the CPU set's race, for callers not handed one.

`rows` packs the per-row inputs in one int64 (3, B) tensor, one host-to-device copy per step:
row 0 the seed (its 64-bit pattern), row 1 the position, row 2 the temperature's float32 bits
(0 for greedy). `pack_rows` builds it on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import torch

from batchrun.kernels import cpu_native
from batchrun.kernels.race_hash import C_POS, C_SEED, C_TOKEN, M32, MIX_A, MIX_B, SMALL_U, THIRD

_ROW_CHUNK = 8  # rows the reference hashes at once: its (chunk, V) temporaries stay in cache
SPILL_WIDTH = 1024  # the host's first candidate width for a spilled row; rows it cannot hold retry 8x wider

# (logits (B, V), rows (3, B) int64, threshold (B,) float32 or None) -> tokens (B,) int64
RaceFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
# (s (R, V) float32, kth (R,) float32, top_p (R,) float64, spill (R,) bool, threshold (R,) float32)
#   -> threshold (R,) float32, the spilled rows' replaced (`spill_thresholds`)
SpillFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def pack_rows(seeds: Sequence[int], positions: Sequence[int], temperatures: Sequence[float]) -> np.ndarray:
    """(3, B) int64: seeds as 64-bit patterns, positions, temperatures as float32 bits (0: greedy)."""
    out = np.empty((3, len(seeds)), dtype=np.int64)
    out[0] = np.array([s & 0xFFFFFFFFFFFFFFFF for s in seeds], dtype=np.uint64).view(np.int64)
    out[1] = positions
    out[2] = np.asarray(temperatures, dtype=np.float32).view(np.int32)
    return out


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit mixer on int64 words in [0, 2**32): xorshift-multiply twice (a bijection)."""
    x = x ^ (x >> 16)
    x = (x * MIX_A) & M32
    x = x ^ (x >> 15)
    x = (x * MIX_B) & M32
    return x ^ (x >> 16)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """`mix32` in place on int32 tensors holding the words' bit patterns (wrapping multiplies, the
    shifts masked to be logical), the reference's fast form over (rows, V)."""
    x.bitwise_xor_((x >> 16) & 0xFFFF)
    x.mul_(MIX_A)
    x.bitwise_xor_((x >> 15) & 0x1FFFF)
    x.mul_(MIX_B)
    x.bitwise_xor_((x >> 16) & 0xFFFF)
    return x


def row_keys(rows: torch.Tensor) -> torch.Tensor:
    """(B,) int64 in [0, 2**32): each row's key from the packed (3, B) rows."""
    seed, position = rows[0], rows[1]
    lo, hi = seed & M32, (seed >> 32) & M32
    key = mix32(mix32(hi ^ C_SEED) ^ lo)
    return mix32(key ^ mix32((position & M32) ^ C_POS))


@functools.lru_cache(maxsize=4)
def _token_words(vocab: int, device: torch.device) -> torch.Tensor:
    """(V,) int32: mix(token ^ C_TOKEN) as bit patterns, the per-column half of the hash."""
    return mix32(torch.arange(vocab, dtype=torch.int64) ^ C_TOKEN).to(torch.int32).to(device)


def _race(
    s: torch.Tensor, words: torch.Tensor, log: Callable[[torch.Tensor], torch.Tensor] = torch.log
) -> torch.Tensor:
    """s - log E elementwise: s float32 scaled logits, words int32 (key ^ token word) of the same shape."""
    h = _mix32_(words)
    u = ((h >> 1) & 0x7FFFFFFF).float().add_(0.5).mul_(2.0**-31)
    e = log(torch.rsub(u, 1.0)).neg_()
    series = u * THIRD
    series.add_(0.5).mul_(u).add_(1.0).mul_(u)  # u * (1 + u * (0.5 + u / 3)), rounded op by op
    e = torch.where(u < SMALL_U, series, e)
    return s - log(e)


def race_keys(
    s: torch.Tensor, keys: torch.Tensor, log: Callable[[torch.Tensor], torch.Tensor] = torch.log
) -> torch.Tensor:
    """s - log E for every token: s (R, V) float32 scaled logits, keys (R,) int64 row keys. `log`
    is torch's (the reference); the tests pass the correctly rounded one to check the native kernel
    bit for bit."""
    return _race(s, keys.to(torch.int32)[:, None] ^ _token_words(s.shape[-1], s.device)[None, :], log)


def gumbel_sample_native(
    logits: torch.Tensor,  # (B, V) float32 or bf16 (others are widened to float32), on the CPU
    rows: torch.Tensor,  # (3, B) int64: kernels/sampling.pack_rows
    threshold: Optional[torch.Tensor] = None,  # (B,) float32, or None
    keys_out: Optional[torch.Tensor] = None,  # (B, V) float32: every token's race key, for the tests
) -> torch.Tensor:
    """(B,) int64: `gumbel_sample` by the native kernel (built: the caller checked). It computes only
    the keys that can win (csrc/sampling.cpp), each bitwise the reference's with a correctly
    rounded log; `keys_out` gets every key, unpruned."""
    if logits.dtype not in cpu_native.DTYPE_CODES:
        logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    rows = rows.contiguous()
    assert rows.shape == (3, num_rows) and rows.dtype == torch.int64
    out = torch.empty(num_rows, dtype=torch.int64)
    if num_rows == 0:
        return out
    if threshold is not None:
        threshold = threshold.float().contiguous()
        assert threshold.shape == (num_rows,)
    if keys_out is not None:
        assert keys_out.shape == (num_rows, vocab) and keys_out.dtype == torch.float32 and keys_out.is_contiguous()
    err = cpu_native.loaded().batchrun_gumbel_sample(
        logits.data_ptr(),
        cpu_native.DTYPE_CODES[logits.dtype],
        num_rows,
        vocab,
        logits.stride(0),
        rows.data_ptr(),
        threshold.data_ptr() if threshold is not None else None,
        _token_words(vocab, logits.device).data_ptr(),
        out.data_ptr(),
        keys_out.data_ptr() if keys_out is not None else None,
        torch.get_num_threads(),
    )
    assert err == 0, f"batchrun_gumbel_sample failed ({err})"
    return out


def cpu_race() -> RaceFn:
    """The race a CPU kernel set binds (kernels/bind_cpu.py): the native one where the kernels are
    built and on (BATCHRUN_CPU_KERNELS, read by kernels/target.py), else the torch reference."""
    from batchrun.kernels.target import find_target

    return gumbel_sample_native if find_target("cpu").native_cpu_kernels else gumbel_sample_reference


def _scaled_rows(
    logits: torch.Tensor, rows: torch.Tensor, threshold: Optional[torch.Tensor]
) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    """(argmax tokens (B,), the sampled rows without NaN, their s (R, V) with masked tokens at -inf,
    their keys (R,)). A row holding a NaN logit keeps argmax's answer, its first NaN."""
    x = logits.float()
    temperature = rows[2].to(torch.int32).view(torch.float32)  # (B,)
    tokens = x.argmax(dim=-1)  # greedy rows' answer, and NaN rows'
    race = (temperature != 0) & ~torch.isnan(x).any(dim=-1)
    idx = race.nonzero().squeeze(1)
    s = x.index_select(0, idx) / temperature.index_select(0, idx)[:, None]
    if threshold is not None:
        s = s.masked_fill(s < threshold.index_select(0, idx)[:, None], float("-inf"))
    return tokens, idx.tolist(), s, row_keys(rows).index_select(0, idx)


def gumbel_sample_reference(
    logits: torch.Tensor, rows: torch.Tensor, threshold: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """(B,) int64 tokens. logits (B, V) any float dtype; rows (3, B) int64 (`pack_rows`) on the
    logits' device; threshold (B,) float32, the smallest scaled logit a row keeps (-inf: all), or
    None for no mask. In plain torch ops: every token's race key, a few rows at a time. A kernel
    set binds it, or on Triton targets kernels/triton_sampling.py: gumbel_sample (one launch)."""
    tokens, idx, s, keys = _scaled_rows(logits, rows, threshold)
    for i in range(0, len(idx), _ROW_CHUNK):
        k = race_keys(s[i : i + _ROW_CHUNK], keys[i : i + _ROW_CHUNK])
        k = k.masked_fill(s[i : i + _ROW_CHUNK] == float("-inf"), float("-inf"))  # masked: out of the race
        tokens[idx[i : i + _ROW_CHUNK]] = k.argmax(dim=-1)
    return tokens


def weight_past(s: torch.Tensor, idx: torch.Tensor, kth: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(R,) float64: the weight, exp(s - max s) per token, of each row's tokens (with s >= kth, when
    given) that are not among its candidates idx (R, W), the row's largest s first. Taken from the
    softmax (one fused pass) over its largest probability and summed in float32: its rounding is
    relative to itself, and a mask that stops inside the candidates compares a tail holding all of
    it, so it moves no decision a float32 rounding of the weights would not."""
    probs = torch.softmax(s, dim=-1)  # (R, V)
    top = probs.gather(1, idx[:, :1]).squeeze(1)  # the largest s's: 1 / the row's weight
    if kth is not None:
        probs = probs.masked_fill_(s < kth[:, None], 0.0)
    return probs.scatter_(1, idx, 0.0).sum(dim=-1).double() / top.double()


def kept_prefix(vals: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """(R,) int64: how many of each row's leading candidates a top-k/top-p mask keeps. vals (R, W)
    float32 scaled logits in descending order, their first the row's largest; kth (R,) the top-k
    boundary (-inf: off); top_p (R,) float64; past (R,) float64, the weight of the tokens >= kth
    beyond the candidates (`weight_past`; 0 where there are none). A candidate is kept when it is
    >= kth and the weight before it is below top_p times the weight of all tokens >= kth, a
    token's weight being exp(s - max s) in float32, the candidates' summed in float64."""
    in_k = vals >= kth[:, None]
    w = torch.where(in_k, torch.exp(vals - vals[:, :1]), 0.0).double()  # (R, W)
    total = w.cumsum(dim=-1)
    before = torch.nn.functional.pad(total[:, :-1], (1, 0))  # mass strictly before each candidate
    limit = top_p * (total[:, -1] + past)
    return (in_k & (before < limit[:, None])).sum(dim=-1)


def spill_thresholds_reference(
    s: torch.Tensor,  # (R, V) float32 scaled logits
    kth: torch.Tensor,  # (R,) float32: the k-th largest s where top-k applies, else -inf
    top_p: torch.Tensor,  # (R,) float64, below 1 on the spilled rows
    spill: torch.Tensor,  # (R,) bool: the rows to redo
    threshold: torch.Tensor,  # (R,) float32: the other rows' thresholds, kept
) -> torch.Tensor:
    """`threshold` with each spilled row's replaced by its exact top-p threshold over the whole row:
    the smallest s_v >= kth whose mass above, the weight of the tokens with kth <= s_j > s_v, is
    below top_p times the weight of all tokens with s_j >= kth (weights as `kept_prefix`'s). On the
    host: the spilled rows are picked out (a device sync on a GPU) and redone with SPILL_WIDTH
    candidates, 8x wider while the kept set still fills them; the Triton kernel of the GPU's
    sampled steps finds the same thresholds without leaving the device (its weights all summed in
    float64)."""
    idx = spill.nonzero().squeeze(1)
    if not idx.numel():
        return threshold
    rows, kth_rows, top_p_rows = s.index_select(0, idx), kth.index_select(0, idx), top_p.index_select(0, idx)
    vocab = s.shape[-1]
    width = min(vocab, SPILL_WIDTH)
    while True:
        vals, cand = torch.topk(rows, width, dim=-1)  # (r, width) descending
        past = torch.zeros_like(top_p_rows)
        if width < vocab:  # top-k rows (their ties spilled) count only the tokens >= kth
            past = weight_past(rows, cand, kth_rows if bool(torch.isfinite(kth_rows).any()) else None)
        num = kept_prefix(vals, kth_rows, top_p_rows, past)
        # A row whose kept set ends before its last candidate is done (each candidate's mass before
        # it counts every larger s, the limit every token); one that keeps them all may keep more.
        if width == vocab or not bool((num == width).any()):
            break
        width = min(vocab, width * 8)
    return threshold.index_copy(0, idx, vals.gather(1, (num - 1)[:, None]).squeeze(1))


def gather_in_place_reference(ids: torch.Tensor, src: torch.Tensor) -> None:
    """ids[i] = src[ids[i]] for (n,) int64 `ids` holding row indices into (m,) int64 `src`: a
    step launched before the previous step's tokens are read takes its input ids from them
    (engine/runners/gpu.py). index_select and a copy; a Triton kernel set binds
    kernels/triton_sampling.py: gather_in_place (one launch) instead."""
    ids.copy_(src.index_select(0, ids))
