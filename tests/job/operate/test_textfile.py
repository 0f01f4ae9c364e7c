"""output.metrics_textfile: Prometheus text format as node_exporter's textfile collector reads it,
written by a real worker, true to its results, and never seen torn by a concurrent reader."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchrun.job.operate.textfile import MetricsTextfile, textfile_path
from tests.support import REPO

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

TIMEOUT_S = 300  # hang guards, never timing assertions
# What every version of the file holds, whatever the run has done so far.
ALWAYS = {
    "batchrun_rows_done",
    "batchrun_errors",
    "batchrun_prompt_tokens",
    "batchrun_output_tokens",
    "batchrun_shards",
    "batchrun_output_tokens_per_second",
    "batchrun_ttft_seconds",
    "batchrun_running",
}


def _samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted extra labels) -> value; checks every sample has the run's labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("job", "output_uri", "rank")))
            out[(s.name, extra)] = s.value
    return out


def test_paths_of_several_workers():
    assert textfile_path("/m/batchrun.prom", 0, 1) == "/m/batchrun.prom"
    assert textfile_path("/m/batchrun.prom", 1, 2) == "/m/batchrun.rank1.prom"
    assert textfile_path("/m/b-{rank}.prom", 1, 2) == "/m/b-1.prom"
    assert textfile_path("/m/metrics", 3, 4) == "/m/metrics.rank3"


def test_last_success_outlives_a_failed_run(tmp_path):
    path = str(tmp_path / "b.prom")
    ok = MetricsTextfile(path, "summarize", "s3://user:secret@bucket/run", 0, lambda: {"committed": 2})
    ok.finish(0)
    first = _samples(open(path).read())
    assert "secret" not in open(path).read()
    failed = MetricsTextfile(path, "summarize", "s3://bucket/run", 0, lambda: {"failed": 1})
    failed.finish(1)
    after = _samples(open(path).read())
    last = ("batchrun_last_success_timestamp_seconds", ())
    assert after[last] == pytest.approx(first[last]) and abs(first[last] - time.time()) < 600
    assert after[("batchrun_last_exit_code", ())] == 1 and after[("batchrun_running", ())] == 0


def test_a_worker_writes_its_metrics_atomically_and_true_to_its_results(
    tmp_path, make_shards, job_overrides, hooked_env
):
    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=3)
    pq.write_table(pa.table({"id": ["bad-0"], "title": ["t"], "text": [""]}), tmp_path / "in" / "part-02.parquet")
    out, prom = tmp_path / "out", tmp_path / "collector" / "batchrun.prom"
    prom.parent.mkdir()
    reads: list[str] = []
    stop = threading.Event()

    def reader() -> None:  # as node_exporter: open and read whenever it likes
        while not stop.is_set():
            try:
                text = prom.read_text()
            except FileNotFoundError:
                continue
            names = {f.name for f in text_string_to_metric_families(text)}  # raises on a torn file
            assert ALWAYS <= names, sorted(ALWAYS - names)
            if not reads or reads[-1] != text:
                reads.append(text)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "batchrun", *job_overrides(tmp_path / "in", out), f"output.metrics_textfile={prom}"],
            env=hooked_env({"delay_s": 0.1, "metrics_interval_s": 0.01}),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    finally:
        stop.set()
        thread.join(timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not thread.is_alive()
    assert len(reads) >= 3, "the reader saw too few versions to say anything about atomicity"
    assert sorted(p.name for p in prom.parent.iterdir()) == ["batchrun.prom"]  # no temp file left

    rows = [r for p in sorted((out / "results").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    final = prom.read_text()
    assert f'output_uri="file://{out}"' in final and 'rank="0"' in final and 'job="summarize"' in final
    got = _samples(final)
    assert got[("batchrun_rows_done_total", ())] == len(rows) == 7
    assert got[("batchrun_errors_total", (("type", "empty_prompt"),))] == 1
    assert got[("batchrun_output_tokens_total", ())] == sum(r["num_output_tokens"] or 0 for r in rows)
    assert got[("batchrun_prompt_tokens_total", ())] == sum(r["num_prompt_tokens"] or 0 for r in rows)
    assert got[("batchrun_shards", (("state", "committed"),))] == 3
    assert got[("batchrun_shards", (("state", "failed"),))] == 0
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    assert got[("batchrun_ttft_seconds_count", ())] == len(ttfts)
    assert got[("batchrun_ttft_seconds", (("quantile", "0.5"),))] == pytest.approx(np.quantile(ttfts, 0.5))
    assert got[("batchrun_output_tokens_per_second", ())] > 0
    assert got[("batchrun_running", ())] == 0 and got[("batchrun_last_exit_code", ())] == 0
    assert abs(got[("batchrun_last_success_timestamp_seconds", ())] - time.time()) < 600


def test_nightly_points_the_textfile_at_the_collector_directory(tmp_path):
    """jobs/nightly/nightly.sh passes output.metrics_textfile when the collector directory exists
    (batchrun itself replaced by a stand-in that records its arguments)."""
    script = REPO / "jobs" / "nightly" / "nightly.sh"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\nprintf "%s\\n" "$@" > "$ARGS"\n')
    fake.chmod(0o755)
    (tmp_path / "collector").mkdir()
    env = {
        **os.environ,
        "BATCHRUN_PYTHON": str(fake),
        "BATCHRUN_NIGHTLY_LOCK_DIR": str(tmp_path / "locks"),
        "BATCHRUN_TEXTFILE_DIR": str(tmp_path / "collector"),
        "ARGS": str(tmp_path / "args"),
    }
    env.pop("BATCHRUN_METRICS_TEXTFILE", None)

    def args(**extra: str) -> list[str]:
        cmd = [str(script), str(tmp_path / "nightly"), "job=summarize"]
        run = subprocess.run(cmd, env={**env, **extra}, timeout=60)
        assert run.returncode == 0
        return (tmp_path / "args").read_text().splitlines()

    assert f"output.metrics_textfile={tmp_path}/collector/batchrun-nightly.prom" in args()
    assert not any(a.startswith("output.metrics_textfile") for a in args(BATCHRUN_METRICS_TEXTFILE=""))
