"""The run manifest: what ran, with which config, code and model, and what happened to each shard.

It is rewritten after every shard (never appended to), so a killed run still leaves an accurate
record of what it committed. With several workers each writes its own (`_manifest.rank{r}.json`):
workers never coordinate, so no file has two writers.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.metadata
import os
import platform
import socket
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from batchrun.engine import EngineStats
from batchrun.job.shards import Shard, Worker
from batchrun.job.store import RunStore

PACKAGES = ("batchrun", "torch", "transformers", "pyarrow", "fsspec", "s3fs", "tokenizers")


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
    status: str = "pending"
    started_at: Optional[str] = None
    finished_at: Optional[str] = None
    num_rows: Optional[int] = None
    num_errors: Optional[int] = None
    error: Optional[str] = None  # why a shard failed


class Manifest:
    def __init__(self, store: RunStore, config: dict[str, Any], worker: Worker,
                 num_shards_total: int, shards: Sequence[Shard]) -> None:
        self._store = store
        self.path = store.manifest_path(worker.rank, worker.world_size)
        self.shards = {s.name: ShardRecord(s.name, s.url) for s in shards}
        self._doc: dict[str, Any] = {
            "status": "running",  # running | completed | failed (some shard failed) | interrupted
            "started_at": utc_now(),
            "finished_at": None,
            "output_uri": store.url(store.root),
            "worker": {"rank": worker.rank, "world_size": worker.world_size, "source": worker.source,
                       "hostname": socket.gethostname(), "pid": os.getpid()},
            "num_shards_total": num_shards_total,  # in the input, all workers together
            "versions": package_versions(),
            "model": {"path": None, "fingerprint": None},  # filled once the engine loads
            "engine_settings": None,  # what the engine resolved at start-up (dtype, batch limits, KV blocks)
            "config": config,
            "engine_stats": None,
            "message": None,
        }

    @property
    def url(self) -> str:
        return self._store.url(self.path)

    def set_engine(self, model_path: str, fingerprint: str, settings: dict[str, Any]) -> None:
        self._doc["model"] = {"path": model_path, "fingerprint": fingerprint}
        self._doc["engine_settings"] = settings

    def update(self, shard: str, **fields: Any) -> None:
        record = self.shards[shard]
        for key, value in fields.items():
            assert hasattr(record, key), key
            setattr(record, key, value)

    def finish(self, status: str, message: str, stats: Optional[EngineStats]) -> None:
        self._doc.update(status=status, finished_at=utc_now(), message=message,
                         engine_stats=dataclasses.asdict(stats) if stats is not None else None)

    def to_dict(self) -> dict[str, Any]:
        return {**self._doc, "shards": [dataclasses.asdict(r) for r in self.shards.values()]}

    def write(self) -> None:
        self._store.write_json(self.path, self.to_dict())
