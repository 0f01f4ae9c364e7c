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

The engine samples this way on the GPU (one fused pass per row, no sort, no prefix sum, no per-row
host work); the torch reference here is the kernel's specification and its test oracle. Both
implementations round every float32 operation the same way (no fused multiply-add in the
kernel, division by temperature rounded as torch's), so in Triton's interpreter they pick the same
tokens; only `log` may differ in its last bit between numpy, torch and the GPU, which changes a
token only where two race keys are that close.

`rows` packs the per-row inputs in one int64 (3, B) tensor, one host-to-device copy per step:
row 0 the seed (its 64-bit pattern), row 1 the position, row 2 the temperature's float32 bits
(0 for greedy). `pack_rows` builds it on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from batchrun.kernels.backend import triton_usable
from batchrun.kernels.race_hash import C_POS, C_SEED, C_TOKEN, M32, MIX_A, MIX_B, SMALL_U, THIRD

_ROW_CHUNK = 8  # rows the reference hashes at once: its (chunk, V) temporaries stay in cache


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


def _race(s: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """s - log E elementwise: s float32 scaled logits, words int32 (key ^ token word) of the same shape."""
    h = _mix32_(words)
    u = ((h >> 1) & 0x7FFFFFFF).float().add_(0.5).mul_(2.0**-31)
    e = torch.rsub(u, 1.0).log_().neg_()
    series = u * THIRD
    series.add_(0.5).mul_(u).add_(1.0).mul_(u)  # u * (1 + u * (0.5 + u / 3)), rounded op by op
    e = torch.where(u < SMALL_U, series, e)
    return s - e.log_()


def race_keys(s: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """s - log E for every token: s (R, V) float32 scaled logits, keys (R,) int64 row keys."""
    return _race(s, keys.to(torch.int32)[:, None] ^ _token_words(s.shape[-1], s.device)[None, :])


def gumbel_sample(logits: torch.Tensor, rows: torch.Tensor, threshold: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B,) int64 tokens. logits (B, V) any float dtype; rows (3, B) int64 (`pack_rows`) on the
    logits' device; threshold (B,) float32, the smallest scaled logit a row keeps (-inf: all), or
    None for no mask. The Triton kernel on a GPU; elsewhere the reference (the engine's CPU path
    samples by inverse CDF instead: engine/sampler.py)."""
    if triton_usable(logits):
        from batchrun.kernels.triton_sampling import gumbel_sample as gumbel_sample_triton

        return gumbel_sample_triton(logits, rows, threshold)
    return gumbel_sample_reference(logits, rows, threshold)


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
    """`gumbel_sample` in plain torch ops: every token's race key, a few rows at a time."""
    tokens, idx, s, keys = _scaled_rows(logits, rows, threshold)
    for i in range(0, len(idx), _ROW_CHUNK):
        k = race_keys(s[i : i + _ROW_CHUNK], keys[i : i + _ROW_CHUNK])
        k = k.masked_fill(s[i : i + _ROW_CHUNK] == float("-inf"), float("-inf"))  # masked: out of the race
        tokens[idx[i : i + _ROW_CHUNK]] = k.argmax(dim=-1)
    return tokens


def gather_in_place(ids: torch.Tensor, src: torch.Tensor) -> None:
    """ids[i] = src[ids[i]] for (n,) int64 `ids` holding row indices into (m,) int64 `src`: a
    step launched before the previous step's tokens are read takes its input ids from them
    (engine/runners/gpu.py). One Triton launch on a GPU; index_select and a copy elsewhere."""
    if triton_usable(ids):
        from batchrun.kernels.triton_sampling import gather_in_place as gather_in_place_triton

        gather_in_place_triton(ids, src)
        return
    ids.copy_(src.index_select(0, ids))
