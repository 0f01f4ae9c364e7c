"""Start-up sizing: KV cache bytes from free memory, batch limits from a short timing profile.

Offline throughput depends on the machine: on a 2-core CPU a decode batch stops paying well before
a GPU's does. Rather than a fixed guess, time a few synthetic steps of this model here and take the
smallest setting that gets close to the best rate (smaller batches mean lower latency and less KV).

A machine shared with other processes only ever slows a timed step, so a measurement that
contradicts its neighbours (a larger batch or chunk measured slower per token than a smaller one)
is repeated before it is believed (`_measured`): up to RECHECKS more times, keeping the fastest.
Only a rate that stays below its smaller neighbour's ends the profile or loses the pick.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.engine.config import SamplingParams
from batchrun.engine.request import Request
from batchrun.engine.runners import ModelRunner
from batchrun.engine.scheduler import ScheduledBatch

PREFILL_SIZES = (256, 512, 1024, 2048, 4096)
DECODE_SIZES = (1, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXT = 256  # tokens of context per synthetic decode sequence
MAX_STEP_S = 2.0  # stop growing a profile once one step takes this long
RECHECKS = 2  # more timings of a size measured slower per token than a smaller size, before it is believed
_CPU_KV_CAP = 1 << 30  # enough for ~45k tokens of SmolLM2 in bf16; zeroing more costs start-up time


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    profile: dict[str, Any]  # what was measured: {"prefill": {tokens: tok/s}, "decode": {seqs: tok/s}}


def default_kv_bytes(on_gpu: bool, available: int) -> int:
    """engine.kv_cache_memory's default: 90% of a GPU's free memory, or a quarter of the CPU's
    available RAM up to _CPU_KV_CAP."""
    if on_gpu:
        return int(0.9 * available)
    return int(min(0.25 * available, _CPU_KV_CAP))


def _synchronize() -> None:
    """Wait for the GPU's queued work where this process runs any (a timed step ends there, not
    at its launch); nothing to wait for on the CPU, where CUDA is never initialized."""
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


def _fake_request(seq_id: int, num_tokens: int, num_computed: int, block_ids: list[int]) -> Request:
    req = Request(seq_id, seq_id, [1] * num_tokens, SamplingParams(temperature=0.0), 0.0)
    req.num_computed_tokens = num_computed
    req.block_ids = block_ids
    return req


def _rate(runner: ModelRunner, batch: ScheduledBatch, repeats: int = 2) -> tuple[float, float]:
    """(tokens per second, seconds per step): the best of `repeats` timed steps."""
    best = float("inf")
    for _ in range(repeats):
        _synchronize()
        t = time.perf_counter()
        runner.forward(batch)
        _synchronize()
        best = min(best, time.perf_counter() - t)
    return batch.num_tokens / best, best


def _measured(size: int, rates: dict[int, float], measure: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """`measure()` (tokens per second, seconds per step) at `size`, repeated up to RECHECKS more
    times while its rate is below the best rate measured at a smaller size (larger batches and
    chunks should not run slower per token until past their knee, and a shared machine's noise
    only slows), keeping the fastest. Steps past MAX_STEP_S are not repeated (their length is the
    profile's end anyway)."""
    rate, step_s = measure()
    smaller = max((r for k, r in rates.items() if k < size), default=0.0)
    for _ in range(RECHECKS):
        if rate >= smaller or step_s > MAX_STEP_S:
            break
        again, again_s = measure()
        if again > rate:
            rate, step_s = again, again_s
    return rate, step_s


def _smallest_near_best(rates: dict[int, float], fraction: float) -> int:
    best = max(rates.values())
    return min(k for k, r in rates.items() if r >= fraction * best)


def pick_batch_limits(
    runner: ModelRunner,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    profile_decode: bool = False,
    spec_tokens: int = 0,
) -> BatchLimits:
    """Fill in whichever of the two limits is None by profiling; keep the ones given. With
    profile_decode the decode rates are measured even when max_num_seqs is given (speculative
    decoding's cost model needs them), at the widths a speculative step has too: B * (1 +
    spec_tokens) tokens for B = 1 and B = max_num_seqs. Without those points the cost model would
    extrapolate from width 1 as if compute-bound, and never speculate at small batches."""
    profile: dict[str, Any] = {}
    if max_num_seqs is not None and max_num_batched_tokens is not None and not profile_decode:
        return BatchLimits(max_num_seqs, max_num_batched_tokens, profile)  # nothing to measure
    capacity = num_blocks * block_size
    warm = min(32, capacity)
    # warm-up: the first calls pay for one-off setup
    runner.forward(ScheduledBatch([_fake_request(0, warm, 0, list(range(-(-warm // block_size))))], [warm]))
    if max_num_batched_tokens is None:
        rates: dict[int, float] = {}
        for n in PREFILL_SIZES:
            if n > min(capacity, max_model_len):
                break
            blocks = list(range(-(-n // block_size)))
            batch = ScheduledBatch([_fake_request(0, n, 0, blocks)], [n])
            rates[n], step_s = _measured(n, rates, functools.partial(_rate, runner, batch))
            if step_s > MAX_STEP_S or rates[n] < 0.9 * max(rates.values()):
                break  # attention grows with the chunk: once the rate falls it keeps falling
        profile["prefill_tok_s"] = {k: round(v, 1) for k, v in rates.items()}
        # at least 512 so that a typical prompt is prefilled in one step when possible
        max_num_batched_tokens = max(_smallest_near_best(rates, 0.95), min(512, max(rates))) if rates else 512
    if max_num_seqs is None or profile_decode:
        context = min(DECODE_CONTEXT, max_model_len - 1)
        blocks = list(range(-(-(context + 1) // block_size)))
        # sequences of ~1.5x the profiled context must fit the cache side by side
        fit = max(1, capacity // int(1.5 * (context + 1)))
        rates = {}
        sizes = set(DECODE_SIZES)
        if spec_tokens:  # a speculative step's widths: 1 + k tokens alone, B * (1 + k) at the batch limit
            sizes |= {1 + spec_tokens, (max_num_seqs or 1) * (1 + spec_tokens)}
        widest = None if max_num_seqs is None else max(4 * max_num_seqs, max_num_seqs * (1 + spec_tokens))
        for b in sorted(sizes):
            if b > fit or b > max_num_batched_tokens or (widest is not None and b > widest):
                break
            batch = ScheduledBatch([_fake_request(i, context + 1, context, blocks) for i in range(b)], [1] * b)
            rates[b], step_s = _measured(b, rates, functools.partial(_rate, runner, batch))
            if step_s > MAX_STEP_S or (b >= 32 and rates[b] < 1.05 * max(r for k, r in rates.items() if k < b)):
                break  # past the knee: a bigger batch no longer pays
        profile["decode_tok_s"] = {k: round(v, 1) for k, v in rates.items()}
        if max_num_seqs is None:  # from the standard sizes only: speculation must not move the batch limit
            standard = {b: r for b, r in rates.items() if b in DECODE_SIZES}
            max_num_seqs = _smallest_near_best(standard, 0.9) if standard else 1
    # The profile wrote garbage into the cache; no block is registered in the prefix cache yet, so
    # nothing will ever read it.
    return BatchLimits(max_num_seqs, max_num_batched_tokens, profile)


def measure_rates(
    runner: ModelRunner, num_blocks: int, block_size: int, max_model_len: int, chunk_tokens: int, num_seqs: int
) -> dict[str, Any]:
    """The prefill rate of one chunk of `chunk_tokens` and the decode rate of `num_seqs` sequences
    (DECODE_CONTEXT tokens of context each), timed as the start-up profile times them, in its
    shape: {"prefill_tok_s": {tokens: tok/s}, "decode_tok_s": {seqs: tok/s}}. The steps write into
    the first blocks of the cache: the caller must hold no request and no cached prefix."""
    capacity = num_blocks * block_size
    chunk = max(1, min(chunk_tokens, capacity, max_model_len))
    prefill = ScheduledBatch([_fake_request(0, chunk, 0, list(range(-(-chunk // block_size))))], [chunk])
    runner.forward(prefill)  # the first call of a shape pays for one-off setup
    profile: dict[str, Any] = {"prefill_tok_s": {chunk: round(_rate(runner, prefill)[0], 1)}}
    context = min(DECODE_CONTEXT, max_model_len - 1)
    blocks = list(range(-(-(context + 1) // block_size)))
    seqs = max(1, min(num_seqs, capacity // int(1.5 * (context + 1)) or 1))
    decode = ScheduledBatch([_fake_request(i, context + 1, context, blocks) for i in range(seqs)], [1] * seqs)
    runner.forward(decode)
    profile["decode_tok_s"] = {seqs: round(_rate(runner, decode)[0], 1)}
    return profile


def cpu_threads() -> int:
    """Physical-ish core count for torch's intra-op pool (hyperthreads do not help matmuls)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
