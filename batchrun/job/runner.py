"""One worker's run: which shards are its own, start-up checks, and each shard's reported outcome.

The shards themselves run in flow.py: rows of consecutive shards flow through one engine stream,
each shard is committed only when every input row has its result row (see store.py). A bad row
becomes a typed error row; any failure of a shard (unreadable, a storage error that outlasted its
retries, a bug) is recorded as that shard's failure and the run goes on; a stop signal abandons the
shards in progress.

With data.format=openai_batch a shard is a .jsonl file of OpenAI batch requests (openai_files.py,
openai_requests.py): each line is a row, its request's body sets its sampling params, and besides
the usual Parquet results and metrics the attempt writes OpenAI batch output and errors files,
committed with them under the same marker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Optional

from batchrun.engine import Engine, EngineConfig, EngineStats
from batchrun.job.affinity import partition_by_group, shard_groups
from batchrun.job.checkpoints import remove_parts
from batchrun.job.claims import FAILED, QUARANTINED, RELEASED, ClaimBook, ShardQueue, steal_order
from batchrun.job.config import RunConfig
from batchrun.job.errors import ConfigError, JobError
from batchrun.job.fence import FingerprintFence
from batchrun.job.fingerprint import (
    differences,
    fingerprint_changes,
    input_fingerprint,
    model_fingerprint,
    settings_fingerprint,
)
from batchrun.job.flow import ShardFlow
from batchrun.job.manifest import Manifest, redact, utc_now, write_merged_manifest
from batchrun.job.metrics import percentile
from batchrun.job.openai_requests import RequestBuilder
from batchrun.job.progress import Progress
from batchrun.job.prompts import PromptBuilder
from batchrun.job.results import RunResult, ShardSummary, run_throughput
from batchrun.job.shards import Shard, Worker, assign_shards, discover_shards, open_filesystem, resolve_worker
from batchrun.job.signals import StopRequest
from batchrun.job.store import RunStore
from batchrun.job.textfile import MetricsTextfile, textfile_path
from batchrun.job.tool_calls import resolve_template

log = logging.getLogger(__name__)


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


def check_openai_batch_config(config: RunConfig) -> None:
    """Keys that read Parquet columns or template rows mean nothing for batch files: refuse them
    rather than ignore them."""
    if config.job.prompt_template is not None:
        raise ConfigError(
            "job.prompt_template", "not used with data.format=openai_batch (requests carry their prompts)"
        )
    if config.output.keep_columns:
        raise ConfigError("output.keep_columns", "batch files have no columns to keep (data.format=openai_batch)")


def check_id_column(config: RunConfig, fs: Any, first: Shard) -> None:
    """A misspelled data.id_column must not silently become positional ids: the first shard must
    have it (a later shard without it fails on its own)."""
    column = config.data.id_column
    if column is None or config.data.format == "openai_batch":
        return
    try:
        with fs.open(first.path, "rb") as f:
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


def prompt_builders(config: RunConfig, engine: Engine) -> tuple[PromptBuilder, Optional[RequestBuilder]]:
    """What turns rows into prompts for this engine (a real run and a dry run alike): the
    PromptBuilder, and with data.format=openai_batch the RequestBuilder of batch lines."""
    max_prompt_tokens = engine.max_model_len - config.sampling.max_tokens
    if max_prompt_tokens <= 0:
        raise JobError(
            f"sampling.max_tokens={config.sampling.max_tokens} leaves no room for a prompt "
            f"within the engine's max_model_len={engine.max_model_len}"
        )
    builder = PromptBuilder(config.job, config.data, engine.tokenizer, max_prompt_tokens)
    requests = None
    if config.data.format == "openai_batch":
        alias = config.data.openai_model_name
        requests = RequestBuilder(
            engine.tokenizer,
            engine.max_model_len,
            frozenset([config.model.path, *([alias] if alias else [])]),
            config.sampling,
            config.job.system_prompt,
            resolve_template(config.job.tools_chat_template),
        )
    return builder, requests


def _id_hash(key: Any) -> int:
    """8 bytes per id for the run-wide duplicate count, whatever the id's size."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


