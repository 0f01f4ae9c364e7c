"""A worker's record of its shards while it runs: the manifest, each shard's summary, its claims,
and the run-wide tallies (time to first token, ids seen in more than one shard).

The flow (flow.py) reports here as shards open and end; the queue (claims.ShardQueue) asks here
whether a shard is committed and reports the shards it skips. The ledger decides nothing about
rows: it keeps the books, and writes the manifest as they change (quietly: the commit markers
are the record that counts).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any, Optional

from batchrun.job.commit.checkpoints import remove_parts
from batchrun.job.commit.claims import FAILED, QUARANTINED, RELEASED, ClaimBook
from batchrun.job.commit.fingerprint import fingerprint_changes, input_fingerprint
from batchrun.job.commit.manifest import Manifest, utc_now
from batchrun.job.commit.store import RunStore
from batchrun.job.config import RunConfig
from batchrun.job.operate.metrics import percentile
from batchrun.job.results import RunResult, ShardSummary
from batchrun.job.run.plan import WorkerPlan
from batchrun.job.run.signals import StopRequest
from batchrun.job.shards import Shard
from batchrun.utils.redact import redact

log = logging.getLogger(__name__)

# A run's summaries are counted by these, in this order (RunResult.message).
_COUNTED = ("committed", "skipped", "failed", "quarantined", "interrupted", "pending", "elsewhere")


def _id_hash(key: Any) -> int:
    """8 bytes per id for the run-wide duplicate count, whatever the id's size."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


