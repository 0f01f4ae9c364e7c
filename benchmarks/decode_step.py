"""One decode step taken apart, on a live engine: device time against host time (schedule, pack,
launch, sample, update), kernels per step, and CUDA-graph replays against eager steps.

Measured from outside: for one step at a time the engine's `step` and its scheduler's, runner's and
sampler's methods are wrapped (instance attributes, removed afterwards), and the batch is whatever
the scheduler picks. `probe_decode_steps` runs the engine on N prompts until all N decode in one
step (every prompt computed, nothing waiting), then spends the following steps on its plan:

  compare   before the step: for every graph bucket b <= N, the first b running requests as one
            decode batch, replayed from the bucket's graph and run eagerly, logits compared; and
            N - 1 requests, which the graph pads to a bucket (when N - 1 is no bucket itself)
  timed     a device sync before each part, so each part's host time is its own; the forward's
            device time from CUDA events around it (first to last kernel, so idle gaps while the
            host still launches count: that is what the step costs the device)
  profiled  one step under torch.profiler: kernels run on the device, launch calls made by the host,
            and the kernels that took the most device time
  wall      steps back to back as the engine runs them, the real cost of a step

each graphed (the engine's path for a pure decode step) and eager (graphs set aside), alternating,
so a drift in the machine's speed hits both. Last, with graphs: `async`, as many steps back to back
with engine.async_scheduling on and no sync between them (engine/runners/gpu.py), whose wall time
per step against the graphed step's device time is the host time left unhidden. The requests are
aborted afterwards.

A decode sub-batch run by `compare` writes K/V for its requests' current tokens into the same slots
the real step writes before it reads them, so the probe leaves no trace in later steps.

A library module (no `__main__`): benchmarks.gpu calls it on the GPU, and with the CPU stand-in for
the GPU runner (`GpuRunner.stand_in`) in --smoke, where only the harness itself is exercised.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import numpy as np
import torch

from batchrun.benchmark.timing import patched
from batchrun.engine import Engine, EngineRequest, SamplingParams
from batchrun.engine.runners import GpuRunner
from batchrun.engine.runners.cuda_graphs import NUM_FIXED, DecodeGraphs, pack_decode_inputs, packed_views, pick_bucket
from batchrun.engine.scheduler import ScheduledBatch

_LAUNCH_CALL = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchKernelEx|LaunchKernelExC|LaunchCooperativeKernel)(_v\d+)?$")
_GRAPH_LAUNCH_CALL = re.compile(r"^(cuda|cu)GraphLaunch(_v\d+)?$")


class _Done(Exception):
    """Raised from the wrapped step once the plan is spent: ends the engine's stream (which aborts
    the requests on its way out)."""


@contextlib.contextmanager
def _eager(runner: Any, is_eager: bool) -> Iterator[None]:
    """The runner without its graphs for the block, when is_eager."""
    if not is_eager or runner.graphs is None:
        yield
        return
    with patched(runner, "graphs", None):
        yield


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Span:
    """Host time of one call (until it returned, and until the device finished it) and, on a GPU,
    the device time between CUDA events recorded before and after it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        _sync(device)
        self.events: Optional[tuple[Any, Any]] = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()
        self.issued_s = self.total_s = 0.0

    def returned(self) -> None:
        self.issued_s = time.perf_counter() - self.t0

    def finished(self) -> None:
        if self.events is not None:
            self.events[1].record()
        _sync(self.device)
        self.total_s = time.perf_counter() - self.t0

    def device_ms(self) -> Optional[float]:
        return self.events[0].elapsed_time(self.events[1]) if self.events is not None else None


def _pack(runner: Any, batch: ScheduledBatch, graphed: bool) -> None:
    """The host's input preparation for `batch` alone, into scratch buffers: what the graph path packs
    (one row per request, padded to the bucket) or what the eager path prepares and uploads."""
    if graphed:
        graphs = runner.graphs
        bucket = pick_bucket(graphs.buckets, len(batch.requests))
        if bucket is None:
            raise ValueError(f"a decode of {len(batch.requests)} requests is above the largest graph bucket")
        width = max(len(r.block_ids) for r in batch.requests)
        host = np.empty(bucket * (NUM_FIXED + width), dtype=np.int64)  # as DecodeGraphs packs
        pack_decode_inputs(batch.requests, runner.block_size, *packed_views(host, bucket, width), graphs.host_tables)
    else:
        runner.prepare(batch)


