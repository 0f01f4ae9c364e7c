"""Start-up measurement of the native CPU kernels against torch's own, for a bf16 model on a CPU
where the native kernels are built and on (engine/startup.py: tune, with engine.tune_kernels).

For every distinct linear kind and weight shape the model holds in the native tiles (listed by
model/gemm_shapes.py: cpu_linear_shapes) and for its attention, model-shaped random inputs are
timed at a decode step's row counts (1 and a decode batch) and at a prefill chunk's: the native
kernel (csrc/linear.cpp over its tiles; the paged decode and prefill kernels) against torch's
(oneDNN over its packed weight, bitwise F.linear; the torch attention path). Each candidate is
timed `REPEATS` times, interleaved with the others so a shared machine's drift touches all alike,
and its fastest call kept (`best_ms` says why). A row count where torch's kernel wins is timed
again before that is believed, at the prefill rows with torch over the tiles unpacked per call
too (the form a layer split by row count may run: kernels/cpu_choices.py). kernels/cpu_choices.py
decides from the times. The whole measurement stops at `BUDGET_S` (a shape not reached keeps the
native kernel, logged) and its seconds are recorded in the Tuning.

The elementwise kernels (norms, rotary, silu-mul, the KV write) and the sampler are not measured:
they stream memory with no oneDNN/AMX counterpart that could win.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F

from batchrun.kernels import cpu_linear as ck
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.cpu_attention import paged_attention_cpu, supports, supports_prefill
from batchrun.kernels.cpu_choices import (
    TORCH,
    AttentionChoice,
    KernelTiming,
    LinearChoice,
    choose_attention,
    choose_linear,
)
from batchrun.kernels.elementwise import act_mul_native
from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.kv_layout import new_kv_cache

log = logging.getLogger(__name__)

DECODE_ROWS = 32  # a decode batch's rows, where engine.max_num_seqs is not given
PREFILL_ROWS = 256  # a prefill chunk's rows (or the token budget, where smaller)
DECODE_CONTEXT = 256  # tokens of context per decoding sequence (as the batch-limit profile's)
REPEATS = 5
BUDGET_S = 3.0  # a bound on start-up time: the measurement stops here, a shape not reached keeps the native kernel
BF16 = torch.bfloat16

Timer = Callable[[dict[str, Callable[[], Any]]], dict[str, float]]


@dataclass(frozen=True)
class LinearShape:
    """One linear kind and weight shape held in the native tiles (model/gemm_shapes.py lists them)."""

    kind: str  # kernels/cpu_choices.py: LinearChoice.kind
    n: int  # output features (a silu gate/up: 2 x intermediate)
    k: int  # input features
    silu_mul: bool = False  # the native kernel applies silu(gate) * up in its store; torch's side after it
    # a tied LM head: torch's layout is the plain weight the embedding shares (F.linear), not a copy
    tied: bool = False
    bias: bool = False


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention, as the kernels see it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    scale: float
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None


@dataclass(frozen=True)
class CpuRows:
    """The row counts timed: a decode batch's and a prefill chunk's (1 row is always timed)."""

    decode: int = DECODE_ROWS
    prefill: int = PREFILL_ROWS

    @staticmethod
    def for_limits(max_num_seqs: Optional[int], max_num_batched_tokens: Optional[int]) -> CpuRows:
        prefill = min(PREFILL_ROWS, max_num_batched_tokens or PREFILL_ROWS)
        return CpuRows(max(1, min(max_num_seqs or DECODE_ROWS, DECODE_ROWS, prefill)), prefill)

    def of(self, shape: LinearShape) -> list[int]:
        """An LM head computes one row per sampled sequence: decode row counts only."""
        counts = {1, self.decode} if shape.kind == "lm_head" else {1, self.decode, self.prefill}
        return sorted(counts)


@dataclass(frozen=True)
class CpuMeasurement:
    """What `measure_cpu` found."""

    linears: tuple[LinearChoice, ...]
    attention: Optional[AttentionChoice]
    seconds: float


def measure_cpu(
    linears: Iterable[LinearShape],
    attention: Optional[AttentionShape],
    rows: CpuRows,
    budget_s: float = BUDGET_S,
    timer: Optional[Timer] = None,
) -> CpuMeasurement:
    """Time every shape and the attention (module doc) and choose per kind and regime. `timer`:
    the function that times a dict of candidates (tests inject timings; default: interleaved medians)."""
    timer = timer or best_ms
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    choices: list[LinearChoice] = []
    attention_choice = None
    with torch.inference_mode():
        if attention is not None:
            attention_choice = choose_attention(*_time_attention(attention, rows, timer))
        for shape in dict.fromkeys(linears):
            if time.perf_counter() > deadline:
                log.warning(
                    "CPU kernel measurement over its %.1fs budget: %s %s keeps the native kernel",
                    budget_s,
                    shape.kind,
                    (shape.n, shape.k),
                )
                continue
            choices.append(choose_linear(shape.kind, shape.n, shape.k, _time_linear(shape, rows, timer)))
    seconds = time.perf_counter() - t0
    changed = [f"{c.kind} {c.small}/{c.large}" for c in choices if not c.is_native]
    log.info(
        "measured the native CPU kernels against torch's in %.2fs: %s; attention decode %s, prefill %s",
        seconds,
        ", ".join(changed) or "native linears throughout",
        attention_choice.decode if attention_choice else "native",
        attention_choice.prefill if attention_choice else "native",
    )
    return CpuMeasurement(tuple(choices), attention_choice, seconds)


def best_ms(candidates: dict[str, Callable[[], Any]], repeats: int = REPEATS) -> dict[str, float]:
    """The fastest of `repeats` calls of each candidate, in milliseconds, the candidates interleaved
    (one call of each per round) after one untimed call each. The fastest, not the median: on a
    machine shared with other processes a call is only ever slowed (a thread descheduled mid-call
    holds up the others at the next barrier, a whole time slice), so the median of a few calls
    moves with the load and the fastest call is what the kernel itself takes."""
    for fn in candidates.values():
        fn()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(repeats):
        for name, fn in candidates.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: t * 1e3 for name, t in best.items()}


def _confirmed(
    timer: Timer, candidates: dict[str, Callable[[], Any]], rows: int, unpacked: Optional[Callable[[], Any]] = None
) -> KernelTiming:
    """The timing of `candidates` (native, torch) at `rows` rows. Where torch's kernel wins (a
    change from the static choice) they are timed again, with `unpacked` (torch over the tiles
    unpacked per call, the form a layer split by rows may run) where given, and each keeps its
    faster time: one run in which the native kernel was slowed does not flip the choice, and the
    unpacked form is timed only where torch's side can serve."""
    ms = timer(candidates)
    if KernelTiming(rows, ms["native"], ms["torch"]).winner() == TORCH:
        again = timer({**candidates, "unpacked": unpacked} if unpacked is not None else candidates)
        ms = {name: min(t, ms.get(name, t)) for name, t in again.items()}
    return KernelTiming(rows, ms["native"], ms["torch"], ms.get("unpacked"))