class ShardLedger:
    """The books of one worker's run, from its plan: the manifest, summaries and claims."""

    def __init__(self, config: RunConfig, store: RunStore, plan: WorkerPlan) -> None:
        self.store, self.plan = store, plan
        self.shards = list(plan.shards)  # own, and those taken over from other workers
        self.todo = list(plan.todo)  # gains the shards committed with another model (recompute)
        self.stale = set(plan.stale)  # loses those another recompute launch redid meanwhile
        self.manifest = Manifest(store, redact(config.to_dict()), plan.worker, len(plan.all_shards), self.shards)
        self.claims = ClaimBook(store, config.launcher.claim_lease_s, config.launcher.max_shard_attempts)
        self.summaries: dict[str, ShardSummary] = {s.name: ShardSummary(s.name, "pending") for s in self.shards}
        self.ttfts: list[float] = []  # of the rows generated in this run
        self.run_ids: set[int] = set()  # id hashes of the shards committed by this worker in this run
        for shard in plan.skipped:
            self.record_skipped(shard, plan.markers.get(shard.name), publish=shard.name in plan.unpublished)

    # ---- before the flow ----------------------------------------------------------------------

    def record_skipped(self, shard: Shard, marker: Optional[Mapping[str, Any]] = None, publish: bool = False) -> None:
        """A shard committed before (by an earlier run or another worker). `publish`: its results
        file is missing, so its committer died between marker and publication: finish that."""
        marker = marker if marker is not None else (self.store.read_marker(shard.name) or {})
        if publish and marker:
            try:
                if not self.store.publish(shard.name, marker):
                    log.error("shard %s: committed, but its files are missing from %s", shard.name, self.store.uri)
                remove_parts(self.store, shard.name)  # its committer died before removing them
            except Exception:
                log.warning("shard %s: could not publish its committed files", shard.name, exc_info=True)
        metrics = marker.get("metrics")
        self.manifest.update(
            shard.name,
            status="skipped",
            started_at=marker.get("started_at"),
            finished_at=marker.get("committed_at"),
            num_rows=marker.get("num_rows"),
            num_errors=(metrics or {}).get("num_errors"),
        )
        self.summaries[shard.name] = ShardSummary(shard.name, "skipped", metrics)

    def recompute(self, names: list[str]) -> None:
        """Committed shards found stale once the model loaded (plan.model_changes): run them again."""
        for name in names:
            self.stale.add(name)
            self.todo.append(next(s for s in self.shards if s.name == name))
            self.summaries[name] = ShardSummary(name, "pending")
            self.manifest.update(name, status="pending")

    def shard_states(self) -> dict[str, int]:
        """This worker's shards by manifest status (the metrics textfile's batchrun_shards)."""
        states: dict[str, int] = {}
        for record in self.manifest.shards.values():
            states[record.status] = states.get(record.status, 0) + 1
        return states

    def write_manifest_quietly(self) -> None:
        try:
            self.manifest.write()
        except Exception:  # progress bookkeeping only; the markers are the record that counts
            log.warning("could not write %s", self.manifest.url, exc_info=True)

    # ---- the queue's questions and reports ----------------------------------------------------

    def is_committed(self, shard: str, current: Mapping[str, Any]) -> bool:
        """A marker exists that is this run's to keep: `current` is the run's fingerprint
        ({"settings", "model"}) a stale shard's marker must match to count as redone."""
        marker = self.store.read_marker(shard)
        if marker is None:
            return False
        if shard in self.stale:  # committed under other settings: ours to redo, unless redone meanwhile
            if not self._is_current(marker, shard, current):
                return False
            self.stale.discard(shard)  # another recompute launch committed it with these settings
        return True

    def skip_claimed(self, shard: Shard, status: str) -> None:
        """One of our shards that another worker committed ("skipped"), is working on ("elsewhere"),
        or that is quarantined."""
        if status == "skipped":
            self.record_skipped(shard)
        elif status == QUARANTINED:
            error = (
                f"quarantined: {self.claims.max_attempts} attempts at it died (launcher.max_shard_attempts); "
                f"delete {self.store.url(self.store.path('_claims', shard.name))} to retry it"
            )
            self.manifest.update(shard.name, status=QUARANTINED, error=error)
            self.summaries[shard.name] = ShardSummary(shard.name, QUARANTINED, error=error)
        else:
            self.manifest.update(shard.name, status="elsewhere")
            self.summaries[shard.name] = ShardSummary(shard.name, "elsewhere")
        self.write_manifest_quietly()

    def claim_failed(self, shard: Shard, error: BaseException) -> None:
        """Claiming or checking a shard failed (after retries): that shard fails, the worker goes on."""
        message = f"{type(error).__name__}: {' '.join(str(error).split())}"
        log.error("shard %s failed: cannot claim it: %s", shard.name, message)
        if shard.name in self.summaries or shard in self.shards:
            self.manifest.update(shard.name, status="failed", error=message)
            self.summaries[shard.name] = ShardSummary(shard.name, "failed", error=message)

    # ---- the flow's reports -------------------------------------------------------------------

    def take_over(self, shard: Shard) -> bool:
        """True when `shard` is another worker's, now this one's to run (work stealing)."""
        if shard.name in self.summaries:
            return False
        log.info("shard %s: taken over from another worker", shard.name)
        self.shards.append(shard)
        self.manifest.add_shard(shard)
        return True

    def start_shard(self, shard: Shard, current: Mapping[str, Any]) -> str:
        """A shard opens: report it running, and un-commit it when it is stale (under our claim);
        returns its start time."""
        started_at = utc_now()
        self.manifest.update(shard.name, status="running", started_at=started_at)
        self.write_manifest_quietly()
        if shard.name in self.stale:  # output.on_change=recompute: un-commit it, under our claim
            marker = self.store.read_marker(shard.name)
            # Read again: a marker another recompute launch committed since is current, not stale.
            if marker is not None and not self._is_current(marker, shard.name, current):
                self.store.remove_marker(shard.name)
        return started_at

    def record_commit(self, shard: str, ttfts: list[float], id_keys: set[Any]) -> None:
        """A shard this worker committed: its rows' first-token times, and the count of its ids
        that earlier shards of this worker's run had too."""
        self.ttfts.extend(ttfts)
        hashes = {_id_hash(k) for k in id_keys}
        repeated = len(hashes & self.run_ids)
        self.run_ids |= hashes
        if repeated:
            log.warning("shard %s: %d id(s) also appear in another shard of this run", shard, repeated)
            self.manifest.add_duplicate_ids(shard, repeated)

    def finish_shard(self, shard: Shard, summary: ShardSummary) -> None:
        """A shard the flow opened is done with: committed, failed, lost or interrupted. A lost one
        (another worker holds it now) is recorded "elsewhere" and its claim let go."""
        m = summary.metrics or {}
        self.manifest.update(
            shard.name,
            status=summary.status if summary.status != "lost" else "elsewhere",
            finished_at=utc_now(),
            error=summary.error,
            num_rows=m.get("num_rows"),
            num_errors=m.get("num_errors"),
        )
        if summary.status == "committed":
            log.info(
                "shard %s committed: %d rows, %d errors, %.1f output tok/s over its own open time",
                shard.name,
                m["num_rows"],
                m["num_errors"],
                m["output_tokens_per_s"],
            )
        if summary.status == "lost":
            summary = ShardSummary(shard.name, "elsewhere")
            self.claims.release(shard.name)
        elif summary.status in ("committed", "skipped"):
            self.claims.drop(shard.name)
        else:
            self.claims.release(shard.name, FAILED if summary.status == "failed" else RELEASED)
        self.summaries[shard.name] = summary
        self.write_manifest_quietly()

    # ---- the end ------------------------------------------------------------------------------

    def result(self, stop: StopRequest, num_output_tokens: int, wall_s: float, engine_s: Optional[float]) -> RunResult:
        summaries = [self.summaries[s.name] for s in self.shards]
        count = {status: sum(s.status == status for s in summaries) for status in _COUNTED}
        done = f"{count['committed']} committed, {count['skipped']} already done"
        if count["elsewhere"]:
            done += f", {count['elsewhere']} being done by other workers"
        # A signal that arrives after the last commit changes nothing: the run is complete.
        if stop.requested and (count["interrupted"] or count["pending"] or count["elsewhere"]):
            exit_code, status = stop.exit_code, "interrupted"
            message = (
                f"interrupted by {stop.name}: {done}, {count['interrupted']} abandoned, "
                f"{count['pending']} not started; rerun the same command to resume"
            )
        elif count["failed"] or count["quarantined"]:
            failed = [s.name for s in summaries if s.status in ("failed", "quarantined")]
            exit_code, status = 1, "failed"
            quarantined = f" ({count['quarantined']} quarantined)" if count["quarantined"] else ""
            message = (
                f"{len(failed)} of {len(summaries)} shards failed ({', '.join(failed[:5])}"
                f"{', ...' if len(failed) > 5 else ''}){quarantined}, {done}; see {self.manifest.url}"
            )
        else:
            exit_code, status = 0, "completed"
            message = f"{len(summaries)} shards done: {done}"
        return RunResult(
            exit_code,
            status,
            message,
            self.store.url(self.store.root),
            self.manifest.url,
            summaries,
            percentile(self.ttfts, 50),
            num_output_tokens=num_output_tokens,
            wall_s=wall_s,
            engine_s=engine_s,
        )

    def _is_current(self, marker: Mapping[str, Any], shard: str, current: Mapping[str, Any]) -> bool:
        """The marker was committed with this worker's settings and model, from the input as listed."""
        listed = next((s for s in self.plan.all_shards if s.name == shard), None)
        expected = dict(current)
        if listed is not None:
            expected["input"] = input_fingerprint(listed)
        return not fingerprint_changes(marker.get("fingerprint") or {}, expected, tuple(expected))
