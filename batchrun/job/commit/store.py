"""The output directory's layout and its exactly-once commit protocol.

    {output.uri}/results/{shard}.parquet          the committed attempt's results, rows in input order
    {output.uri}/metrics/{shard}.parquet          its metrics row
    {output.uri}/outputs/{shard}.jsonl            data.format=openai_batch: OpenAI batch output lines
    {output.uri}/errors/{shard}.jsonl             data.format=openai_batch: OpenAI batch error lines
    {output.uri}/_commits/{shard}.json            the commit marker: the only proof a shard is done
    {output.uri}/_attempts/{shard}/{attempt}/     one attempt's own files, never read by anyone else
    {output.uri}/_claims/{shard}/{gen}.json       who is working on a shard (claims.py); advisory
    {output.uri}/_plan.json                       the shard list, when work stealing is off
    {output.uri}/_manifest.json                   this run (one per worker when world_size > 1)

Protocol. Each attempt at a shard writes its files under its own `_attempts/{shard}/{attempt}/`;
no attempt deletes or overwrites another's. The commit is ONE create-if-absent of the marker, which
names the attempt whose files are the result: exactly one attempt wins, however many workers ran
the shard (a frozen worker that wakes up after its lease, two workers racing on an object store).
The loser logs it and discards its own attempt. After winning, the winner publishes the files the
marker lists to `results/` and `metrics/` (and `outputs/`, `errors/` for OpenAI batch files; a
rename locally, a copy then delete on object stores); anyone who finds a marker whose files are not
published yet (the winner died in between) finishes the publication from the attempt the marker
names. So:

- A shard is committed if and only if its marker exists; a marker always names complete files.
- `results/*.parquet` only ever holds files of committed attempts, one per shard; during the short
  gap between marker and publication a committed shard's file may be missing there, never extra.
  `read_committed` (and so the notebook) reads through the markers and sees no such gap.
- The marker's create-if-absent is the output directory's (directory.py: a hard link locally,
  `If-None-Match: *` on S3, a lock for memory://, else check-then-put, which two racing committers
  can both pass): `commit_method` says which one a run used, and the manifest records it.

Every path is built from shard names (shards.py makes them safe) and checked to stay inside
`output.uri`: a hostile name cannot address anything outside its own files.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from batchrun.job.commit.directory import OutputDirectory, describe_error, fsync_dir, fsync_file, with_retries
from batchrun.job.errors import ShardError
from batchrun.job.shards import is_safe_name

log = logging.getLogger(__name__)

# An attempt's file name -> (published directory, suffix): {output.uri}/{directory}/{shard}{suffix}.
PUBLISHED_FILES: dict[str, tuple[str, str]] = {
    "results.parquet": ("results", ".parquet"),
    "metrics.parquet": ("metrics", ".parquet"),
    "output.jsonl": ("outputs", ".jsonl"),
    "errors.jsonl": ("errors", ".jsonl"),
}
# The files every commit has; a marker without a "files" list (older runs) has these.
DEFAULT_FILES = ("results.parquet", "metrics.parquet")
# committed_files' kinds -> the attempt file of that kind
_KIND_FILES = {directory: name for name, (directory, _) in PUBLISHED_FILES.items()}

MARKER_PROTOCOL = 2  # markers of this layout carry "protocol": 2 and name their attempt


class CommitUnclear(ShardError):
    """The marker's create failed in a way that leaves open whether it landed, and reading it back
    failed too. Nothing is deleted: the attempt stays, and whoever next finds a marker naming it
    (a rerun, a reader) publishes it; without such a marker the attempt is an unread leftover."""


@dataclass(frozen=True)
class Attempt:
    """One try at one shard: its id and its own file names."""

    shard: str
    attempt_id: str
    directory: str
    results_tmp: str
    metrics_tmp: str

    def file(self, name: str) -> str:
        """Where the attempt writes its file `name` (a PUBLISHED_FILES key)."""
        return posixpath.join(self.directory, name)


class RunStore(OutputDirectory):
    """The output directory of a run (its files and create-if-absent: OutputDirectory) and the
    commit protocol on it: where each shard's files go, its attempts, markers and publication."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any]) -> None:
        super().__init__(uri, storage_options)
        self._kept: set[str] = set()  # attempt directories an unclear commit may have named: never removed

    # ---- a shard's paths ----------------------------------------------------------------------

    def results_path(self, shard: str) -> str:
        return self.path("results", f"{_checked(shard)}.parquet")

    def metrics_path(self, shard: str) -> str:
        return self.path("metrics", f"{_checked(shard)}.parquet")

    def published_path(self, shard: str, file_name: str) -> str:
        """Where an attempt's `file_name` (a PUBLISHED_FILES key) is published for `shard`."""
        directory, suffix = PUBLISHED_FILES[file_name]
        return self.path(directory, f"{_checked(shard)}{suffix}")

    def marker_path(self, shard: str) -> str:
        return self.path("_commits", f"{_checked(shard)}.json")

    def manifest_path(self, rank: int, world_size: int) -> str:
        return self.path("_manifest.json" if world_size == 1 else f"_manifest.rank{rank}.json")

    # ---- commit markers -----------------------------------------------------------------------

    def committed_shards(self) -> set[str]:
        """Names of shards with a commit marker (one listing, not one request per shard)."""
        commits = self.path("_commits")
        self.fs.invalidate_cache(commits)  # another process may have committed since we last looked
        try:
            names = with_retries(lambda: self.fs.ls(commits, detail=False), f"listing {self.url(commits)}")
        except (FileNotFoundError, NotADirectoryError):
            return set()
        return {
            posixpath.basename(n)[: -len(".json")]
            for n in names
            if n.endswith(".json") and is_safe_name(posixpath.basename(n)[: -len(".json")])
        }

    def published_shards(self) -> set[str]:
        """Names of shards with a file in results/ (one listing)."""
        results = self.path("results")
        self.fs.invalidate_cache(results)
        try:
            names = with_retries(lambda: self.fs.ls(results, detail=False), f"listing {self.url(results)}")
        except (FileNotFoundError, NotADirectoryError):
            return set()
        return {posixpath.basename(n)[: -len(".parquet")] for n in names if n.endswith(".parquet")}

    def read_marker(self, shard: str) -> Optional[dict[str, Any]]:
        path = self.marker_path(shard)
        self.fs.invalidate_cache(posixpath.dirname(path))
        try:
            doc = json.loads(with_retries(lambda: self.fs.cat_file(path), f"reading {self.url(path)}"))
        except (FileNotFoundError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def remove_marker(self, shard: str) -> None:
        """Un-commit a shard (output.on_change=recompute, by the holder of its claim only)."""
        try:
            self.fs.rm(self.marker_path(shard))
        except FileNotFoundError:
            pass

    # ---- attempts -----------------------------------------------------------------------------

    def begin(self, shard: str) -> Attempt:
        """A fresh attempt with its own directory; nothing anyone else wrote is touched."""
        attempt_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}"
        directory = self.path("_attempts", _checked(shard), attempt_id)
        if self._needs_dirs:
            with_retries(lambda: self.fs.makedirs(directory, exist_ok=True), f"creating {directory}")
        return Attempt(
            shard,
            attempt_id,
            directory,
            posixpath.join(directory, "results.parquet"),
            posixpath.join(directory, "metrics.parquet"),
        )

    def commit(self, attempt: Attempt, marker: Mapping[str, Any], files: Sequence[str] = DEFAULT_FILES) -> bool:
        """Create the shard's marker naming this attempt and its `files` (PUBLISHED_FILES keys),
        then publish those files.

        False, with this attempt's files discarded, when another attempt's marker was there first:
        that commit stands and this attempt's work is redundant.

        The outcome is decided by reading the marker back whenever the create does not plainly
        succeed: a create can land and still fail on the way back (a lost reply whose retries then
        fail, a retransmitted NFS link answered EEXIST), and discarding the attempt then would leave
        a marker naming deleted files. Only an attempt that another marker names is discarded;
        when the marker cannot be read, or is absent after an error, CommitUnclear is raised and
        the attempt is kept (abandon() leaves it alone).
        """
        doc = {
            **marker,
            "protocol": MARKER_PROTOCOL,
            "attempt": attempt.attempt_id,
            "attempt_dir": posixpath.relpath(attempt.directory, self.root),
            "files": list(files),
        }
        assert all(name in PUBLISHED_FILES for name in files), files
        marker_path = self.marker_path(attempt.shard)
        if self.is_local:
            self._sync_before_marker(attempt, files)
        error: Optional[Exception] = None
        try:
            created = self.create_json(marker_path, doc)
        except Exception as e:
            created, error = False, e
        if not created and not self._marker_is_ours(attempt, error):
            self.abandon(attempt)
            return False
        if self.is_local:  # the marker's name, and _commits/ itself when it was just made
            fsync_dir(posixpath.dirname(marker_path))
            fsync_dir(self.root)
        try:
            self.publish(attempt.shard, doc)
        except Exception:  # committed all the same: whoever looks next finishes the publication
            log.warning(
                "shard %s: committed, but publishing its files failed; the next run publishes them",
                attempt.shard,
                exc_info=True,
            )
        return True

    def publish(self, shard: str, marker: Mapping[str, Any]) -> bool:
        """Make sure the marker's attempt files are at their published names (idempotent; anyone
        may call it for any committed shard). False when neither place has them (deleted by hand)."""
        attempt_dir = marker.get("attempt_dir")
        if not isinstance(attempt_dir, str):  # a marker of the earlier layout: files were moved first
            return bool(self.fs.exists(self.results_path(shard)))
        parts = attempt_dir.split("/")
        source_dir = self.path(*parts)
        complete = True
        # results/ last: published_shards() takes a shard's results file as proof that all of its
        # files are published, so a committer that dies part way is finished by the next run.
        for name in sorted(marker_files(marker), key=lambda name: name == "results.parquet"):
            complete &= self._move_if_needed(posixpath.join(source_dir, name), self.published_path(shard, name))
        if complete:
            self._remove_tree(source_dir)
        return complete

    def _move_if_needed(self, source: str, final: str) -> bool:
        """Move `source` to `final` unless it was moved already. A concurrent mover may take the
        source between our looks, so a missing source means: look at `final` once more."""
        if not self.fs.exists(source):
            self.fs.invalidate_cache(posixpath.dirname(final))
            return bool(self.fs.exists(final))
        if self._needs_dirs:
            self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
        try:
            if self.is_local:
                os.replace(source, final)  # atomic: the file is always at one of the two names
            else:
                with_retries(lambda: self.fs.copy(source, final), f"publishing {self.url(final)}")
                self.fs.rm(source)
        except FileNotFoundError:
            self.fs.invalidate_cache(posixpath.dirname(final))
            return bool(self.fs.exists(final))
        return True

    def _marker_is_ours(self, attempt: Attempt, error: Optional[Exception]) -> bool:
        """After a create that did not plainly succeed (`error`, or None when it answered "exists"):
        does the marker name this attempt? CommitUnclear when that cannot be known."""
        path = self.marker_path(attempt.shard)
        return self.is_own_create(path, "attempt", attempt.attempt_id, error, keep=attempt.directory)

    def create_owned(self, path: str, doc: Mapping[str, Any], key: str = "attempt") -> bool:
        """create_json, decided by reading back when the create did not plainly succeed: True when
        `path` now holds a document whose `key` is `doc[key]` (ours), False when another's."""
        try:
            if self.create_json(path, doc):
                return True
            error: Optional[Exception] = None
        except Exception as e:
            error = e
        return self.is_own_create(path, key, doc[key], error)

    def is_own_create(
        self, path: str, key: str, value: Any, error: Optional[Exception], keep: Optional[str] = None
    ) -> bool:
        """Whether the document at `path` (just created by someone, maybe us) has `key` == `value`.
        `error`: how our create failed (None: it answered "exists"). CommitUnclear when that cannot
        be known: the document cannot be read, or is absent after an error (a request still in
        flight may yet land); `keep` (a directory it may name) is then never removed by abandon()."""
        url = self.url(path)
        self.fs.invalidate_cache(posixpath.dirname(path))
        try:
            raw = with_retries(lambda: self.fs.cat_file(path), f"reading {url}")
        except FileNotFoundError:
            raw = None
        except Exception as e:
            if keep is not None:
                self._kept.add(keep)
            raise CommitUnclear(
                f"creating {url} failed ({describe_error(error or e)}) and it cannot be read back ({describe_error(e)})"
                + (f"; the attempt is kept at {self.url(keep)}" if keep else "")
            ) from (error or e)
        if raw is not None:
            try:
                existing = json.loads(raw)
            except ValueError:
                existing = None
            ours = isinstance(existing, dict) and existing.get(key) == value
            if ours and error is not None:
                log.warning("%s: the create said %s, yet it is ours", url, describe_error(error))
            return ours
        if error is None:  # it existed a moment ago and was removed since (recompute): never ours
            return False
        if keep is not None:
            self._kept.add(keep)
        raise CommitUnclear(
            f"creating {url} failed ({describe_error(error)}) and nothing is there yet"
            + (f"; the attempt is kept at {self.url(keep)}" if keep else "")
        ) from error

    def _sync_before_marker(self, attempt: Attempt, files: Sequence[str]) -> None:
        """Make the files the marker will name durable first, with the directory entries leading to
        them (attempt, shard, _attempts, root): a power loss must not leave a marker naming a short
        or missing file."""
        for name in files:
            fsync_file(posixpath.join(attempt.directory, name))
        directory = attempt.directory
        while directory != self.root and directory.startswith(self.root):
            fsync_dir(directory)
            directory = posixpath.dirname(directory)
        fsync_dir(self.root)

    def abandon(self, attempt: Attempt) -> None:
        """Remove this attempt's own files; they were never visible. Not those of an attempt whose
        commit is unclear (CommitUnclear): a marker naming it may exist or yet appear."""
        if attempt.directory in self._kept:
            log.warning("shard %s: keeping attempt %s (its commit is unclear)", attempt.shard, attempt.attempt_id)
            return
        self._remove_tree(attempt.directory)

    # ---- working directories ------------------------------------------------------------------

    def cleanup(self) -> None:
        """Drop the working directories once they are empty (other workers may still use them)."""
        if self._needs_dirs:
            for name in ("_attempts", "_tmp"):
                try:
                    for shard_dir in self.fs.ls(self.path(name), detail=False):
                        try:
                            os.rmdir(shard_dir)
                        except OSError:
                            pass
                    os.rmdir(self.path(name))
                except (OSError, FileNotFoundError):
                    pass

    def _remove_tree(self, path: str) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        if self._needs_dirs:  # the shard's and then the run's attempts directory, once empty
            try:
                os.rmdir(posixpath.dirname(path))
                os.rmdir(posixpath.dirname(posixpath.dirname(path)))
            except OSError:
                pass


