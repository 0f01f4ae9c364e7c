"""Shard claims: who is working on which shard, so that idle workers steal unstarted shards and a
dead worker's shards are redone, while the commit marker stays the only proof that a shard is done.

    {output.uri}/_claims/{shard}/{generation:06d}.json
        {"owner", "host", "pid", "state": running | released | failed, "claimed_at", "heartbeat_at"}

A worker claims a shard before it starts it by creating the next generation file if-absent: 0 for
a shard nobody has claimed, g + 1 to take over generation g. The highest generation is the current
claim. A claim may be taken over when its state is `released` (its owner stopped or abandoned it),
when its owner ran on this host and its pid is gone (a crash or SIGKILL: taken at once), or when
its heartbeat is older than `lease_s` (an owner on another host that died or hangs). Owners refresh
`heartbeat_at` from a background thread every lease_s / 4.

Create-if-absent is atomic on local filesystems (os.open with O_CREAT | O_EXCL): exactly one
contender gets each generation. Object stores have no portable conditional PUT through fsspec, so
there a claim is written after an existence check and read back; two workers racing within that
window may both process a shard. That costs time, never correctness: before publishing anything a
committer checks for the shard's marker and discards its attempt when another worker committed
first (RunStore.commit), so a shard is committed once even when it was processed twice.
"""
from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence

from fsspec.implementations.local import LocalFileSystem

from batchrun.job.shards import Shard
from batchrun.job.store import RunStore

log = logging.getLogger("batchrun.job")

RUNNING, RELEASED, FAILED = "running", "released", "failed"


