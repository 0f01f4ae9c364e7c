"""One shard while it is open in the flow (flow.py): its reader, its results, its rows in flight.

A ShardRun is one attempt (store.py) that commits on its own as soon as every one of its rows has
its result row; results are written in input order by its ShardOutput (checkpoints.py), which
also commits parts as it goes. What a row is, and what it writes besides its result rows, is its
ShardFormat's (shard_format.py); what every shard of the run reads is its ShardContext.

Per-shard metrics with overlapping shards: a shard's wall time runs from its opening (first row
read) to its last result, so its tok/s is its own tokens over its own lifetime; overlapping shards'
rates are not additive (the run manifest has the worker's true rate). Request-level counts (cache
hits, preemptions, speculative proposals) are summed over the shard's own rows; the KV peak is the
engine's since the oldest shard open at this shard's opening started, and MoE expert counts are
the engine's over the shard's lifetime (both shared with overlapping shards).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa

from batchrun.engine import (
    Engine,
    EngineRequest,
    EngineSettings,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from batchrun.job.commit.checkpoints import (
    CheckpointPolicy,
    Resume,
    ShardOutput,
    parts_changes,
    read_parts,
    remove_parts,
    resume_from,
    tally_rows,
)
from batchrun.job.commit.claims import ClaimBook
from batchrun.job.commit.fence import FingerprintConflict, FingerprintFence
from batchrun.job.commit.fingerprint import fingerprint_changes, input_fingerprint, model_fingerprint
from batchrun.job.commit.manifest import utc_now
from batchrun.job.commit.store import Attempt, RunStore
from batchrun.job.config import RunConfig
from batchrun.job.errors import ConfigError, ShardError
from batchrun.job.formats.logprobs import TokenTexts
from batchrun.job.formats.prompts import Prompt
from batchrun.job.formats.reader import InputRow
from batchrun.job.formats.rows import INVALID_SCHEMA, with_row_schema
from batchrun.job.formats.shard_format import RowOutputs, RowPrompt, ShardFormat, engine_think_tags
from batchrun.job.formats.writer import (
    error_result,
    logprob_columns,
    output_result,
    pooled_fields,
    pooled_result,
    reasoning_columns,
    result_schema,
    write_metrics,
)
from batchrun.job.operate.metrics import ShardTally, metrics_row
from batchrun.job.operate.progress import Progress
from batchrun.job.results import ShardSummary
from batchrun.job.run.plan import WorkerPlan
from batchrun.job.run.signals import StopRequest
from batchrun.job.shards import Shard, refreshed

log = logging.getLogger(__name__)

IN_FLIGHT_PER_SEQ = 4  # requests the engine may hold at once, per sequence it runs


@dataclass(frozen=True)
class ShardContext:
    """What every shard of a run reads, fixed once the engine has loaded (`shard_context`)."""

    config: RunConfig
    store: RunStore
    data_fs: Any
    worker_rank: int
    sampling: SamplingParams  # the request defaults: a row's params unless its own replace them
    settings: Mapping[str, Any]  # the settings part of the run's fingerprint
    model: Mapping[str, Any]  # the model part of the run's fingerprint
    model_fingerprint: str  # the engine's, as the commit markers name it
    model_path: str
    engine_settings: EngineSettings  # what the engine resolved at start-up, as the manifest reports it
    block_size: int
    max_num_seqs: int  # sequences the engine runs at once
    max_in_flight: int  # requests the engine holds at once

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The run's fingerprint but for the input: a marker must match it to count as this run's."""
        return {"settings": self.settings, "model": self.model}


