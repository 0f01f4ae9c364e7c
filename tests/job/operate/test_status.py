"""`python -m batchrun status`: a run's state read from its store alone, during and after a real
two-worker run, on local disk and on an S3-protocol server; the status call never changes the store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jsonschema
import pytest

from batchrun.job.commit.checkpoints import committed_parts
from batchrun.job.commit.store import RunStore
from batchrun.job.operate.status import format_status, read_status, status_schema

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::DeprecationWarning")

TIMEOUT_S = 300  # hang guards, never timing assertions
NUM_SHARDS, ROWS = 4, 3


def _status(out: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchrun", "status", out, *args], capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _snapshot(store: RunStore) -> dict[str, bytes]:
    """Every file under the output directory, with its bytes."""
    store.fs.invalidate_cache()
    return {path: store.fs.cat_file(path) for path in sorted(store.fs.find(store.root))}


def _check_against_store(report: dict, store: RunStore) -> None:
    jsonschema.validate(report, status_schema())
    shards = {s["name"]: s for s in report["shards"]}
    committed = store.committed_shards()
    assert {n for n, s in shards.items() if s["state"] == "committed"} == committed
    assert report["counts"]["committed"] == len(committed)
    for name, parts in committed_parts(store).items():
        if name not in committed:
            assert shards[name]["num_parts"] == len(parts)
            assert shards[name]["num_rows"] == sum(p.num_result_rows for p in parts)
    for name in committed:
        assert shards[name]["num_rows"] == store.read_marker(name)["num_rows"]
    assert report["num_rows_done"] == sum(s["num_rows"] for s in shards.values())


@pytest.mark.parametrize("where", ["local", "s3"])
def test_status_mid_run_and_after_changes_nothing(where, request, tmp_path, make_shards, job_overrides, hooked_env):
    make_shards(tmp_path / "in", num_shards=NUM_SHARDS, rows_per_shard=ROWS)
    if where == "s3":
        _, bucket, _ = request.getfixturevalue("s3")
        out = f"s3://{bucket}/run"
    else:
        out = str(tmp_path / "out")
    store = RunStore(out, {})
    common = [
        *job_overrides(tmp_path / "in", out),
        "launcher.world_size=2",
        "output.checkpoint_rows=1",  # parts mid-shard: rows done before a shard commits
        "planner.max_open_shards=1",
    ]
    env = hooked_env({"delay_s": 0.4})
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "batchrun", *common, f"launcher.rank={rank}"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not committed_parts(store) or len(store.committed_shards()) == NUM_SHARDS:
            assert all(w.poll() is None for w in workers) and time.monotonic() < deadline, "no part mid-run"
            time.sleep(0.1)
        # Both workers frozen for a moment (well within the lease): the store holds still while it is read.
        for w in workers:
            os.kill(w.pid, signal.SIGSTOP)
        try:
            before = _snapshot(store)
            looked = _status(out, "--json")
            assert _snapshot(store) == before
            assert looked.returncode == 0, looked.stderr[-2000:]
            mid = json.loads(looked.stdout)
            _check_against_store(mid, RunStore(out, {}))
        finally:
            for w in workers:
                os.kill(w.pid, signal.SIGCONT)
        assert mid["exit_status"] == "running"
        assert mid["counts"]["running"] >= 1 and mid["num_shards_known"] == NUM_SHARDS
        running = [s for s in mid["shards"] if s["state"] == "running"]
        assert all(s["owner"] and s["claim_age_s"] is not None for s in running)
        assert any(s["num_parts"] and s["worker"] in (0, 1) for s in running)
        assert mid["fingerprint"] and mid["fingerprint"]["model_sha256"]

        for w in workers:
            _, stderr = w.communicate(timeout=TIMEOUT_S)
            assert w.returncode == 0, stderr[-2000:]
    finally:
        for w in workers:
            w.kill()

    before = _snapshot(store)
    done = _status(out, "--json")
    text = _status(out)
    assert _snapshot(store) == before
    report = json.loads(done.stdout)
    _check_against_store(report, store)
    assert report["exit_status"] == 0 and report["counts"]["committed"] == NUM_SHARDS
    assert report["num_rows_done"] == NUM_SHARDS * ROWS and report["eta_s"] == 0
    assert report["rows_per_s"] > 0 and report["num_output_tokens"] > 0
    assert report["fingerprint"]["id"] == mid["fingerprint"]["id"]
    assert {w["rank"] for w in report["workers"]} == {0, 1}
    assert text.returncode == 0 and "exit status: 0" in text.stdout and f"{NUM_SHARDS} committed" in text.stdout


def test_shards_nobody_named_are_counted_and_listed_with_data(tmp_path, make_shards):
    """Before its workers start, the store knows only what was written: --data lists the inputs."""
    make_shards(tmp_path / "in", num_shards=3, rows_per_shard=1)
    out = tmp_path / "out"
    (out / "_commits").mkdir(parents=True)
    marker = {"shard": "part-00", "num_rows": 1, "committed_at": "2026-01-01T00:00:10.000Z", "metrics": {}}
    marker["started_at"] = "2026-01-01T00:00:00.000Z"
    (out / "_commits" / "part-00.json").write_text(json.dumps(marker))
    alone = read_status(str(out))
    assert alone.num_shards_known == 1 and alone.exit_status == 0  # all it can see is done
    listed = read_status(str(out), data_uri=str(tmp_path / "in"))
    assert listed.num_shards_known == 3 and listed.counts["pending"] == 2
    assert listed.exit_status == "interrupted" and listed.rows_per_s == pytest.approx(0.1)
    jsonschema.validate(listed.to_json(), status_schema())
    missing = _status(str(tmp_path / "nothing"))
    assert missing.returncode == 1 and "no batchrun run" in missing.stderr


def _worker_manifest(rank: int, world_size: int, device, settings, config_engine=None) -> dict:
    """A worker's manifest as manifest.Manifest writes it, cut to what status reads."""
    return {
        "status": "completed",
        "started_at": "2026-01-01T00:00:00.000Z",
        "finished_at": "2026-01-01T00:01:00.000Z",
        "worker": {"rank": rank, "world_size": world_size, "device": device, "hostname": "h", "pid": 100 + rank},
        "num_shards_total": 1,
        "engine_settings": settings,
        "config": {"engine": config_engine} if config_engine is not None else {},
        "shards": [],
    }


