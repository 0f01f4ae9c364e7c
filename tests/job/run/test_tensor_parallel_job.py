"""A job whose worker is a tensor-parallel group (engine.tensor_parallel_size=2, gloo on the CPU):
the real CLI in a subprocess, its followers real processes. Each shard is committed once with the
rows a one-process run writes; a follower or rank 0 killed mid-run leaves nothing partial and no
process behind, and the rerun gives every id exactly once; SIGTERM to the whole process group
(what a terminal, Slurm or Kubernetes send) takes the normal stop path."""

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

from tests.job.run.test_resume import SEQUENTIAL, SHARD_ROWS
from tests.support.followers import follower_pids, kill_all, new_marker, wait_until_no_followers

TP2 = ("engine.tensor_parallel_size=2", "engine.num_threads=2")

# The real CLI, paused at the second output of the shard TEST_PAUSE_SHARD names (with shards run one
# after another, the shards before it are committed then): it touches READY and waits for GO.
WORKER = r"""
import os, pathlib, time
from batchrun.job.run import flow
ready, go = pathlib.Path(os.environ["TEST_READY"]), pathlib.Path(os.environ["TEST_GO"])
shard = os.environ["TEST_PAUSE_SHARD"]
outputs = {}
real_on_output = flow.ShardRun.on_output
def on_output(self, out):
    real_on_output(self, out)
    outputs[self.shard.name] = outputs.get(self.shard.name, 0) + 1
    if self.shard.name == shard and outputs[shard] == 2 and not ready.exists():
        ready.touch()
        while not go.exists():
            time.sleep(0.02)
flow.ShardRun.on_output = on_output
from batchrun.cli import main
main()
"""


@pytest.fixture
def marker():
    tag = new_marker()
    yield tag
    kill_all(tag)


def _input(tmp_path: Path, make_shards) -> list[str]:
    ids = []
    for s, rows in enumerate(SHARD_ROWS):
        ids += make_shards(tmp_path / "in", num_shards=1, rows_per_shard=rows, prefix=f"s{s}")[0]
    return ids


def _cli(tmp_path: Path, overrides: list[str], marker: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchrun", *overrides],
        cwd=tmp_path,
        env={**os.environ, **marker},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _rows(out: Path) -> dict[str, str]:
    rows = {}
    for p in sorted((out / "results").glob("*.parquet")):
        t = pq.read_table(p)
        for i, text in zip(t.column("id").to_pylist(), t.column("output").to_pylist()):
            assert i not in rows, f"{i} written twice"
            rows[i] = text
    return rows


def _paused(tmp_path: Path, overrides: list[str], marker: dict[str, str]) -> subprocess.Popen:
    """The CLI paused at shard s2-00's second output (s0 and s1 committed), its group up."""
    env = {
        **os.environ,
        **marker,
        "TEST_READY": str(tmp_path / "ready"),
        "TEST_GO": str(tmp_path / "go"),
        "TEST_PAUSE_SHARD": "s2-00",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, *overrides],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a launcher gives a job: killpg reaches all
    )
    deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
    while not (tmp_path / "ready").exists():
        if proc.poll() is not None:
            pytest.fail(f"worker exited early ({proc.returncode}): {proc.stderr.read()}")
        assert time.monotonic() < deadline, "worker never reached its pause"
        time.sleep(0.05)
    assert len(follower_pids(marker)) == 1, "a group of 2 has one follower"
    return proc


def test_a_tp2_job_commits_each_shard_once_with_the_rows_of_one_process(tmp_path, make_shards, job_overrides, marker):
    ids = _input(tmp_path, make_shards)
    one = _cli(tmp_path, job_overrides(tmp_path / "in", tmp_path / "one"), marker)
    assert one.returncode == 0, one.stderr
    two = _cli(tmp_path, job_overrides(tmp_path / "in", tmp_path / "two", *TP2), marker)
    assert two.returncode == 0, two.stderr
    assert "Traceback" not in two.stderr
    assert sorted(_rows(tmp_path / "two")) == sorted(ids)
    assert _rows(tmp_path / "two") == _rows(tmp_path / "one")  # float32 greedy: the same text
    assert sorted(p.name for p in (tmp_path / "two" / "_commits").iterdir()) == [f"s{s}-00.json" for s in range(4)]
    settings = json.loads((tmp_path / "two" / "_manifest.json").read_text())["engine_settings"]
    assert settings["tensor_parallel_size"] == 2
    assert len(settings["rank_weight_bytes"]) == 2 and sum(settings["rank_weight_bytes"]) > settings["weight_bytes"]
    assert max(settings["rank_weight_bytes"]) < 0.6 * settings["weight_bytes"]
    assert follower_pids(marker) == []  # the run closed its group before it exited


def _kill_at_pause(tmp_path: Path, overrides: list[str], marker: dict[str, str], victim: str) -> None:
    """Run to the pause, SIGKILL the follower or rank 0 there, let the run go on, and check that
    the group ended with nothing more committed (two shards, as at the pause)."""
    for name in ("ready", "go"):
        (tmp_path / name).unlink(missing_ok=True)
    proc = _paused(tmp_path, [*overrides, SEQUENTIAL], marker)
    (follower,) = follower_pids(marker)
    os.kill(follower if victim == "follower" else proc.pid, signal.SIGKILL)
    (tmp_path / "go").touch()
    _, stderr = proc.communicate(timeout=120)  # a hang guard
    if victim == "follower":
        # rank 0's next step fails at once: one line, exit 1, the open shard not committed
        assert proc.returncode == 1, stderr
        assert "tensor-parallel rank 1" in stderr and "Traceback" not in stderr  # names the dead rank
    else:
        assert proc.returncode == -signal.SIGKILL
    assert wait_until_no_followers(marker) == []  # a follower outlives neither its peer nor rank 0
    assert sorted(p.name for p in (tmp_path / "out" / "_commits").iterdir()) == ["s0-00.json", "s1-00.json"]


def test_a_rank_killed_mid_run_ends_the_group_and_the_rerun_gives_every_id_once(
    tmp_path, make_shards, job_overrides, marker
):
    ids = _input(tmp_path, make_shards)
    out = tmp_path / "out"
    overrides = job_overrides(tmp_path / "in", out, *TP2)
    _kill_at_pause(tmp_path, overrides, marker, "follower")
    _kill_at_pause(tmp_path, overrides, marker, "rank0")  # the rerun of the first, killed in turn
    # The last rerun runs in one process: tensor_parallel_size is no part of the run's fingerprint.
    rerun = _cli(tmp_path, job_overrides(tmp_path / "in", out), marker)
    assert rerun.returncode == 0, rerun.stderr
    assert "2 committed, 2 already done" in rerun.stdout
    assert sorted(_rows(out)) == sorted(ids)  # _rows asserts no id twice


def test_sigterm_to_the_process_group_takes_the_normal_stop_path(tmp_path, make_shards, job_overrides, marker):
    _input(tmp_path, make_shards)
    overrides = job_overrides(tmp_path / "in", tmp_path / "out", *TP2)
    proc = _paused(tmp_path, [*overrides, SEQUENTIAL], marker)
    os.killpg(proc.pid, signal.SIGTERM)  # rank 0 and its follower alike: the follower ignores it
    (tmp_path / "go").touch()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr  # the stop path's code: the step in flight finished, the group closed
    assert "Traceback" not in stderr and "group failed" not in stderr
    assert wait_until_no_followers(marker) == []
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["status"] == "interrupted"
