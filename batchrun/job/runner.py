"""One worker's run: its shards, each read, prompted, generated, written and committed in turn.

Per shard: rows are validated and turned into prompts lazily while the engine streams (bounded by
`max_in_flight`), results are written in input order to the attempt's own file, and the shard is
committed only when every input row has its result row (see store.py). A bad row becomes a typed
error row; any failure of a shard (unreadable, a storage error that outlasted its retries, a bug) is
recorded as that shard's failure and the run goes on; a stop signal abandons the shard in progress.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any, Optional

from batchrun.engine import Engine, EngineConfig, EngineRequest, EngineStats, SamplingParams
from batchrun.job.affinity import partition_by_group, shard_groups
from batchrun.job.claims import FAILED, QUARANTINED, RELEASED, ClaimBook, ShardQueue, steal_order
from batchrun.job.config import RunConfig
from batchrun.job.errors import ConfigError, JobError, ShardError
from batchrun.job.fingerprint import differences, input_fingerprint, model_fingerprint, settings_fingerprint
from batchrun.job.manifest import Manifest, redact, utc_now, write_merged_manifest
from batchrun.job.metrics import ShardTally, metrics_row, percentile
from batchrun.job.planner import plan_requests
from batchrun.job.progress import Progress
from batchrun.job.prompts import Prompt, PromptBuilder
from batchrun.job.reader import InputRow, ShardReader
from batchrun.job.results import RunResult, ShardSummary
from batchrun.job.shards import Shard, Worker, assign_shards, discover_shards, open_filesystem, resolve_worker
from batchrun.job.signals import StopRequest
from batchrun.job.store import Attempt, RunStore
from batchrun.job.writer import ResultWriter, error_result, output_result, result_schema, write_metrics

log = logging.getLogger(__name__)

# Requests the engine may hold at once, per sequence it runs: enough queued work to refill the
# batch as sequences finish, while memory stays bounded for shards of any size.
IN_FLIGHT_PER_SEQ = 4

DUPLICATE_ID = "duplicate_id"
NULL_ID = "null_id"
INVALID_TEXT = "invalid_text"
INVALID_SCHEMA = "invalid_schema"


def run_worker(
    config: RunConfig, engine: Optional[Engine] = None, env: Optional[Mapping[str, str]] = None
) -> RunResult:
    """Run this worker's share of the job. Raises JobError when it cannot start at all, ConfigError
    when the configuration (or the output's committed state) forbids it."""
    return _JobRun(config, env if env is not None else os.environ).run(engine)


def load_engine(config: EngineConfig) -> Engine:
    try:
        return Engine(config)
    except Exception as e:  # a missing file, an unknown model name or format: the user must fix the path
        log.debug("engine construction failed", exc_info=True)
        raise JobError(f"cannot load model {config.model!r}: {type(e).__name__}: {' '.join(str(e).split())}") from None


def _id_key(row_id: Any) -> Any:
    """A hashable key for an id of any Arrow type (lists and structs come back as lists and dicts)."""
    try:
        hash(row_id)
        return (type(row_id).__name__, row_id)
    except TypeError:
        return repr(row_id)


def _id_hash(key: Any) -> int:
    """8 bytes per id for the run-wide duplicate count, whatever the id's size."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


class _JobRun:
    def __init__(self, config: RunConfig, env: Mapping[str, str]) -> None:
        self.config = config
        self.worker: Worker = resolve_worker(config.launcher, env)
        try:
            self.store = RunStore(config.output.uri, config.output.storage_options)
        except Exception as e:
            raise JobError(f"output.uri: cannot open {config.output.uri}: {e}") from None
        data_uri = config.data.uri
        assert data_uri is not None, "DataConfig requires a uri"
        self.data_fs, data_path = open_filesystem(data_uri, config.data.storage_options)
        same_fs = type(self.data_fs) is type(self.store.fs) and self.data_fs.protocol == self.store.fs.protocol
        listed = discover_shards(self.data_fs, data_path, data_uri, exclude=self.store.root if same_fs else None)
        stealing = config.launcher.work_stealing and self.worker.world_size > 1
        all_shards = self._shared_plan(listed) if self.worker.world_size > 1 and not stealing else listed
        self._check_id_column(all_shards[0])
        if config.data.group_column and self.worker.world_size > 1:
            groups = shard_groups(self.data_fs, all_shards, config.data.group_column)
            parts = partition_by_group(all_shards, groups, self.worker.world_size)
        else:
            world = self.worker.world_size
            parts = [assign_shards(all_shards, Worker(r, world, self.worker.source)) for r in range(world)]
        self.shards = list(parts[self.worker.rank])
        self.all_shards = all_shards
        try:
            committed = self.store.committed_shards()
        except Exception as e:
            raise JobError(f"output.uri: cannot list {config.output.uri}: {e}") from None
        self.manifest = Manifest(self.store, redact(config.to_dict()), self.worker, len(all_shards), self.shards)
        self.settings = settings_fingerprint(config)
        self.summaries: dict[str, ShardSummary] = {s.name: ShardSummary(s.name, "pending") for s in self.shards}
        self.markers: dict[str, dict[str, Any]] = {}  # own committed shards' markers, read once
        self.stale = self._check_committed(committed)
        self.todo = [s for s in self.shards if s.name not in committed or s.name in self.stale]
        # Shards of other workers this one may take once its own are done (none without stealing).
        self.steal = [s for s in steal_order(parts, self.worker.rank) if s.name not in committed] if stealing else []
        self.claims = ClaimBook(self.store, config.launcher.claim_lease_s, config.launcher.max_shard_attempts)
        published = self.store.published_shards() if self.markers else set()
        for shard in self.shards:
            if shard.name in committed and shard.name not in self.stale:
                self._record_skipped(shard, self.markers.get(shard.name), publish=shard.name not in published)
        log.info(
            "worker %d of %d (%s): %d of %d shards, %d already committed; output %s (commits: %s)",
            self.worker.rank,
            self.worker.world_size,
            self.worker.source,
            len(self.shards),
            len(all_shards),
            len(self.shards) - len(self.todo),
            self.store.url(self.store.root),
            self.store.commit_method,
        )
        self.manifest.set_commit_method(self.store.commit_method)
        try:
            self.manifest.write()
        except Exception as e:
            raise JobError(f"output.uri: cannot write to {config.output.uri}: {e}") from None
        self.ttfts: list[float] = []
        self.run_ids: set[int] = set()  # id hashes of the shards committed by this worker in this run

    # ---- start-up checks ----------------------------------------------------------------------

    def _shared_plan(self, listed: list[Shard]) -> list[Shard]:
        """Without work stealing, workers split the shard list by rank, so they must split the SAME
        list: the first worker to start writes `_plan.json` (create-if-absent) and every worker,
        now and on reruns, uses it. Inputs that appear later are not part of this run."""
        path = self.store.path("_plan.json")
        doc = {"created_at": utc_now(), "shards": [dataclasses.asdict(s) for s in listed]}
        if not self.store.create_json(path, doc):
            existing = self.store.read_json(path)
            if not isinstance(existing, dict) or not isinstance(existing.get("shards"), list):
                raise JobError(f"output.uri: {self.store.url(path)} is unreadable; delete it if no worker is running")
            doc = existing
        planned = [Shard(**s) for s in doc["shards"]]
        extra = {s.name for s in listed} - {s.name for s in planned}
        if extra:
            log.warning(
                "%d input file(s) appeared after this run's plan was made (%s) and are not part of it; "
                "run them with another output.uri, or with launcher.work_stealing=true",
                len(extra),
                ", ".join(sorted(extra)[:3]),
            )
        return planned

    def _check_id_column(self, first: Shard) -> None:
        """A misspelled data.id_column must not silently become positional ids: the first shard
        must have it (a later shard without it fails on its own)."""
        column = self.config.data.id_column
        if column is None:
            return
        try:
            with self.data_fs.open(first.path, "rb") as f:
                import pyarrow.parquet as pq

                names = pq.read_schema(f).names
        except Exception:  # unreadable: that shard fails with its own message later
            return
        if column not in names:
            raise ConfigError(
                "data.id_column",
                f"no column {column!r} in {first.url} (it has {', '.join(names)}); "
                "set data.id_column to the id column, or null for ids <shard>-<row index>",
            )

    def _check_committed(self, committed: set[str]) -> set[str]:
        """Compare the committed markers' fingerprints with this run's (settings and inputs; the
        model once it is loaded). Returns the shards to recompute (output.on_change=recompute);
        with on_change=error a difference is a ConfigError naming it."""
        own = [s for s in self.shards if s.name in committed]
        for shard in own:
            self.markers[shard.name] = self.store.read_marker(shard.name) or {}
        reference = next((m for m in self.markers.values() if m.get("fingerprint")), None)
        if reference is None and committed:  # another worker's shard: all of a run must agree
            reference = self.store.read_marker(sorted(committed)[0]) or {}
        changed_settings = differences((reference or {}).get("fingerprint", {}).get("settings", {}), self.settings)
        stale: dict[str, list[str]] = {}
        for shard in own:
            fingerprint = self.markers[shard.name].get("fingerprint") or {}
            changes = differences(fingerprint.get("settings", {}), self.settings)
            changes += differences(fingerprint.get("input", {}), input_fingerprint(shard))
            if changes:
                stale[shard.name] = changes
        if changed_settings and not stale and own:  # the reference was another worker's
            stale = {s.name: changed_settings for s in own}
        if (changed_settings or stale) and self.config.output.on_change == "error":
            changes = changed_settings or next(iter(stale.values()))
            where = f"{len(stale)} shard(s) (e.g. {next(iter(stale))})" if stale else "shards"
            raise ConfigError(
                "output.on_change",
                f"{where} in {self.config.output.uri} were committed with other "
                f"settings or inputs ({'; '.join(changes[:4])}); use a new output.uri, or set "
                "output.on_change=recompute to redo them",
            )
        for name, changes in stale.items():
            log.warning(
                "shard %s: committed with other settings or input (%s); recomputing it", name, "; ".join(changes[:4])
            )
        return set(stale)

    def _check_model(self, engine: Engine) -> None:
        """The model part of the fingerprint, once the engine is loaded."""
        self.model_fp = model_fingerprint(engine.model_fingerprint, engine.tokenizer, str(engine.settings.get("dtype")))
        changed = {
            name: differences((m.get("fingerprint") or {}).get("model", {}), self.model_fp)
            for name, m in self.markers.items()
            if name not in self.stale
        }
        changed = {name: c for name, c in changed.items() if c}
        if not changed:
            return
        if self.config.output.on_change == "error":
            name, changes = next(iter(changed.items()))
            raise ConfigError(
                "output.on_change",
                f"{len(changed)} shard(s) (e.g. {name}) in {self.config.output.uri} "
                f"were committed with another model or tokenizer ({'; '.join(changes)}); use a new "
                "output.uri, or set output.on_change=recompute to redo them",
            )
        for name in changed:
            log.warning("shard %s: committed with another model or tokenizer; recomputing it", name)
            self.stale.add(name)
            shard = next(s for s in self.shards if s.name == name)
            self.todo.append(shard)
            self.summaries[name] = ShardSummary(name, "pending")
            self.manifest.update(name, status="pending")

    def _record_skipped(self, shard: Shard, marker: Optional[dict[str, Any]] = None, publish: bool = False) -> None:
        """A shard committed before (by an earlier run or another worker). `publish`: its results
        file is missing, so its committer died between marker and publication: finish that."""
        marker = marker if marker is not None else (self.store.read_marker(shard.name) or {})
        if publish and marker:
            try:
                if not self.store.publish(shard.name, marker):
                    log.error("shard %s: committed, but its files are missing from %s", shard.name, self.store.uri)
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

    # ---- the run ------------------------------------------------------------------------------

    def run(self, engine: Optional[Engine]) -> RunResult:
        stats: Optional[EngineStats] = None
        with StopRequest() as stop:
            if (self.todo or self.steal) and not stop.requested:
                try:
                    engine = engine or load_engine(self.config.engine)
                    self.manifest.set_engine(engine.model_path, engine.model_fingerprint, engine.settings)
                    self._check_model(engine)
                    with self.claims:
                        self._process(engine, stop)
                except (JobError, ConfigError) as e:
                    self.manifest.finish("failed", str(e), None)
                    self.manifest.write()
                    raise
                stats = engine.stats()
            result = self._result(stop)
            self.manifest.finish(result.status, result.message, stats)
            self._write_manifests()
        self.store.cleanup()
        return result

    def _write_manifests(self) -> None:
        """Inside the stop handler: a second SIGTERM while these are written must not cut them short."""
        self.manifest.write()
        if self.worker.world_size > 1:
            try:
                write_merged_manifest(self.store, self.all_shards, self.worker.world_size)
            except Exception:  # the rank manifest is written; the next finisher merges again
                log.warning("could not merge the run manifest", exc_info=True)

    def _process(self, engine: Engine, stop: StopRequest) -> None:
        max_prompt_tokens = engine.max_model_len - self.config.sampling.max_tokens
        if max_prompt_tokens <= 0:
            raise JobError(
                f"sampling.max_tokens={self.config.sampling.max_tokens} leaves no room for a prompt "
                f"within the engine's max_model_len={engine.max_model_len}"
            )
        builder = PromptBuilder(self.config.job, self.config.data, engine.tokenizer, max_prompt_tokens)
        progress = Progress(len(self.todo), self.config.quiet)
        queue = ShardQueue(
            self.todo,
            self.steal,
            self.claims,
            self._is_committed,
            self._skip_claimed,
            lambda: stop.requested,
            on_error=self._claim_failed,
        )
        try:
            with progress.logging_redirected():
                for shard in queue:
                    if shard.name not in self.summaries:  # stolen from another worker
                        log.info("shard %s: taken over from another worker", shard.name)
                        self.shards.append(shard)
                        self.manifest.add_shard(shard)
                        progress.add_shards(1)
                    summary = self._run_shard_logged(shard, engine, builder, progress, stop)
                    if summary.status == "lost":
                        queue.wait_for(shard)  # another worker has it now; ours until it commits
                        summary = ShardSummary(shard.name, "elsewhere")
                        self.manifest.update(shard.name, status="elsewhere")
                        self.claims.release(shard.name)
                    elif summary.status in ("committed", "skipped"):
                        self.claims.drop(shard.name)
                    else:
                        self.claims.release(shard.name, FAILED if summary.status == "failed" else RELEASED)
                    self.summaries[shard.name] = summary
                    self._write_manifest_quietly()
                    progress.shard_done()
        finally:
            progress.close()

    def _write_manifest_quietly(self) -> None:
        try:
            self.manifest.write()
        except Exception:  # progress bookkeeping only; the markers are the record that counts
            log.warning("could not write %s", self.manifest.url, exc_info=True)

    def _is_committed(self, shard: str) -> bool:
        if shard in self.stale:  # committed under other settings: ours to redo
            return False
        return self.store.read_marker(shard) is not None

    def _skip_claimed(self, shard: Shard, status: str) -> None:
        """One of our shards that another worker committed ("skipped"), is working on ("elsewhere"),
        or that is quarantined."""
        if status == "skipped":
            self._record_skipped(shard)
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
        self._write_manifest_quietly()

    def _claim_failed(self, shard: Shard, error: BaseException) -> None:
        """Claiming or checking a shard failed (after retries): that shard fails, the worker goes on."""
        message = f"{type(error).__name__}: {' '.join(str(error).split())}"
        log.error("shard %s failed: cannot claim it: %s", shard.name, message)
        if shard.name in self.summaries or shard in self.shards:
            self.manifest.update(shard.name, status="failed", error=message)
            self.summaries[shard.name] = ShardSummary(shard.name, "failed", error=message)

    def _run_shard_logged(
        self, shard: Shard, engine: Engine, builder: PromptBuilder, progress: Progress, stop: StopRequest
    ) -> ShardSummary:
        started_at = utc_now()
        self.manifest.update(shard.name, status="running", started_at=started_at)
        self._write_manifest_quietly()
        try:
            if shard.name in self.stale:  # output.on_change=recompute: un-commit it, under our claim
                self.store.remove_marker(shard.name)
            summary = _ShardRun(self, shard, engine, builder, progress, stop, started_at).run()
        except ShardError as e:
            log.error("shard %s failed: %s", shard.name, e)
            summary = ShardSummary(shard.name, "failed", error=str(e))
        except Exception as e:  # not an expected failure: keep the traceback, still go on with other shards
            log.exception("shard %s failed unexpectedly", shard.name)
            summary = ShardSummary(shard.name, "failed", error=f"{type(e).__name__}: {e}")
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
                "shard %s committed: %d rows, %d errors, %.1f output tok/s",
                shard.name,
                m["num_rows"],
                m["num_errors"],
                m["output_tokens_per_s"],
            )
        return summary

    def record_ids(self, shard: str, id_keys: set[Any]) -> None:
        """Count the ids of a committed shard that earlier shards of this worker's run had too."""
        hashes = {_id_hash(k) for k in id_keys}
        repeated = len(hashes & self.run_ids)
        self.run_ids |= hashes
        if repeated:
            log.warning("shard %s: %d id(s) also appear in another shard of this run", shard, repeated)
            self.manifest.add_duplicate_ids(shard, repeated)

    def _result(self, stop: StopRequest) -> RunResult:
        summaries = [self.summaries[s.name] for s in self.shards]
        count = {
            status: sum(s.status == status for s in summaries)
            for status in ("committed", "skipped", "failed", "quarantined", "interrupted", "pending", "elsewhere")
        }
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
        )


