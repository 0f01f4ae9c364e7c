"""Crashes and stop signals: a real subprocess is killed (SIGKILL) or asked to stop (SIGTERM) in the
middle of a shard, and the rerun of the same command leaves every input id exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.engine import Engine
from batchrun.job import run_job
from batchrun.job.signals import StopRequest

# Runs the real CLI with Engine.stream wrapped so the third shard pauses after two outputs: it
# touches READY, then waits for GO (or forever), so the test can signal it at a known point.
WORKER = r"""
import os, pathlib, sys, time
from batchrun.engine import Engine
ready, go = pathlib.Path(os.environ["TEST_READY"]), pathlib.Path(os.environ["TEST_GO"])
real_stream = Engine.stream
calls = []
def stream(self, *args, **kwargs):
    calls.append(1)
    paused_call = len(calls) == 3
    for n, out in enumerate(real_stream(self, *args, **kwargs)):
        yield out
        if paused_call and n == 1:
            ready.touch()
            while not go.exists():
                time.sleep(0.02)
Engine.stream = stream
from batchrun.cli import main
main()
"""

SHARD_ROWS = (2, 2, 6, 2)


def _make_input(tmp_path: Path, make_shards) -> list[str]:
    ids = []
    for s, rows in enumerate(SHARD_ROWS):
        ids += make_shards(tmp_path / "in", num_shards=1, rows_per_shard=rows, prefix=f"s{s}")[0]
    return ids


def _start_paused_worker(tmp_path: Path, overrides: list[str]) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "TEST_READY": str(tmp_path / "ready"), "TEST_GO": str(tmp_path / "go")}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, *overrides],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
    while not (tmp_path / "ready").exists():
        if proc.poll() is not None:
            pytest.fail(f"worker exited early ({proc.returncode}): {proc.stderr.read()}")
        assert time.monotonic() < deadline, "worker never reached the third shard"
        time.sleep(0.05)
    return proc, tmp_path / "go"


def _all_result_ids(out: Path) -> list[str]:
    return [i for p in sorted((out / "results").glob("*.parquet")) for i in pq.read_table(p).column("id").to_pylist()]


def test_sigkill_mid_shard_then_rerun_gives_every_id_exactly_once(tmp_path, make_shards, job_overrides):
    ids = _make_input(tmp_path, make_shards)
    out = tmp_path / "out"
    proc, _ = _start_paused_worker(tmp_path, job_overrides(tmp_path / "in", tmp_path / "out"))
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    # Two shards committed, the third in progress left nothing at a final name.
    assert sorted(p.name for p in (out / "_commits").iterdir()) == ["s0-00.json", "s1-00.json"]
    assert sorted(p.name for p in (out / "results").iterdir()) == ["s0-00.parquet", "s1-00.parquet"]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert [s["status"] for s in manifest["shards"]] == ["committed", "committed", "running", "pending"]
    committed_bytes = {p.name: p.read_bytes() for p in (out / "results").iterdir()}

    rerun = subprocess.run(
        [sys.executable, "-m", "batchrun", *job_overrides(tmp_path / "in", tmp_path / "out")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert "Traceback" not in rerun.stderr
    for line in (
        "s0-00  skipped",
        "s1-00  skipped",
        "s2-00  committed",
        "s3-00  committed",
        f"results:  file://{out}/results/",
        "completed: 4 shards done: 2 committed, 2 already done",
    ):
        assert line in rerun.stdout, rerun.stdout
    assert sorted(_all_result_ids(out)) == sorted(ids) and len(_all_result_ids(out)) == len(ids)
    for name, data in committed_bytes.items():
        assert (out / "results" / name).read_bytes() == data
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert [s["status"] for s in manifest["shards"]] == ["skipped", "skipped", "committed", "committed"]
    # Only the killed attempt's own directory is left (nobody removes another attempt's files).
    assert [p.parent.name for p in (out / "_attempts").glob("*/*")] == ["s2-00"]
    # Hydra kept to the working directory's contents: nothing but what the test made.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out", "ready"]


def test_sigterm_abandons_the_shard_in_progress_and_the_next_run_resumes(
    tmp_path, make_shards, job_overrides, tiny_engine
):
    ids = _make_input(tmp_path, make_shards)
    out = tmp_path / "out"
    proc, go = _start_paused_worker(tmp_path, job_overrides(tmp_path / "in", tmp_path / "out"))
    proc.send_signal(signal.SIGTERM)
    go.touch()
    stdout, stderr = proc.communicate(timeout=300)

    assert proc.returncode == 128 + signal.SIGTERM
    assert stderr.strip().splitlines()[-1] == (
        "batchrun: interrupted by SIGTERM: 2 committed, 0 already done, 1 abandoned, 1 not started; "
        "rerun the same command to resume"
    )
    assert "Traceback" not in stderr and "s2-00  interrupted" in stdout
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert [(s["name"], s["status"]) for s in manifest["shards"]] == [
        ("s0-00", "committed"),
        ("s1-00", "committed"),
        ("s2-00", "interrupted"),
        ("s3-00", "pending"),
    ]
    assert sorted(p.name for p in (out / "results").iterdir()) == ["s0-00.parquet", "s1-00.parquet"]
    assert not (out / "_attempts" / "s2-00").exists()

    result = run_job(cli.load_config(job_overrides(tmp_path / "in", tmp_path / "out")), engine=tiny_engine)
    assert result.exit_code == 0
    assert [s.status for s in result.shards] == ["skipped", "skipped", "committed", "committed"]
    assert sorted(_all_result_ids(out)) == sorted(ids) and len(_all_result_ids(out)) == len(ids)


def test_sigint_in_process_stops_the_run_with_exit_130(tmp_path, make_shards, job_overrides, tiny_engine, monkeypatch):
    ids = _make_input(tmp_path, make_shards)
    real_stream = Engine.stream
    calls = []

    def stream(self, *args, **kwargs):
        calls.append(1)
        for n, out in enumerate(real_stream(self, *args, **kwargs)):
            yield out
            if len(calls) == 2 and n == 0:
                os.kill(os.getpid(), signal.SIGINT)  # a real signal, handled by run_job's handler

    monkeypatch.setattr(Engine, "stream", stream)
    config = cli.load_config(job_overrides(tmp_path / "in", tmp_path / "out"))
    result = run_job(config, engine=tiny_engine)
    assert (result.exit_code, result.status) == (130, "interrupted")
    assert [s.status for s in result.shards] == ["committed", "interrupted", "pending", "pending"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are restored

    monkeypatch.setattr(Engine, "stream", real_stream)
    assert run_job(config, engine=tiny_engine).exit_code == 0
    assert sorted(_all_result_ids(tmp_path / "out")) == sorted(ids)


def test_stop_request_turns_the_first_signal_into_a_flag():
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # let the interpreter run the handler
        assert stop.requested and stop.name == "SIGTERM" and stop.exit_code == 143
        # Repeated signals (SIGINT after SIGTERM, SIGTERM again) do not cut the graceful stop short:
        # this process is still here, and the first signal is the one reported.
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.name == "SIGTERM" and stop.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
