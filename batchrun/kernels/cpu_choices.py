"""Which CPU kernel serves a bf16 linear kind or the attention, decided from start-up timings.

On a CPU two kernel families can run a bf16 model's GEMMs and attention: the native csrc kernels
(AVX512-BF16 dot products over weights in their own tiles, prefetching the weight stream) and
torch's own (oneDNN, which takes AMX tile instructions where the CPU has them; torch's SDPA and
batched matmuls for attention). Which is faster depends on the CPU and on the row count: a decode
step's few rows stream each weight byte once, where the native kernel's prefetching wins; a
prefill chunk's hundreds of rows are compute-bound, where AMX wins by a wide margin on a Xeon that
has it and oneDNN and the native kernel tie on an AVX512-BF16 CPU without it.

kernels/cpu_tuning.py times both at a few row counts; this module only decides, so the rule can be
checked on any timings (tests/kernels/test_cpu_kernel_choice.py):

- At each row count torch's kernel wins only when it is faster by more than `MARGIN`; a near-tie
  keeps the native kernel (the static choice), so a noisy measurement does not flip the choice
  from run to run.
- A linear kind takes the winner at its smallest row count (the decode regime) below a row
  threshold and the winner at its largest (the prefill regime) from it. Where they are the same
  kernel the layer holds one layout. Where they differ the layer holds what both need: the native
  tiles and, for torch's side, either the tiles unpacked per call into a buffer the model shares
  ("unpacked": no second copy, a copy per call) or oneDNN's packed copy ("packed": the weight
  twice); the unpacked form is taken where its time is within the margin of the packed one.
- The threshold is where straight lines through the two measurements around the switch cross
  (the torch side's time with the margin added, as at each row count).
- Attention: the decode and the prefill kernel are chosen apart (no layout to share); torch's
  prefill only where it wins both for a fresh prompt and for a chunk after cached context (a
  prefix-cache hit, a long prompt's next chunk), which the torch path runs as a masked SDPA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

NATIVE = "native"
TORCH = "torch"
PACKED = "packed"  # torch's side holds oneDNN's packed copy beside the native tiles
UNPACKED = "unpacked"  # torch's side unpacks the native tiles into a shared buffer per call

# torch's kernel must be more than this much faster (15%: 1.15x) to replace the native one
MARGIN = 0.15


@dataclass(frozen=True)
class KernelTiming:
    """Median milliseconds of one call at `rows` rows: the native kernel, torch's over its own
    layout, and (a linear's largest row count only) torch's over the native tiles unpacked first."""

    rows: int
    native_ms: float
    torch_ms: float
    unpacked_ms: Optional[float] = None

    def winner(self, margin: float = MARGIN) -> str:
        return TORCH if self.torch_ms * (1.0 + margin) < self.native_ms else NATIVE

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": self.rows, "native_ms": _ms(self.native_ms), "torch_ms": _ms(self.torch_ms)}
        if self.unpacked_ms is not None:
            out["unpacked_ms"] = _ms(self.unpacked_ms)
        return out


@dataclass(frozen=True)
class LinearChoice:
    """The kernels of one bf16 linear kind and weight shape: `small` below `split_rows` rows, `large`
    from there (the same kernel: one layout, `split_rows` None), and how torch's side gets its
    weight where the layer holds both (`torch_form`: PACKED or UNPACKED)."""

    kind: str  # "qkv", "o", "gate_up" (silu(gate) * up in the native kernel's store: "gate_up_silu"), "down", "lm_head"
    n: int  # output features
    k: int  # input features
    small: str  # NATIVE or TORCH
    large: str
    split_rows: Optional[int] = None
    torch_form: Optional[str] = None  # where small != large
    timings: tuple[KernelTiming, ...] = ()

    @property
    def is_native(self) -> bool:
        """The static choice: the native kernel at every row count (nothing to change)."""
        return self.small == self.large == NATIVE

    def kernel_at(self, rows: int) -> str:
        if self.split_rows is None or rows < self.split_rows:
            return self.small
        return self.large

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "weight": [self.n, self.k], "small": self.small, "large": self.large}
        if self.split_rows is not None:
            out["split_rows"] = self.split_rows
            out["torch_form"] = self.torch_form
        out["timings"] = [t.describe() for t in self.timings]
        return out


@dataclass(frozen=True)
class AttentionChoice:
    """The paged attention kernels of decodes and of prefills (NATIVE or TORCH), and their timings."""

    decode: str = NATIVE
    prefill: str = NATIVE
    decode_timing: Optional[KernelTiming] = None  # rows: the decoding sequences
    # rows: the chunk's tokens; a fresh prompt, then the same chunk after a cached context
    prefill_timings: tuple[KernelTiming, ...] = ()

    def describe(self) -> dict[str, Any]:
        return {
            "decode": self.decode,
            "prefill": self.prefill,
            "decode_timing": None if self.decode_timing is None else self.decode_timing.describe(),
            "prefill_timings": [t.describe() for t in self.prefill_timings],
        }


def choose_linear(kind: str, n: int, k: int, timings: Sequence[KernelTiming], margin: float = MARGIN) -> LinearChoice:
    """The choice for one linear kind from its timings at two or more row counts (module doc)."""
    ordered = tuple(sorted(timings, key=lambda t: t.rows))
    if not ordered:
        return LinearChoice(kind, n, k, NATIVE, NATIVE)
    small, large = ordered[0].winner(margin), ordered[-1].winner(margin)
    if small == large:  # a middle row count that disagrees is outvoted by both regimes
        return LinearChoice(kind, n, k, small, large, timings=ordered)
    form = PACKED
    last = ordered[-1]
    if large == TORCH and last.unpacked_ms is not None:
        unpacked_wins = last.unpacked_ms * (1.0 + margin) < last.native_ms
        if unpacked_wins and last.unpacked_ms <= last.torch_ms * (1.0 + margin):
            form = UNPACKED  # no second copy of the weight, for a time within the margin
    # the call overhead the unpacking adds, the same at every row count (a copy of the weight)
    overhead = (last.unpacked_ms or 0.0) - last.torch_ms if form == UNPACKED else 0.0
    b = next(i for i, t in enumerate(ordered) if i > 0 and t.winner(margin) == large)
    split = crossover_rows(ordered[b - 1], ordered[b], overhead, margin)
    return LinearChoice(kind, n, k, small, large, split, form, ordered)


def crossover_rows(a: KernelTiming, b: KernelTiming, torch_overhead_ms: float = 0.0, margin: float = MARGIN) -> int:
    """The row count in (a.rows, b.rows] from which the kernel that wins at b serves: where the
    straight lines through the two timings of each kernel cross, torch's with the margin added
    (and `torch_overhead_ms`, its per-call cost in the form it will run in)."""

    def gap(t: KernelTiming) -> float:  # > 0 where torch wins
        return t.native_ms - (t.torch_ms + torch_overhead_ms) * (1.0 + margin)

    ga, gb = gap(a), gap(b)
    if ga == gb:
        return b.rows
    cross = a.rows + (b.rows - a.rows) * ga / (ga - gb)
    return min(b.rows, max(a.rows + 1, math.ceil(cross)))


def choose_attention(
    decode: Optional[KernelTiming], prefills: Sequence[KernelTiming], margin: float = MARGIN
) -> AttentionChoice:
    """Decode and prefill attention each keep the native kernel unless torch's wins by the margin;
    prefill only where it wins every prefill timed (a fresh prompt, a chunk after cached context)."""
    prefill = TORCH if prefills and all(t.winner(margin) == TORCH for t in prefills) else NATIVE
    return AttentionChoice(NATIVE if decode is None else decode.winner(margin), prefill, decode, tuple(prefills))


def _ms(v: float) -> float:
    return round(v, 4)
