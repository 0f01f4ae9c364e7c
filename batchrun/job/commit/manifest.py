"""The run manifest: what ran, with which config, code and model, and what happened to each shard.

It is rewritten after every shard (never appended to), so a killed run still leaves an accurate
record of what it committed. With several workers each writes its own (`_manifest.rank{r}.json`):
workers never coordinate, so no such file has two writers. Each worker, when it finishes, and the
local launcher (launcher.num_workers), when all have, also merge them with the commit markers into
the run's one `_manifest.json` (merge_manifests).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.metadata
import json
import logging
import os
import platform
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from batchrun.engine import EngineSettings, EngineStats
from batchrun.job.commit.store import RunStore
from batchrun.job.results import run_throughput
from batchrun.job.shards import Shard, Worker
from batchrun.utils.redact import REDACTED, redact  # noqa: F401 - manifest.redact, manifest.REDACTED

PACKAGES = ("batchrun", "torch", "transformers", "pyarrow", "fsspec", "s3fs", "tokenizers")

log = logging.getLogger(__name__)


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def package_versions() -> dict[str, Optional[str]]:
    versions: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@dataclass
class ShardRecord:
    name: str
    input: str  # the input file's URL
    # pending -> running -> committed | failed | interrupted; skipped: committed by an earlier run
    # or another worker; elsewhere: another worker holds its claim (work stealing); quarantined:
    # attempts at it died launcher.max_shard_attempts times (see results.SHARD_STATUSES)
    status: str = "pending"
    started_at: Optional[str] = None
    finished_at: Optional[str] = None
    num_rows: Optional[int] = None
    num_errors: Optional[int] = None
    error: Optional[str] = None  # why a shard failed
    num_duplicate_ids: Optional[int] = None  # its ids that another shard of this worker's run had too


class Manifest:
    def __init__(
        self, store: RunStore, config: dict[str, Any], worker: Worker, num_shards_total: int, shards: Sequence[Shard]
    ) -> None:
        self._store = store
        self.path = store.manifest_path(worker.rank, worker.world_size)
        self.shards = {s.name: ShardRecord(s.name, s.url) for s in shards}
        self._doc: dict[str, Any] = {
            "status": "running",  # running | completed | failed (some shard failed) | interrupted
            "started_at": utc_now(),
            "finished_at": None,
            "output_uri": store.url(store.root),
            "worker": {
                "rank": worker.rank,
                "world_size": worker.world_size,
                "source": worker.source,
                "device": worker.device,  # the GPU(s) this worker was given (CUDA_VISIBLE_DEVICES), else null
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
            },
            "num_shards_total": num_shards_total,  # in the input, all workers together
            "versions": package_versions(),
            "model": {"path": None, "fingerprint": None},  # filled once the engine loads
            "engine_settings": None,  # what the engine resolved at start-up (dtype, batch limits, KV blocks)
            "config": config,
            "commit_method": store.commit_method,  # how commit markers are made exclusive (store.py)
            "num_duplicate_ids": 0,  # ids that also appeared in another shard this worker ran
            "engine_stats": None,
            "throughput": None,  # results.run_throughput: this worker's rate over its run
            "message": None,
        }

    @property
    def url(self) -> str:
        return self._store.url(self.path)

    def set_engine(self, model_path: str, fingerprint: str, settings: EngineSettings) -> None:
        self._doc["model"] = {"path": model_path, "fingerprint": fingerprint}
        self._doc["engine_settings"] = settings.as_dict()

    def set_commit_method(self, method: str) -> None:
        self._doc["commit_method"] = method

    def add_duplicate_ids(self, shard: str, count: int) -> None:
        self._doc["num_duplicate_ids"] += count
        self.update(shard, num_duplicate_ids=count)

    def update(self, shard: str, **fields: Any) -> None:
        record = self.shards[shard]
        for key, value in fields.items():
            assert hasattr(record, key), key
            setattr(record, key, value)

    def add_shard(self, shard: Shard) -> None:
        """A shard taken over from another worker (work stealing)."""
        self.shards.setdefault(shard.name, ShardRecord(shard.name, shard.url))

    def finish(
        self, status: str, message: str, stats: Optional[EngineStats], throughput: Optional[dict[str, Any]] = None
    ) -> None:
        self._doc.update(
            status=status,
            finished_at=utc_now(),
            message=message,
            engine_stats=dataclasses.asdict(stats) if stats is not None else None,
            throughput=throughput,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**self._doc, "shards": [dataclasses.asdict(r) for r in self.shards.values()]}

    def write(self) -> None:
        self._store.write_json(self.path, self.to_dict())


# A shard's record in the run manifest comes from the worker whose record says the most.
STATUS_RANK = {
    "committed": 6,
    "skipped": 5,
    "quarantined": 4,
    "failed": 4,
    "interrupted": 3,
    "running": 2,
    "elsewhere": 1,
    "pending": 0,
}


def read_worker_manifests(store: RunStore) -> list[dict[str, Any]]:
    """Every worker's `_manifest.rank{r}.json`, by rank (a worker that never started has none)."""
    store.fs.invalidate_cache(store.root)
    docs = []
    for path in store.fs.glob(store.path("_manifest.rank*.json")):
        try:
            docs.append(json.loads(store.fs.cat_file(path)))
        except (FileNotFoundError, ValueError):  # being replaced right now; the next merge has it
            pass
    return sorted(docs, key=lambda d: d["worker"]["rank"])


