"""One output directory on any fsspec filesystem: paths that cannot leave it, JSON documents
created if absent or replaced whole, and storage errors retried when they are transient.

Create-if-absent is a hard link of a complete temp file on local filesystems (atomic, and a reader
never sees a half-written document), `If-None-Match: *` on S3 (s3fs `mode="create"`), and a lock
within the process for memory://. Other stores get check-then-put, which two racing creators can
both pass: `commit_method` says which one a run uses, and `verify_exclusive` proves, once at run
start, that an object store's create really excludes. The commit protocol (store.py), claims and
the fence are built on it.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import posixpath
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from batchrun.job.errors import ConfigError, JobError
from batchrun.job.shards import open_filesystem
from batchrun.utils.redact import redact

log = logging.getLogger(__name__)

T = TypeVar("T")

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


RETRY_BASE_DELAY_S = 0.5  # with_retries' first backoff (tests shorten it)


def with_retries(action: Callable[[], T], what: str, attempts: int = 4, base_delay_s: Optional[float] = None) -> T:
    """Run `action`, retrying transient storage errors (timeouts, connection resets, 5xx, and 409
    ConditionalRequestConflict: a concurrent conditional write is in flight; any OSError but the
    permanent ones and a failed precondition) with jittered exponential backoff; the last error is
    raised."""
    base_delay_s = RETRY_BASE_DELAY_S if base_delay_s is None else base_delay_s
    for attempt in range(attempts):
        try:
            return action()
        except _PERMANENT:
            raise
        except (OSError, TimeoutError, ConnectionError) as e:
            if attempt == attempts - 1 or _is_precondition_failure(e):
                raise
            delay = base_delay_s * (2**attempt) * (0.5 + random.random())
            log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(e).__name__, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


class OutputDirectory:
    """`uri` opened once: where its files are, and how they are created, replaced and read."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any]) -> None:
        self.fs: fsspec.AbstractFileSystem
        self.fs, root = open_filesystem(uri, storage_options)
        self.root = root.rstrip("/") or root
        self.uri = uri
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.is_memory = isinstance(self.fs, MemoryFileSystem)
        # Object stores have no directories; a local filesystem needs them before a file goes in.
        self._needs_dirs = self.is_local
        self._conditional_put = _supports_conditional_put(self.fs)  # False too once a probe disproves it

    # ---- paths --------------------------------------------------------------------------------

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
        return str(self.fs.unstrip_protocol(path))

    # ---- exclusive create ---------------------------------------------------------------------

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

    def verify_exclusive(self, allow_non_exclusive: bool) -> str:
        """Prove, once at run start, that this store's create-if-absent is exclusive, and return the
        commit method text for the log and the manifest. An object store is probed: one object
        created twice under `_probe/`, the second create must be refused. Without that (an s3fs
        or botocore that drops `mode="create"` silently, a store that ignores If-None-Match, a store
        with no conditional create at all) the run is refused with a ConfigError naming
        output.allow_non_exclusive, unless it is set: then creates fall back to check-then-put and
        the returned text says NOT exclusive."""
        if self.is_local or self.is_memory:
            return self.commit_method
        try:
            problem = self._exclusive_create_problem()
        except Exception as e:
            raise JobError(f"output.uri: cannot write to {self.uri}: {describe_error(e)}") from None
        if problem is None:
            return self.commit_method
        if not allow_non_exclusive:
            raise ConfigError(
                "output.allow_non_exclusive",
                f"{self.uri} has no exclusive create ({problem}): two racing committers could both publish; "
                "set output.allow_non_exclusive=true to run anyway",
            )
        self._conditional_put = False  # a create that does not exclude: at least look first
        log.warning("output %s: commits are NOT exclusive (%s); output.allow_non_exclusive=true", self.uri, problem)
        return f"check-then-put (NOT exclusive: {problem}; two racing committers may both publish)"

    def _exclusive_create_problem(self) -> Optional[str]:
        """None when a second conditional create of one object is refused, else why it is not."""
        if not self._conditional_put:
            if type(self.fs).__module__.split(".")[0] == "s3fs":
                return "this s3fs has no pipe_file(mode='create'): it needs s3fs>=2024.12 and botocore>1.35.20"
            return f"{type(self.fs).__name__} has no conditional create"
        path = self.path("_probe", f"{uuid.uuid4().hex}.json")
        create = self.fs.pipe_file
        try:
            try:
                with_retries(lambda: create(path, b"{}", mode="create"), f"probing {self.url(path)}")
            except TypeError:
                return "this filesystem's pipe_file takes no mode='create'"
            try:
                with_retries(lambda: create(path, b"{}", mode="create"), f"probing {self.url(path)}")
            except (FileExistsError, OSError) as e:
                if _is_precondition_failure(e):
                    return None
                raise
            return "a second create of one object was accepted: the store or botocore ignores If-None-Match"
        finally:
            try:
                self.fs.rm(path)
            except Exception:
                log.warning("could not remove the probe %s", self.url(path), exc_info=True)

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
                try:
                    os.link(tmp, path)  # fails if `path` exists, whoever made it
                except FileExistsError:
                    # NFSv3 retransmits a LINK whose reply was lost, and the retry answers EEXIST
                    # although the first one linked: our private temp file then has a second name.
                    return os.stat(tmp).st_nlink >= 2
                return True
            finally:
                try:
                    os.unlink(tmp)
                except OSError:  # the link (or its refusal) stands; a leftover temp name is harmless
                    log.warning("could not remove %s", tmp, exc_info=True)
        if self.is_memory:
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, data)
                return True
        if self._conditional_put:
            try:
                with_retries(lambda: self.fs.pipe_file(path, data, mode="create"), f"creating {self.url(path)}")
                return True
            except (FileExistsError, OSError) as e:
                if not _is_precondition_failure(e):
                    raise
                # A retried PUT whose first try did land answers 412 too: the bytes tell whose it is.
                try:
                    return bool(with_retries(lambda: self.fs.cat_file(path), f"reading {self.url(path)}") == data)
                except FileNotFoundError:
                    return False
        self.fs.invalidate_cache(posixpath.dirname(path))
        if self.fs.exists(path):
            return False
        with_retries(lambda: self.fs.pipe_file(path, data), f"writing {self.url(path)}")
        return True

    def sync_files(self, paths: Sequence[str]) -> None:
        """Make written files durable before a marker names them: on local disks fsync each file
        and then each directory holding them; an object store's PUT is durable once it returns."""
        if not self.is_local:
            return
        for path in paths:
            fsync_file(path)
        for directory in dict.fromkeys(posixpath.dirname(p) for p in paths):
            fsync_dir(directory)

    def write_json(self, path: str, obj: Any) -> None:
        """Replace `path` whole: a reader sees the old or the new content, never a mix."""
        self.write_bytes(path, _encode(obj))

    def write_bytes(self, path: str, data: bytes) -> None:
        """Replace `path` whole with `data` (write_json's atomic replace, for files that are not JSON)."""
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