def shard_context(config: RunConfig, store: RunStore, data_fs: Any, plan: WorkerPlan, engine: Engine) -> ShardContext:
    """The run's context once `engine` has loaded: the one place the job reads the engine's settings."""
    max_num_seqs = engine.max_num_seqs
    return ShardContext(
        config=config,
        store=store,
        data_fs=data_fs,
        worker_rank=plan.worker.rank,
        sampling=config.sampling,
        settings=plan.settings,
        model=model_fingerprint(
            engine.model_fingerprint, engine.tokenizer, engine.settings.dtype, engine_think_tags(engine)
        ),
        model_fingerprint=engine.model_fingerprint,
        model_path=engine.model_path,
        engine_settings=engine.settings,
        block_size=engine.config.block_size,
        max_num_seqs=max_num_seqs,
        # Enough queued work to refill the batch as sequences finish, while memory stays bounded
        # for shards of any size.
        max_in_flight=IN_FLIGHT_PER_SEQ * (config.engine.max_num_seqs or max_num_seqs),
    )


class ShardRun:
    """One attempt at one shard while it is open: its reader, its results file, its rows in flight.

    Requests carry `(key, row index)` as their id; `key` tells the shards of one flow apart."""

    def __init__(
        self,
        context: ShardContext,
        format: ShardFormat,
        claims: ClaimBook,
        fence: FingerprintFence,
        shard: Shard,
        key: int,
        engine: Engine,
        progress: Progress,
        started_at: str,
    ) -> None:
        """`started_at`: when the ledger reported it running; `fence.check` runs before every commit."""
        self.context, self.format, self.claims, self.fence = context, format, claims, fence
        self.shard, self.key, self.engine, self.progress = shard, key, engine, progress
        self.config = context.config
        self.tally = ShardTally(reasoning=format.reasoning)
        self.in_flight: dict[int, RowOutputs] = {}  # row index -> the row while its samples run
        # Result rows of the rows read so far (the format says how many per row): the next row's first index.
        self.num_result_rows = 0
        # embed/score: the engine's vectors instead of text (writer.pooled_fields); no optional columns
        # but a batch file's sample_index (an embeddings request's inputs)
        self.task: str = engine.task
        self.labels: Optional[list[str]] = engine.labels
        self.optional_columns = self.format.optional_columns()
        self.fixed_fields: Optional[list[pa.Field]] = None
        if self.task != "generate":
            self.fixed_fields = pooled_fields(self.task, self.labels is not None and len(self.labels) > 1)
            self.optional_columns = [c for c in self.optional_columns if c == "sample_index"]
        self.token_texts = TokenTexts(engine.tokenizer)
        self.seen_ids: set[Any] = set()
        self.is_read = False  # every row was read and either admitted or written as an error row
        self.failure: Optional[BaseException] = None  # set when the shard cannot go on
        # Earlier attempts at it died with their worker: it may be what kills workers (see ShardFlow).
        self.runs_alone = claims.died_before(shard.name) > 0
        self.started_at = started_at
        self.t0 = time.perf_counter()
        self.engine_before: EngineStats = engine.stats()
        store = context.store
        self.attempt: Attempt = store.begin(shard.name)
        try:
            # The input as it is now, not as listed (or planned) at start: what this attempt reads.
            try:
                self.shard = refreshed(shard, context.data_fs)
            except FileNotFoundError:
                raise ShardError(f"cannot read {shard.url}: it no longer exists") from None
            self.fingerprint = {**context.fingerprint, "input": input_fingerprint(self.shard)}
            self.reader = self.format.open_reader(self.shard, context.data_fs)
            try:
                keep_fields = [self.reader.field(c) for c in self.config.output.keep_columns]
                # A previous run's samples as input: each result row carries its sample_index.
                self.carries_sample_index = self.format.carries_sample_index(self.reader)
                if self.carries_sample_index and "sample_index" not in self.optional_columns:
                    self.optional_columns = [*self.optional_columns, "sample_index"]
                schema = result_schema(keep_fields, self.reader.id_type, self.optional_columns, self.fixed_fields)
                self.resume = self._resume()
                output = self.config.output
                self.output = ShardOutput(
                    store,
                    self.attempt,
                    schema,
                    lines=self.format.line_files(),
                    policy=CheckpointPolicy(output.checkpoint_rows, output.checkpoint_s),
                    resume=self.resume,
                    part_marker=self._part_fields,
                    before_commit=fence.check,
                )
            except BaseException:
                self.reader.close()
                raise
        except BaseException:
            store.abandon(self.attempt)
            raise
        progress.add_rows(self.reader.num_rows * self.format.default_samples)

    def _resume(self) -> Resume:
        """Take over the shard's committed parts (checkpoints.py): their rows are not run again,
        and they count in this shard's metrics. Parts computed with other settings, model or input
        are redone (output.on_change=recompute) or stop the run (error)."""
        store = self.context.store
        parts = read_parts(store, self.shard.name)
        if not parts:
            return Resume()
        changes = parts_changes(parts, self.fingerprint)
        if changes and self.config.output.on_change == "error":
            raise ConfigError(
                "output.on_change",
                f"shard {self.shard.name} in {self.config.output.uri} has committed parts computed with other "
                f"settings, model or input ({'; '.join(changes[:4])}); use a new output.uri, or set "
                "output.on_change=recompute to redo them",
            )
        if changes:
            log.warning("shard %s: its parts differ (%s); recomputing it", self.shard.name, "; ".join(changes[:4]))
            remove_parts(store, self.shard.name)
            return Resume()
        resume = resume_from(parts)
        for row in tally_rows(store, parts):
            self.tally.add(row)
        for part in parts:
            self.tally.add_counts(part.request_counts)
        log.info(
            "shard %s: resuming after %d committed part(s): %d of %d rows done",
            self.shard.name,
            len(parts),
            len(resume.done),
            self.reader.num_rows,
        )
        return resume

    def _part_fields(self) -> dict[str, Any]:
        """What every part marker of this attempt carries besides its rows."""
        return {
            "input": self.shard.url,
            "owner": self.claims.owner,
            "worker": self.context.worker_rank,
            "committed_at": utc_now(),
            "fingerprint": self.fingerprint,
            "wall_s": self.resume.wall_s + time.perf_counter() - self.t0,
        }

    def checkpoint_if_due(self) -> None:
        if self.failure is None and self.output.is_due():
            self.output.checkpoint()

    def checkpoint_on_stop(self) -> None:
        """A stop signal: commit the finished rows as a part before the attempt is abandoned, so
        a graceful stop (Slurm's preemption SIGTERM) loses only the rows in flight."""
        if self.failure is None and not self.is_lost and self.output.policy.enabled:
            self.output.checkpoint()

    @property
    def is_lost(self) -> bool:
        """Our claim was taken over (we froze past the lease): another worker runs it now."""
        return self.claims.is_lost(self.shard.name)

    @property
    def is_complete(self) -> bool:
        return self.is_read and not self.in_flight and self.failure is None

    def requests(self, stop: StopRequest) -> Iterator[EngineRequest]:
        """The shard's rows as engine requests, lazily; rows that cannot be prompts are written as
        error rows here. Ends early, with `is_read` false, on a stop, a lost claim or a read error."""
        keep_columns = self.config.output.keep_columns
        try:
            for row in self.reader.rows():
                if stop.requested or self.is_lost:
                    return
                done = self.resume.done.get(row.index)
                if done is not None:
                    self._skip_done(row, done)
                    continue
                keep = {c: row.values[c] for c in keep_columns}
                if self.carries_sample_index:
                    keep["sample_index"] = row.values.get("sample_index")
                built = self.format.build(row, self.seen_ids)
                if "adapter" in self.optional_columns:  # every result row of the row says which adapter
                    keep["adapter"] = built.adapter
                prompt, params = self._final_params(row, built)
                num_samples = self.format.num_samples(prompt, params)
                if num_samples != self.format.default_samples:
                    self.progress.add_rows(num_samples - self.format.default_samples)
                self.num_result_rows += num_samples
                self.output.expect(row.index, num_samples)
                if prompt.token_ids is None:
                    error = error_result(
                        row.id, prompt.error_type or "", prompt.error_message, prompt.num_prompt_tokens, keep
                    )
                    for sample in range(num_samples):  # one error row per (id, sample)
                        self._emit_row(row.index, sample, dict(error))
                    line = self.format.error_line(self.shard.name, row, error["error_type"], prompt)
                    if line is not None:
                        self.output.put_line(row.index, line)
                    continue
                self.in_flight[row.index] = RowOutputs(
                    row, prompt, keep, built.request, params or self.context.sampling, num_samples
                )
                if prompt.engine_prompts:  # an embed text, an embeddings request's inputs: one result row each
                    for i, engine_prompt in enumerate(prompt.engine_prompts):
                        yield EngineRequest(
                            request_id=(self.key, row.index, i),
                            prompt=engine_prompt,
                            params=params,
                            adapter=built.adapter,
                        )
                    continue
                yield EngineRequest(
                    request_id=(self.key, row.index), prompt=prompt.token_ids, params=params, adapter=built.adapter
                )
            self.is_read = True
        except Exception as e:
            # Raising here would unwind through the engine: the flow fails this shard alone.
            if not isinstance(e, ShardError):
                log.error("shard %s: unexpected error while reading it", self.shard.name, exc_info=True)
            self.failure = e

    def _final_params(self, row: InputRow, built: RowPrompt) -> tuple[Prompt, Optional[SamplingParams]]:
        """The row's prompt and params once its seed and its schema column apply (None: the
        stream's shared params); an invalid schema makes it an error row."""
        if built.prompt.token_ids is None:
            return built.prompt, built.params
        params, schema_error = self._with_row_schema(row, self._params_for(row, built.params, built.seeded))
        if schema_error is not None:
            return Prompt(error_type=INVALID_SCHEMA, error_message=schema_error), params
        return built.prompt, params

    def on_output(self, out: RequestOutput) -> None:
        """One sample of a row in flight is done: its result row now, the row's line (formats
        with lines) once every sample is in."""
        entry = self.in_flight[out.request_id[1]]
        # A row of several prompts numbers them in its request ids; samples of one prompt, the engine.
        sample = out.request_id[2] if len(out.request_id) > 2 else out.sample_index
        entry.outputs[sample] = out
        if entry.is_complete:
            del self.in_flight[entry.row.index]
        if self.task != "generate":
            # A text the engine tokenized: its own truncation count is the row's note, not the job's estimate.
            note = None if entry.prompt.engine_prompts else entry.prompt.error_message
            cut = entry.prompt.num_truncated_tokens
            result = pooled_result(entry.row.id, out, note, entry.keep, self.labels, cut)
        else:
            result = output_result(entry.row.id, out, entry.prompt.error_message, entry.keep)
            result.update(logprob_columns(out, entry.params, self.token_texts))
            if "reasoning" in self.optional_columns:
                result.update(reasoning_columns(out))
        result.update(self.format.sample_columns(entry, out, self.shard.name))
        self._emit_row(entry.row.index, sample, result, out.metrics)
        self.tally.add_request(out.metrics)
        if entry.is_complete:
            line = self.format.row_line(self.shard.name, entry, self.token_texts)
            if line is not None:
                self.output.put_line(entry.row.index, line)

    def commit(self) -> ShardSummary:
        """Write the results file (with the committed parts' rows) and commit the attempt (every
        row has its result row)."""
        self.reader.close()
        wall_s = self.resume.wall_s + time.perf_counter() - self.t0
        num_rows, num_lines = self.output.finish()
        if num_rows != self.num_result_rows:
            raise ShardError(
                f"{num_rows} result rows for {self.reader.num_rows} input rows with {self.num_result_rows} samples; "
                "not committed"
            )
        self.format.check_lines(num_lines, self.reader.num_rows)
        store = self.context.store
        metrics = metrics_row(
            self.shard.name, self.context.worker_rank, self.tally, wall_s, self.engine_before, self.engine.stats()
        )
        write_metrics(store.fs, self.attempt.metrics_tmp, metrics)
        fingerprint = self.fingerprint
        self.fence.check()
        is_first = store.commit(
            self.attempt,
            {
                "shard": self.shard.name,
                "input": self.shard.url,
                "num_rows": num_rows,
                "started_at": self.started_at,
                "committed_at": utc_now(),
                "worker": self.context.worker_rank,
                "owner": self.claims.owner,
                "model_fingerprint": self.context.model_fingerprint,
                "fingerprint": fingerprint,
                "error_counts": self.tally.error_counts,
                "metrics": metrics,
            },
            self.format.files,
        )
        if not is_first:
            winner = store.read_marker(self.shard.name) or {}
            changes = fingerprint_changes(winner.get("fingerprint") or {}, fingerprint, ("settings", "model"))
            if changes:  # a concurrent launch with other settings: never adopt its rows as ours
                raise FingerprintConflict(
                    "output.on_change",
                    f"shard {self.shard.name} was committed meanwhile by a launch with other settings or another "
                    f"model ({'; '.join(changes[:4])}); this worker stops",
                )
            log.warning(
                "shard %s was committed by another worker meanwhile; this attempt is discarded", self.shard.name
            )
            return ShardSummary(self.shard.name, "skipped", winner.get("metrics"))
        try:  # the marker has the rows now; the parts are only working state
            remove_parts(store, self.shard.name)
        except Exception:
            log.warning("shard %s: could not remove its committed parts", self.shard.name, exc_info=True)
        return ShardSummary(self.shard.name, "committed", metrics)

    def abandon(self) -> None:
        """Nothing more of this attempt is committed; its own files are removed (its committed
        parts stay: the next attempt resumes from them)."""
        self.output.abort()
        self.reader.close()
        self.context.store.abandon(self.attempt)

    def _skip_done(self, row: InputRow, num_results: int) -> None:
        """A row a committed part holds: counted, and its id seen, but not run again."""
        self.format.see(row, self.seen_ids)  # for the duplicate-id check of the rows after it
        self.num_result_rows += num_results
        if num_results != self.format.default_samples:
            self.progress.add_rows(num_results - self.format.default_samples)
        self.progress.advance(num_results, 0)

    def _params_for(
        self, row: InputRow, own: Optional[SamplingParams] = None, seeded: bool = False
    ) -> Optional[SamplingParams]:
        """Per-row seed from (sampling.seed, id): the same row samples the same text in any batch,
        shard split or resumed run (its n samples get seeds from it and their index, in the engine).
        None keeps the stream's shared params (greedy needs no seed).
        `own`: the row's params (a batch request's body); `seeded`: its own params chose the seed."""
        sampling = own or self.context.sampling
        if seeded or sampling.seed is None or sampling.is_greedy:
            return own
        digest = hashlib.sha256(f"{sampling.seed}\0{row.id}".encode()).digest()
        return dataclasses.replace(sampling, seed=int.from_bytes(digest[:8], "little") >> 1)

    def _with_row_schema(
        self, row: InputRow, params: Optional[SamplingParams]
    ) -> tuple[Optional[SamplingParams], Optional[str]]:
        column = self.config.data.schema_column
        if column is None or row.values.get(column) is None:
            return params, None  # None stays None: the stream's shared params
        return with_row_schema(row, params or self.context.sampling, column)

    def _emit_row(
        self, row: int, sample: int, result: dict[str, Any], metrics: Optional[RequestMetrics] = None
    ) -> None:
        """One result row, at its place: rows in input order, a row's samples in sample order."""
        if "sample_index" in self.optional_columns:
            result.setdefault("sample_index", sample)  # a previous run's sample keeps its own
        self.output.put(row, sample, result, metrics)
        self.tally.add(result)
        self.progress.advance(1, result.get("num_output_tokens") or 0, result)
