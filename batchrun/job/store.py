"""The output directory's layout and its exactly-once commit protocol.

    {output.uri}/results/{shard}.parquet    one per input shard, rows in input order
    {output.uri}/metrics/{shard}.parquet    one row per shard
    {output.uri}/_commits/{shard}.json      the commit marker: the only proof a shard is done
    {output.uri}/_manifest.json             this run (one per worker when world_size > 1)
    {output.uri}/_tmp/{shard}/...           files being written; never read by anyone
    {output.uri}/_claims/{shard}/...        who is working on a shard (claims.py); advisory only

Protocol, the same on every filesystem: write both files under _tmp, move them to their final
names, then write the marker. A shard is committed if and only if its marker exists. A crash before
the marker leaves at worst complete-but-uncommitted files at the final names, which the rerun
overwrites; nothing partial is ever at a final name, because local moves are renames and object
stores publish an object only once it is complete. Reruns skip shards with a marker.
"""
from __future__ import annotations

import json
import posixpath
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem

from batchrun.job.shards import open_filesystem


@dataclass(frozen=True)
class Attempt:
    """Temporary file names for one try at one shard."""

    shard: str
    results_tmp: str
    metrics_tmp: str


class RunStore:
    def __init__(self, uri: str, storage_options: Mapping[str, Any]) -> None:
        self.fs: fsspec.AbstractFileSystem
        self.fs, root = open_filesystem(uri, storage_options)
        self.root = root.rstrip("/") or root
        self.uri = uri
        # Object stores have no directories; a local filesystem needs them before a file goes in.
        self._needs_dirs = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def results_path(self, shard: str) -> str:
        return self.path("results", f"{shard}.parquet")

    def metrics_path(self, shard: str) -> str:
        return self.path("metrics", f"{shard}.parquet")

    def marker_path(self, shard: str) -> str:
        return self.path("_commits", f"{shard}.json")

    def manifest_path(self, rank: int, world_size: int) -> str:
        return self.path("_manifest.json" if world_size == 1 else f"_manifest.rank{rank}.json")

    def committed_shards(self) -> set[str]:
        """Names of shards with a commit marker (one listing, not one request per shard)."""
        commits = self.path("_commits")
        self.fs.invalidate_cache(commits)  # another process may have committed since we last looked
        try:
            names = self.fs.ls(commits, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return set()
        return {posixpath.basename(n)[: -len(".json")] for n in names if n.endswith(".json")}

    def read_marker(self, shard: str) -> Optional[dict[str, Any]]:
        try:
            return json.loads(self.fs.cat_file(self.marker_path(shard)))
        except (FileNotFoundError, ValueError):
            return None

    def begin(self, shard: str) -> Attempt:
        """Fresh temp names for `shard`, after removing what an earlier, abandoned try left."""
        tmp_dir = self.path("_tmp", shard)
        self._remove_tree(tmp_dir)
        token = uuid.uuid4().hex[:12]
        if self._needs_dirs:
            for d in (tmp_dir, self.path("results"), self.path("metrics"), self.path("_commits")):
                self.fs.makedirs(d, exist_ok=True)
        return Attempt(shard, posixpath.join(tmp_dir, f"{token}.results.parquet"),
                       posixpath.join(tmp_dir, f"{token}.metrics.parquet"))

    def commit(self, attempt: Attempt, marker: Mapping[str, Any]) -> bool:
        """Publish an attempt's files, then its marker; from the marker on, the shard is done.

        False, with the attempt discarded, when another worker committed the shard first (two
        workers can end up processing one shard: see claims.py); the first marker stands.
        """
        self.fs.invalidate_cache(self.path("_commits"))
        if self.fs.exists(self.marker_path(attempt.shard)):
            self.abandon(attempt)
            return False
        self.fs.mv(attempt.results_tmp, self.results_path(attempt.shard))
        self.fs.mv(attempt.metrics_tmp, self.metrics_path(attempt.shard))
        self.write_json(self.marker_path(attempt.shard), marker)
        self._remove_tree(self.path("_tmp", attempt.shard))
        return True

    def abandon(self, attempt: Attempt) -> None:
        """Remove what an attempt wrote; it was never visible, this only tidies up."""
        self._remove_tree(self.path("_tmp", attempt.shard))

    def write_json(self, path: str, obj: Any) -> None:
        """Replace `path` whole: a reader sees the old or the new content, never a mix."""
        data = json.dumps(obj, indent=2, sort_keys=False, default=str).encode()
        if not self._needs_dirs:
            self.fs.pipe_file(path, data)  # an object store publishes a PUT only once it is complete
            return
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def cleanup(self) -> None:
        """Drop the _tmp directory once it is empty (other workers may still be using it)."""
        if self._needs_dirs:
            try:
                self.fs.rmdir(self.path("_tmp"))
            except OSError:
                pass

    def _remove_tree(self, path: str) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
