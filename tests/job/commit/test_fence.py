"""Reruns and concurrent launches never mix outputs (batchrun/job/commit/fence.py, the input fingerprint at
shard open): real worker processes over one output directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.job.commit.store import RunStore

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

TIMEOUT_S = 300  # hang guards, never timing assertions


def _run(args: list[str], env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchrun", *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )


def _wait_until_established(proc: subprocess.Popen, out) -> None:
    """Until the launch `proc` has made its fingerprint the run's (its engine is loaded)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (out / "_fingerprint.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the first launch never started"
        time.sleep(0.1)


def _markers(out: str) -> dict[str, dict]:
    store = RunStore(out, {})
    return {name: store.read_marker(name) for name in store.committed_shards()}


def test_a_rank_started_with_another_model_commits_nothing(tmp_path, make_shards, job_overrides, tiny_model_factory):
    """Rank 1 of 2 with another model used to compare only with its own (absent) markers and commit."""
    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2)
    out = tmp_path / "out"
    world = ["launcher.world_size=2", "launcher.work_stealing=false"]
    first = _run([*job_overrides(tmp_path / "in", out), *world, "launcher.rank=0"])
    assert first.returncode == 0, first.stderr[-2000:]
    other_model = f"model.path={tiny_model_factory('qwen2')}"
    second = _run([*job_overrides(tmp_path / "in", out), *world, "launcher.rank=1", other_model])
    assert second.returncode == 2, second.stderr[-2000:]
    assert "output.on_change" in second.stderr and "model.sha256" in second.stderr
    assert sorted(_markers(str(out))) == ["part-00"]  # nothing of the other model was committed


def test_an_overlapping_launch_with_other_settings_stops_at_start(tmp_path, make_shards, job_overrides, hooked_env):
    make_shards(tmp_path / "in", num_shards=3, rows_per_shard=3)
    out = tmp_path / "out"
    slow = subprocess.Popen(
        [sys.executable, "-m", "batchrun", *job_overrides(tmp_path / "in", out)],
        env=hooked_env({"delay_s": 0.3}),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_until_established(slow, out)
        other = _run([*job_overrides(tmp_path / "in", out), "sampling.max_tokens=3"])
        assert other.returncode == 2, other.stderr[-2000:]
        assert "sampling.max_tokens: 8 -> 3" in other.stderr
        _, stderr = slow.communicate(timeout=TIMEOUT_S)
    finally:
        slow.kill()
    assert slow.returncode == 0, stderr[-2000:]
    assert {m["fingerprint"]["settings"]["sampling.max_tokens"] for m in _markers(str(out)).values()} == {8}


def test_a_recompute_launch_stops_the_running_one_at_its_next_commit(tmp_path, make_shards, job_overrides, hooked_env):
    """The running launch re-reads the run's fingerprint before each commit: once a recompute launch
    has replaced it, the old launch commits nothing more, and every marker ends with the new settings."""
    make_shards(tmp_path / "in", num_shards=4, rows_per_shard=3)
    out = tmp_path / "out"
    slow = subprocess.Popen(
        [sys.executable, "-m", "batchrun", *job_overrides(tmp_path / "in", out), "planner.max_open_shards=1"],
        # 1.5 s a row: the slow launch still has shards to commit when the recompute launch, which
        # starts a whole process and engine first, replaces the fingerprint
        env=hooked_env({"delay_s": 1.5}),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_until_established(slow, out)
        new = _run(
            [
                *job_overrides(tmp_path / "in", out),
                "sampling.max_tokens=3",
                "output.on_change=recompute",
                "launcher.claim_lease_s=2",
            ]
        )
        _, stderr = slow.communicate(timeout=TIMEOUT_S)
    finally:
        slow.kill()
    assert slow.returncode == 2, stderr[-2000:]
    assert "another launch with other settings" in stderr
    # The new launch ran what it could claim; a rerun of it finishes what the old one held.
    again = _run([*job_overrides(tmp_path / "in", out), "sampling.max_tokens=3", "output.on_change=recompute"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert new.returncode in (0, 1), new.stderr[-2000:]
    markers = _markers(str(out))
    assert len(markers) == 4
    assert {m["fingerprint"]["settings"]["sampling.max_tokens"] for m in markers.values()} == {3}


def test_a_rewritten_input_is_seen_with_a_shared_plan(tmp_path, make_shards, job_overrides):
    """Without work stealing the ranks split `_plan.json`, which froze the inputs' sizes and versions:
    a rewritten input was never noticed."""
    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2)
    out = tmp_path / "out"
    world = ["launcher.world_size=2", "launcher.work_stealing=false"]
    for rank in (0, 1):
        done = _run([*job_overrides(tmp_path / "in", out), *world, f"launcher.rank={rank}"])
        assert done.returncode == 0, done.stderr[-2000:]
    table = pq.read_table(tmp_path / "in" / "part-01.parquet")
    rewritten = table.set_column(2, "text", pa.array([t + " Changed." for t in table.column("text").to_pylist()]))
    time.sleep(0.01)  # a new mtime even on coarse clocks
    pq.write_table(rewritten, tmp_path / "in" / "part-01.parquet")
    rerun = _run([*job_overrides(tmp_path / "in", out), *world, "launcher.rank=1"])
    assert rerun.returncode == 2, rerun.stderr[-2000:]
    assert "input.size" in rerun.stderr or "input.version" in rerun.stderr
    redo = _run([*job_overrides(tmp_path / "in", out), *world, "launcher.rank=1", "output.on_change=recompute"])
    assert redo.returncode == 0, redo.stderr[-2000:]
    marker = _markers(str(out))["part-01"]
    assert marker["fingerprint"]["input"]["input.size"] == (tmp_path / "in" / "part-01.parquet").stat().st_size


def test_a_recompute_launch_keeps_a_marker_another_recompute_committed_meanwhile(
    tmp_path, make_shards, tiny_engine, job_overrides
):
    """Two recompute launches: the one that found the shard stale first must not remove the marker
    the other one committed with the new settings in the meantime."""
    from batchrun import cli
    from batchrun.job import run_job
    from batchrun.job.run.runner import _JobRun

    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2)
    out = tmp_path / "out"
    overrides = job_overrides(tmp_path / "in", out)
    assert run_job(cli.load_config(overrides), engine=tiny_engine).exit_code == 0
    new_settings = [*overrides, "sampling.max_tokens=3", "output.on_change=recompute"]
    slow = _JobRun(cli.load_config(new_settings), {})  # found part-00 stale at its start
    assert slow.stale == {"part-00"}
    assert run_job(cli.load_config(new_settings), engine=tiny_engine).exit_code == 0  # the other launch
    fresh = json.loads((out / "_commits" / "part-00.json").read_text())
    result = slow.run(tiny_engine)
    assert result.exit_code == 0 and [s.status for s in result.shards] == ["skipped"]
    assert json.loads((out / "_commits" / "part-00.json").read_text())["attempt"] == fresh["attempt"]