def _timed_step(engine: Engine, step: Callable[[], Any], graphed: bool) -> dict[str, Optional[float]]:
    """One step with a device sync around each part: milliseconds per part. `pack` is timed on its own
    just before the runner runs (the runner packs again inside, within `launch`'s host time)."""
    runner, scheduler, sampler, device = engine.runner, engine.scheduler, engine.sampler, engine.device
    spans: dict[str, _Span] = {}
    pack_s = 0.0

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            span = _Span(device)
            out = fn(*args, **kwargs)
            span.returned()
            span.finished()
            spans[name] = span
            return out

        return wrapper

    execute = timed("execute", runner.forward)  # the step's forward; its sampling is timed apart

    def run(batch: ScheduledBatch, *args: Any, **kwargs: Any) -> Any:
        nonlocal pack_s
        _sync(device)
        t = time.perf_counter()
        _pack(runner, batch, graphed)
        _sync(device)
        pack_s = time.perf_counter() - t
        return execute(batch, *args, **kwargs)

    with (
        _eager(runner, not graphed),
        patched(scheduler, "schedule", timed("schedule", scheduler.schedule)),
        patched(scheduler, "update", timed("update", scheduler.update)),
        patched(runner, "forward", run),
        patched(sampler, "sample", timed("sample", sampler.sample)),
    ):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        step_s = time.perf_counter() - t - pack_s  # the isolated pack is not part of a real step
    ex = spans["execute"]
    parts: dict[str, float] = {
        "schedule_ms": spans["schedule"].total_s * 1e3,
        "pack_ms": pack_s * 1e3,
        "launch_ms": max(0.0, ex.issued_s - pack_s) * 1e3,  # host time issuing the forward, less packing
        "forward_wait_ms": (ex.total_s - ex.issued_s) * 1e3,  # host waiting for the device after issuing
        "sample_ms": spans["sample"].total_s * 1e3,  # its device work and the copy of token ids included
        "update_ms": spans["update"].total_s * 1e3,
    }
    parts["other_ms"] = step_s * 1e3 - sum(
        spans[name].total_s * 1e3 for name in ("schedule", "execute", "sample", "update")
    )
    parts["host_ms"] = sum(parts[k] for k in ("schedule_ms", "pack_ms", "launch_ms", "sample_ms", "update_ms"))
    parts["host_ms"] += max(0.0, parts["other_ms"])
    parts["step_ms"] = step_s * 1e3
    forward_gpu, sample_gpu = ex.device_ms(), spans["sample"].device_ms()
    gpu = None if forward_gpu is None or sample_gpu is None else forward_gpu + sample_gpu
    return {**parts, "gpu_forward_ms": forward_gpu, "gpu_sample_ms": sample_gpu, "gpu_ms": gpu}


def count_launches(events: Sequence[tuple[str, bool]]) -> dict[str, int]:
    """From profiler events as (name, is_device): kernels the device ran, its copies and fills, and
    the host's kernel and graph launch calls."""
    kernels = copies = launches = graph_launches = 0
    for name, is_device in events:
        if is_device:
            if name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels += 1
        elif _LAUNCH_CALL.match(name):
            launches += 1
        elif _GRAPH_LAUNCH_CALL.match(name):
            graph_launches += 1
    return {
        "gpu_kernels": kernels,
        "gpu_copies": copies,
        "host_kernel_launches": launches,
        "host_graph_launches": graph_launches,
    }


def top_kernels(events: Sequence[tuple[str, bool, float]], limit: int = 12) -> list[tuple[str, int, float]]:
    """From profiler events as (name, is_device, microseconds): the device kernels (copies and fills
    left out) that took the most device time, as (name, launches, total microseconds), most first."""
    totals: dict[str, list[float]] = {}
    for name, is_device, us in events:
        if is_device and not name.startswith(("Memcpy", "Memset")):
            entry = totals.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += us
    rows = [(name, int(n), us) for name, (n, us) in totals.items()]
    return sorted(rows, key=lambda r: (-r[2], r[0]))[:limit]


