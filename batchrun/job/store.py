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
- Create-if-absent is a hard link of a complete temp file on local filesystems (atomic, and a
  reader never sees a half-written marker), `If-None-Match: *` on S3 (s3fs `mode="create"`), and a
  lock within the process for memory://. Other stores get check-then-put, which two racing
  committers can both pass: `commit_method` says which one a run used, and the manifest records it.

Every path is built from shard names (shards.py makes them safe) and checked to stay inside
`output.uri`: a hostile name cannot address anything outside its own files.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from batchrun.job.shards import is_safe_name, open_filesystem
from batchrun.utils.redact import redact

log = logging.getLogger(__name__)

T = TypeVar("T")

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
_MEMORY_LOCK = threading.Lock()  # memory:// lives in one process: a lock makes create exclusive

# Errors that say something about the request, not about the store's health: never retried.
_PERMANENT = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    ValueError,
    TypeError,
    KeyError,
)


def with_retries(action: Callable[[], T], what: str, attempts: int = 4, base_delay_s: float = 0.5) -> T:
    """Run `action`, retrying transient storage errors (timeouts, connection resets, 5xx: any
    OSError but the permanent ones) with jittered exponential backoff; the last error is raised."""
    for attempt in range(attempts):
        try:
            return action()
        except _PERMANENT:
            raise
        except (OSError, TimeoutError, ConnectionError) as e:
            if attempt == attempts - 1:
                raise
            delay = base_delay_s * (2**attempt) * (0.5 + random.random())
            log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(e).__name__, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Attempt:
    """One try at one shard: its id and its own file names."""

    shard: str
    attempt_id: str
    directory: str
    results_tmp: str
    metrics_tmp: str
    output_tmp: str  # OpenAI batch output lines (data.format=openai_batch only)
    errors_tmp: str  # OpenAI batch error lines (data.format=openai_batch only)


