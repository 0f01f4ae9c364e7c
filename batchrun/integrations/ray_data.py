"""batchrun as a Ray Data stage: `ds.map_batches(BatchrunPredictor, fn_constructor_args=(config,), ...)`.

For pipelines whose rows are already a Ray Dataset. Each actor of the map loads one engine; its
`__call__` is async, so Ray Data runs several batches at once on the actor (its async UDF
concurrency) and their rows share that engine's continuous batching: a thread owns the engine and
streams the rows of every batch in flight through one `Engine.stream`.

Rows become prompts exactly as in a job (job/formats/prompts.py: the job's template, system
prompt, chat template, data.on_too_long), and each batch comes back as batchrun's result columns
(job/formats/writer.py: id, output, finish_reason, error_type, error_message, token counts,
timings, the optional sample and logprob columns, a reasoning model's reasoning columns, then
output.keep_columns). A row that cannot be
a prompt is a typed error row (null_prompt, prompt_too_long, template_error, null_id, ...); a
batch never fails for one bad row.
Greedy outputs are those of the job for the same rows and settings (an error message's "row N" is
the row's place in its batch here, in its shard in a job).

Ray's semantics apply here, not batchrun's: which rows are done, retries of failed tasks and any
checkpointing are Ray Data's (at-least-once where it retries), there is no commit marker, manifest,
claim or resume. Duplicate ids are not checked (a batch is not a shard). Prefer the launcher
(`launcher=ray`, job/launch/ray_launch.py) when the input is files and every row must be
committed exactly once across restarts; use this when the rows come out of, and go on into, a Ray
pipeline.

    import ray
    from batchrun.cli import load_config
    from batchrun.integrations.ray_data import BatchrunPredictor

    config = load_config(["job=summarize", "model.path=smollm2-135m"])
    ds = ray.data.read_parquet("s3://bucket/prompts/")
    out = ds.map_batches(BatchrunPredictor, fn_constructor_args=(config,), concurrency=4, num_gpus=1,
                         batch_size=64, batch_format="pyarrow")
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Optional, Union

import pyarrow as pa

from batchrun.engine import Engine, EngineRequest, RequestOutput, SamplingParams
from batchrun.job import RunConfig, build_run_config, load_engine
from batchrun.job.config import check_thinking
from batchrun.job.formats.logprobs import TokenTexts
from batchrun.job.formats.prompts import Prompt, PromptBuilder
from batchrun.job.formats.reader import InputRow
from batchrun.job.formats.rows import check_row
from batchrun.job.formats.writer import (
    error_result,
    logprob_columns,
    optional_columns,
    output_result,
    reasoning_columns,
    result_schema,
)
from batchrun.job.run.shard_run import IN_FLIGHT_PER_SEQ

Batch = Union[pa.Table, Mapping[str, Any], Any]  # a pyarrow Table, a dict of columns, or a pandas DataFrame


class BatchrunPredictor:
    """A Ray Data callable class: one engine per actor, batches in flight sharing it.

    `config`: a RunConfig (batchrun.cli.load_config) or its plain dict (RunConfig.to_dict()); its
    data.text_column, data.id_column, job.*, sampling.*, engine.* and output.keep_columns apply
    (data.uri, output.uri and launcher.* are not used). `engine`: reuse a loaded one (tests)."""

    def __init__(self, config: Union[RunConfig, Mapping[str, Any]], engine: Optional[Engine] = None) -> None:
        self.config = config if isinstance(config, RunConfig) else build_run_config(config)
        self.engine = engine or load_engine(self.config.engine)
        sampling = self.config.sampling
        reasoning = self.engine.think_tags is not None
        check_thinking(self.config, self.engine.think_tags)
        self.builder = PromptBuilder(
            self.config.job, self.config.data, self.engine.tokenizer, self.engine.max_model_len - sampling.max_tokens
        )
        self.optional = optional_columns(sampling, reasoning=reasoning)
        self.token_texts = TokenTexts(self.engine.tokenizer)
        self.loop = _EngineLoop(self.engine, sampling, IN_FLIGHT_PER_SEQ * self.engine.max_num_seqs)
        self.loop.start()

    async def __call__(self, batch: Batch) -> pa.Table:
        rows = _rows(batch)
        data, keep_columns = self.config.data, self.config.output.keep_columns
        prepared: list[tuple[Any, Prompt, Optional[SamplingParams], dict[str, Any]]] = []
        for index, values in enumerate(rows):
            row_id = values.get(data.id_column) if data.id_column else None
            row = InputRow(index, row_id, values)
            # Per row, never across rows: a batch is not a shard, its ids are not checked for repeats.
            prompt = (check_row(row, set(), data.id_column) if data.id_column else None) or self.builder.build(row)
            prepared.append((row_id, prompt, self._params_for(row_id), {c: values.get(c) for c in keep_columns}))
        waits = [
            self.loop.submit(prompt.token_ids, params) if prompt.token_ids is not None else None
            for _, prompt, params, _ in prepared
        ]
        outputs = await asyncio.gather(*(w for w in waits if w is not None))
        done = iter(outputs)
        results: list[dict[str, Any]] = []
        n = self.config.sampling.n
        for (row_id, prompt, _, keep), wait in zip(prepared, waits):
            if wait is None:
                error = error_result(
                    row_id, prompt.error_type or "", prompt.error_message, prompt.num_prompt_tokens, keep
                )
                samples = [dict(error) for _ in range(n)]
            else:
                samples = [
                    {
                        **output_result(row_id, out, prompt.error_message, keep),
                        **logprob_columns(out, self.config.sampling, self.token_texts),
                        **(reasoning_columns(out) if "reasoning" in self.optional else {}),
                    }
                    for out in sorted(next(done), key=lambda o: o.sample_index)
                ]
            for i, sample in enumerate(samples):
                if "sample_index" in self.optional:
                    sample["sample_index"] = i
                results.append(sample)
        return pa.Table.from_pylist(results, schema=self._schema(batch))

    def _params_for(self, row_id: Any) -> Optional[SamplingParams]:
        """A seeded sampled row gets the seed a job gives it (shard_run.ShardRun._params_for): the same
        row samples the same text here as in a job. None keeps the shared params (greedy)."""
        sampling = self.config.sampling
        if sampling.seed is None or sampling.is_greedy:
            return None
        digest = hashlib.sha256(f"{sampling.seed}\0{row_id}".encode()).digest()
        return dataclasses.replace(sampling, seed=int.from_bytes(digest[:8], "little") >> 1)

    def _schema(self, batch: Batch) -> pa.Schema:
        schema = batch.schema if isinstance(batch, pa.Table) else None
        id_column = self.config.data.id_column
        id_type = schema.field(id_column).type if schema is not None and id_column in schema.names else None
        keep = [
            schema.field(c) if schema is not None and c in schema.names else pa.field(c, pa.string())
            for c in self.config.output.keep_columns
        ]
        return result_schema(keep, id_type, self.optional)


def _rows(batch: Batch) -> list[dict[str, Any]]:
    """A batch in any of Ray Data's formats as a list of {column: Python value}."""
    if isinstance(batch, pa.Table):
        rows: list[dict[str, Any]] = batch.to_pylist()
        return rows
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        return [dict(r) for r in batch.to_dict("records")]
    columns = {k: (v.tolist() if hasattr(v, "tolist") else list(v)) for k, v in dict(batch).items()}
    num_rows = len(next(iter(columns.values()), []))
    return [{k: v[i] for k, v in columns.items()} for i in range(num_rows)]