def _encode(obj: Any) -> bytes:
    """Every JSON document the store writes (markers, plan, manifests, claims) passes here, so none
    can carry a credential from a URL or a storage option (utils/redact.py). create_json's read-back
    compares bytes from this same function."""
    plain = json.loads(json.dumps(obj, default=str))  # what default=str makes of odd values gets redacted too
    return json.dumps(redact(plain), indent=2, sort_keys=False).encode()


def _supports_conditional_put(fs: fsspec.AbstractFileSystem) -> bool:
    """s3fs from 2024.12 sends If-None-Match for pipe_file(mode="create") (an older one passes `mode`
    on as an unknown keyword that botocore drops); fsspec's generic pipe_file only checks, then
    writes, which is no exclusion at all. Whether the store honours the header is only known by
    trying (RunStore.verify_exclusive)."""
    if type(fs).__module__.split(".")[0] != "s3fs":
        return False
    try:
        return "mode" in inspect.signature(type(fs)._pipe_file).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _is_precondition_failure(error: BaseException) -> bool:
    """The store refused a conditional request because its condition did not hold: HTTP 412, by
    the error's code anywhere on the exception chain, never by its text (a key or request id may
    hold "412"). A 409 ConditionalRequestConflict is not one: the write it raced is still in flight,
    so it is retried and the outcome read back."""
    for e in _exception_chain(error):
        if isinstance(e, FileExistsError):
            return True
        response = getattr(e, "response", None)  # botocore's ClientError
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return True
    return False


def _exception_chain(error: BaseException) -> list[BaseException]:
    """`error` and its causes and contexts, each once."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [error]
    while todo and len(seen) < 32:
        e = todo.pop()
        if any(e is s for s in seen):
            continue
        seen.append(e)
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return seen


def describe_error(error: Optional[BaseException]) -> str:
    return "exists" if error is None else f"{type(error).__name__}: {' '.join(str(error).split())}"


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make the names in directory `path` durable; a filesystem that cannot sync a directory
    (EINVAL, ENOTSUP) orders its metadata by other means."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)
