"""The job path as a benchmark system: rows written as Parquet shards, run through `run_worker`
(claims, reading, prompts, planner, the shard flow, results and commits) with an engine already
loaded, timed from the call to its return. Set beside `engine.stream` on the same prompts, it
shows what the job layer costs per row and what shard boundaries cost.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.benchmark.timing import TimedRun
from batchrun.engine import Engine, RequestOutput, SamplingParams
from batchrun.job.config import RunConfig
from batchrun.job.errors import JobError
from batchrun.job.run.runner import run_worker


class _RecordingEngine:
    """The engine, with the outputs the job receives kept (by request id) for the greedy check."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.outputs: dict[Any, RequestOutput] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream(self, *args: Any, **kwargs: Any):
        for out in self._engine.stream(*args, **kwargs):
            self.outputs[out.request_id] = out
            yield out


class JobPath:
    """`rows` (column -> values, equal lengths) split into `num_shards` contiguous shards, run as a
    job with `config`'s settings; each call is a fresh output directory under one temporary root."""

    def __init__(self, config: RunConfig, rows: dict[str, list[Any]], num_shards: int) -> None:
        num_rows = len(next(iter(rows.values())))
        if not 1 <= num_shards <= num_rows:
            raise JobError(f"benchmark.job_shards={num_shards}: must be between 1 and the {num_rows} rows")
        self.config = config
        self.root = Path(tempfile.mkdtemp(prefix="batchrun-jobpath-"))
        self.num_rows = num_rows
        self.shard_sizes: list[int] = []
        bounds = [round(i * num_rows / num_shards) for i in range(num_shards + 1)]
        (self.root / "in").mkdir()
        table = pa.table(rows)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            pq.write_table(table.slice(lo, hi - lo), self.root / "in" / f"part-{i:03d}.parquet")
            self.shard_sizes.append(hi - lo)
        # The benchmark's untimed warm-up runs a couple of rows, not the whole workload.
        (self.root / "warm-up").mkdir()
        pq.write_table(table.slice(0, min(2, num_rows)), self.root / "warm-up" / "part-000.parquet")
        self._num_runs = 0

    def __call__(
        self, engine: Engine, params: SamplingParams, max_open_shards: Optional[int] = None, num_rows: int = 0
    ) -> TimedRun:
        """One pass over every row (or, with 0 < num_rows < all, the warm-up's rows); raises
        JobError unless every row reached the engine."""
        self._num_runs += 1
        warm_up = 0 < num_rows < self.num_rows
        planner = self.config.planner
        if max_open_shards is not None:
            planner = dataclasses.replace(planner, max_open_shards=max_open_shards)
        config = dataclasses.replace(
            self.config,
            data=dataclasses.replace(
                self.config.data, uri=str(self.root / ("warm-up" if warm_up else "in")), storage_options={}
            ),
            output=dataclasses.replace(self.config.output, uri=str(self.root / f"out-{self._num_runs}")),
            sampling=params,
            planner=planner,
            quiet=True,
        )
        recorder = _RecordingEngine(engine)
        engine.reset_prefix_cache()
        start = time.perf_counter()
        result = run_worker(config, engine=recorder)  # type: ignore[arg-type]
        wall_s = time.perf_counter() - start
        if result.exit_code != 0:
            raise JobError(f"the job path failed: {result.message}")
        done = self._in_row_order(recorder.outputs, min(2, self.num_rows) if warm_up else self.num_rows)
        shutil.rmtree(self.root / f"out-{self._num_runs}", ignore_errors=True)
        return TimedRun.from_outputs(wall_s, done)

    def _in_row_order(self, outputs: dict[Any, RequestOutput], num_rows: int) -> list[RequestOutput]:
        """Request ids are (shard key, row index); one worker opens shards in name order."""
        if len(outputs) != num_rows:
            raise JobError(f"the job path sent {len(outputs)} of {num_rows} rows to the engine")
        return [outputs[key] for key in sorted(outputs)]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