class _EngineLoop(threading.Thread):
    """The one thread that steps the engine: requests from any batch (any event loop) go into one
    stream; each request's outputs (sampling.n of them) resolve its asyncio future."""

    def __init__(self, engine: Engine, sampling: SamplingParams, max_in_flight: int) -> None:
        super().__init__(daemon=True, name="batchrun-ray-data-engine")
        self.engine, self.sampling, self.max_in_flight = engine, sampling, max_in_flight
        self.inbox: queue.Queue[tuple[int, list[int], Optional[SamplingParams], _Waiter]] = queue.Queue()
        self.waiting: dict[int, _Waiter] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    def submit(self, token_ids: list[int], params: Optional[SamplingParams]) -> asyncio.Future[list[RequestOutput]]:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future(), (params or self.sampling).n)
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
        self.inbox.put((request_id, token_ids, params, waiter))
        return waiter.future

    def run(self) -> None:
        while True:  # a stream ends when the engine fails; the next request starts another
            try:
                for out in self.engine.stream(self._requests(), self.sampling, self.max_in_flight):
                    waiter = self.waiting[out.request_id]
                    waiter.outputs.append(out)
                    if len(waiter.outputs) == waiter.num_samples:
                        del self.waiting[out.request_id]
                        waiter.resolve()
            except Exception as e:  # the engine itself: every request in it fails, the actor goes on
                for waiter in self.waiting.values():
                    waiter.fail(e)
                self.waiting.clear()

    def _requests(self) -> Iterator[Optional[EngineRequest]]:
        """Blocks while the engine has nothing to do; else None lets it step (Engine.stream)."""
        while True:
            try:
                item = self.inbox.get(block=not self.waiting)
            except queue.Empty:
                yield None
                continue
            request_id, token_ids, params, waiter = item
            self.waiting[request_id] = waiter
            yield EngineRequest(request_id=request_id, prompt=token_ids, params=params)


@dataclasses.dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[RequestOutput]]
    num_samples: int
    outputs: list[RequestOutput] = dataclasses.field(default_factory=list)

    def resolve(self) -> None:
        self.loop.call_soon_threadsafe(_set, self.future, list(self.outputs), None)

    def fail(self, error: BaseException) -> None:
        self.loop.call_soon_threadsafe(_set, self.future, None, error)


def _set(
    future: asyncio.Future[list[RequestOutput]], value: Optional[list[RequestOutput]], error: Optional[BaseException]
) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert value is not None
        future.set_result(value)
