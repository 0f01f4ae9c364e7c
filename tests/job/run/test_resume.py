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
from batchrun.job import run_job
from batchrun.job.run import flow
from batchrun.job.run.signals import StopRequest

# Runs the real CLI with the shard flow wrapped so that it pauses at a known point: it touches
# READY, then waits for GO (or forever), so the test can signal it there. TEST_PAUSE says where:
#   third_shard  the third shard opened, after its second output (with planner.max_open_shards=1)
#   overlap      the first output after a shard committed while two or more shards are open
WORKER = r"""
import os, pathlib, sys, time
from batchrun.job.run import flow
ready, go = pathlib.Path(os.environ["TEST_READY"]), pathlib.Path(os.environ["TEST_GO"])
mode = os.environ["TEST_PAUSE"]
flows, commits, outputs = [], [], {}
real_init, real_on_output, real_commit = flow.ShardFlow.__init__, flow.ShardRun.on_output, flow.ShardRun.commit
def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    flows.append(self)
def commit(self):
    commits.append(self.shard.name)
    return real_commit(self)
def on_output(self, out):
    real_on_output(self, out)
    outputs[self.key] = outputs.get(self.key, 0) + 1
    if mode == "third_shard":
        pause = self.key == 2 and outputs[self.key] == 2
    else:
        pause = bool(commits) and len(flows[-1].open) >= 2
    if pause and not ready.exists():
        open_names = sorted(r.shard.name for r in flows[-1].open.values())
        ready.write_text(" ".join(open_names))
        while not go.exists():
            time.sleep(0.02)
flow.ShardFlow.__init__, flow.ShardRun.on_output, flow.ShardRun.commit = init, on_output, commit
from batchrun.cli import main
main()
"""

# One after another: what is committed at the pause is known exactly.
SEQUENTIAL = "planner.max_open_shards=1"

SHARD_ROWS = (2, 2, 6, 2)


def _make_input(tmp_path: Path, make_shards) -> list[str]:
    ids = []
    for s, rows in enumerate(SHARD_ROWS):
        ids += make_shards(tmp_path / "in", num_shards=1, rows_per_shard=rows, prefix=f"s{s}")[0]
    return ids


def _start_paused_worker(
    tmp_path: Path, overrides: list[str], pause: str = "third_shard"
) -> tuple[subprocess.Popen, Path]:
    env = {
        **os.environ,
        "TEST_READY": str(tmp_path / "ready"),
        "TEST_GO": str(tmp_path / "go"),
        "TEST_PAUSE": pause,
    }
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
        assert time.monotonic() < deadline, f"worker never reached its pause ({pause})"
        time.sleep(0.05)
    return proc, tmp_path / "go"


def _all_result_ids(out: Path) -> list[str]:
    return [i for p in sorted((out / "results").glob("*.parquet")) for i in pq.read_table(p).column("id").to_pylist()]


def test_sigkill_mid_shard_then_rerun_gives_every_id_exactly_once(tmp_path, make_shards, job_overrides):
    ids = _make_input(tmp_path, make_shards)
    out = tmp_path / "out"
    proc, _ = _start_paused_worker(tmp_path, job_overrides(tmp_path / "in", tmp_path / "out", SEQUENTIAL))
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
    proc, go = _start_paused_worker(tmp_path, job_overrides(tmp_path / "in", tmp_path / "out", SEQUENTIAL))
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


