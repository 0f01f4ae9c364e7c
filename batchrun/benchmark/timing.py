"""Timing shared by the benchmarks: one system's timed pass, alternating rounds, per-round ratios and
the matmul ceiling.

Benchmarks here run on shared machines whose speed drifts, so every comparison runs its systems in
alternating rounds in one process and takes ratios within a round (`median_ratio`), never across
separate runs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from batchrun.engine import RequestOutput

T = TypeVar("T")


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """obj.name = value for the block (an instance attribute shadowing the method), then as before."""
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@dataclass
class TimedRun:
    """One system's pass over the workload (the benchmark job's unit of measurement)."""

    wall_s: float  # first admission to last output
    token_ids: list[list[int]]  # generated tokens per prompt, in prompt order (EOS included)
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from a prefix cache (0 for the baseline)
    num_computed_tokens: int  # tokens that went through the model, padding included
    ttfts_s: list[float] = field(default_factory=list)  # per request
    itls_s: list[float] = field(default_factory=list)  # per request with 2+ output tokens

    @classmethod
    def from_outputs(cls, wall_s: float, outputs: Sequence[RequestOutput]) -> TimedRun:
        """A batchrun pass from its outputs in prompt order: only uncached prompt tokens and the
        generated ones went through the model."""
        run = cls(
            wall_s,
            [o.token_ids for o in outputs],
            sum(len(o.prompt_token_ids) for o in outputs),
            sum(len(o.token_ids) for o in outputs),
            sum(o.metrics.num_cached_tokens for o in outputs),
            0,
        )
        run.num_computed_tokens = run.num_prompt_tokens - run.num_cached_tokens + run.num_output_tokens
        run.ttfts_s = [o.metrics.ttft_s for o in outputs if o.metrics.ttft_s is not None]
        run.itls_s = [o.metrics.itl_s for o in outputs if o.metrics.itl_s is not None]
        return run


def round_order(names: Sequence[T], round_index: int) -> list[T]:
    """The systems of round `round_index`, each round starting one system later: no system always
    runs first (or last) while the machine's load rises or falls through the round. With two
    systems this alternates who goes first."""
    shift = round_index % len(names)
    return list(names[shift:]) + list(names[:shift])


def median_ratio(values: Sequence[float], references: Sequence[float]) -> float:
    """Median over rounds of value / reference, both measured in the same round."""
    return statistics.median(a / b for a, b in zip(values, references, strict=True))


def matmul_peak(dtype: torch.dtype, m: int, k: int, n: int, repeats: int = 5) -> float:
    """Best FLOP/s of one (m, k) x (k, n) matmul in `dtype` through torch, as the model's linears run."""
    x = torch.randn(m, k).to(dtype)  # (tokens, in_features)
    w = torch.randn(n, k).to(dtype)  # (out_features, in_features)
    flops = 2.0 * m * k * n
    torch.nn.functional.linear(x, w)  # warm-up: first calls pay one-off setup
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t0)
    return flops / best