def marker_files(marker: Mapping[str, Any]) -> list[str]:
    """The attempt files a commit marker publishes (only names this module knows: a marker is data)."""
    files = marker.get("files")
    if not isinstance(files, list):
        return list(DEFAULT_FILES)
    return [name for name in files if name in PUBLISHED_FILES]


def checked_name(shard: str) -> str:
    """`shard`, when it is a name shards.py could have made; ValueError otherwise."""
    return _checked(shard)


def _checked(shard: str) -> str:
    if not is_safe_name(shard):
        raise ValueError(f"unsafe shard name {shard!r}")
    return shard


def committed_files(store: RunStore, kind: str = "results") -> dict[str, str]:
    """shard -> path of its committed `kind` file ("results", "metrics", and for OpenAI batch
    runs "outputs" or "errors"), from the markers alone: what a reader should use to see exactly the
    committed results, also while workers are running. Read-only: a shard whose publication is
    pending is read from the attempt its marker names. A publication that moves the file after the
    last look (a moment's window) makes the returned pending path vanish: a reader that gets
    FileNotFoundError for it calls again and finds the published file."""
    assert kind in _KIND_FILES, kind
    name = _KIND_FILES[kind]
    out = {}
    for shard in sorted(store.committed_shards()):
        marker = store.read_marker(shard)
        if marker is None or name not in marker_files(marker):
            continue
        path = store.published_path(shard, name)
        attempt_dir = marker.get("attempt_dir")
        if isinstance(attempt_dir, str) and not store.fs.exists(path):
            pending = posixpath.join(store.path(*attempt_dir.split("/")), name)
            store.fs.invalidate_cache(posixpath.dirname(pending))
            if store.fs.exists(pending):
                # published between the two looks? then the pending name is about to vanish
                store.fs.invalidate_cache(posixpath.dirname(path))
                path = path if store.fs.exists(path) else pending
        out[shard] = path
    return out