def _time_linear(shape: LinearShape, rows: CpuRows, timer: Timer) -> list[KernelTiming]:
    n, k = shape.n, shape.k
    w = (torch.randn(n, k) * 0.02).to(BF16)  # (N, K), HF's row order
    bias = (torch.randn(n) * 0.02).to(BF16) if shape.bias else None
    tiles = ck.pack_native_weight(w[ck.silu_pair_order(n // 2)] if shape.silu_mul else w)
    bias_f32 = None if bias is None else bias.float()  # a silu layer has no bias (model/linear.py: pack_silu_mul)
    after: Callable[[torch.Tensor], torch.Tensor] = (
        (lambda y: act_mul_native(y, "silu")) if shape.silu_mul else (lambda y: y)
    )
    if shape.tied or not ck.packing_available():
        torch_linear: Callable[[torch.Tensor], torch.Tensor] = lambda x: F.linear(x, w, bias)  # noqa: E731
    else:
        packed = ck.mkldnn_pack(w, 32)  # as model/linear.py: pack_linear packs it
        torch_linear = lambda x: ck.mkldnn_linear(x, packed, bias)  # noqa: E731
    buffer = torch.empty(n, k, dtype=BF16)
    counts = rows.of(shape)
    timings = []
    for m in counts:
        x = (torch.randn(m, k) * 0.5).to(BF16)  # (M, K)
        candidates: dict[str, Callable[[], Any]] = {
            "native": partial(ck.native_linear, x, tiles, bias_f32, shape.silu_mul),
            "torch": partial(lambda x: after(torch_linear(x)), x),
        }
        unpacked = partial(
            lambda x: after(F.linear(x, ck.unpack_native_weight_into(tiles, buffer, shape.silu_mul), bias)), x
        )
        timings.append(_confirmed(timer, candidates, m, unpacked if m == counts[-1] else None))
    return timings


def _time_attention(
    shape: AttentionShape, rows: CpuRows, timer: Timer
) -> tuple[Optional[KernelTiming], list[KernelTiming]]:
    """Timings of the paged attention: (decode: `rows.decode` sequences of DECODE_CONTEXT tokens
    decoding; prefill: a chunk of `rows.prefill` tokens as a fresh prompt, and after DECODE_CONTEXT
    cached tokens, as a prefix-cache hit or a long prompt's next chunk runs it, which sends the
    torch path to a masked SDPA over a copy of the context). None and [] where the native kernel
    does not take the shape (both would run the torch path)."""
    bs, kv_heads, head_dim = shape.block_size, shape.num_kv_heads, shape.head_dim
    d, p, context = rows.decode, rows.prefill, DECODE_CONTEXT
    per_seq = -(-context // bs)
    num_blocks = max(d * per_seq, -(-(context + p) // bs))
    k_cache = new_kv_cache(num_blocks, bs, kv_heads, head_dim, BF16, "cpu")
    v_cache = new_kv_cache(num_blocks, bs, kv_heads, head_dim, BF16, "cpu")
    k_cache.normal_()
    v_cache.normal_()
    args = (shape.scale, shape.sliding_window, shape.softcap)

    def timed(
        q: torch.Tensor, meta: AttentionMetadata, new: Optional[tuple[torch.Tensor, torch.Tensor]]
    ) -> KernelTiming:
        k_new, v_new = new if new is not None else (None, None)
        candidates: dict[str, Callable[[], Any]] = {
            name: partial(paged_attention_cpu, q, k_cache, v_cache, meta, *args, k_new, v_new, native=native)
            for name, native in (("native", True), ("torch", False))
        }
        return _confirmed(timer, candidates, q.shape[0])

    q = torch.randn(d, shape.num_heads, head_dim).to(BF16)  # (num_seqs, num_heads, head_dim)
    tables = torch.arange(d * per_seq, dtype=torch.int64).view(d, per_seq)
    meta = AttentionMetadata(
        slot_mapping=tables[:, -1] * bs + (context - 1) % bs,
        query_start_loc=list(range(d + 1)),
        seq_lens=[context] * d,
        block_tables=tables,
        block_size=bs,
        decode_seq_ids=torch.arange(d),
        decode_seq_lens=torch.full((d,), context, dtype=torch.int64),
        prefill_seq_ids=[],
    )
    decode = timed(q, meta, None) if supports(q, k_cache) else None
    q = torch.randn(p, shape.num_heads, head_dim).to(BF16)  # (num_tokens, num_heads, head_dim)
    new = (torch.randn(p, kv_heads, head_dim).to(BF16), torch.randn(p, kv_heads, head_dim).to(BF16))
    prefills = []
    if supports_prefill(q, k_cache):
        for cached in (0, context):
            table = torch.arange(-(-(cached + p) // bs), dtype=torch.int64).view(1, -1)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(cached, cached + p, dtype=torch.int64),  # blocks in order: slot = position
                query_start_loc=[0, p],
                seq_lens=[cached + p],
                block_tables=table,
                block_size=bs,
                decode_seq_ids=torch.zeros(0, dtype=torch.int64),
                decode_seq_lens=torch.zeros(0, dtype=torch.int64),
                prefill_seq_ids=[0],
            )
            slots = meta.slot_mapping
            k_cache[slots // bs, slots % bs] = new[0]  # this step's keys are in the cache, as the KV write leaves them
            v_cache[slots // bs, slots % bs] = new[1]
            prefills.append(timed(q, meta, new))
    return decode, prefills


def cpu_measurable(kernels: KernelSet) -> bool:
    """Whether `kernels` has native CPU kernels to measure against torch's: the CPU
    binder on a CPU, the native kernels built and on, a bf16 model (float32 keeps torch's ops:
    the path held token-identical to HF)."""
    target = kernels.target
    return bool(kernels.binder == "cpu" and target.gpu is None and target.native_cpu_kernels and kernels.dtype == BF16)
