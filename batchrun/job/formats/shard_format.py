"""Input formats: what a shard's rows are, how a row becomes engine requests, and what a row
writes besides its result rows.

A ShardRun (flow.py) holds one ShardFormat and never asks which it is. Two formats:
- `parquet`: *.parquet shards of rows; a row's prompt comes from job.prompt_template or
  job.prompt_column (prompts.py), every row runs `sampling` (n samples each).
- `openai_batch`: *.jsonl files of OpenAI batch requests (openai_files.py, openai_requests.py):
  each line is a row, its request's body sets its sampling params (its own n), and each row also
  gets one OpenAI batch output or error line; the attempt writes them to output.jsonl and
  errors.jsonl, committed with the results under the same marker.

Start-up checks that need no engine are class methods (`check_config`, `check_first_shard`); the
instance (`select_format`) holds what turns rows into prompts with the loaded engine's tokenizer.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Protocol

import pyarrow as pa

from batchrun.engine import Engine, RequestOutput, SamplingParams
from batchrun.job.commit.checkpoints import LineFiles
from batchrun.job.commit.store import DEFAULT_FILES
from batchrun.job.config import RunConfig
from batchrun.job.errors import ConfigError, JobError, ShardError
from batchrun.job.formats.logprobs import TokenTexts
from batchrun.job.formats.openai_files import BatchFileReader
from batchrun.job.formats.openai_requests import (
    BatchRequest,
    RequestBuilder,
    embeddings_line,
    error_line,
    response_line,
    tool_columns,
)
from batchrun.job.formats.prompts import UPSTREAM_ERROR, Prompt, PromptBuilder
from batchrun.job.formats.reader import InputRow, ShardReader
from batchrun.job.formats.rows import check_row, row_adapter
from batchrun.job.formats.tool_calls import resolve_template
from batchrun.job.formats.writer import ENGINE_ERROR, optional_columns
from batchrun.job.shards import Shard


class RowReader(Protocol):
    """One open input shard (reader.ShardReader, openai_files.BatchFileReader)."""

    num_rows: int

    @property
    def id_type(self) -> pa.DataType: ...

    def field(self, name: str) -> pa.Field: ...

    def rows(self) -> Iterator[InputRow]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RowPrompt:
    """A row as the format reads it: its prompt (or its error), its own sampling params (None:
    the job's), whether those chose their own seed, the format's request behind it (a batch
    request; None for Parquet rows) and the LoRA adapter it names (None: the base model; an
    unknown_adapter error row keeps the name it asked for)."""

    prompt: Prompt
    params: Optional[SamplingParams] = None
    seeded: bool = False
    request: Any = None
    adapter: Optional[str] = None


@dataclass
class RowOutputs:
    """A row whose samples are in the engine, and the outputs it has so far."""

    row: InputRow
    prompt: Prompt
    keep: dict[str, Any]  # the kept input columns (output.keep_columns)
    request: Any  # RowPrompt.request
    params: SamplingParams  # its own (a batch request's body, a row seed or schema) or the job's
    num_samples: int
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # sample index -> output

    @property
    def is_complete(self) -> bool:
        return len(self.outputs) == self.num_samples


class ShardFormat(ABC):
    """What a run needs to know of its input format; one instance serves every shard of a run."""

    name: ClassVar[str]
    extra_files: ClassVar[tuple[str, ...]] = ()  # attempt files it writes besides DEFAULT_FILES
    has_lines: ClassVar[bool] = False  # every input row also gets one line (ShardOutput.put_line)

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        # The engine recognises a reasoning model's think tags (select_format sets it): every
        # result row has the reasoning columns, every batch choice its reasoning_content.
        self.reasoning = False

    # ---- start-up, before the engine --------------------------------------------------------

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        """Refuse keys that mean nothing for this format (one ConfigError naming the key)."""
        return None

    @classmethod
    def check_first_shard(cls, config: RunConfig, fs: Any, first: Shard) -> None:
        """Checks of the first listed shard that would otherwise fail every shard alike."""
        return None

    # ---- one shard --------------------------------------------------------------------------

    @property
    def files(self) -> tuple[str, ...]:
        """The attempt's files its marker commits (store.PUBLISHED_FILES keys)."""
        return (*DEFAULT_FILES, *self.extra_files)

    @property
    def default_samples(self) -> int:
        """Result rows counted per input row when a shard opens (corrected per row as it is read)."""
        return self.config.sampling.n

    def optional_columns(self) -> list[str]:
        return optional_columns(
            self.config.sampling, per_row=self.has_lines, adapters=self.config.has_adapters, reasoning=self.reasoning
        )

    @abstractmethod
    def open_reader(self, shard: Shard, fs: Any) -> RowReader: ...

    @abstractmethod
    def build(self, row: InputRow, seen_ids: set[Any]) -> RowPrompt:
        """The row's prompt or error; `seen_ids` (the shard's earlier ids) gains the row's id."""

    def see(self, row: InputRow, seen_ids: set[Any]) -> None:
        """A row a committed part holds: its id counts for the duplicate check of the rows after it."""
        check_row(row, seen_ids, self.config.data.id_column)

    def carries_sample_index(self, reader: RowReader) -> bool:
        """The shard's rows are samples of a previous run (its results with sample_index): each
        result row carries its input row's sample_index."""
        return False

    def num_samples(self, prompt: Prompt, params: Optional[SamplingParams]) -> int:
        """Result rows of a row whose prompt and final params (seed, schema) are these."""
        return self.config.sampling.n

    def sample_columns(self, entry: RowOutputs, out: RequestOutput, shard: str) -> dict[str, Any]:
        """Result columns the format adds to a sample's result row."""
        return {}

    def error_line(self, shard: str, row: InputRow, error_type: str, prompt: Prompt) -> Optional[dict[str, Any]]:
        """The line of a row that became an error row (has_lines formats)."""
        return None

    def row_line(self, shard: str, entry: RowOutputs, texts: TokenTexts) -> Optional[dict[str, Any]]:
        """The line of a row whose samples are all done (has_lines formats)."""
        return None

    def line_files(self) -> Optional[LineFiles]:
        """Where the rows' lines go (has_lines formats)."""
        return None

    def check_lines(self, num_lines: int, num_rows: int) -> None:
        """Before commit: the attempt's lines (has_lines formats) cover every input row."""
        return None


class ParquetFormat(ShardFormat):
    name = "parquet"

    def __init__(self, config: RunConfig, prompts: PromptBuilder) -> None:
        super().__init__(config)
        self.prompts = prompts
        self.columns = [*config.job.input_columns(config.data), *config.output.keep_columns]

    @classmethod
    def check_first_shard(cls, config: RunConfig, fs: Any, first: Shard) -> None:
        """A misspelled data.id_column must not silently become positional ids: the first shard must
        have it (a later shard without it fails on its own). A previous run's results must have the
        text and response columns too: a first run that did not keep its input column would fail
        every shard alike."""
        try:
            with fs.open(first.path, "rb") as f:
                import pyarrow.parquet as pq

                schema = pq.read_schema(f)
        except Exception:  # unreadable: that shard fails with its own message later
            return
        names = schema.names
        column = config.data.id_column
        if column is not None and column not in names:
            raise ConfigError(
                "data.id_column",
                f"no column {column!r} in {first.url} (it has {', '.join(names)}); "
                "set data.id_column to the id column, or null for ids <shard>-<row index>",
            )
        if not is_results_file(schema):
            return
        for key, column in (
            ("data.text_column", config.data.text_column),
            ("data.response_column", config.data.response_column),
        ):
            if column is not None and column not in names:
                raise ConfigError(
                    key,
                    f"no column {column!r} in {first.url}, a previous run's results (it has {', '.join(names)}); "
                    f"rerun the first run with output.keep_columns=[{column}] to carry it into its results",
                )

    def open_reader(self, shard: Shard, fs: Any) -> RowReader:
        reader = ShardReader(shard, fs, self.config.data, self.columns)
        if not is_results_file(reader.schema):
            return reader
        # A previous run's results: its error rows and sample indices must be read too.
        extra = [c for c in (*UPSTREAM_COLUMNS, SAMPLE_INDEX) if c in reader.schema.names and c not in self.columns]
        if not extra:
            return reader
        reader.close()
        return ShardReader(shard, fs, self.config.data, [*self.columns, *extra])

    def carries_sample_index(self, reader: RowReader) -> bool:
        schema = getattr(reader, "schema", None)
        if self.config.sampling.n > 1:  # this run's own samples number the result rows
            return False
        return isinstance(schema, pa.Schema) and is_results_file(schema) and SAMPLE_INDEX in schema.names

    def _identity(self, row: InputRow) -> InputRow:
        """A previous run's row is (id, sample_index) with sampling.n > 1: its samples share an id."""
        if SAMPLE_INDEX in row.values and SAMPLE_INDEX not in self.columns and row.id is not None:
            return dataclasses.replace(row, id=(row.id, row.values[SAMPLE_INDEX]))
        return row

    def see(self, row: InputRow, seen_ids: set[Any]) -> None:
        check_row(self._identity(row), seen_ids, self.config.data.id_column)

    def build(self, row: InputRow, seen_ids: set[Any]) -> RowPrompt:
        checked = check_row(self._identity(row), seen_ids, self.config.data.id_column)
        if checked is not None:
            return RowPrompt(checked)
        upstream = row.values.get(UPSTREAM_COLUMNS[0])
        if upstream is not None and UPSTREAM_COLUMNS[0] not in self.columns:
            # A previous run's error row has nothing to run on: it stays an error row, typed as
            # such, so that every row of that run has one row here.
            message = f"the input run's row failed: {upstream}: {row.values.get(UPSTREAM_COLUMNS[1]) or ''}"
            return RowPrompt(Prompt(error_type=UPSTREAM_ERROR, error_message=message.rstrip(": ")))
        adapter, unknown = row_adapter(row, self.config.data.adapter_column, self.config.model.lora_adapters)
        if unknown is not None:  # checked before the engine: the engine would fail it the same way
            return RowPrompt(unknown, adapter=adapter)
        return RowPrompt(self.prompts.build(row), adapter=adapter)


class OpenAIBatchFormat(ShardFormat):
    name = "openai_batch"
    extra_files = ("output.jsonl", "errors.jsonl")
    has_lines = True

    def __init__(self, config: RunConfig, requests: RequestBuilder) -> None:
        super().__init__(config)
        self.requests = requests

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        """Keys that read Parquet columns or template rows mean nothing for batch files: refuse them
        rather than ignore them."""
        if config.job.prompt_template is not None:
            raise ConfigError(
                "job.prompt_template", "not used with data.format=openai_batch (requests carry their prompts)"
            )
        if config.output.keep_columns:
            raise ConfigError("output.keep_columns", "batch files have no columns to keep (data.format=openai_batch)")

    @property
    def default_samples(self) -> int:
        return 1  # a request's own n is known once its line is read

    def open_reader(self, shard: Shard, fs: Any) -> RowReader:
        return BatchFileReader(shard, fs)

    def build(self, row: InputRow, seen_ids: set[Any]) -> RowPrompt:
        # A line that is no request has no custom_id to check for uniqueness: its own error first.
        prompt = self.requests.check_line(row) or check_row(row, seen_ids, self.config.data.id_column)
        if prompt is not None:
            return RowPrompt(prompt)
        prompt, params, request = self.requests.build(row)
        seeded = request is not None and request.body.get("seed") is not None
        # body.model naming a configured adapter selects it (as vLLM serves LoRA adapters by name)
        adapter = request.model if request is not None and request.model in self.config.model.lora_adapters else None
        return RowPrompt(prompt, params, seeded, request, adapter)

    def see(self, row: InputRow, seen_ids: set[Any]) -> None:
        if self.requests.check_line(row) is None:
            check_row(row, seen_ids, self.config.data.id_column)

    def num_samples(self, prompt: Prompt, params: Optional[SamplingParams]) -> int:
        if prompt.engine_prompts:  # an embeddings request: one result row per input
            return len(prompt.engine_prompts)
        if prompt.token_ids is None or params is None:
            return 1  # an error line answers the request once, whatever n it asked for
        return params.n

    def sample_columns(self, entry: RowOutputs, out: RequestOutput, shard: str) -> dict[str, Any]:
        """A chat choice's parsed tool calls."""
        request: Optional[BatchRequest] = entry.request
        if request is None or request.is_embeddings:
            return {}
        return tool_columns(request, out, shard, entry.row.index)

    def error_line(self, shard: str, row: InputRow, error_type: str, prompt: Prompt) -> Optional[dict[str, Any]]:
        message = prompt.error_message or prompt.error_type or ""
        return error_line(shard, row.index, row.id, error_type, message)

    def row_line(self, shard: str, entry: RowOutputs, texts: TokenTexts) -> Optional[dict[str, Any]]:
        """One line per request, its n choices in sample order; its error line when the engine
        failed any sample (the first failed sample's message)."""
        outs = [entry.outputs[i] for i in range(entry.num_samples)]
        failed = next((o for o in outs if o.finish_reason == "error"), None)
        request: Optional[BatchRequest] = entry.request
        if request is None:  # rows in flight are requests that built: never
            return None
        if failed is None and request.is_embeddings:
            return embeddings_line(shard, entry.row.index, request, outs)
        if failed is None:
            return response_line(
                shard, entry.row.index, request, outs, entry.params.logprobs, texts, reasoning=self.reasoning
            )
        return error_line(shard, entry.row.index, request.custom_id, ENGINE_ERROR, failed.error or "engine error")

    def line_files(self) -> Optional[LineFiles]:
        """Answers to output.jsonl, error lines (a request or the engine failed) to errors.jsonl."""
        return LineFiles(self.extra_files, _line_file)

    def check_lines(self, num_lines: int, num_rows: int) -> None:
        if num_lines != num_rows:
            raise ShardError(f"{num_lines} batch output lines for {num_rows} requests; not committed")


def _line_file(line: dict[str, Any]) -> str:
    return "errors.jsonl" if line.get("error") is not None else "output.jsonl"


FORMATS: dict[str, type[ShardFormat]] = {ParquetFormat.name: ParquetFormat, OpenAIBatchFormat.name: OpenAIBatchFormat}


def format_class(config: RunConfig) -> type[ShardFormat]:
    return FORMATS[config.data.format]


# A results file of a batchrun run (writer.py) has these; a previous run's output as data.uri.
UPSTREAM_COLUMNS = ("error_type", "error_message")
SAMPLE_INDEX = "sample_index"  # a previous run's with sampling.n > 1: its rows are (id, sample_index)


def is_results_file(schema: pa.Schema) -> bool:
    """`schema` is a batchrun results file's: its error rows are error rows here too."""
    return {"id", "finish_reason", *UPSTREAM_COLUMNS} <= set(schema.names)


def engine_task(engine: Engine) -> str:
    """What the engine serves (generate, embed, score)."""
    return engine.task


def prompt_builders(config: RunConfig, engine: Engine) -> tuple[PromptBuilder, Optional[RequestBuilder]]:
    """What turns rows into prompts for this engine (a real run and a dry run alike): the
    PromptBuilder, and for batch files the RequestBuilder of their lines."""
    task = engine_task(engine)
    max_prompt_tokens: Optional[int] = None  # embed: the engine truncates to its limit itself
    if task == "score":
        max_prompt_tokens = engine.max_model_len
    elif task == "generate":
        max_prompt_tokens = engine.max_model_len - config.sampling.max_tokens
        if max_prompt_tokens <= 0:
            raise JobError(
                f"sampling.max_tokens={config.sampling.max_tokens} leaves no room for a prompt "
                f"within the engine's max_model_len={engine.max_model_len}"
            )
    embed_limit = engine.max_model_len if task == "embed" else None
    builder = PromptBuilder(config.job, config.data, engine.tokenizer, max_prompt_tokens, task, embed_limit)
    requests = None
    if format_class(config) is OpenAIBatchFormat:
        alias = config.data.openai_model_name
        requests = RequestBuilder(
            engine.tokenizer,
            engine.max_model_len,
            frozenset([config.model.path, *([alias] if alias else []), *config.model.lora_adapters]),
            config.sampling,
            config.job.system_prompt,
            resolve_template(config.job.tools_chat_template),
            task,
            engine.embedding_dim,
            config.job.template_kwargs,
        )
    return builder, requests


def select_format(config: RunConfig, engine: Engine) -> ShardFormat:
    """The run's format, ready to turn rows into prompts with `engine`'s tokenizer."""
    builder, requests = prompt_builders(config, engine)
    chosen: ShardFormat = (
        OpenAIBatchFormat(config, requests) if requests is not None else ParquetFormat(config, builder)
    )
    chosen.reasoning = engine_think_tags(engine) is not None
    return chosen


def engine_think_tags(engine: Engine) -> Any:
    """The engine's think tags (engine/reasoning.ThinkTags), None when it recognises no trace."""
    return engine.think_tags