def _profiled_step(engine: Engine, step: Callable[[], Any], graphed: bool) -> dict[str, Any]:
    """Launch counts of one step and its top kernels by device time (`top_kernels`), or {"error": ...}:
    a profiler that fails (CUPTI can be unavailable) costs this count only, and the step still runs,
    so the rest of the plan goes on."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with _eager(engine.runner, not graphed):
        try:
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            step()
            return {"error": repr(exc)}
        try:
            step()
            _sync(engine.device)
        finally:
            prof.__exit__(None, None, None)
    try:
        events = prof.events()
        counts: dict[str, Any] = count_launches([(e.name, e.device_type == DeviceType.CUDA) for e in events])
        counts["top_kernels"] = top_kernels(
            [(e.name, e.device_type == DeviceType.CUDA, e.time_range.elapsed_us()) for e in events]
        )
        return counts
    except Exception as exc:  # noqa: BLE001 - see the docstring
        return {"error": repr(exc)}


def _async_wall(engine: Engine, step: Callable[[], Any], num_steps: int) -> dict[str, Any]:
    """Graphed steps back to back with engine.async_scheduling on (each launched before the last
    one's tokens are read), no device sync between them: the wall time of a step when the host's
    work hides behind the device's. The first step only starts the pipeline and is not timed. The
    option stays on until the probe's requests are aborted (which drops the step in flight)."""
    engine.runner.run_ahead = True
    step()
    _sync(engine.device)
    before = engine.stats().num_async_steps or 0
    t = time.perf_counter()
    for _ in range(num_steps):
        step()
    _sync(engine.device)
    wall_ms = (time.perf_counter() - t) * 1e3 / num_steps
    return {"wall_ms": wall_ms, "num_ahead": (engine.stats().num_async_steps or 0) - before}


def _wall_step(engine: Engine, step: Callable[[], Any], graphed: bool) -> float:
    with _eager(engine.runner, not graphed):
        t = time.perf_counter()
        step()
        _sync(engine.device)
        return (time.perf_counter() - t) * 1e3


def compare_graph_buckets(engine: Engine, requests: list[Any], rel_tol: float) -> list[dict[str, Any]]:
    """Graph replay against an eager run of the same decode batch, for every bucket up to
    len(requests) (and one padded size): logits' max |error|, relative error, argmax agreement."""
    runner = engine.runner
    graphs = runner.graphs
    assert graphs is not None
    n = len(requests)
    sizes = [b for b in graphs.buckets if b <= n]
    if n - 1 >= 1 and n - 1 not in graphs.buckets:
        sizes.append(n - 1)  # packed rows padded up to the next bucket by repeating the last one
    rows = []
    for size in sizes:
        batch = ScheduledBatch(list(requests[:size]), [1] * size)
        bucket = pick_bucket(graphs.buckets, size)
        row: dict[str, Any] = {"num_seqs": size, "bucket": bucket, "ok": False}
        rows.append(row)
        if not graphs.can_run(batch):
            row["error"] = "graphs cannot run this batch" + (
                " (a capture failed: is_broken)" if graphs.is_broken else ""
            )
            continue
        try:
            graphed = graphs.execute(batch)
        except Exception as exc:  # noqa: BLE001 - one bucket's failure is a row, the rest still run
            row["error"] = repr(exc)
            continue
        if graphed is None:
            row["error"] = "capture failed: the engine falls back to eager steps"
            continue
        got, seq_ids = graphed
        with _eager(runner, True):
            want = runner.forward(batch)
        if seq_ids != want.sample_seq_ids:
            row["error"] = "graphed and eager steps sample different requests"
            continue
        diff = got.double() - want.logits.double()
        row["max_abs_err"] = diff.abs().max().item()
        row["rel_err"] = (diff.norm() / want.logits.double().norm().clamp_min(1e-30)).item()
        row["argmax_agreement"] = (got.argmax(-1) == want.logits.argmax(-1)).double().mean().item()
        row["ok"] = row["rel_err"] <= rel_tol
    _sync(engine.device)
    return rows


def capture_buckets(graphs: DecodeGraphs, max_batch: int) -> dict[str, Any]:
    """Capture every bucket up to max_batch (largest first, as `capture_all` does). A failed capture
    is recorded and the smaller buckets are still tried, so every failing bucket is named."""
    limit = pick_bucket(graphs.buckets, min(max_batch, graphs.max_batch))
    assert limit is not None, "the buckets end at graphs.max_batch"
    wanted = [b for b in graphs.buckets if b <= limit]
    failures: dict[int, str] = {}
    t = time.perf_counter()
    while limit is not None:
        try:
            graphs.capture_all(max_batch=limit)
            break
        except Exception as exc:  # noqa: BLE001 - recorded per bucket
            missing = [b for b in wanted if b not in graphs.graphs and b not in failures]
            if not missing:
                failures[limit] = repr(exc)
                break
            failures[max(missing)] = repr(exc)
            smaller = [b for b in wanted if b < max(missing)]
            limit = max(smaller) if smaller else None
    return {
        "buckets": wanted,
        "captured": sorted(graphs.graphs),
        "failed": failures,
        "capture_s": time.perf_counter() - t,
    }


def _median(rows: list[dict[str, Optional[float]]]) -> dict[str, Optional[float]]:
    out: dict[str, Optional[float]] = {}
    for key in rows[0]:
        values = [v for v in (r[key] for r in rows) if v is not None]
        out[key] = statistics.median(values) if values else None
    return out


def _plan(has_graphs: bool, cuda: bool, num_timed: int, num_wall: int) -> list[tuple[str, bool]]:
    """(kind, graphed) per measured step, graphed and eager alternating."""
    modes = [True, False] if has_graphs else [False]
    plan = [("compare", True)] if has_graphs else []
    plan += [("timed", g) for _ in range(num_timed) for g in modes]
    if cuda:
        plan += [("profiled", g) for g in modes]
    plan += [("wall", g) for _ in range(num_wall) for g in modes]
    if has_graphs:
        plan.append(("async", True))  # num_wall + 1 steps back to back with engine.async_scheduling
    return plan


def probe_decode_steps(
    engine: Engine,
    prompts: list[list[int]],
    rel_tol: float,
    num_timed: int = 5,
    num_wall: int = 8,
    stand_in: bool = False,
) -> dict[str, Any]:
    """Run `prompts` (greedy) until all decode in one step, then measure the plan of steps (module
    docstring). Returns {"num_seqs", "mean_context", "max_context", "graph_vs_eager": rows or None,
    "graphed": {...} or None, "eager": {...}, "async": {"wall_ms", "num_ahead"} or None}, each path
    with "timed" (median ms per part), "kernels" (one profiled step; None without CUDA) and "wall_ms"
    (median). With `stand_in`, a runner without graphs is stood in for by `GpuRunner.stand_in`."""
    n = len(prompts)
    assert n <= engine.max_num_seqs, "all prompts must run in one step"
    runner = engine.runner
    if stand_in and runner.graphs is None:
        with patched(engine, "runner", GpuRunner.stand_in(runner, n)):
            return probe_decode_steps(engine, prompts, rel_tol, num_timed, num_wall)
    scheduler = engine.scheduler
    cuda = engine.device.type == "cuda"
    plan = _plan(runner.graphs is not None, cuda, num_timed, num_wall)
    # long enough that nobody finishes before the plan is spent: prefill takes a few steps, then the plan
    params = SamplingParams(temperature=0.0, max_tokens=len(plan) + num_wall + 64 + n, ignore_eos=True)
    requests = [EngineRequest(i, p, params) for i, p in enumerate(prompts)]
    inner_step = engine.step
    result: dict[str, Any] = {"num_seqs": n, "graph_vs_eager": None}
    timed: dict[bool, list[dict[str, Optional[float]]]] = {True: [], False: []}
    kernels: dict[bool, dict[str, Any]] = {}
    walls: dict[bool, list[float]] = {True: [], False: []}

    def all_decoding() -> bool:
        running = scheduler.running
        return (
            len(running) == n
            and not scheduler.waiting
            and all(r.num_computed_tokens == r.num_tokens - 1 for r in running)
        )

    def step() -> Any:
        if not all_decoding():
            return inner_step()
        kind, graphed = plan.pop(0)
        if "mean_context" not in result:
            contexts = [r.num_tokens for r in scheduler.running]
            result.update(mean_context=sum(contexts) / n, max_context=max(contexts))
        # Every measured step is a real engine step; nobody finishes during the plan (max_tokens),
        # so what a step returns is empty and dropped.
        if kind == "compare":
            result["graph_vs_eager"] = compare_graph_buckets(engine, list(scheduler.running), rel_tol)
            inner_step()
        elif kind == "timed":
            timed[graphed].append(_timed_step(engine, inner_step, graphed))
        elif kind == "profiled":
            kernels[graphed] = _profiled_step(engine, inner_step, graphed)
        elif kind == "async":
            result["async"] = _async_wall(engine, inner_step, num_wall)
        else:
            walls[graphed].append(_wall_step(engine, inner_step, graphed))
        if not plan:
            raise _Done
        return []

    run_ahead = engine.runner.run_ahead
    with patched(engine, "step", step):
        try:
            for out in engine.stream(requests, max_in_flight=n):
                raise RuntimeError(
                    f"request {out.request_id} finished ({out.error or out.finish_reason}) before all {n} "
                    "decoded in one step (preempted for lack of KV blocks, or batch limits below the prompts)"
                )
        except _Done:
            pass
        finally:
            engine.runner.run_ahead = run_ahead  # the engine is idle again: as it was
    result.setdefault("async", None)
    for graphed, name in ((True, "graphed"), (False, "eager")):
        if not timed[graphed]:
            result[name] = None
            continue
        result[name] = {
            "timed": _median(timed[graphed]),
            "kernels": kernels.get(graphed),
            "wall_ms": statistics.median(walls[graphed]) if walls[graphed] else None,
        }
    return result