class ClaimBook:
    """This worker's view of `_claims/`: claim, heartbeat, release."""

    def __init__(self, store: RunStore, lease_s: float) -> None:
        assert lease_s > 0
        self.store, self.fs, self.lease_s = store, store.fs, lease_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.owner = f"{self.host}:{self.pid}:{uuid.uuid4().hex[:8]}"
        self._is_local = isinstance(self.fs, LocalFileSystem)
        self._held: dict[str, str] = {}  # shard -> path of our generation file
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- claiming ---------------------------------------------------------------------------

    def try_claim(self, shard: str) -> bool:
        """Claim `shard` unless a live claim by another worker exists; True when it is ours now."""
        generation, current = self._current(shard)
        if current is not None and not self._is_stale(current):
            return current.get("owner") == self.owner
        path = self._path(shard, generation + 1 if current is not None else 0)
        if not self._create(path, self._doc(RUNNING)):
            return False
        with self._lock:
            self._held[shard] = path
        return True

    def holder(self, shard: str) -> Optional[str]:
        """The owner of the live claim on `shard`, or None."""
        _, current = self._current(shard)
        return current.get("owner") if current is not None and not self._is_stale(current) else None

    def release(self, shard: str, state: str = RELEASED) -> None:
        """Give a claim up: `released` lets anyone take it now; `failed` keeps others off it until
        the lease runs out or this process is gone (a rerun on this host retries it at once)."""
        with self._lock:
            path = self._held.pop(shard, None)
        if path is not None:
            self._write(path, self._doc(state))

    def drop(self, shard: str) -> None:
        """Remove a committed shard's claim files: the marker is what counts from now on."""
        with self._lock:
            self._held.pop(shard, None)
        try:
            self.fs.rm(self.store.path("_claims", shard), recursive=True)
        except (FileNotFoundError, OSError):
            pass

    # ---- heartbeat --------------------------------------------------------------------------

    def __enter__(self) -> "ClaimBook":
        self._thread = threading.Thread(target=self._beat, name="batchrun-claims", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for shard in list(self._held):
            self.release(shard)
        if self._is_local:
            try:
                self.fs.rmdir(self.store.path("_claims"))  # only when empty: others may hold claims
            except OSError:
                pass

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            with self._lock:
                held = list(self._held.values())
            for path in held:
                try:
                    self._write(path, self._doc(RUNNING))
                except Exception:  # a missed beat only shortens the lease; the next one retries
                    log.debug("claim heartbeat failed for %s", path, exc_info=True)

    # ---- files ------------------------------------------------------------------------------

    def _path(self, shard: str, generation: int) -> str:
        return self.store.path("_claims", shard, f"{generation:06d}.json")

    def _doc(self, state: str) -> dict[str, Any]:
        now = time.time()
        return {"owner": self.owner, "host": self.host, "pid": self.pid, "state": state, "heartbeat_at": now}

    def _current(self, shard: str) -> tuple[int, Optional[dict[str, Any]]]:
        directory = self.store.path("_claims", shard)
        self.fs.invalidate_cache(directory)
        try:
            names = [posixpath.basename(p) for p in self.fs.ls(directory, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return -1, None
        generations = sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())
        if not generations:
            return -1, None
        try:
            doc = json.loads(self.fs.cat_file(self._path(shard, generations[-1])))
        except (FileNotFoundError, ValueError):  # being replaced right now: treat it as live
            doc = {"owner": None, "state": RUNNING, "heartbeat_at": time.time()}
        return generations[-1], doc

    def _is_stale(self, claim: dict[str, Any]) -> bool:
        if claim.get("owner") == self.owner:
            return False
        if claim.get("state") == RELEASED:
            return True
        if claim.get("host") == self.host and isinstance(claim.get("pid"), int) and not _pid_alive(claim["pid"]):
            return True
        return time.time() - float(claim.get("heartbeat_at") or 0) > self.lease_s

    def _create(self, path: str, doc: dict[str, Any]) -> bool:
        data = json.dumps(doc).encode()
        if self._is_local:
            os.makedirs(posixpath.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        # Object store: check, write, read back (see the module docstring for the race it leaves).
        if self.fs.exists(path):
            return False
        self.fs.pipe_file(path, data)
        try:
            return json.loads(self.fs.cat_file(path)).get("owner") == self.owner
        except (FileNotFoundError, ValueError):
            return False

    def _write(self, path: str, doc: dict[str, Any]) -> None:
        self.store.write_json(path, doc)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    # A zombie (killed, not yet reaped by its parent) has done all it will do.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def steal_order(parts: Sequence[Sequence[Shard]], rank: int) -> list[Shard]:
    """Other workers' shards (`parts`: every worker's, by rank) in the order an idle worker `rank`
    should try them: each owner's last shard first (the one it would reach last), owners taken in
    turn starting after this worker."""
    world = len(parts)
    order: list[Shard] = []
    depth = max((len(p) for p in parts), default=0)
    for level in range(depth):
        for step in range(1, world):
            part = parts[(rank + step) % world]
            if level < len(part):
                order.append(part[len(part) - 1 - level])
    return order


def claimed_shards(own: Sequence[Shard], steal: Sequence[Shard], book: ClaimBook,
                   is_committed: Callable[[str], bool], on_skip: Callable[[Shard, str], None],
                   should_stop: Callable[[], bool], poll_s: float = 1.0) -> Iterator[Shard]:
    """Own shards, then others' shards, each yielded only once this worker holds its claim.

    A shard that got committed meanwhile is reported to `on_skip(shard, "skipped")`; one of ours
    that another worker holds, to `on_skip(shard, "elsewhere")`, and once all else is done this
    worker waits for those: until they are committed, or their claim goes stale (its owner died)
    and it takes them itself. So a worker ends with every one of its own shards committed or
    failed, whoever ran them. Stolen shards are not reported when someone else has them: they were
    never ours.
    """
    held_elsewhere: list[Shard] = []
    for is_own, shard in [*((True, s) for s in own), *((False, s) for s in steal)]:
        if should_stop():
            return
        if is_committed(shard.name):
            if is_own:
                on_skip(shard, "skipped")
            continue
        if not book.try_claim(shard.name):
            if is_own:
                on_skip(shard, "elsewhere")
                held_elsewhere.append(shard)
            continue
        if is_committed(shard.name):  # committed between the check and the claim
            book.drop(shard.name)
            if is_own:
                on_skip(shard, "skipped")
            continue
        yield shard
    while held_elsewhere and not should_stop():
        time.sleep(min(poll_s, book.lease_s / 4))
        waiting = []
        for shard in held_elsewhere:
            if is_committed(shard.name):
                on_skip(shard, "skipped")
            elif book.try_claim(shard.name):
                if is_committed(shard.name):
                    book.drop(shard.name)
                    on_skip(shard, "skipped")
                else:
                    yield shard
            else:
                waiting.append(shard)
        held_elsewhere = waiting