def merge_manifests(store: RunStore, shards: Sequence[Shard], world_size: int) -> dict[str, Any]:
    """One manifest for the whole run from the workers' own and the commit markers (the truth).

    Workers never coordinate, so any of them (and the local launcher, after all of them) may write
    it; the content is a function of the files (write_merged_manifest says why the last one written
    has seen every worker's final state).
    """
    return _merge(store, shards, world_size, read_worker_manifests(store))


def _merge(store: RunStore, shards: Sequence[Shard], world_size: int, docs: list[dict[str, Any]]) -> dict[str, Any]:
    committed = store.committed_shards()
    records: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for record in doc.get("shards", []):
            best = records.get(record["name"])
            if best is None or STATUS_RANK.get(record["status"], 0) > STATUS_RANK.get(best["status"], 0):
                records[record["name"]] = {**record, "worker": doc["worker"]["rank"]}
    merged_shards = []
    for shard in shards:
        record = records.get(shard.name) or {**dataclasses.asdict(ShardRecord(shard.name, shard.url)), "worker": None}
        if shard.name in committed:
            marker = store.read_marker(shard.name) or {}
            record = {
                **record,
                "status": "committed",
                "started_at": marker.get("started_at"),
                "finished_at": marker.get("committed_at"),
                "num_rows": marker.get("num_rows"),
                "num_errors": (marker.get("metrics") or {}).get("num_errors"),
                "error": None,
                "worker": marker.get("worker"),
            }
        merged_shards.append(record)
    statuses = {r["status"] for r in merged_shards}
    worker_statuses = {d["status"] for d in docs}
    if statuses == {"committed"}:
        status = "completed"
    elif "failed" in statuses or "quarantined" in statuses:
        status = "failed"
    elif "running" in worker_statuses or len(docs) < world_size:
        status = "running"
    else:
        status = "interrupted"  # some shard neither committed nor failed: a rerun finishes it
    first = next((d for d in docs if d.get("model", {}).get("path")), docs[0] if docs else {})
    finished = [d["finished_at"] for d in docs if d.get("finished_at")]
    num_done = sum(r["status"] == "committed" for r in merged_shards)
    return {
        "status": status,
        "started_at": min((d["started_at"] for d in docs), default=None),
        "finished_at": max(finished) if status != "running" and finished else None,
        "output_uri": store.url(store.root),
        "worker": {"rank": None, "world_size": world_size, "source": "merged from _manifest.rank*.json"},
        "workers": [
            {
                **d["worker"],
                "status": d["status"],
                "started_at": d["started_at"],
                "finished_at": d["finished_at"],
                "message": d.get("message"),
                "engine_stats": d.get("engine_stats"),
                "throughput": d.get("throughput"),
            }
            for d in docs
        ],
        "num_shards_total": len(shards),
        "versions": first.get("versions"),
        "model": first.get("model"),
        "engine_settings": first.get("engine_settings"),
        "config": first.get("config"),
        "commit_method": first.get("commit_method"),
        "num_duplicate_ids": sum(d.get("num_duplicate_ids") or 0 for d in docs),
        "engine_stats": None,  # per worker, under workers
        "throughput": _merged_throughput(docs, status),
        "message": f"{num_done} of {len(shards)} shards committed",
        "shards": merged_shards,
    }


def _merged_throughput(docs: Sequence[dict[str, Any]], status: str) -> Optional[dict[str, Any]]:
    """The workers' tokens and engine time summed, over the run's wall time from the first start
    to the last finish (none while it runs)."""
    own = [d["throughput"] for d in docs if d.get("throughput")]
    if not own:
        return None
    finished = [d["finished_at"] for d in docs if d.get("finished_at")]
    wall = None
    if status != "running" and finished:
        start = min(dt.datetime.fromisoformat(d["started_at"]) for d in docs)
        wall = (max(dt.datetime.fromisoformat(f) for f in finished) - start).total_seconds()
    engine_s = sum(t.get("engine_s") or 0.0 for t in own)
    return run_throughput(sum(t.get("num_output_tokens") or 0 for t in own), wall, engine_s or None)


# Rounds of write_merged_manifest's merge, write and re-read: each further round needs a worker to
# have started or finished during the previous one, so this bounds only a store gone wrong.
MAX_MERGE_ROUNDS = 20


def write_merged_manifest(store: RunStore, shards: Sequence[Shard], world_size: int) -> dict[str, Any]:
    """Merge and write `_manifest.json`, the merged document returned.

    Writers hold no lock, so a merge read while some worker was still running may be written after
    that worker has written its own final merge, replacing the run's final state with "running".
    Hence, after writing, the workers' manifests are read again; when a worker started or finished
    in between (its _worker_key changed), the merge is redone and written again. Every worker
    writes its final manifest before it merges, so one that finishes after that last re-read
    merges, and writes, after this writer: the last `_manifest.json` written has seen every
    worker's final manifest (a worker killed before it could merge leaves its own saying running).
    """
    path = store.path("_manifest.json")
    docs = read_worker_manifests(store)
    for _ in range(MAX_MERGE_ROUNDS):
        doc = _merge(store, shards, world_size, docs)
        store.write_json(path, doc)
        seen, docs = docs, read_worker_manifests(store)
        if _worker_keys(docs) == _worker_keys(seen):
            return doc
    log.warning("the run manifest kept changing while it was merged; the next worker to finish merges it again")
    return doc


def _worker_keys(docs: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What changes in a worker's manifest when it starts or finishes (not after each shard: a
    running worker merges again itself when it finishes)."""
    return [
        (d["worker"]["rank"], d["worker"].get("hostname"), d["worker"].get("pid"))
        + (d.get("started_at"), d.get("status"), d.get("finished_at"))
        for d in docs
    ]
