"""Rows flow from one shard into the next through a single engine stream.

A worker does not drain the engine at a shard boundary: while a shard's last rows finish, the next
shard's rows are admitted, so the batch stays full across many small or uneven shards. Up to
`planner.max_open_shards` shards are open at once (each holds its claim, an input file and a
results file); rows in flight are bounded by the engine's `max_in_flight` and the planner's
window, which orders rows across the boundary too.

Each open shard is a ShardRun (shard_run.py), one attempt (store.py) that commits on its own as
soon as every one of its rows has its result row, in whatever order shards complete. A shard that
fails (unreadable part way, a storage error, a lost claim) is dropped alone: its rows still in the
engine run to the end and their outputs are discarded. A stop signal abandons every open shard
(nothing of them is committed); an exception from the engine itself fails the shards open at
that moment and the flow goes on with the next. The flow reports each shard to the ShardLedger
(ledger.py) as it opens and as it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Optional, TypeVar

from batchrun.engine import Engine, EngineRequest, RequestOutput, TensorParallelError
from batchrun.job.commit.checkpoints import PartLost
from batchrun.job.commit.claims import ShardQueue
from batchrun.job.commit.fence import FingerprintFence
from batchrun.job.errors import ConfigError, ShardError
from batchrun.job.formats.shard_format import ShardFormat
from batchrun.job.operate.progress import Progress
from batchrun.job.results import ShardSummary
from batchrun.job.run.ledger import ShardLedger
from batchrun.job.run.planner import plan_requests
from batchrun.job.run.shard_run import IN_FLIGHT_PER_SEQ, ShardContext, ShardRun
from batchrun.job.run.signals import StopRequest
from batchrun.job.shards import Shard

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["IN_FLIGHT_PER_SEQ", "ShardFlow", "ShardRun"]


class ShardFlow:
    """Runs the shards `queue` hands out through one engine stream, a bounded number at a time,
    reporting each to `ledger` as it opens and ends."""

    def __init__(
        self,
        context: ShardContext,
        format: ShardFormat,
        ledger: ShardLedger,
        fence: FingerprintFence,
        engine: Engine,
        progress: Progress,
        stop: StopRequest,
        queue: ShardQueue,
    ) -> None:
        self.context, self.format, self.ledger, self.fence = context, format, ledger, fence
        self.engine, self.progress, self.stop, self.queue = engine, progress, stop, queue
        self.config = context.config
        self.max_open_shards = self.config.planner.max_open_shards
        self.open: dict[int, ShardRun] = {}  # key -> open shard, in opening order
        self._held_back: Optional[Shard] = None  # claimed, to run alone once the open shards are done
        self._next_key = 0
        self._is_exhausted = False  # no shard left to open

    def run(self) -> None:
        try:
            self._run()
        # The run's fingerprint changed under it, or the engine's tensor-parallel group lost a rank:
        # nothing more is committed (the open shards' claims are released as the error unwinds).
        except (ConfigError, TensorParallelError):
            for run in list(self.open.values()):
                self._close(run, ShardSummary(run.shard.name, "interrupted"))
            raise

    def _run(self) -> None:
        block_size = self.context.block_size
        # Exhausted is rechecked once the engine drains: a claim lost meanwhile (_settle) puts
        # its shard back in the queue, which must be taken again or waited for, not left undone.
        while not (self._is_exhausted and self.queue.is_done) and not self.stop.requested:
            self._is_exhausted = False
            requests = plan_requests(self._requests(), self.config.planner, block_size)
            try:
                for out in self.engine.stream(requests, self.context.sampling, self.context.max_in_flight):
                    run = self.open.get(out.request_id[0])
                    if run is not None and run.failure is None:  # else: a dropped shard's row
                        self._deliver(run, out)
                    self._settle()
                    if self.stop.requested:
                        break
            except (ConfigError, TensorParallelError):
                raise
            except Exception as e:  # the engine itself: it cannot say whose row broke it
                log.exception("the engine failed with %d shard(s) open", len(self.open))
                for run in self.open.values():
                    run.failure = run.failure or ShardError(f"the engine failed: {type(e).__name__}: {e}")
            self._settle()
        for run in list(self.open.values()):  # stopped: what is finished becomes a part, the rest is dropped
            try:
                run.checkpoint_on_stop()
            except ConfigError:
                raise
            except Exception:  # the finished rows are recomputed; the committed parts stand
                log.warning("shard %s: could not commit its finished rows at the stop", run.shard.name, exc_info=True)
            parts = run.output.num_committed_parts + len(run.resume.parts)
            kept = f"{parts} committed part(s) kept, a rerun resumes after them" if parts else "nothing committed"
            log.warning("shard %s abandoned (%s): %s", run.shard.name, self.stop.name, kept)
            self._close(run, ShardSummary(run.shard.name, "interrupted"))

    def _requests(self) -> Iterator[Optional[EngineRequest]]:
        """Every open shard's rows in turn; None while the open shards' rows in flight must finish
        before another shard may open (see Engine.stream).

        Two shards wait for the others to drain: a shard whose earlier attempts died runs alone, so
        that a shard that kills its worker (OOM) does not take its neighbours' attempts with it
        toward quarantine; and another worker's shard is taken only while this engine's batch has
        empty slots (fewer rows in flight than max_num_seqs): stealing is for idle capacity, not
        look-ahead, so a worker that starts late still finds its own shards."""
        while True:
            self._settle()
            if self.stop.requested:
                return
            if len(self.open) >= self.max_open_shards or any(r.runs_alone for r in self.open.values()):
                yield None
                continue
            shard = self._held_back or self.queue.next_shard(
                wait=not self.open, steal=self._rows_in_flight() < self.context.max_num_seqs
            )
            self._held_back = None
            if shard is None:
                if self.queue.is_done or self.stop.requested or not self.open:
                    self._is_exhausted = True
                    return
                yield None  # own shards held elsewhere, or others' shards, are tried after this step
                continue
            if self.ledger.claims.died_before(shard.name) and self.open:
                self._held_back = shard  # claimed; opened once the shards open now are done
                yield None
                continue
            run = self._open(shard)
            if run is not None:
                yield from run.requests(self.stop)

    def _rows_in_flight(self) -> int:
        return sum(len(r.in_flight) for r in self.open.values())

    def _open(self, shard: Shard) -> Optional[ShardRun]:
        if not self.open:
            self.engine.reset_peak_stats()  # the KV peak of this shard and those opened before it closes
        if self.ledger.take_over(shard):
            self.progress.add_shards(1)
        started_at = self.ledger.start_shard(shard, self.context.fingerprint)
        try:
            run = ShardRun(
                self.context,
                self.format,
                self.ledger.claims,
                self.fence,
                shard,
                self._next_key,
                self.engine,
                self.progress,
                started_at,
            )
        except ConfigError:
            self._finish(shard, ShardSummary(shard.name, "interrupted"))
            raise
        except Exception as e:
            self._finish(shard, _failed(shard, e))
            return None
        self.open[self._next_key] = run
        self._next_key += 1
        return run

    def _deliver(self, run: ShardRun, out: RequestOutput) -> None:
        try:
            run.on_output(out)
        except Exception as e:  # writing its row failed (after retries): that shard alone fails
            run.failure = e

    def _settle(self) -> None:
        """Commit the complete shards and drop the failed and lost ones, in any order."""
        for run in list(self.open.values()):
            if run.failure is not None:
                self._close(run, _failed(run.shard, run.failure))
            elif run.is_lost:
                self._close(run, ShardSummary(run.shard.name, "lost"))
            elif run.is_complete:
                summary = self._guarded(run, run.commit)
                if summary is not None:
                    del self.open[run.key]
                    if summary.status == "committed":
                        self.ledger.record_commit(run.shard.name, run.tally.ttfts, run.seen_ids)
                    self._finish(run.shard, summary)
            else:
                self._guarded(run, run.checkpoint_if_due)

    def _guarded(self, run: ShardRun, action: Callable[[], T]) -> Optional[T]:
        """`action`'s result; None with `run` closed when it failed: a part index another attempt
        took makes the shard lost (it resumes elsewhere or later), any other error (a write that
        failed after retries) fails it, its committed parts kept. A changed run fingerprint
        (ConfigError) stops the whole flow."""
        try:
            return action()
        except ConfigError:
            raise
        except PartLost as e:
            log.warning("shard %s: %s", run.shard.name, e)
            self._close(run, ShardSummary(run.shard.name, "lost"))
        except Exception as e:
            self._close(run, _failed(run.shard, e))
        return None

    def _close(self, run: ShardRun, summary: ShardSummary) -> None:
        del self.open[run.key]
        try:
            run.abandon()
        except Exception:
            log.warning("shard %s: could not remove its attempt's files", run.shard.name, exc_info=True)
        self._finish(run.shard, summary)

    def _finish(self, shard: Shard, summary: ShardSummary) -> None:
        """A shard this flow opened is done with. A lost one (another worker took its claim over)
        is waited for: it is ours until it commits, and comes back through the queue if it does
        not; it counts in the progress once, when it ends for good."""
        if summary.status == "lost":
            self.queue.wait_for(shard)
        self.ledger.finish_shard(shard, summary)
        if summary.status != "lost":
            self.progress.shard_done()


def _failed(shard: Shard, error: BaseException) -> ShardSummary:
    """An expected failure (ShardError) logs its message; anything else its traceback too."""
    if isinstance(error, ShardError):
        log.error("shard %s failed: %s", shard.name, error)
        return ShardSummary(shard.name, "failed", error=str(error))
    log.error("shard %s failed unexpectedly", shard.name, exc_info=error)
    return ShardSummary(shard.name, "failed", error=f"{type(error).__name__}: {error}")