class _ShardRun:
    """One attempt at one shard; `run` returns its summary or raises ShardError."""

    def __init__(
        self,
        job: _JobRun,
        shard: Shard,
        engine: Engine,
        builder: PromptBuilder,
        progress: Progress,
        stop: StopRequest,
        started_at: str,
    ) -> None:
        self.job, self.shard, self.engine, self.builder = job, shard, engine, builder
        self.progress, self.stop, self.started_at = progress, stop, started_at
        self.config = job.config
        self.tally = ShardTally()
        self.in_flight: dict[int, tuple[InputRow, Prompt, dict[str, Any]]] = {}
        self.seen_ids: set[Any] = set()
        self.read_error: Optional[ShardError] = None

    def run(self) -> ShardSummary:
        store = self.job.store
        attempt = store.begin(self.shard.name)
        t0 = time.perf_counter()
        columns = [*self.config.job.input_columns(self.config.data), *self.config.output.keep_columns]
        try:
            self.reader = ShardReader(self.shard, self.job.data_fs, self.config.data, columns)
        except BaseException:
            store.abandon(attempt)
            raise
        try:
            self.progress.add_rows(self.reader.num_rows)
            keep_fields = [self.reader.field(c) for c in self.config.output.keep_columns]
            self.writer = ResultWriter(store.fs, attempt.results_tmp, result_schema(keep_fields, self.reader.id_type))
            try:
                summary = self._generate_and_commit(attempt, t0)
            except BaseException:
                self.writer.abort()
                store.abandon(attempt)
                raise
        finally:
            self.reader.close()
        if summary.status not in ("committed", "skipped"):
            store.abandon(attempt)
        return summary

    def _should_stop(self) -> bool:
        return self.stop.requested or self.job.claims.is_lost(self.shard.name)

    def _generate_and_commit(self, attempt: Attempt, t0: float) -> ShardSummary:
        self.engine.reset_peak_stats()
        before = self.engine.stats()
        max_num_seqs = self.config.engine.max_num_seqs
        # None: the engine bounds it itself, by the batch size it picked at start-up.
        max_in_flight = IN_FLIGHT_PER_SEQ * max_num_seqs if max_num_seqs else None
        # The planner reorders a window of rows (shared prefixes together, longest first); the
        # writer puts the results back in input order.
        requests = plan_requests(self._requests(), self.config.planner, self.engine.config.block_size)
        for out in self.engine.stream(requests, self.config.sampling, max_in_flight):
            row, prompt, keep = self.in_flight.pop(out.request_id)
            self._emit(row.index, output_result(row.id, out, prompt.error_message, keep))
            if self._should_stop():
                break
        if self._should_stop():
            self.writer.abort()
            if not self.stop.requested:  # the claim was lost: another worker runs it now
                return ShardSummary(self.shard.name, "lost")
            log.warning("shard %s abandoned (%s): nothing of it is committed", self.shard.name, self.stop.name)
            return ShardSummary(self.shard.name, "interrupted")
        if self.read_error is not None:
            raise self.read_error
        wall_s = time.perf_counter() - t0
        num_rows = self.writer.close()
        if num_rows != self.reader.num_rows:
            raise ShardError(f"{num_rows} result rows for {self.reader.num_rows} input rows; not committed")
        metrics = metrics_row(self.shard.name, self.job.worker.rank, self.tally, wall_s, before, self.engine.stats())
        write_metrics(self.job.store.fs, attempt.metrics_tmp, metrics)
        fingerprint = {
            "settings": self.job.settings,
            "model": self.job.model_fp,
            "input": input_fingerprint(self.shard),
        }
        is_first = self.job.store.commit(
            attempt,
            {
                "shard": self.shard.name,
                "input": self.shard.url,
                "num_rows": num_rows,
                "started_at": self.started_at,
                "committed_at": utc_now(),
                "worker": self.job.worker.rank,
                "owner": self.job.claims.owner,
                "model_fingerprint": self.engine.model_fingerprint,
                "fingerprint": fingerprint,
                "error_counts": self.tally.error_counts,
                "metrics": metrics,
            },
        )
        if not is_first:
            log.warning(
                "shard %s was committed by another worker meanwhile; this attempt is discarded", self.shard.name
            )
            return ShardSummary(
                self.shard.name, "skipped", (self.job.store.read_marker(self.shard.name) or {}).get("metrics")
            )
        self.job.ttfts.extend(self.tally.ttfts)
        self.job.record_ids(self.shard.name, self.seen_ids)
        return ShardSummary(self.shard.name, "committed", metrics)

    def _requests(self) -> Iterator[EngineRequest]:
        """Rows as engine requests, lazily; rows that cannot be prompts are written as errors here."""
        keep_columns = self.config.output.keep_columns
        try:
            for row in self.reader.rows():
                if self._should_stop():
                    return  # stop admitting; what is in flight is abandoned by the consumer
                keep = {c: row.values[c] for c in keep_columns}
                prompt = self._check_row(row) or self.builder.build(row)
                params: Optional[SamplingParams] = None
                if prompt.token_ids is not None:
                    params, schema_error = self._params_for(row)
                    if schema_error is not None:
                        prompt = Prompt(error_type=INVALID_SCHEMA, error_message=schema_error)
                if prompt.token_ids is None:
                    self._emit(
                        row.index,
                        error_result(
                            row.id, prompt.error_type or "", prompt.error_message, prompt.num_prompt_tokens, keep
                        ),
                    )
                    continue
                self.in_flight[row.index] = (row, prompt, keep)
                yield EngineRequest(request_id=row.index, prompt=prompt.token_ids, params=params)
        except ShardError as e:
            # Raising here would unwind through the engine; stop feeding it and fail after it drains.
            self.read_error = e

    def _check_row(self, row: InputRow) -> Optional[Prompt]:
        """Errors of the row itself, before any prompt is built: its text and its id."""
        if row.invalid_columns:
            return Prompt(
                error_type=INVALID_TEXT,
                error_message=(
                    f"row {row.index} (id {row.id!r}): column(s) {', '.join(map(repr, row.invalid_columns))} hold text "
                    "that is not valid UTF-8"
                ),
            )
        if row.id is None:
            return Prompt(
                error_type=NULL_ID,
                error_message=f"row {row.index}: column {self.config.data.id_column!r} is null or NaN",
            )
        key = _id_key(row.id)
        if key in self.seen_ids:
            return Prompt(
                error_type=DUPLICATE_ID, error_message=f"id {row.id!r} already appeared earlier in this shard"
            )
        self.seen_ids.add(key)
        return None

    def _params_for(self, row: InputRow) -> tuple[Optional[SamplingParams], Optional[str]]:
        """(params, None), or (None, why the row's schema is invalid). Per-row seed from
        (sampling.seed, id): the same row samples the same text in any batch, shard split or resumed
        run; a per-row schema from data.schema_column. None params keep the stream's shared ones."""
        sampling = self.config.sampling
        changes: dict[str, Any] = {}
        if sampling.seed is not None and not sampling.is_greedy:
            digest = hashlib.sha256(f"{sampling.seed}\0{row.id}".encode()).digest()
            changes["seed"] = int.from_bytes(digest[:8], "little") >> 1
        column = self.config.data.schema_column
        schema = row.values.get(column) if column is not None else None
        if schema is not None:
            if not isinstance(schema, str):
                return None, f"column {column!r} holds {type(schema).__name__}; expected JSON Schema text"
            # The row's schema replaces any constraint of the job's.
            changes.update(json_schema=schema, regex=None, choice=())
        if not changes:
            return None, None
        try:
            return dataclasses.replace(sampling, **changes), None
        except ValueError as e:  # SamplingParams checks the schema: invalid JSON or not compilable
            return None, f"column {column!r}: {e}"

    def _emit(self, index: int, result: dict[str, Any]) -> None:
        self.writer.put(index, result)
        self.tally.add(result)
        self.progress.advance(1, result["num_output_tokens"] or 0)