def test_status_shows_each_workers_group_and_reads_manifests_from_before_tensor_parallelism(tmp_path):
    """A run of two tensor-parallel workers (2 GPUs each) shows tp=2, its GPUs and each rank's
    weights; a manifest without tensor_parallel_size (an older batchrun's) is one rank holding
    weight_bytes; a worker whose engine has not loaded yet takes the size from its config."""
    new, old = tmp_path / "new", tmp_path / "old"
    for out in (new, old):
        (out / "_commits").mkdir(parents=True)
    group = {"weight_bytes": 706304, "tensor_parallel_size": 2, "rank_weight_bytes": [354048, 354048]}
    (new / "_manifest.rank0.json").write_text(json.dumps(_worker_manifest(0, 2, "0,1", group)))
    loading = _worker_manifest(1, 2, "2,3", None, {"tensor_parallel_size": 2})
    (new / "_manifest.rank1.json").write_text(json.dumps({**loading, "status": "running", "finished_at": None}))
    (old / "_manifest.json").write_text(json.dumps(_worker_manifest(0, 1, None, {"weight_bytes": 2048})))

    report = read_status(str(new), now=time.time() + 3600)  # the running manifest: out of its lease
    jsonschema.validate(report.to_json(), status_schema())
    assert [(w["device"], w["tensor_parallel_size"], w["rank_weight_bytes"]) for w in report.workers] == [
        ("0,1", 2, [354048, 354048]),
        ("2,3", 2, None),
    ]
    assert (
        "workers:     2 (1 completed, 1 running), tp=2 each on GPUs 0,1 | 2,3; weights per rank 345.8 KiB, 345.8 KiB"
        in format_status(report)
    )
    report = read_status(str(old))
    jsonschema.validate(report.to_json(), status_schema())
    assert [(w["device"], w["tensor_parallel_size"], w["rank_weight_bytes"]) for w in report.workers] == [
        (None, 1, [2048])
    ]
    assert "workers:     1 (1 completed), tp=1 each; weights per rank 2.0 KiB" in format_status(report)