class _JobRun:
    def __init__(self, config: RunConfig, env: Mapping[str, str]) -> None:
        self.t0 = time.perf_counter()  # the run's wall time starts here: listing, checks and start-up count
        self.num_output_tokens = 0  # generated by the engine in this run, and the time it took
        self.engine_s: Optional[float] = None
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
        self.is_openai_batch = config.data.format == "openai_batch"
        if self.is_openai_batch:
            check_openai_batch_config(config)
        listed = discover_shards(
            self.data_fs, data_path, data_uri, self.store.root if same_fs else None, config.data.format
        )
        stealing = config.launcher.work_stealing and self.worker.world_size > 1
        all_shards = self._shared_plan(listed) if self.worker.world_size > 1 and not stealing else listed
        check_id_column(config, self.data_fs, all_shards[0])
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
        self.model_fp: dict[str, Any] = {}  # set once the engine is loaded
        self.fence = FingerprintFence(self.store, config.output.on_change)
        self.fence.check_settings(self.settings)
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
        commit_method = self.store.verify_exclusive(config.output.allow_non_exclusive)
        log.info(
            "worker %d of %d (%s): %d of %d shards, %d already committed; output %s (commits: %s)",
            self.worker.rank,
            self.worker.world_size,
            self.worker.source,
            len(self.shards),
            len(all_shards),
            len(self.shards) - len(self.todo),
            self.store.url(self.store.root),
            commit_method,
        )
        self.manifest.set_commit_method(commit_method)
        try:
            self.manifest.write()
        except Exception as e:
            raise JobError(f"output.uri: cannot write to {config.output.uri}: {e}") from None
        self.textfile: Optional[MetricsTextfile] = None  # output.metrics_textfile
        if config.output.metrics_textfile:
            self.textfile = MetricsTextfile(
                textfile_path(config.output.metrics_textfile, self.worker.rank, self.worker.world_size),
                config.job.name,
                self.store.url(self.store.root),
                self.worker.rank,
                self._shard_states,
            )
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
        # The plan fixes names and order. Everything else comes from this worker's own listing: the
        # plan on disk is redacted (store._encode), and sizes and versions must be the files' own
        # now, so that a rewritten input is seen as changed (the markers' input fingerprints).
        here = {s.name: s for s in listed}
        planned = [here.get(s.name, s) for s in (Shard(**s) for s in doc["shards"])]
        extra = {s.name for s in listed} - {s.name for s in planned}
        if extra:
            log.warning(
                "%d input file(s) appeared after this run's plan was made (%s) and are not part of it; "
                "run them with another output.uri, or with launcher.work_stealing=true",
                len(extra),
                ", ".join(sorted(extra)[:3]),
            )
        return planned

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
        self.model_fp = model_fingerprint(engine.model_fingerprint, engine.tokenizer, engine.settings.dtype)
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

    # ---- the run ------------------------------------------------------------------------------

    def run(self, engine: Optional[Engine]) -> RunResult:
        stats: Optional[EngineStats] = None
        with StopRequest() as stop:
            if (self.todo or self.steal) and not stop.requested:
                try:
                    engine = engine or load_engine(self.config.engine)
                    self.manifest.set_engine(engine.model_path, engine.model_fingerprint, engine.settings)
                    self._check_model(engine)
                    self.fence.establish(self.settings, self.model_fp)
                    with self.claims:
                        before, t = engine.stats().num_generated_tokens, time.perf_counter()
                        try:
                            self._process(engine, stop)
                        finally:
                            self.engine_s = time.perf_counter() - t
                            self.num_output_tokens = engine.stats().num_generated_tokens - before
                except (JobError, ConfigError) as e:
                    self.manifest.finish("failed", str(e), None)
                    self.manifest.write()
                    if self.textfile is not None:
                        self.textfile.finish(2 if isinstance(e, ConfigError) else 1)
                    raise
                stats = engine.stats()
            result = self._result(stop)
            throughput = run_throughput(result.num_output_tokens or 0, result.wall_s, result.engine_s)
            self.manifest.finish(result.status, result.message, stats, throughput)
            self._write_manifests()
            if self.textfile is not None:
                self.textfile.finish(result.exit_code)
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
        builder, self.requests = prompt_builders(self.config, engine)  # self.requests: read by flow.ShardRun
        progress = Progress(len(self.todo), self.config.quiet, self.textfile)
        queue = ShardQueue(
            self.todo,
            self.steal,
            self.claims,
            self._is_committed,
            self._skip_claimed,
            lambda: stop.requested,
            on_error=self._claim_failed,
        )
        self.progress = progress
        self.queue = queue
        try:
            with progress.logging_redirected():
                ShardFlow(self, engine, builder, progress, stop, queue).run()
        finally:
            progress.close()

    def _shard_states(self) -> dict[str, int]:
        """This worker's shards by manifest status (the metrics textfile's batchrun_shards)."""
        states: dict[str, int] = {}
        for record in self.manifest.shards.values():
            states[record.status] = states.get(record.status, 0) + 1
        return states

    def _write_manifest_quietly(self) -> None:
        try:
            self.manifest.write()
        except Exception:  # progress bookkeeping only; the markers are the record that counts
            log.warning("could not write %s", self.manifest.url, exc_info=True)

    def _is_committed(self, shard: str) -> bool:
        marker = self.store.read_marker(shard)
        if marker is None:
            return False
        if shard in self.stale:  # committed under other settings: ours to redo, unless redone meanwhile
            if not self._is_current(marker, shard):
                return False
            self.stale.discard(shard)  # another recompute launch committed it with these settings
        return True

    def _is_current(self, marker: dict[str, Any], shard: str) -> bool:
        """The marker was committed with this worker's settings and model, from the input as listed."""
        listed = next((s for s in self.all_shards if s.name == shard), None)
        current = {"settings": self.settings, "model": self.model_fp}
        if listed is not None:
            current["input"] = input_fingerprint(listed)
        return not fingerprint_changes(marker.get("fingerprint") or {}, current, tuple(current))

    def check_fence(self) -> None:
        self.fence.check()

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

    def start_shard(self, shard: Shard) -> str:
        """A shard opens (flow.ShardRun): report it running; returns its start time."""
        if shard.name not in self.summaries:  # stolen from another worker
            log.info("shard %s: taken over from another worker", shard.name)
            self.shards.append(shard)
            self.manifest.add_shard(shard)
            self.progress.add_shards(1)
        started_at = utc_now()
        self.manifest.update(shard.name, status="running", started_at=started_at)
        self._write_manifest_quietly()
        if shard.name in self.stale:  # output.on_change=recompute: un-commit it, under our claim
            marker = self.store.read_marker(shard.name)
            # Read again: a marker another recompute launch committed since is current, not stale.
            if marker is not None and not self._is_current(marker, shard.name):
                self.store.remove_marker(shard.name)
        return started_at

    def finish_shard(self, shard: Shard, summary: ShardSummary) -> None:
        """A shard the flow opened is done with: committed, failed, lost or interrupted."""
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
        status_was_lost = summary.status == "lost"
        if summary.status == "lost":
            self.queue.wait_for(shard)  # another worker has it now; ours until it commits
            summary = ShardSummary(shard.name, "elsewhere")
            self.claims.release(shard.name)
        elif summary.status in ("committed", "skipped"):
            self.claims.drop(shard.name)
        else:
            self.claims.release(shard.name, FAILED if summary.status == "failed" else RELEASED)
        self.summaries[shard.name] = summary
        self._write_manifest_quietly()
        if status_was_lost:  # it comes back through the queue: counted once, when it ends for good
            return
        self.progress.shard_done()

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
            num_output_tokens=self.num_output_tokens,
            wall_s=time.perf_counter() - self.t0,
            engine_s=self.engine_s,
        )
