"""run_job: this worker's shards, each read, prompted, generated, written and committed in turn.

Per shard: rows are validated and turned into prompts lazily while the engine streams (bounded by
`max_in_flight`), results are written in input order to a temp file, and the shard is committed
only when every input row has its result row (see store.py). A bad row becomes a typed error row;
a bad shard is recorded as failed and the run goes on; a stop signal abandons the shard in progress.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from batchrun.engine import Engine, EngineConfig, EngineRequest, EngineStats, SamplingParams
from batchrun.job.affinity import partition_by_group, shard_groups
from batchrun.job.claims import FAILED, ClaimBook, claimed_shards, steal_order
from batchrun.job.config import RunConfig
from batchrun.job.errors import JobError, ShardError
from batchrun.job.manifest import Manifest, utc_now, write_merged_manifest
from batchrun.job.metrics import ShardTally, metrics_row, percentile
from batchrun.job.planner import plan_requests
from batchrun.job.progress import Progress
from batchrun.job.prompts import Prompt, PromptBuilder
from batchrun.job.reader import InputRow, ShardReader
from batchrun.job.shards import Shard, Worker, assign_shards, discover_shards, open_filesystem, resolve_worker
from batchrun.job.signals import StopRequest
from batchrun.job.store import RunStore
from batchrun.job.writer import ResultWriter, error_result, output_result, result_schema, write_metrics

log = logging.getLogger("batchrun.job")

# Requests the engine may hold at once, per sequence it runs: enough queued work to refill the
# batch as sequences finish, while memory stays bounded for shards of any size.
IN_FLIGHT_PER_SEQ = 4

DUPLICATE_ID = "duplicate_id"
NULL_ID = "null_id"


@dataclass(frozen=True)
class ShardSummary:
    name: str
    # committed | skipped | failed | interrupted | pending | elsewhere (another worker holds its claim)
    status: str
    metrics: Optional[dict[str, Any]] = None  # the metrics row, for committed and skipped shards
    error: Optional[str] = None


@dataclass(frozen=True)
class RunResult:
    exit_code: int  # 0 done, 1 some shard failed, 128 + signal number when stopped
    status: str  # completed | failed | interrupted
    message: str  # one line for the log
    output_url: str
    manifest_url: str
    shards: list[ShardSummary]
    ttft_p50_s: Optional[float]  # over the rows generated in this run


def run_job(config: RunConfig, engine: Optional[Engine] = None, env: Optional[Mapping[str, str]] = None) -> RunResult:
    """Run this worker's share of the job. Raises JobError when it cannot start at all.

    `engine` may be passed in to reuse a loaded one (notebooks, tests); `env` defaults to
    os.environ and is where torchrun/Slurm ranks are read from when the config leaves them unset.
    """
    if config.launcher.num_workers > 1 and config.launcher.rank is None:
        from batchrun.job.pool import run_local_workers  # the pool runs this module in each worker

        return run_local_workers(config, env if env is not None else os.environ)
    return _JobRun(config, env if env is not None else os.environ).run(engine)


def load_engine(config: EngineConfig) -> Engine:
    try:
        return Engine(config)
    except Exception as e:  # a missing file, an unknown model name or format: the user must fix the path
        log.debug("engine construction failed", exc_info=True)
        raise JobError(f"cannot load model {config.model!r}: {type(e).__name__}: {' '.join(str(e).split())}") from None


def config_hash(config: RunConfig) -> str:
    """Hash of the settings that decide what a result row says (not where it goes, not speed knobs)."""
    keys = {"job": dataclasses.asdict(config.job), "model": dataclasses.asdict(config.model),
            "sampling": dataclasses.asdict(config.sampling),
            "data": {k: getattr(config.data, k) for k in ("id_column", "text_column", "on_too_long")},
            "keep_columns": config.output.keep_columns}
    blob = json.dumps(keys, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class _JobRun:
    def __init__(self, config: RunConfig, env: Mapping[str, str]) -> None:
        self.config = config
        self.worker: Worker = resolve_worker(config.launcher, env)
        data_uri = config.data.uri
        assert data_uri is not None, "DataConfig requires a uri"
        self.data_fs, data_path = open_filesystem(data_uri, config.data.storage_options)
        all_shards = discover_shards(self.data_fs, data_path, data_uri)
        if config.data.group_column and self.worker.world_size > 1:
            groups = shard_groups(self.data_fs, all_shards, config.data.group_column)
            parts = partition_by_group(all_shards, groups, self.worker.world_size)
        else:
            world = self.worker.world_size
            parts = [assign_shards(all_shards, Worker(r, world, self.worker.source)) for r in range(world)]
        self.shards = list(parts[self.worker.rank])
        try:
            self.store = RunStore(config.output.uri, config.output.storage_options)
            committed = self.store.committed_shards()
        except Exception as e:
            raise JobError(f"output.uri: cannot open {config.output.uri}: {e}") from None
        self.manifest = Manifest(self.store, config.to_dict(), self.worker, len(all_shards), self.shards)
        self.config_hash = config_hash(config)
        self.summaries: dict[str, ShardSummary] = {s.name: ShardSummary(s.name, "pending") for s in self.shards}
        self.todo = [s for s in self.shards if s.name not in committed]
        self.all_shards = all_shards
        # Shards of other workers this one may take once its own are done (none without stealing).
        self.steal = [s for s in steal_order(parts, self.worker.rank) if s.name not in committed] \
            if config.launcher.work_stealing and self.worker.world_size > 1 else []
        self.claims = ClaimBook(self.store, config.launcher.claim_lease_s)
        for shard in self.shards:
            if shard.name in committed:
                self._record_skipped(shard)
        log.info("worker %d of %d (%s): %d of %d shards, %d already committed; output %s",
                 self.worker.rank, self.worker.world_size, self.worker.source, len(self.shards),
                 len(all_shards), len(self.shards) - len(self.todo), self.store.url(self.store.root))
        try:
            self.manifest.write()
        except Exception as e:
            raise JobError(f"output.uri: cannot write to {config.output.uri}: {e}") from None
        self.ttfts: list[float] = []

    def _record_skipped(self, shard: Shard) -> None:
        marker = self.store.read_marker(shard.name) or {}
        metrics = marker.get("metrics")
        self.manifest.update(shard.name, status="skipped", started_at=marker.get("started_at"),
                             finished_at=marker.get("committed_at"), num_rows=marker.get("num_rows"),
                             num_errors=(metrics or {}).get("num_errors"))
        self.summaries[shard.name] = ShardSummary(shard.name, "skipped", metrics)
        if marker.get("config_hash") not in (None, self.config_hash):
            log.warning("shard %s was committed with different job/model/sampling settings and is kept as is; "
                        "use a new output.uri to regenerate it", shard.name)

    # ---- the run ------------------------------------------------------------------------------

    def run(self, engine: Optional[Engine]) -> RunResult:
        stats: Optional[EngineStats] = None
        with StopRequest() as stop:
            if (self.todo or self.steal) and not stop.requested:
                try:
                    engine = engine or load_engine(self.config.engine)
                    self.manifest.set_engine(engine.model_path, engine.model_fingerprint, engine.settings)
                    with self.claims:
                        self._process(engine, stop)
                except JobError as e:
                    self.manifest.finish("failed", str(e), None)
                    self.manifest.write()
                    raise
                stats = engine.stats()
        result = self._result(stop)
        self.manifest.finish(result.status, result.message, stats)
        self.manifest.write()
        if self.worker.world_size > 1:
            try:
                write_merged_manifest(self.store, self.all_shards, self.worker.world_size)
            except Exception:  # the rank manifest is written; the next finisher merges again
                log.warning("could not merge the run manifest", exc_info=True)
        self.store.cleanup()
        return result

    def _process(self, engine: Engine, stop: StopRequest) -> None:
        max_prompt_tokens = engine.max_model_len - self.config.sampling.max_tokens
        if max_prompt_tokens <= 0:
            raise JobError(f"sampling.max_tokens={self.config.sampling.max_tokens} leaves no room for a prompt "
                           f"within the engine's max_model_len={engine.max_model_len}")
        builder = PromptBuilder(self.config.job, self.config.data, engine.tokenizer, max_prompt_tokens)
        progress = Progress(len(self.todo), self.config.quiet)
        try:
            with progress.logging_redirected():
                for shard in claimed_shards(self.todo, self.steal, self.claims, self._is_committed,
                                            self._skip_claimed, lambda: stop.requested):
                    if shard.name not in self.summaries:  # stolen from another worker
                        log.info("shard %s: taken over from another worker", shard.name)
                        self.shards.append(shard)
                        self.manifest.add_shard(shard)
                        progress.add_shards(1)
                    summary = self._run_shard_logged(shard, engine, builder, progress, stop)
                    self.summaries[shard.name] = summary
                    if summary.status in ("committed", "skipped"):
                        self.claims.drop(shard.name)
                    else:
                        self.claims.release(shard.name, FAILED if summary.status == "failed" else "released")
                    self.manifest.write()
                    progress.shard_done()
        finally:
            progress.close()

    def _is_committed(self, shard: str) -> bool:
        return self.store.read_marker(shard) is not None

    def _skip_claimed(self, shard: Shard, status: str) -> None:
        """One of our shards that another worker committed ("skipped") or is working on ("elsewhere")."""
        if status == "skipped":
            self._record_skipped(shard)
        else:
            self.manifest.update(shard.name, status="elsewhere")
            self.summaries[shard.name] = ShardSummary(shard.name, "elsewhere")
        self.manifest.write()

    def _run_shard_logged(self, shard: Shard, engine: Engine, builder: PromptBuilder,
                          progress: Progress, stop: StopRequest) -> ShardSummary:
        started_at = utc_now()
        self.manifest.update(shard.name, status="running", started_at=started_at)
        self.manifest.write()
        try:
            summary = _ShardRun(self, shard, engine, builder, progress, stop, started_at).run()
        except ShardError as e:
            log.error("shard %s failed: %s", shard.name, e)
            summary = ShardSummary(shard.name, "failed", error=str(e))
        except Exception as e:  # not an expected failure: keep the traceback, still go on with other shards
            log.exception("shard %s failed unexpectedly", shard.name)
            summary = ShardSummary(shard.name, "failed", error=f"{type(e).__name__}: {e}")
        m = summary.metrics or {}
        self.manifest.update(shard.name, status=summary.status, finished_at=utc_now(), error=summary.error,
                             num_rows=m.get("num_rows"), num_errors=m.get("num_errors"))
        if summary.status == "committed":
            log.info("shard %s committed: %d rows, %d errors, %.1f output tok/s", shard.name, m["num_rows"],
                     m["num_errors"], m["output_tokens_per_s"])
        return summary

    def _result(self, stop: StopRequest) -> RunResult:
        summaries = [self.summaries[s.name] for s in self.shards]
        count = {status: sum(s.status == status for s in summaries)
                 for status in ("committed", "skipped", "failed", "interrupted", "pending", "elsewhere")}
        done = f"{count['committed']} committed, {count['skipped']} already done"
        if count["elsewhere"]:
            done += f", {count['elsewhere']} being done by other workers"
        # A signal that arrives after the last commit changes nothing: the run is complete.
        if stop.requested and (count["interrupted"] or count["pending"] or count["elsewhere"]):
            exit_code, status = stop.exit_code, "interrupted"
            message = (f"interrupted by {stop.name}: {done}, {count['interrupted']} abandoned, "
                       f"{count['pending']} not started; rerun the same command to resume")
        elif count["failed"]:
            failed = [s.name for s in summaries if s.status == "failed"]
            exit_code, status = 1, "failed"
            message = (f"{count['failed']} of {len(summaries)} shards failed ({', '.join(failed[:5])}"
                       f"{', ...' if len(failed) > 5 else ''}), {done}; see {self.manifest.url}")
        else:
            exit_code, status = 0, "completed"
            message = f"{len(summaries)} shards done: {done}"
        return RunResult(exit_code, status, message, self.store.url(self.store.root), self.manifest.url,
                         summaries, percentile(self.ttfts, 50))


class _ShardRun:
    """One attempt at one shard; `run` returns its summary or raises ShardError."""

    def __init__(self, job: _JobRun, shard: Shard, engine: Engine, builder: PromptBuilder,
                 progress: Progress, stop: StopRequest, started_at: str) -> None:
        self.job, self.shard, self.engine, self.builder = job, shard, engine, builder
        self.progress, self.stop, self.started_at = progress, stop, started_at
        self.config = job.config
        self.tally = ShardTally()
        self.in_flight: dict[int, tuple[InputRow, Prompt, dict[str, Any]]] = {}
        self.seen_ids: set[str] = set()
        self.read_error: Optional[ShardError] = None

    def run(self) -> ShardSummary:
        store = self.job.store
        attempt = store.begin(self.shard.name)
        t0 = time.perf_counter()
        columns = [*self.config.job.input_columns(self.config.data), *self.config.output.keep_columns]
        self.reader = ShardReader(self.shard, self.job.data_fs, self.config.data, columns)
        try:
            self.progress.add_rows(self.reader.num_rows)
            keep_fields = [self.reader.field(c) for c in self.config.output.keep_columns]
            self.writer = ResultWriter(store.fs, attempt.results_tmp, result_schema(keep_fields))
            try:
                summary = self._generate_and_commit(attempt, t0)
            except BaseException:
                self.writer.abort()
                store.abandon(attempt)
                raise
        finally:
            self.reader.close()
        if summary.status != "committed":
            store.abandon(attempt)
        return summary

    def _generate_and_commit(self, attempt: Any, t0: float) -> ShardSummary:
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
            if self.stop.requested:
                break
        if self.stop.requested:
            self.writer.abort()
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
        is_first = self.job.store.commit(attempt, {
            "shard": self.shard.name, "input": self.shard.url, "num_rows": num_rows,
            "started_at": self.started_at, "committed_at": utc_now(), "worker": self.job.worker.rank,
            "config_hash": self.job.config_hash, "model_fingerprint": self.engine.model_fingerprint,
            "error_counts": self.tally.error_counts, "metrics": metrics,
        })
        if not is_first:
            log.warning("shard %s was committed by another worker meanwhile; this attempt is discarded",
                        self.shard.name)
            return ShardSummary(self.shard.name, "skipped", (self.job.store.read_marker(self.shard.name) or {})
                                .get("metrics"))
        self.job.ttfts.extend(self.tally.ttfts)
        return ShardSummary(self.shard.name, "committed", metrics)

    def _requests(self) -> Iterator[EngineRequest]:
        """Rows as engine requests, lazily; rows that cannot be prompts are written as errors here."""
        keep_columns = self.config.output.keep_columns
        try:
            for row in self.reader.rows():
                if self.stop.requested:
                    return  # stop admitting; what is in flight is abandoned by the consumer
                keep = {c: row.values[c] for c in keep_columns}
                prompt = self._check_id(row) or self.builder.build(row)
                if prompt.token_ids is None:
                    row_id = row.id if row.id is not None else f"{self.shard.name}-{row.index}"
                    self._emit(row.index, error_result(row_id, prompt.error_type or "", prompt.error_message,
                                                       prompt.num_prompt_tokens, keep))
                    continue
                self.in_flight[row.index] = (row, prompt, keep)
                yield EngineRequest(request_id=row.index, prompt=prompt.token_ids, params=self._params_for(row))
        except ShardError as e:
            # Raising here would unwind through the engine; stop feeding it and fail after it drains.
            self.read_error = e

    def _check_id(self, row: InputRow) -> Optional[Prompt]:
        if row.id is None:
            return Prompt(error_type=NULL_ID, error_message=f"column {self.config.data.id_column!r} is null; "
                          "the id given here is <shard>-<row index>")
        if row.id in self.seen_ids:
            return Prompt(error_type=DUPLICATE_ID,
                          error_message=f"id {row.id!r} already appeared earlier in this shard")
        self.seen_ids.add(row.id)
        return None

    def _params_for(self, row: InputRow) -> Optional[SamplingParams]:
        """Per-row seed from (sampling.seed, id): the same row samples the same text in any batch,
        shard split or resumed run. None keeps the stream's shared params (greedy needs no seed)."""
        sampling = self.config.sampling
        if sampling.seed is None or sampling.is_greedy:
            return None
        digest = hashlib.sha256(f"{sampling.seed}\0{row.id}".encode()).digest()
        return dataclasses.replace(sampling, seed=int.from_bytes(digest[:8], "little") >> 1)

    def _emit(self, index: int, result: dict[str, Any]) -> None:
        self.writer.put(index, result)
        self.tally.add(result)
        self.progress.advance(1, result["num_output_tokens"] or 0)
