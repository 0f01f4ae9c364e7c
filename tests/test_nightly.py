"""jobs/nightly/nightly.sh: a dated output directory, a failed shard fails the night, a rerun of the
same day finishes it without redoing or duplicating anything."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support import REPO

SCRIPT = REPO / "jobs" / "nightly" / "nightly.sh"


def test_nightly_run_is_dated_fails_on_a_bad_shard_and_a_rerun_finishes_it(tmp_path, make_shards, tiny_llama_dir):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2) for i in s]
    (tmp_path / "in" / "part-02.parquet").write_bytes(b"not parquet")  # the night's broken input
    env = {
        **os.environ,
        "BATCHRUN_PYTHON": sys.executable,
        "BATCHRUN_NIGHTLY_DATE": "2026-01-02",
        "BATCHRUN_NIGHTLY_LOCK_DIR": str(tmp_path),
    }
    cmd = [
        str(SCRIPT),
        str(tmp_path / "nightly"),
        f"model.path={tiny_llama_dir}",
        f"data.uri={tmp_path / 'in'}",
        "engine.kv_cache_memory=67108864",
        "engine.max_num_seqs=2",
        "engine.max_num_batched_tokens=1024",
        "engine.dtype=float32",
        "sampling.max_tokens=8",
    ]
    out = tmp_path / "nightly" / "2026-01-02"

    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 1, first.stderr
    assert "nightly: " in first.stdout and "finished for 2026-01-02 with exit 1" in first.stdout
    assert "1 of 3 shards failed (part-02)" in first.stderr
    assert sorted(p.name for p in (out / "_commits").iterdir()) == ["part-00.json", "part-01.json"]
    committed = {p.name: p.read_bytes() for p in (out / "results").iterdir()}

    # The input is repaired; rerunning the same day does only what is left.
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2, prefix="fixed")
    (tmp_path / "in" / "part-02.parquet").unlink()
    ids += ["fixed0-row0", "fixed0-row1"]
    rerun = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert re.search(r"part-00\s+skipped", rerun.stdout) and re.search(r"fixed-00\s+committed", rerun.stdout)
    for name, data in committed.items():
        assert (out / "results" / name).read_bytes() == data
    all_ids = [
        i for p in sorted((out / "results").glob("*.parquet")) for i in pq.read_table(p).column("id").to_pylist()
    ]
    assert sorted(all_ids) == sorted(ids)
    assert json.loads((out / "_manifest.json").read_text())["status"] == "completed"

    bad = subprocess.run(
        cmd, cwd=tmp_path, env={**env, "BATCHRUN_NIGHTLY_DATE": "../x"}, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "must be YYYY-MM-DD" in bad.stderr


# A stand-in for BATCHRUN_PYTHON: `-m batchrun ...` records its arguments, says it started and waits
# for the test's "go" (or, with NIGHTLY_STUB_CRASH, kills the nightly script as a lost node would);
# anything else (the lock's `-c` fallback) is the real interpreter.
STUB = f"""#!/usr/bin/env bash
if [ "$1" != -m ]; then exec {sys.executable} "$@"; fi
printf '%s\\n' "$*" >>"$NIGHTLY_STUB_DIR/calls"
if [ -n "$NIGHTLY_STUB_CRASH" ]; then kill -KILL $PPID; exit 137; fi
touch "$NIGHTLY_STUB_DIR/started"
while [ ! -e "$NIGHTLY_STUB_DIR/go" ]; do sleep 0.05; done
exit 0
"""


def _stub_env(tmp_path, with_flock=True, **extra):
    stub = tmp_path / "stub-python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    env = {
        **os.environ,
        "BATCHRUN_PYTHON": str(stub),
        "BATCHRUN_NIGHTLY_LOCK_DIR": str(tmp_path / "locks"),
        "NIGHTLY_STUB_DIR": str(tmp_path),
        **extra,
    }
    if not with_flock:  # every tool on PATH but flock(1)
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for directory in env["PATH"].split(os.pathsep):
            for tool in Path(directory).glob("*") if Path(directory).is_dir() else ():
                if tool.name != "flock" and not (bin_dir / tool.name).exists():
                    (bin_dir / tool.name).symlink_to(tool)
        env["PATH"] = str(bin_dir)
    return env


@pytest.mark.parametrize("with_flock", [True, False], ids=["flock", "no-flock"])
def test_a_second_launch_of_the_same_day_exits_75_while_the_first_runs(tmp_path, with_flock):
    env = _stub_env(tmp_path, with_flock, BATCHRUN_NIGHTLY_DATE="2026-01-02")
    cmd = [str(SCRIPT), str(tmp_path / "nightly"), "job=summarize"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 75, second.stderr
        assert "another run for" in second.stderr and "2026-01-02 is in progress" in second.stderr
    finally:
        (tmp_path / "go").touch()
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert (tmp_path / "calls").read_text().count("-m batchrun") == 1  # the second never started batchrun
    # Once the first is done the day may be run again.
    assert subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60).returncode == 0


def test_a_crashed_previous_day_is_finished_before_today_starts(tmp_path, make_shards, tiny_llama_dir):
    make_shards(tmp_path / "in-0101", num_shards=1, rows_per_shard=2, prefix="jan1")
    make_shards(tmp_path / "in-0102", num_shards=1, rows_per_shard=2, prefix="jan2")
    common = [
        f"model.path={tiny_llama_dir}",
        "engine.kv_cache_memory=67108864",
        "engine.max_num_seqs=2",
        "engine.max_num_batched_tokens=1024",
        "engine.dtype=float32",
        "sampling.max_tokens=4",
    ]
    root = tmp_path / "nightly"

    def launch(day, env, data):
        cmd = [str(SCRIPT), str(root), *common, f"data.uri={data}"]
        return subprocess.run(
            cmd, env={**env, "BATCHRUN_NIGHTLY_DATE": day}, capture_output=True, text=True, timeout=300
        )

    # January 1st: the node is lost mid-run (the script and batchrun die by SIGKILL).
    crashed = launch("2026-01-01", _stub_env(tmp_path, NIGHTLY_STUB_CRASH="1"), tmp_path / "in-0101")
    assert crashed.returncode == -signal.SIGKILL
    assert not (root / "2026-01-01" / "_manifest.json").exists()

    # January 2nd: January 1st is finished first, from its own input, then the day's own run.
    env = {**_stub_env(tmp_path), "BATCHRUN_PYTHON": sys.executable}
    second = launch("2026-01-02", env, tmp_path / "in-0102")
    assert second.returncode == 0, second.stderr
    lines = second.stdout.splitlines()
    order = [i for i, line in enumerate(lines) if re.search(r"Z run for 2026-01-0[12] ->", line)]
    assert [("01-01" in lines[i]) for i in order] == [True, False], second.stdout
    assert "the run for 2026-01-01 did not complete (running); finishing it first" in second.stdout
    for day, prefix in (("2026-01-01", "jan1"), ("2026-01-02", "jan2")):
        assert json.loads((root / day / "_manifest.json").read_text())["status"] == "completed"
        ids = pq.read_table(root / day / "results" / f"{prefix}-00.parquet").column("id").to_pylist()
        assert ids == [f"{prefix}0-row0", f"{prefix}0-row1"]

    # Both days are complete now: the next launch runs only its own day.
    third = launch("2026-01-03", env, tmp_path / "in-0102")
    assert third.returncode == 0 and "finishing it first" not in third.stdout, third.stdout
