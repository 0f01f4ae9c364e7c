"""jobs/nightly/nightly.sh: a dated output directory, a failed shard fails the night, a rerun of the
same day finishes it without redoing or duplicating anything."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

SCRIPT = Path(__file__).resolve().parents[1] / "jobs" / "nightly" / "nightly.sh"


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