def _committed(out: Path) -> list[str]:
    return sorted(p.stem for p in (out / "_commits").iterdir()) if (out / "_commits").exists() else []


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_stop_with_shards_open_side_by_side_commits_or_redoes_each_once(tmp_path, make_shards, job_overrides, how):
    """Rows of several shards in the engine at once: a kill (or a graceful stop) then leaves each
    shard either committed whole or not at all, and the rerun finishes the rest, nothing twice."""
    ids = _make_input(tmp_path, make_shards)
    out = tmp_path / "out"
    proc, go = _start_paused_worker(tmp_path, job_overrides(tmp_path / "in", out), pause="overlap")
    open_at_pause = (tmp_path / "ready").read_text().split()
    if how == "SIGKILL":
        proc.kill()
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
    else:
        proc.send_signal(signal.SIGTERM)
        go.touch()
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert len(open_at_pause) >= 2
    committed = _committed(out)
    # The shard whose output was being delivered at the pause may complete and commit on the way
    # out of a graceful stop; the others open at the signal are abandoned.
    abandoned = sorted(set(open_at_pause) - set(committed))
    assert committed and len(abandoned) >= (len(open_at_pause) if how == "SIGKILL" else len(open_at_pause) - 1)
    if how == "SIGTERM":
        assert f"{len(abandoned)} abandoned" in stderr.strip().splitlines()[-1]
    # Each committed shard's results are whole and in input order; nothing of an open one is visible.
    assert sorted(p.stem for p in (out / "results").iterdir()) == committed
    for name in committed:
        rows = pq.read_table(out / "results" / f"{name}.parquet").column("id").to_pylist()
        assert rows == [i for i in ids if i.startswith(name.split("-")[0] + "0-row")]  # s2-00: s20-row0...
    committed_bytes = {name: (out / "results" / f"{name}.parquet").read_bytes() for name in committed}

    rerun = subprocess.run(
        [sys.executable, "-m", "batchrun", *job_overrides(tmp_path / "in", out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr
    for name in committed:
        assert f"{name}  skipped" in rerun.stdout
        assert (out / "results" / f"{name}.parquet").read_bytes() == committed_bytes[name]
    for name in abandoned:
        assert f"{name}  committed" in rerun.stdout
    assert sorted(_all_result_ids(out)) == sorted(ids) and len(_all_result_ids(out)) == len(ids)


@pytest.fixture
def sigint_handled():
    """SIGINT as an interactive shell gives it (Python's KeyboardInterrupt handler), whatever this
    process started with: run as a background job of a script, SIGINT starts ignored, and a run must
    then leave it ignored (test_a_signal_ignored_at_start_stays_ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_sigint_in_process_stops_the_run_with_exit_130(
    tmp_path, make_shards, job_overrides, tiny_engine, monkeypatch, sigint_handled
):
    ids = _make_input(tmp_path, make_shards)
    real_on_output = flow.ShardRun.on_output

    def on_output(self, out):
        real_on_output(self, out)
        if self.key == 1 and len(self.in_flight) == 1:  # the second shard's first output
            os.kill(os.getpid(), signal.SIGINT)  # a real signal, handled by run_job's handler

    monkeypatch.setattr(flow.ShardRun, "on_output", on_output)
    config = cli.load_config(job_overrides(tmp_path / "in", tmp_path / "out", SEQUENTIAL))
    result = run_job(config, engine=tiny_engine)
    assert (result.exit_code, result.status) == (130, "interrupted")
    assert [s.status for s in result.shards] == ["committed", "interrupted", "pending", "pending"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are restored

    monkeypatch.setattr(flow.ShardRun, "on_output", real_on_output)
    assert run_job(config, engine=tiny_engine).exit_code == 0
    assert sorted(_all_result_ids(tmp_path / "out")) == sorted(ids)


def test_stop_request_turns_the_first_signal_into_a_flag(sigint_handled):
    term_before = signal.getsignal(signal.SIGTERM)
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
    # what the process had before, not a fixed default: restored exactly
    assert signal.getsignal(signal.SIGTERM) is term_before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_ignored_at_start_stays_ignored():
    """A background job of a shell script starts with SIGINT ignored (so the terminal's Ctrl-C does
    not reach it), as nohup leaves SIGHUP ignored: like Python itself, the run does not catch a
    signal it found ignored, and leaves it ignored afterwards."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequest() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            assert not stop.requested
            assert signal.getsignal(signal.SIGTERM) == stop._handle  # the other one is caught as usual
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
