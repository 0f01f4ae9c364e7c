"""One worker's run: its start-up checks, its plan, then its shards through one engine stream.

The parts, in the order a run uses them:
- shard_format.py: the input format's start-up checks, and later what turns its rows into requests;
- plan.py: which shards are this worker's, which are committed, stale or to publish (reads only);
- ledger.py: the manifest, each shard's summary and its claim, as shards open and end;
- flow.py: rows of consecutive shards flow through one engine stream, each shard committed only
  when every input row has its result row (see store.py).
A bad row becomes a typed error row; any failure of a shard (unreadable, a storage error that
outlasted its retries, a bug) is recorded as that shard's failure and the run goes on; a stop
signal abandons the shards in progress.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Optional

from batchrun.engine import Engine, EngineConfig, EngineConfigError, TensorParallelError
from batchrun.job.commit.claims import ShardQueue
from batchrun.job.commit.fence import FingerprintFence
from batchrun.job.commit.fingerprint import settings_fingerprint
from batchrun.job.commit.manifest import write_merged_manifest
from batchrun.job.commit.store import RunStore
from batchrun.job.config import RunConfig, check_task, check_thinking
from batchrun.job.errors import ConfigError, JobError
from batchrun.job.formats.shard_format import engine_task, engine_think_tags, format_class, select_format
from batchrun.job.operate.progress import Progress
from batchrun.job.operate.textfile import MetricsTextfile, textfile_path
from batchrun.job.results import RunResult, run_throughput
from batchrun.job.run.flow import ShardFlow
from batchrun.job.run.ledger import ShardLedger
from batchrun.job.run.plan import WorkerPlan, is_stealing, model_changes, plan_worker, shared_shards
from batchrun.job.run.shard_run import ShardContext, shard_context
from batchrun.job.run.signals import StopRequest
from batchrun.job.shards import Worker, discover_shards, open_filesystem, resolve_worker

log = logging.getLogger(__name__)

LORA_KEY = "model.lora_adapters."  # how the engine's adapter errors start


def run_worker(
    config: RunConfig, engine: Optional[Engine] = None, env: Optional[Mapping[str, str]] = None
) -> RunResult:
    """Run this worker's share of the job. Raises JobError when it cannot start at all, ConfigError
    when the configuration (or the output's committed state) forbids it."""
    return _JobRun(config, env if env is not None else os.environ).run(engine)


def load_engine(config: EngineConfig) -> Engine:
    try:
        return Engine(config)
    except EngineConfigError as e:
        # The engine saw the model or the machine and refused the settings (a tensor-parallel group
        # that does not split the model's heads, or more ranks than GPUs): a config error, exit 2.
        # Its message names the key already.
        raise ConfigError("", " ".join(str(e).split())) from None
    except Exception as e:
        message = " ".join(str(e).split())
        if isinstance(e, ValueError) and message.startswith(LORA_KEY):
            # An adapter that does not fit the model (the engine's LoraError names the adapter and
            # its first mismatch): a config error, exit 2.
            raise ConfigError("", message) from None
        # a missing file, an unknown model name or format: the user must fix the path
        log.debug("engine construction failed", exc_info=True)
        raise JobError(f"cannot load model {config.model!r}: {type(e).__name__}: {message}") from None


class _JobRun:
    """Start-up (the constructor: checks, plan, books) and the run (`run`)."""

    def __init__(self, config: RunConfig, env: Mapping[str, str]) -> None:
        self.t0 = time.perf_counter()  # the run's wall time starts here: listing, checks and start-up count
        self.config = config
        worker: Worker = resolve_worker(config.launcher, env)
        self.worker = worker
        try:
            self.store = RunStore(config.output.uri, config.output.storage_options)
        except Exception as e:
            raise JobError(f"output.uri: cannot open {config.output.uri}: {e}") from None
        data_uri = config.data.uri
        assert data_uri is not None, "DataConfig requires a uri"
        self.data_fs, data_path = open_filesystem(data_uri, config.data.storage_options)
        same_fs = type(self.data_fs) is type(self.store.fs) and self.data_fs.protocol == self.store.fs.protocol
        input_format = format_class(config)
        input_format.check_config(config)
        listed = discover_shards(
            self.data_fs, data_path, data_uri, self.store.root if same_fs else None, input_format.name
        )
        shared = worker.world_size > 1 and not is_stealing(config, worker)
        all_shards = shared_shards(self.store, listed) if shared else listed
        input_format.check_first_shard(config, self.data_fs, all_shards[0])
        self.fence = FingerprintFence(self.store, config.output.on_change)
        self.fence.check_settings(settings_fingerprint(config))
        self.plan: WorkerPlan = plan_worker(config, worker, self.store, self.data_fs, all_shards)
        self.ledger = ShardLedger(config, self.store, self.plan)
        commit_method = self.store.verify_exclusive(config.output.allow_non_exclusive)
        log.info(
            "worker %d of %d (%s): %d of %d shards, %d already committed; output %s (commits: %s)",
            worker.rank,
            worker.world_size,
            worker.source,
            len(self.plan.shards),
            len(all_shards),
            len(self.plan.shards) - len(self.plan.todo),
            self.store.url(self.store.root),
            commit_method,
        )
        self.manifest = self.ledger.manifest
        self.manifest.set_commit_method(commit_method)
        try:
            self.manifest.write()
        except Exception as e:
            raise JobError(f"output.uri: cannot write to {config.output.uri}: {e}") from None
        self.textfile: Optional[MetricsTextfile] = None  # output.metrics_textfile
        if config.output.metrics_textfile:
            self.textfile = MetricsTextfile(
                textfile_path(config.output.metrics_textfile, worker.rank, worker.world_size),
                config.job.name,
                self.store.url(self.store.root),
                worker.rank,
                self.ledger.shard_states,
            )
        self._owned_engine: Optional[Engine] = None  # an engine this run loaded (`run` closes it)
        self.num_output_tokens = 0  # generated by the engine in this run, and the time it took
        self.engine_s: Optional[float] = None

    @property
    def stale(self) -> set[str]:
        """Own committed shards this run recomputes (the ledger's, as it goes)."""
        return self.ledger.stale

    def run(self, engine: Optional[Engine]) -> RunResult:
        try:
            return self._run(engine)
        finally:
            if self._owned_engine is not None:  # its tensor-parallel followers end with the run
                self._owned_engine.close()

    def _run(self, engine: Optional[Engine]) -> RunResult:
        with StopRequest() as stop:
            if (self.ledger.todo or self.plan.steal) and not stop.requested:
                try:
                    if engine is None:
                        engine = self._owned_engine = load_engine(self.config.engine)
                    check_task(self.config, engine_task(engine), engine.tokenizer)  # engine.task auto: the model's
                    check_thinking(self.config, engine_think_tags(engine))
                    context = shard_context(self.config, self.store, self.data_fs, self.plan, engine)
                    self.manifest.set_engine(context.model_path, context.model_fingerprint, context.engine_settings)
                    self.ledger.recompute(model_changes(self.config, self.plan, context.model))
                    self.fence.establish(self.plan.settings, context.model)
                    with self.ledger.claims:
                        before, t = engine.stats().num_generated_tokens, time.perf_counter()
                        try:
                            self._process(context, engine, stop)
                        finally:
                            self.engine_s = time.perf_counter() - t
                            self.num_output_tokens = engine.stats().num_generated_tokens - before
                except TensorParallelError as e:  # a rank died or hung: nothing more is committed
                    failure = JobError(f"the engine's tensor-parallel group failed: {e}")
                    self.manifest.finish("failed", str(failure), None)
                    self.manifest.write()
                    if self.textfile is not None:
                        self.textfile.finish(1)
                    raise failure from None
                except (JobError, ConfigError) as e:
                    self.manifest.finish("failed", str(e), None)
                    self.manifest.write()
                    if self.textfile is not None:
                        self.textfile.finish(2 if isinstance(e, ConfigError) else 1)
                    raise
                stats = engine.stats()
            else:
                stats = None
            result = self.ledger.result(stop, self.num_output_tokens, time.perf_counter() - self.t0, self.engine_s)
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
                write_merged_manifest(self.store, list(self.plan.all_shards), self.worker.world_size)
            except Exception:  # the rank manifest is written; the next finisher merges again
                log.warning("could not merge the run manifest", exc_info=True)

    def _process(self, context: ShardContext, engine: Engine, stop: StopRequest) -> None:
        input_format = select_format(self.config, engine)
        progress = Progress(len(self.ledger.todo), self.config.quiet, self.textfile)
        ledger = self.ledger
        queue = ShardQueue(
            ledger.todo,
            list(self.plan.steal),
            ledger.claims,
            lambda shard: ledger.is_committed(shard, context.fingerprint),
            ledger.skip_claimed,
            lambda: stop.requested,
            on_error=ledger.claim_failed,
        )
        try:
            with progress.logging_redirected():
                ShardFlow(context, input_format, ledger, self.fence, engine, progress, stop, queue).run()
        finally:
            progress.close()
