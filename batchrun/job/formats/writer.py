"""Result and metrics files: their fixed columns, and writing result rows back in input order.

Rows finish in completion order; ResultWriter holds early finishers until every row before them
is written, then writes row groups incrementally, so memory stays bounded for large shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.engine import RequestOutput, SamplingParams
from batchrun.job.config import OPTIONAL_RESULT_COLUMNS, POOLED_RESULT_COLUMNS, REASONING_COLUMNS, RESULT_COLUMNS
from batchrun.job.formats.logprobs import LOGPROBS_TYPE, TokenTexts, cumulative_logprob, logprob_entries
from batchrun.job.formats.tool_calls import TOOL_CALLS_TYPE

RESULT_FIELDS: list[pa.Field] = [
    # The input row's id, in the id column's own type (result_schema), or "<shard>-<row index>"
    # text with data.id_column=null; null on null_id and some invalid_text rows.
    pa.field("id", pa.string()),
    pa.field("output", pa.string()),  # generated text (a reasoning model's: the answer only); null for error rows
    # stop | length | error (| tool_calls: batch chat choices with calls; | thinking_length: a
    # reasoning model's trace was still open at max_tokens, output "")
    pa.field("finish_reason", pa.string()),
    pa.field("error_type", pa.string()),  # null, or one of the typed errors (null_prompt, ...)
    pa.field("error_message", pa.string()),  # why; on ok rows a note such as a truncation
    pa.field("num_prompt_tokens", pa.int64()),  # null when the row was never tokenized
    pa.field("num_output_tokens", pa.int64()),  # null when the row never reached the engine
    pa.field("num_cached_tokens", pa.int64()),  # prompt tokens served from the prefix cache
    pa.field("ttft_s", pa.float64()),  # admission to first token
    pa.field("itl_s", pa.float64()),  # mean gap between output tokens (null with fewer than 2)
    pa.field("latency_s", pa.float64()),  # admission to finish
]
assert [f.name for f in RESULT_FIELDS] == RESULT_COLUMNS, "config.RESULT_COLUMNS names these fields"

OPTIONAL_RESULT_FIELDS: list[pa.Field] = [
    pa.field("sample_index", pa.int64()),  # with sampling.n > 1: which sample of the row, 0..n-1
    # with sampling.logprobs: the sum of the output tokens' logprobs, and per output token its id,
    # text and logprob with the top-N alternatives (logprobs.py); null on error rows
    pa.field("cumulative_logprob", pa.float64()),
    pa.field("logprobs", LOGPROBS_TYPE),
    # with sampling.prompt_logprobs: the same per prompt token after the first, given those before it
    pa.field("prompt_logprobs", LOGPROBS_TYPE),
    # batch files: a chat choice's parsed tool calls in OpenAI's message.tool_calls shape (id, type,
    # function {name, arguments as JSON text}); null when it holds none (tool_calls.py)
    pa.field("tool_calls", TOOL_CALLS_TYPE),
    # with model.lora_adapters: the adapter that served the row (null: the base model); an
    # unknown_adapter error row keeps the name it asked for
    pa.field("adapter", pa.string()),
    # with a reasoning model (the engine has think tags; config.REASONING_COLUMNS): the trace's text
    # (null when the output has none), the tokens between the tags and those after the closing
    # one (num_output_tokens also counts the tags the model wrote); null on error rows
    pa.field("reasoning", pa.string()),
    pa.field("num_reasoning_tokens", pa.int32()),
    pa.field("num_answer_tokens", pa.int32()),
]
assert [f.name for f in OPTIONAL_RESULT_FIELDS] == OPTIONAL_RESULT_COLUMNS

# embed and score runs (job.task): one vector per row where a generation run has its text and tokens.
POOLED_RESULT_FIELDS: list[pa.Field] = [
    pa.field("id", pa.string()),  # as in RESULT_FIELDS
    pa.field("embedding", pa.list_(pa.float32())),  # embed: the row's embedding; null for error rows
    # score: the head's output per label (a classifier's logits, a reward model's reward), in
    # label index order; null for error rows
    pa.field("score", pa.list_(pa.float32())),
    pa.field("label", pa.string()),  # score, num_labels > 1: the id2label name of the highest score
    pa.field("finish_reason", pa.string()),  # pooled | error
    pa.field("error_type", pa.string()),
    pa.field("error_message", pa.string()),
    pa.field("num_prompt_tokens", pa.int64()),  # tokens the model read (after truncation)
    # tokens cut off a prompt longer than the model's input limit (max_seq_length), as
    # sentence-transformers truncates; 0 when it fitted, null for rows the engine never ran
    pa.field("num_truncated_tokens", pa.int64()),
    pa.field("latency_s", pa.float64()),  # admission to finish
]
assert [f.name for f in POOLED_RESULT_FIELDS] == POOLED_RESULT_COLUMNS

METRICS_SCHEMA = pa.schema(
    [
        pa.field("shard", pa.string()),
        pa.field("worker", pa.int64()),  # launcher rank that processed the shard
        pa.field("num_rows", pa.int64()),
        pa.field("num_ok", pa.int64()),
        pa.field("num_errors", pa.int64()),
        pa.field("num_prompt_tokens", pa.int64()),
        pa.field("num_output_tokens", pa.int64()),
        pa.field("wall_s", pa.float64()),  # first read to last result, excluding the commit
        pa.field("output_tokens_per_s", pa.float64()),
        pa.field("total_tokens_per_s", pa.float64()),  # prompt plus output tokens
        pa.field("ttft_p50_s", pa.float64()),
        pa.field("ttft_p95_s", pa.float64()),
        pa.field("ttft_p99_s", pa.float64()),
        pa.field("itl_p50_s", pa.float64()),
        pa.field("itl_p95_s", pa.float64()),
        pa.field("itl_p99_s", pa.float64()),
        pa.field("prefix_cache_hit_rate", pa.float64()),  # cached / prompt tokens of the engine's requests
        pa.field("num_preemptions", pa.int64()),
        pa.field("peak_kv_blocks_used", pa.int64()),
        pa.field("num_kv_blocks_total", pa.int64()),
        pa.field("num_spec_proposed", pa.int64()),  # speculative tokens proposed; null with speculation off
        pa.field("num_spec_accepted", pa.int64()),
        pa.field("spec_acceptance_rate", pa.float64()),  # accepted / proposed; null with speculation off
        # MoE models (null for dense): per MoE layer, the tokens routed to each expert during the shard.
        pa.field("expert_token_counts", pa.list_(pa.list_(pa.int64()))),
        # Rows per second of wall time (every task; embed and score runs have no output tokens) and
        # prompt tokens per second; rows whose prompt was cut to the model's input limit (embed,
        # score) and the tokens cut.
        pa.field("rows_per_s", pa.float64()),
        pa.field("prompt_tokens_per_s", pa.float64()),
        pa.field("num_truncated_rows", pa.int64()),
        pa.field("num_truncated_tokens", pa.int64()),
        # A reasoning model's run (null otherwise): the rows' trace and answer tokens, and the rows
        # whose trace max_tokens cut (finish_reason thinking_length).
        pa.field("num_reasoning_tokens", pa.int64()),
        pa.field("num_answer_tokens", pa.int64()),
        pa.field("num_thinking_length", pa.int64()),
    ]
)

ROWS_PER_ROW_GROUP = 1024


ENGINE_ERROR = "engine_error"
# A constrained output (json_schema, regex, choice) that max_tokens cut before its grammar completed:
# the row keeps the text, typed so that nobody parses it as a complete, valid output.
TRUNCATED_STRUCTURED_OUTPUT = "truncated_structured_output"
TRUNCATED_MESSAGE = "max_tokens cut the output before its constraint (json_schema, regex or choice) was complete"
# The engine's finish_reason for max_tokens reached inside a reasoning trace (no answer yet).
THINKING_LENGTH = "thinking_length"


def is_truncated_structured(out: RequestOutput) -> bool:
    """A constrained output max_tokens cut, in its answer or before it (inside the trace)."""
    return out.constrained and out.finish_reason in ("length", THINKING_LENGTH)


def error_result(
    row_id: Any, error_type: str, message: Optional[str], num_prompt_tokens: Optional[int], keep: dict[str, Any]
) -> dict[str, Any]:
    """The result row of an input row that never produced output."""
    return {
        "id": row_id,
        "output": None,
        "finish_reason": "error",
        "error_type": error_type,
        "error_message": message,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": None,
        "num_cached_tokens": None,
        "ttft_s": None,
        "itl_s": None,
        "latency_s": None,
        **keep,
    }


def optional_columns(
    sampling: SamplingParams, per_row: bool = False, adapters: bool = False, reasoning: bool = False
) -> list[str]:
    """The optional result columns these sampling settings add, in schema order. `per_row`: rows
    may ask for their own samples, logprobs and tools (batch requests' n, logprobs and tools), so
    those columns are always there (null for rows that did not ask). `adapters`: rows may name a
    LoRA adapter (model.lora_adapters). `reasoning`: the engine has think tags (Engine.think_tags)."""
    wanted = {
        "sample_index": sampling.n > 1 or per_row,
        "cumulative_logprob": sampling.logprobs is not None or per_row,
        "logprobs": sampling.logprobs is not None or per_row,
        "prompt_logprobs": sampling.prompt_logprobs is not None,
        "tool_calls": per_row,
        "adapter": adapters,
        **{c: reasoning for c in REASONING_COLUMNS},
    }
    return [c for c in OPTIONAL_RESULT_COLUMNS if wanted[c]]


def logprob_columns(out: RequestOutput, sampling: SamplingParams, texts: TokenTexts) -> dict[str, Any]:
    """The logprob columns of an engine output, as far as `sampling` asks for them."""
    columns: dict[str, Any] = {}
    if out.finish_reason == "error":
        return columns  # left null
    if sampling.logprobs is not None:
        entries = logprob_entries(out.token_ids, out.logprobs, sampling.logprobs, texts)
        columns["logprobs"] = entries
        columns["cumulative_logprob"] = cumulative_logprob(entries)
    if sampling.prompt_logprobs is not None:
        prompt = out.prompt_token_ids[1:]
        columns["prompt_logprobs"] = logprob_entries(prompt, out.prompt_logprobs, sampling.prompt_logprobs, texts)
    return columns


def reasoning_columns(out: RequestOutput) -> dict[str, Any]:
    """The reasoning columns of an engine output (runs whose engine has think tags); null for a
    failed one, as its output is."""
    if out.finish_reason == "error":
        return {}
    return {
        "reasoning": out.reasoning,
        "num_reasoning_tokens": out.num_reasoning_tokens,
        "num_answer_tokens": out.num_answer_tokens,
    }


def output_result(row_id: Any, out: RequestOutput, note: Optional[str], keep: dict[str, Any]) -> dict[str, Any]:
    """The result row of an engine output; an engine-side failure becomes a typed engine_error, a
    constrained output cut by max_tokens a typed truncated_structured_output (its text kept)."""
    failed = out.finish_reason == "error"
    truncated = is_truncated_structured(out)
    m = out.metrics
    return {
        "id": row_id,
        "output": None if failed else out.text,
        "finish_reason": out.finish_reason,
        "error_type": ENGINE_ERROR if failed else TRUNCATED_STRUCTURED_OUTPUT if truncated else None,
        "error_message": (out.error or "engine error") if failed else TRUNCATED_MESSAGE if truncated else note,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_output_tokens": len(out.token_ids),
        "num_cached_tokens": m.num_cached_tokens,
        "ttft_s": m.ttft_s,
        "itl_s": m.itl_s,
        "latency_s": m.latency_s,
        **keep,
    }


def pooled_result(
    row_id: Any,
    out: RequestOutput,
    note: Optional[str],
    keep: dict[str, Any],
    labels: Optional[Sequence[str]],
    job_truncated: int = 0,
) -> dict[str, Any]:
    """The result row of an embed or score output (both vector columns filled with it: the schema
    keeps the task's). The generation keys are set for the tallies (metrics.ShardTally) and left
    out of the file by its schema. `job_truncated`: tokens the job cut before the engine saw the
    prompt (data.on_too_long=truncate), counted with the engine's own cut."""
    failed = out.finish_reason == "error" or out.pooled is None
    vector = None if failed else np.asarray(out.pooled, dtype=np.float32).reshape(-1).tolist()
    label = None
    if vector is not None and labels is not None and len(labels) > 1:
        label = labels[int(np.argmax(np.asarray(vector)))]
    m = out.metrics
    truncated = None if failed else (m.num_truncated_tokens or 0) + job_truncated
    if truncated:
        note = note or f"truncated by {truncated} tokens to the model's input limit"
    return {
        "id": row_id,
        "embedding": vector,
        "score": vector,
        "label": label,
        "finish_reason": "error" if failed else out.finish_reason,
        "error_type": ENGINE_ERROR if failed else None,
        "error_message": (out.error or "engine error") if failed else note,
        "num_prompt_tokens": len(out.prompt_token_ids) if out.prompt_token_ids else None,
        "num_truncated_tokens": truncated,
        "latency_s": m.latency_s,
        "output": None,
        "num_output_tokens": 0,
        "num_cached_tokens": m.num_cached_tokens,
        "ttft_s": None,
        "itl_s": None,
        **keep,
    }


def pooled_fields(task: str, has_label: bool) -> list[pa.Field]:
    """The fixed columns of an embed or score run: the task's vector column, `label` with labels."""
    assert task in ("embed", "score"), task
    drop = {"score", "label"} if task == "embed" else {"embedding"} | (set() if has_label else {"label"})
    return [f for f in POOLED_RESULT_FIELDS if f.name not in drop]


def result_schema(
    keep_fields: Sequence[pa.Field],
    id_type: Optional[pa.DataType] = None,
    optional: Sequence[str] = (),
    fixed: Optional[Sequence[pa.Field]] = None,
) -> pa.Schema:
    """The results schema: the fixed columns (`id` in the input's id type; text by default), the
    `optional` columns asked for (optional_columns), then the kept input columns. `fixed`: an embed
    or score run's (pooled_fields) instead of the generation columns."""
    base = RESULT_FIELDS if fixed is None else fixed
    fields = [f.with_type(id_type) if f.name == "id" and id_type is not None else f for f in base]
    extra = [f for f in OPTIONAL_RESULT_FIELDS if f.name in optional]
    return pa.schema([*fields, *extra, *keep_fields])


class ResultWriter:
    """Writes one results file; `put` takes rows in any order, the file gets them in input order."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, schema: pa.Schema) -> None:
        self.schema = schema
        self._fs = fs
        self._path = path
        self._file = fs.open(path, "wb")
        self._writer = pq.ParquetWriter(self._file, schema)
        self._pending: dict[int, dict[str, Any]] = {}  # finished rows waiting for an earlier one
        self._ready: list[dict[str, Any]] = []  # in order, not yet written
        self._next_index = 0
        self.num_rows = 0

    def put(self, index: int, row: dict[str, Any]) -> None:
        assert index >= self._next_index and index not in self._pending, f"row {index} written twice"
        self._pending[index] = row
        while self._next_index in self._pending:
            self._ready.append(self._pending.pop(self._next_index))
            self._next_index += 1
        if len(self._ready) >= ROWS_PER_ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if self._ready:
            self._writer.write_table(pa.Table.from_pylist(self._ready, schema=self.schema))
            self.num_rows += len(self._ready)
            self._ready = []

    def close(self) -> int:
        """Finish the file; every row from 0 up must have been put. Returns the row count."""
        assert not self._pending, f"rows {sorted(self._pending)[:5]}... finished but an earlier row is missing"
        self._flush()
        self._writer.close()
        self._file.close()
        return self.num_rows

    def abort(self) -> None:
        """Give up on the file and remove what was written (it was never visible: it is a temp name)."""
        try:
            self._writer.close()
            self._file.close()
            self._fs.rm(self._path)
        except Exception:  # best effort: a leftover temp file is removed when the shard is retried
            pass


def write_metrics(fs: fsspec.AbstractFileSystem, path: str, row: dict[str, Any]) -> None:
    with fs.open(path, "wb") as f:
        pq.write_table(pa.Table.from_pylist([row], schema=METRICS_SCHEMA), f)


def read_metrics(fs: fsspec.AbstractFileSystem, path: str) -> Optional[dict[str, Any]]:
    """A committed shard's metrics row, or None when it cannot be read."""
    try:
        with fs.open(path, "rb") as f:
            rows = pq.read_table(f).to_pylist()
        return rows[0] if rows else None
    except Exception:
        return None


def read_column(fs: fsspec.AbstractFileSystem, path: str, column: str) -> list[Any]:
    with fs.open(path, "rb") as f:
        values: list[Any] = pq.read_table(f, columns=[column]).column(column).to_pylist()
    return values
