"""output.metrics_textfile: one worker's progress in Prometheus text format, for node_exporter's
textfile collector (no server: node_exporter reads the file when Prometheus scrapes it).

The file is replaced whole (a temp file in the same directory, then os.replace), so a reader sees
the previous version or the new one, never a torn one; its temp name does not end in `.prom`, so
the collector never reads it. It is rewritten at most every INTERVAL_S while rows arrive (from
Progress.advance, in the worker's main thread: no lock, no thread), once as the run starts and
once at its end. A write that fails is logged once and never stops the run.

With several workers each writes its own file: `{rank}` in the path is replaced by the rank;
without it, rank r of several writes PATH with `.rank{r}` before its `.prom` suffix (or at its end).
On the command line Hydra needs such a path quoted: 'output.metrics_textfile="/dir/batchrun-{rank}.prom"'.
Every sample carries the labels job, output_uri (credentials redacted) and rank, so the files of
one run's workers add up in PromQL without clashing.

    batchrun_rows_done_total               result rows this worker finished in this run (error rows too)
    batchrun_errors_total{type}            of those, error rows by error_type
    batchrun_prompt_tokens_total, batchrun_output_tokens_total
    batchrun_shards{state}                 this worker's shards by manifest status
    batchrun_output_tokens_per_second      output tokens over the time since the worker started
    batchrun_rows_per_second               result rows over the same time (embed and score runs too)
    batchrun_ttft_seconds{quantile}        summary: p50, p95, p99 of its rows' time to first token
    batchrun_running                       1 while the worker runs, 0 once it has ended
    batchrun_last_exit_code                the worker's exit status, once it has ended
    batchrun_last_success_timestamp_seconds  when a run last ended with exit 0 (kept from the file
                                           it replaces, so a running or failed night still shows the
                                           last good one)
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Optional

import numpy as np

from batchrun.utils.redact import redact_text

log = logging.getLogger(__name__)

INTERVAL_S = 5.0  # the least time between two rewrites while rows arrive
QUANTILES = (0.5, 0.95, 0.99)
# Every status a manifest record has (manifest.ShardRecord), each always present as a series.
SHARD_STATES = ("pending", "running", "committed", "skipped", "elsewhere", "interrupted", "failed", "quarantined")
_LAST_SUCCESS = "batchrun_last_success_timestamp_seconds"


def textfile_path(template: str, rank: int, world_size: int) -> str:
    """Where worker `rank` of `world_size` writes (see the module docstring)."""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    if world_size <= 1:
        return template
    stem, suffix = (template[: -len(".prom")], ".prom") if template.endswith(".prom") else (template, "")
    return f"{stem}.rank{rank}{suffix}"


class MetricsTextfile:
    def __init__(
        self,
        path: str,
        job: str,
        output_uri: str,
        rank: int,
        shard_states: Callable[[], Mapping[str, int]],
        interval_s: Optional[float] = None,
    ) -> None:
        self.path = path
        self.labels = {"job": job, "output_uri": redact_text(output_uri), "rank": str(rank)}
        self.shard_states = shard_states
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.rows = self.prompt_tokens = self.output_tokens = 0
        self.errors: dict[str, int] = {}
        self.ttfts: list[float] = []
        self.started = time.monotonic()
        self.last_success = _read_last_success(path)
        self._next_write = 0.0  # time.monotonic() before which maybe_write does nothing
        self._warned = False

    def add_row(self, row: Mapping[str, Any]) -> None:
        """One result row this worker finished."""
        self.rows += 1
        if row.get("error_type") is not None:
            self.errors[row["error_type"]] = self.errors.get(row["error_type"], 0) + 1
        self.prompt_tokens += row.get("num_prompt_tokens") or 0
        self.output_tokens += row.get("num_output_tokens") or 0
        if row.get("ttft_s") is not None:
            self.ttfts.append(float(row["ttft_s"]))

    def maybe_write(self) -> None:
        """Rewrite the file when the last write is INTERVAL_S old."""
        now = time.monotonic()
        if now >= self._next_write:
            self._next_write = now + self.interval_s
            self.write()

    def finish(self, exit_code: int) -> None:
        """The worker has ended with `exit_code`: the last write."""
        if exit_code == 0:
            self.last_success = time.time()
        self.write(exit_code)

    def write(self, exit_code: Optional[int] = None) -> None:
        try:
            text = self.render(exit_code)
            directory = os.path.dirname(self.path) or "."
            tmp = os.path.join(directory, f".{os.path.basename(self.path)}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except Exception as e:
            if not self._warned:
                self._warned = True
                log.warning("output.metrics_textfile: cannot write %s (%s: %s)", self.path, type(e).__name__, e)

    def render(self, exit_code: Optional[int] = None) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for sample, extra, value in samples:
                out.append(f"{sample}{_labels({**self.labels, **extra})} {_value(value)}")

        family(
            "batchrun_rows_done_total",
            "counter",
            "Result rows this worker finished in this run, error rows included.",
            [("batchrun_rows_done_total", {}, self.rows)],
        )
        family(
            "batchrun_errors_total",
            "counter",
            "Error rows this worker wrote in this run, by error_type.",
            [("batchrun_errors_total", {"type": t}, n) for t, n in sorted(self.errors.items())],
        )
        family(
            "batchrun_prompt_tokens_total",
            "counter",
            "Prompt tokens of the rows this worker ran in this run.",
            [("batchrun_prompt_tokens_total", {}, self.prompt_tokens)],
        )
        family(
            "batchrun_output_tokens_total",
            "counter",
            "Output tokens this worker generated in this run.",
            [("batchrun_output_tokens_total", {}, self.output_tokens)],
        )
        states = dict.fromkeys(SHARD_STATES, 0)
        states.update(self.shard_states())
        family(
            "batchrun_shards",
            "gauge",
            "This worker's shards by status (as in its manifest).",
            [("batchrun_shards", {"state": s}, n) for s, n in states.items()],
        )
        elapsed = max(time.monotonic() - self.started, 1e-9)
        family(
            "batchrun_output_tokens_per_second",
            "gauge",
            "Output tokens over the time since this worker started.",
            [("batchrun_output_tokens_per_second", {}, self.output_tokens / elapsed)],
        )
        family(  # every task's rate: embed and score runs generate no tokens
            "batchrun_rows_per_second",
            "gauge",
            "Result rows over the time since this worker started.",
            [("batchrun_rows_per_second", {}, self.rows / elapsed)],
        )
        ttfts = np.asarray(self.ttfts, dtype=np.float64)
        quantiles = np.quantile(ttfts, QUANTILES) if len(ttfts) else [math.nan] * len(QUANTILES)
        family(
            "batchrun_ttft_seconds",
            "summary",
            "Time to first token of this worker's rows in this run.",
            [("batchrun_ttft_seconds", {"quantile": str(q)}, float(v)) for q, v in zip(QUANTILES, quantiles)]
            + [("batchrun_ttft_seconds_sum", {}, float(ttfts.sum())), ("batchrun_ttft_seconds_count", {}, len(ttfts))],
        )
        family(
            "batchrun_running",
            "gauge",
            "1 while this worker runs, 0 once it has ended.",
            [("batchrun_running", {}, 0 if exit_code is not None else 1)],
        )
        if exit_code is not None:
            family(
                "batchrun_last_exit_code",
                "gauge",
                "This worker's exit status (0 done, 1 failed shards, 2 config error, 130/143 stopped).",
                [("batchrun_last_exit_code", {}, exit_code)],
            )
        if self.last_success is not None:
            family(
                _LAST_SUCCESS,
                "gauge",
                "When a run of this worker last ended with exit 0 (POSIX seconds).",
                [(_LAST_SUCCESS, {}, self.last_success)],
            )
        return "\n".join(out) + "\n"


def _labels(labels: Mapping[str, str]) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}"


def _value(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _read_last_success(path: str) -> Optional[float]:
    """The last-success time the file being replaced holds, if any."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    match = re.search(rf"^{_LAST_SUCCESS}(?:{{[^\n]*}})? (\S+)$", text, re.MULTILINE)
    try:
        return float(match.group(1)) if match else None
    except ValueError:
        return None