class RunStore:
    def __init__(self, uri: str, storage_options: Mapping[str, Any]) -> None:
        self.fs: fsspec.AbstractFileSystem
        self.fs, root = open_filesystem(uri, storage_options)
        self.root = root.rstrip("/") or root
        self.uri = uri
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.is_memory = isinstance(self.fs, MemoryFileSystem)
        # Object stores have no directories; a local filesystem needs them before a file goes in.
        self._needs_dirs = self.is_local

    # ---- paths ------------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        """A path inside the output directory. Every part must be one plain path component: a
        shard name that slipped through unsanitized cannot climb out of (or wipe) the root."""
        for part in parts:
            if not part or part in (".", "..") or "/" in part or "\\" in part or "\0" in part:
                raise ValueError(f"refusing output path component {part!r} (under {self.uri})")
        out = posixpath.normpath(posixpath.join(self.root, *parts)) if parts else self.root
        assert out == self.root or out.startswith(self.root.rstrip("/") + "/"), (out, self.root)
        return out

    def url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

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

    @property
    def commit_method(self) -> str:
        """How the marker is created: the guarantee it gives is in the module docstring."""
        if self.is_local:
            return "link (exclusive)"
        if self.is_memory:
            return "in-process lock (exclusive)"
        if _supports_conditional_put(self.fs):
            return "if-none-match (exclusive)"
        return "check-then-put (NOT exclusive: two racing committers may both publish)"

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
            posixpath.join(directory, "output.jsonl"),
            posixpath.join(directory, "errors.jsonl"),
        )

    def commit(self, attempt: Attempt, marker: Mapping[str, Any], files: Sequence[str] = DEFAULT_FILES) -> bool:
        """Create the shard's marker naming this attempt and its `files` (PUBLISHED_FILES keys),
        then publish those files.

        False, with this attempt's files discarded, when another attempt's marker was there first:
        that commit stands and this attempt's work is redundant.
        """
        doc = {
            **marker,
            "protocol": MARKER_PROTOCOL,
            "attempt": attempt.attempt_id,
            "attempt_dir": posixpath.relpath(attempt.directory, self.root),
            "files": list(files),
        }
        assert all(name in PUBLISHED_FILES for name in files), files
        if not self.create_json(self.marker_path(attempt.shard), doc):
            self.abandon(attempt)
            return False
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
            return self.fs.exists(self.results_path(shard))
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
            return self.fs.exists(final)
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
            return self.fs.exists(final)
        return True

    def abandon(self, attempt: Attempt) -> None:
        """Remove this attempt's own files; they were never visible."""
        self._remove_tree(attempt.directory)

    # ---- files --------------------------------------------------------------------------------

    def create_json(self, path: str, obj: Any) -> bool:
        """Create `path` holding `obj` if and only if it does not exist; True when we created it.
        The file appears complete or not at all (see commit_method for what 'only if' rests on)."""
        data = _encode(obj)
        if self.is_local:
            os.makedirs(posixpath.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # fails if `path` exists, whoever made it
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        if self.is_memory:
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, data)
                return True
        if _supports_conditional_put(self.fs):
            try:
                with_retries(lambda: self.fs.pipe_file(path, data, mode="create"), f"creating {self.url(path)}")
                return True
            except (FileExistsError, OSError) as e:
                if not _is_precondition_failure(e):
                    raise
                # A retried PUT whose first try did land answers 412 too: the bytes tell whose it is.
                try:
                    return bool(self.fs.cat_file(path) == data)
                except FileNotFoundError:
                    return False
        self.fs.invalidate_cache(posixpath.dirname(path))
        if self.fs.exists(path):
            return False
        with_retries(lambda: self.fs.pipe_file(path, data), f"writing {self.url(path)}")
        return True

    def sync_files(self, paths: Sequence[str]) -> None:
        """Make written files durable before a marker names them: on local disks fsync each file
        and then each directory holding them (a power loss must not leave a marker naming a short
        or missing file); an object store's PUT is durable once it returns."""
        if not self.is_local:
            return
        directories = []
        for path in paths:
            _fsync_path(path)
            if posixpath.dirname(path) not in directories:
                directories.append(posixpath.dirname(path))
        for directory in directories:
            _fsync_path(directory)

    def write_json(self, path: str, obj: Any) -> None:
        """Replace `path` whole: a reader sees the old or the new content, never a mix."""
        data = _encode(obj)
        if not self._needs_dirs:
            # an object store publishes a PUT only once it is complete
            with_retries(lambda: self.fs.pipe_file(path, data), f"writing {self.url(path)}")
            return
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def read_json(self, path: str) -> Optional[Any]:
        self.fs.invalidate_cache(posixpath.dirname(path))
        try:
            return json.loads(with_retries(lambda: self.fs.cat_file(path), f"reading {self.url(path)}"))
        except (FileNotFoundError, ValueError):
            return None

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


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _encode(obj: Any) -> bytes:
    """Every JSON document the store writes (markers, plan, manifests, claims) passes here, so none
    can carry a credential from a URL or a storage option (utils/redact.py). create_json's read-back
    compares bytes from this same function."""
    plain = json.loads(json.dumps(obj, default=str))  # what default=str makes of odd values gets redacted too
    return json.dumps(redact(plain), indent=2, sort_keys=False).encode()


def _supports_conditional_put(fs: fsspec.AbstractFileSystem) -> bool:
    """s3fs sends If-None-Match for pipe_file(mode="create"); fsspec's generic pipe_file only
    checks, then writes, which is no exclusion at all."""
    return type(fs).__module__.split(".")[0] == "s3fs"


def _is_precondition_failure(error: BaseException) -> bool:
    if isinstance(error, FileExistsError):
        return True
    text = f"{error} {error.__cause__ or ''} {error.__context__ or ''}"
    return "PreconditionFailed" in text or "412" in text or "ConditionalRequestConflict" in text


def committed_files(store: RunStore, kind: str = "results") -> dict[str, str]:
    """shard -> path of its committed `kind` file ("results", "metrics", and for OpenAI batch
    runs "outputs" or "errors"), from the markers alone: what a reader should use to see exactly the
    committed results, also while workers are running. Read-only: a shard whose publication is
    pending is read from the attempt its marker names."""
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
            store.fs.invalidate_cache(posixpath.dirname(path))
            path = pending if store.fs.exists(pending) else path
        out[shard] = path
    return out
