"""Shard claims: who is working on which shard, so that idle workers steal unstarted shards and a
dead worker's shards are redone, while the commit marker stays the only proof that a shard is done.

    {output.uri}/_claims/{shard}/{generation:06d}.json
        {"owner", "host", "boot_id", "pid_ns", "pid", "pid_start", "state", "died_attempts"}
        state: running | released | failed | quarantined

A worker claims a shard before it starts it by creating the next generation file if-absent: 0 for
a shard nobody has claimed, g + 1 to take over generation g. The highest generation is the current
claim, and exactly one contender gets each generation: create-if-absent is the same exclusive
operation as the commit marker's (RunStore.create_json: a hard link locally, If-None-Match on S3).

A claim may be taken over when
- its state is `released` (its owner stopped gracefully or gave it up);
- its owner is provably dead: it ran in this kernel (same boot id) and this pid namespace, and its
  pid is gone or now belongs to a process started at another time (pid reuse). Hostnames prove
  nothing: containers share them;
- or its lease ran out: the claim file was not rewritten for `lease_s` by the STORE's clock. Owners
  rewrite it every lease_s / 4; its age is the store's modification time against the store's
  current time, which each worker estimates by writing a probe file (`_claims/.clock/`). No two
  hosts' clocks are ever compared. A claim file that does not parse as a claim (a crash leftover,
  a foreign writer: ours are always written whole) is judged by its age alone, as a running claim;
- or it is the taker's own, and the taker no longer holds it: its heartbeat found it lost (see
  below) and let it go. Nobody else would take it before its lease ran out, and its owner would
  wait for itself; it takes it again at the next generation, which counts no died attempt.

Taking over a claim whose owner did not release it counts one died attempt; when a shard's died
attempts reach `max_attempts` (launcher.max_shard_attempts) the taker writes a `quarantined` claim
instead of running it, and every worker reports the shard as failed from then on: a shard that
kills its worker (OOM) does not go on to kill every worker in turn.

The owner's heartbeat also watches for a newer generation: a frozen owner (SIGSTOP, a long GC or
swap storm) that wakes up after a takeover finds its claim lost and stops that shard; if it had
finished first, the commit marker is already someone else's and its attempt is discarded.
Heartbeat failures are logged as warnings; an owner that cannot renew its claim for a whole lease
counts it lost too (someone else may rightly have taken it).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

from batchrun.job.commit.store import RunStore, checked_name
from batchrun.job.shards import Shard

log = logging.getLogger(__name__)

RUNNING, RELEASED, FAILED, QUARANTINED = "running", "released", "failed", "quarantined"
# try_claim's answers
CLAIMED, HELD = "claimed", "held"

# Owners of the claim books not yet closed in this process. A claim written by this very process
# whose book is closed belongs to a run that has ended (run_job called again in one process, after
# a shard failed): its owner is provably gone, like a dead pid's.
_OPEN_OWNERS: set[str] = set()


class ClaimBook:
    """This worker's view of `_claims/`: claim, heartbeat, release."""

    def __init__(self, store: RunStore, lease_s: float, max_attempts: int = 3) -> None:
        assert lease_s > 0 and max_attempts >= 1
        self.store, self.fs, self.lease_s, self.max_attempts = store, store.fs, lease_s, max_attempts
        self.identity = process_identity()
        self.owner = f"{self.identity['host']}:{self.identity['pid']}:{uuid.uuid4().hex[:8]}"
        _OPEN_OWNERS.add(self.owner)
        self._held: dict[str, tuple[int, str]] = {}  # shard -> (generation, path) of our claim
        self._died: dict[str, int] = {}  # shard -> died attempts before ours
        self._last_renewed: dict[str, float] = {}  # shard -> time.monotonic() of the last good beat
        self._lost: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._clock_offset_s = 0.0  # store time minus local time
        self._clock_path = store.path("_claims", ".clock", f"{uuid.uuid4().hex}.json")

    # ---- claiming ---------------------------------------------------------------------------

    def try_claim(self, shard: str) -> str:
        """CLAIMED when `shard` is ours now; HELD when another worker has a live claim on it;
        QUARANTINED when its attempts died max_attempts times."""
        generation, current, mtime = self._current(shard)
        if current is None:
            return self._create(shard, 0, RUNNING, 0)
        died = _died_attempts(current)
        if current.get("state") == QUARANTINED:  # whoever wrote it, ourselves included
            if died >= self.max_attempts:
                return QUARANTINED
            return self._create(shard, generation + 1, RUNNING, died)  # the limit was raised
        if current.get("owner") == self.owner:
            with self._lock:
                if shard in self._held and shard not in self._lost:
                    return CLAIMED
            # Our own claim that we no longer hold: the heartbeat found it lost (the store was out of
            # reach for a lease, or a listing hid its newest generation) and it was let go. Nobody
            # else will take it before its lease runs out, and we would wait for ourselves forever:
            # it is ours to take again at the next generation. No attempt of ours died on it.
            log.info("shard %s: taking back this worker's own lost claim", shard)
            return self._create(shard, generation + 1, RUNNING, died)
        if not self._is_stale(current, mtime):
            return HELD
        if current.get("state") == RUNNING:  # not released: its owner died or froze on it
            died += 1
            log.warning(
                "shard %s: taking over the claim of %s, which %s (died attempts: %d of %d)",
                shard,
                "an unreadable claim file" if current.get("unreadable") else current.get("owner"),
                "is dead" if self._is_dead(current) else "let its lease run out",
                died,
                self.max_attempts,
            )
        if died >= self.max_attempts:
            self._create(shard, generation + 1, QUARANTINED, died)
            return QUARANTINED
        return self._create(shard, generation + 1, RUNNING, died)

    def holder(self, shard: str) -> Optional[str]:
        """The owner of the live claim on `shard`, or None."""
        _, current, mtime = self._current(shard)
        return current.get("owner") if current is not None and not self._is_stale(current, mtime) else None

    def died_attempts(self, shard: str) -> int:
        _, current, _ = self._current(shard)
        return _died_attempts(current or {})

    def died_before(self, shard: str) -> int:
        """Attempts at `shard` that died (their worker killed or frozen) before our claim."""
        with self._lock:
            return self._died.get(shard, 0)

    def is_lost(self, shard: str) -> bool:
        """True once the heartbeat found our claim taken over or could not renew it for a lease."""
        with self._lock:
            return shard in self._lost

    def release(self, shard: str, state: str = RELEASED) -> None:
        """Give a claim up: `released` lets anyone take it now; `failed` keeps others off it until
        the lease runs out or this process is gone (a rerun on this host retries it at once)."""
        with self._lock:
            held = self._held.pop(shard, None)
            lost = shard in self._lost
            self._lost.discard(shard)
        if held is not None and not lost:
            try:
                self.store.write_json(held[1], self._doc(state, self._died.get(shard, 0)))
            except Exception:  # the lease runs out by itself
                log.warning("shard %s: could not release its claim", shard, exc_info=True)

    def drop(self, shard: str) -> None:
        """Remove a committed shard's claim files: the marker is what counts from now on."""
        with self._lock:
            self._held.pop(shard, None)
            self._lost.discard(shard)
        try:
            self.fs.rm(self.store.path("_claims", checked_name(shard)), recursive=True)
        except (FileNotFoundError, OSError):
            pass

    # ---- heartbeat --------------------------------------------------------------------------

    def __enter__(self) -> ClaimBook:
        self._stop.clear()
        try:
            self._measure_clock()
        except Exception:
            log.warning("could not read the output store's clock; claim ages use this host's clock", exc_info=True)
        self._thread = threading.Thread(target=self._beat, name="batchrun-claims", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for shard in list(self._held):
            self.release(shard)
        _OPEN_OWNERS.discard(self.owner)
        try:
            self.fs.rm(self._clock_path)
        except (FileNotFoundError, OSError):
            pass
        if self.store.is_local:
            for directory in (posixpath.dirname(self._clock_path), self.store.path("_claims")):
                try:
                    os.rmdir(directory)  # only when empty: others may hold claims
                except OSError:
                    pass

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            self.renew()

    def renew(self) -> None:
        """One heartbeat: rewrite every claim we hold, or find it lost."""
        with self._lock:
            held = [(s, g, p) for s, (g, p) in self._held.items() if s not in self._lost]
        for shard, generation, path in held:
            try:
                newest, _, _ = self._current(shard)
                if newest != generation:  # taken over, or dropped by whoever committed the shard
                    self._mark_lost(shard, "another worker took it over (this worker's lease had run out)")
                    continue
                self.store.write_json(path, self._doc(RUNNING, self._died.get(shard, 0)))
                self._last_renewed[shard] = time.monotonic()
            except Exception as e:
                age = time.monotonic() - self._last_renewed.get(shard, time.monotonic())
                log.warning(
                    "shard %s: claim heartbeat failed (%s: %s), last renewed %.0f s ago",
                    shard,
                    type(e).__name__,
                    e,
                    age,
                )
                if age > self.lease_s:
                    self._mark_lost(shard, f"its claim could not be renewed for {age:.0f} s")
        try:
            self._measure_clock()
        except Exception as e:
            log.warning("could not read the output store's clock (%s: %s)", type(e).__name__, e)

    def _mark_lost(self, shard: str, why: str) -> None:
        log.warning("shard %s: claim lost: %s; this worker stops it", shard, why)
        with self._lock:
            self._lost.add(shard)

    # ---- files ------------------------------------------------------------------------------

    def _path(self, shard: str, generation: int) -> str:
        return self.store.path("_claims", checked_name(shard), f"{generation:06d}.json")

    def _doc(self, state: str, died: int) -> dict[str, Any]:
        return {
            "owner": self.owner,
            **self.identity,
            "state": state,
            "died_attempts": died,
            "written_at": time.time(),
        }  # written_at: for people reading the file; never compared

    def _create(self, shard: str, generation: int, state: str, died: int) -> str:
        path = self._path(shard, generation)
        if not self.store.create_json(path, self._doc(state, died)):
            return HELD  # another contender got this generation first
        if state == QUARANTINED:
            log.error(
                "shard %s: quarantined: %d attempts at it died; set launcher.max_shard_attempts higher "
                "or delete %s to try it again",
                shard,
                died,
                self.store.url(self.store.path("_claims", checked_name(shard))),
            )
            return QUARANTINED
        with self._lock:
            self._held[shard] = (generation, path)
            self._died[shard] = died
            self._lost.discard(shard)
        self._last_renewed[shard] = time.monotonic()
        return CLAIMED

    def _current(self, shard: str) -> tuple[int, Optional[dict[str, Any]], Optional[float]]:
        """(generation, claim document, store modification time) of the newest claim file."""
        directory = self.store.path("_claims", checked_name(shard))
        self.fs.invalidate_cache(directory)
        try:
            entries = self.fs.ls(directory, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return -1, None, None
        files = {}
        for entry in entries:
            name = posixpath.basename(entry["name"])
            if name.endswith(".json") and name[:-5].isdigit():
                files[int(name[:-5])] = entry
        if not files:
            return -1, None, None
        generation = max(files)
        try:
            doc = json.loads(self.fs.cat_file(self._path(shard, generation)))
        except FileNotFoundError:  # listed, then gone: the shard was committed and its claims dropped
            return generation, {"owner": None, "state": RUNNING}, None
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            # Claim files are written whole (a hard link or rename locally, one PUT on S3), so an
            # unparseable one is a crash leftover or a foreign writer's. Read as a running claim of
            # nobody, it is judged by its age alone: live for a lease (it may be mid-write), then
            # taken over as a died attempt, keeping the count of the generation before it.
            doc = {
                "owner": None,
                "state": RUNNING,
                "died_attempts": self._died_before_generation(shard, files, generation),
                "unreadable": True,
            }
        return generation, doc, store_mtime(files[generation])

    def _died_before_generation(self, shard: str, files: dict[int, Any], generation: int) -> int:
        """The died attempts of the newest readable claim older than `generation`: an unreadable
        claim must not reset the count that quarantines a shard which kills its workers."""
        for older in sorted((g for g in files if g < generation), reverse=True):
            try:
                doc = json.loads(self.fs.cat_file(self._path(shard, older)))
            except (FileNotFoundError, ValueError):
                continue
            if isinstance(doc, dict):
                return _died_attempts(doc)
        return 0

    def _measure_clock(self) -> None:
        """Estimate the store's clock: write a probe file and read its modification time."""
        before = time.time()
        self.store.write_json(self._clock_path, {"owner": self.owner})
        after = time.time()
        mtime = store_mtime(self.fs.info(self._clock_path))
        if mtime is not None:
            self._clock_offset_s = mtime - (before + after) / 2

    def _is_stale(self, claim: dict[str, Any], mtime: Optional[float]) -> bool:
        if claim.get("owner") == self.owner:
            return False
        if claim.get("state") == RELEASED or self._is_dead(claim):
            return True
        if mtime is None:  # being rewritten right now, or a store without modification times
            return False
        return time.time() + self._clock_offset_s - mtime > self.lease_s

    def _is_dead(self, claim: dict[str, Any]) -> bool:
        """Provably dead: same kernel and pid namespace, and its pid is gone or reused, or it is this
        process and the claim book that wrote it is closed."""
        me = self.identity
        if not me["boot_id"] or claim.get("boot_id") != me["boot_id"] or claim.get("pid_ns") != me["pid_ns"]:
            return False
        pid = claim.get("pid")
        if not isinstance(pid, int):
            return False
        if pid == me["pid"] and claim.get("pid_start") == me["pid_start"]:  # this process
            return claim.get("owner") not in _OPEN_OWNERS
        start = process_start_time(pid)
        return start is None or (claim.get("pid_start") is not None and start != claim["pid_start"])


def _died_attempts(claim: dict[str, Any]) -> int:
    """A claim's died_attempts; anything but a count (a foreign writer's file) counts none."""
    died = claim.get("died_attempts")
    return died if isinstance(died, int) and not isinstance(died, bool) and died > 0 else 0


def store_mtime(info: dict[str, Any]) -> Optional[float]:
    """A file's modification time by the store's clock (POSIX seconds) from fsspec's info()."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, dt.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def process_identity() -> dict[str, Any]:
    """What proves a claim's owner dead without a lease: kernel boot, pid namespace, pid, start."""

    def read(path: str) -> Optional[str]:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    try:
        pid_ns: Optional[str] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot_id": read("/proc/sys/kernel/random/boot_id"),
        "pid_ns": pid_ns,
        "pid": pid,
        "pid_start": process_start_time(pid),
    }


def process_start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot, or None when no such live process
    exists (a zombie, killed but not yet reaped, has done all it will do)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


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


class ShardQueue:
    """Own shards, then others' shards, each yielded only once this worker holds its claim.

    `on_skip(shard, status)` hears about own shards this worker does not run: "skipped" (committed
    meanwhile), "elsewhere" (another worker holds it) or "quarantined". Once all else is done the
    worker waits for its own shards held elsewhere: until they are committed, or their claim goes
    stale (its owner died) and it takes them itself. So a worker ends with every one of its own
    shards committed, failed or quarantined, whoever ran them. Stolen shards are not reported when
    someone else has them: they were never ours. `wait_for(shard)` puts a shard whose claim this
    worker lost back on the waiting list: taken again if nobody took it meanwhile (a store out of
    reach for a lease loses claims nobody else wanted), else waited for when it is our own; a
    stolen one someone else holds now is theirs to finish.
    """

    def __init__(
        self,
        own: Sequence[Shard],
        steal: Sequence[Shard],
        book: ClaimBook,
        is_committed: Callable[[str], bool],
        on_skip: Callable[[Shard, str], None],
        should_stop: Callable[[], bool],
        poll_s: float = 1.0,
        on_error: Optional[Callable[[Shard, BaseException], None]] = None,
    ) -> None:
        self.own, self.steal, self.book = list(own), list(steal), book
        self.is_committed, self.on_skip, self.should_stop, self.poll_s = is_committed, on_skip, should_stop, poll_s
        self.on_error = on_error
        self._own_names = {s.name for s in own}
        self._order = [*self.own, *self.steal]  # tried once each, in this order
        self._next = 0  # index into _order of the next shard to try
        self._waiting: list[Shard] = []  # own shards another worker holds: polled until done
        self._next_poll = 0.0  # time.monotonic() before which the waiting list is not polled

    def wait_for(self, shard: Shard) -> None:
        self._add_waiting(shard)

    def _add_waiting(self, shard: Shard) -> None:
        # A claim just found held is not worth reading again before one poll interval.
        self._waiting.append(shard)
        self._next_poll = time.monotonic() + self._poll_interval

    @property
    def _poll_interval(self) -> float:
        return min(self.poll_s, self.book.lease_s / 4)

    @property
    def is_done(self) -> bool:
        """Nothing left to try: every shard was handed out, skipped, or is done elsewhere."""
        return self._next >= len(self._order) and (not self._waiting or self.should_stop())

    def __iter__(self) -> Iterator[Shard]:
        while (shard := self.next_shard(wait=True)) is not None:
            yield shard

    def next_shard(self, wait: bool, steal: bool = True) -> Optional[Shard]:
        """The next shard this worker now holds the claim of, or None. Own and stealable shards are
        tried in order first; then the own shards held elsewhere are polled every `poll_s`. With
        `wait`, it sleeps between those polls until it takes one or nothing is left (`is_done`);
        without, it polls at most once per `poll_s` and returns None at once otherwise (the caller
        has other work: shards in flight). Without `steal`, another worker's shard is not tried yet
        (it stays next in line): the caller is not idle enough to take others' work."""
        while self._next < len(self._order):
            if self.should_stop():
                return None
            shard = self._order[self._next]
            if not steal and shard.name not in self._own_names:
                break
            self._next += 1
            if self._take(shard):
                return shard
        while self._waiting and not self.should_stop():
            pause = self._next_poll - time.monotonic()
            if pause > 0:
                if not wait:
                    return None
                time.sleep(pause)
            self._next_poll = time.monotonic() + self._poll_interval
            waiting, self._waiting = self._waiting, []
            for i, shard in enumerate(waiting):
                if self._take(shard, report_held=False):
                    self._waiting.extend(waiting[i + 1 :])
                    return shard
            if not wait:
                return None
        return None

    def _take(self, shard: Shard, report_held: bool = True) -> bool:
        """Claim `shard` if it is to be run here. An error (a storage failure that outlasted its
        retries, a name the store refuses) fails that shard only, through `on_error`."""
        try:
            return self._try_take(shard, report_held)
        except Exception as e:
            if self.on_error is None:
                raise
            self.on_error(shard, e)
            return False

    def _try_take(self, shard: Shard, report_held: bool) -> bool:
        is_own = shard.name in self._own_names
        if self.is_committed(shard.name):
            if is_own:
                self.on_skip(shard, "skipped")
            return False
        answer = self.book.try_claim(shard.name)
        if answer == QUARANTINED:
            if is_own:
                self.on_skip(shard, QUARANTINED)
            return False
        if answer == HELD:
            if is_own:
                if report_held:
                    self.on_skip(shard, "elsewhere")
                self._add_waiting(shard)
            return False
        if self.is_committed(shard.name):  # committed between the check and the claim
            self.book.drop(shard.name)
            if is_own:
                self.on_skip(shard, "skipped")
            return False
        return True
