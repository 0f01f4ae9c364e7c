"""The merged run manifest (`_manifest.json`) written by several workers that hold no lock."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.commit.manifest import Manifest, write_merged_manifest
from batchrun.job.commit.store import RunStore
from batchrun.job.shards import Shard, Worker


def _commit(store: RunStore, shard: str, rank: int) -> None:
    attempt = store.begin(shard)
    pq.write_table(pa.table({"id": [f"{shard}-0"], "output": ["x"]}), attempt.results_tmp)
    pq.write_table(pa.table({"shard": [shard], "num_rows": [1]}), attempt.metrics_tmp)
    assert store.commit(attempt, {"shard": shard, "worker": rank, "num_rows": 1})


def test_a_merge_read_before_the_last_worker_finished_never_has_the_last_word(tmp_path, monkeypatch):
    """Worker 0 finishes and merges while worker 1 still runs; worker 1 finishes and writes its own
    merge between worker 0's read and worker 0's write. The run's manifest must end up completed,
    not with worker 0's view of worker 1 as running."""
    out = str(tmp_path / "out")
    shards = [Shard(name, f"/in/{name}.parquet", f"file:///in/{name}.parquet") for name in ("s0", "s1")]
    store0, store1 = RunStore(out, {}), RunStore(out, {})  # one per worker process
    workers = [Manifest(s, {}, Worker(r, 2, "test"), 2, [shards[r]]) for r, s in enumerate((store0, store1))]
    for manifest in workers:
        manifest.write()

    def finish(rank: int, store: RunStore) -> None:
        _commit(store, f"s{rank}", rank)
        workers[rank].update(f"s{rank}", status="committed", num_rows=1)
        workers[rank].finish("completed", "1 committed", None)
        workers[rank].write()

    finish(0, store0)
    real_write = store0.write_json
    late = []

    def write_after_worker1_finished(path: str, obj) -> None:
        if path.endswith("/_manifest.json") and not late:
            assert obj["status"] == "running"  # what worker 0 read: worker 1 still running
            late.append(True)
            finish(1, store1)
            assert write_merged_manifest(store1, shards, 2)["status"] == "completed"
        real_write(path, obj)

    monkeypatch.setattr(store0, "write_json", write_after_worker1_finished)
    doc = write_merged_manifest(store0, shards, 2)

    assert late
    merged = json.loads(Path(out, "_manifest.json").read_text())
    assert merged == doc
    assert merged["status"] == "completed" and merged["finished_at"] is not None
    assert [(s["name"], s["status"], s["worker"]) for s in merged["shards"]] == [
        ("s0", "committed", 0),
        ("s1", "committed", 1),
    ]
    assert [(w["rank"], w["status"]) for w in merged["workers"]] == [(0, "completed"), (1, "completed")]
