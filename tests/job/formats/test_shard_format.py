"""Input formats (formats/shard_format.py): the run's format is picked by data.format, and each turns its own
rows into prompts, sample counts and lines, over real files and the tiny model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.engine import SamplingParams
from batchrun.job.commit.store import DEFAULT_FILES
from batchrun.job.errors import ConfigError, ShardError
from batchrun.job.formats.rows import DUPLICATE_ID
from batchrun.job.formats.shard_format import OpenAIBatchFormat, ParquetFormat, RowOutputs, format_class, select_format
from batchrun.job.shards import Shard


def _config(tmp_path: Path, model_dir: str, *extra: str) -> Any:
    return cli.load_config(
        [f"model.path={model_dir}", f"data.uri={tmp_path / 'in'}", f"output.uri={tmp_path / 'out'}", *extra]
    )


def _shard(path: Path) -> Shard:
    return Shard(path.stem, str(path), str(path), path.stat().st_size, "v")


def _rows(input_format: Any, path: Path, fs: Any) -> list[Any]:
    reader = input_format.open_reader(_shard(path), fs)
    try:
        return list(reader.rows())
    finally:
        reader.close()


def test_data_format_picks_the_format_and_its_files(tmp_path, tiny_engine, tiny_llama_dir):
    parquet = select_format(_config(tmp_path, tiny_llama_dir), tiny_engine)
    batch = select_format(_config(tmp_path, tiny_llama_dir, "data.format=openai_batch"), tiny_engine)
    assert type(parquet) is ParquetFormat and format_class(parquet.config) is ParquetFormat
    assert type(batch) is OpenAIBatchFormat and format_class(batch.config) is OpenAIBatchFormat
    assert parquet.files == DEFAULT_FILES and not parquet.has_lines
    assert batch.files == (*DEFAULT_FILES, "output.jsonl", "errors.jsonl") and batch.has_lines
    assert "tool_calls" in batch.optional_columns() and "tool_calls" not in parquet.optional_columns()


def test_start_up_checks_belong_to_their_format(tmp_path, tiny_llama_dir):
    template = _config(tmp_path, tiny_llama_dir, "data.format=openai_batch", "job.prompt_template='Q: {text}'")
    with pytest.raises(ConfigError) as info:
        OpenAIBatchFormat.check_config(template)
    assert info.value.key == "job.prompt_template"
    ParquetFormat.check_config(_config(tmp_path, tiny_llama_dir, "job.prompt_template='Q: {text}'"))

    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "a.parquet"
    pq.write_table(pa.table({"key": ["a"], "text": ["t"]}), path)
    config = _config(tmp_path, tiny_llama_dir, "data.id_column=idx")
    with pytest.raises(ConfigError) as info:
        ParquetFormat.check_first_shard(config, _fs(), _shard(path))
    assert info.value.key == "data.id_column" and "'idx'" in str(info.value)
    OpenAIBatchFormat.check_first_shard(config, _fs(), _shard(path))  # batch files have no id column


def _fs() -> Any:
    import fsspec

    return fsspec.filesystem("file")


def test_parquet_rows_become_prompts_with_the_jobs_samples(tmp_path, tiny_engine, tiny_llama_dir):
    config = _config(tmp_path, tiny_llama_dir, "sampling.n=3", "sampling.temperature=1.0")
    parquet = select_format(config, tiny_engine)
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "a.parquet"
    pq.write_table(pa.table({"id": ["x", "x"], "text": ["Hello there", "Hello again"]}), path)
    first, second = _rows(parquet, path, _fs())
    seen: set[Any] = set()
    built = parquet.build(first, seen)
    assert built.prompt.token_ids and built.params is None and built.request is None and not built.seeded
    assert parquet.num_samples(built.prompt, built.params) == 3 == parquet.default_samples
    duplicate = parquet.build(second, seen)
    assert duplicate.prompt.token_ids is None and duplicate.prompt.error_type == DUPLICATE_ID
    assert parquet.error_line("a", second, DUPLICATE_ID, duplicate.prompt) is None


def _write_batch(path: Path, objects: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objects) + "\n")


def test_batch_lines_become_requests_with_their_own_samples_and_lines(tmp_path, tiny_engine, tiny_llama_dir):
    config = _config(tmp_path, tiny_llama_dir, "data.format=openai_batch")
    batch = select_format(config, tiny_engine)

    def line(custom_id: str, **body: Any) -> dict[str, Any]:
        body = {"model": tiny_llama_dir, "prompt": "The Python language", "max_tokens": 4, **body}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}

    path = tmp_path / "in" / "b.jsonl"
    _write_batch(path, [line("a", n=2, seed=5, temperature=1.0), "not json", line("a"), line("b", n=9999)])
    good, broken, repeated, too_many = _rows(batch, path, _fs())
    seen: set[Any] = set()

    built = batch.build(good, seen)
    assert built.prompt.token_ids and built.params is not None and built.seeded and built.request.custom_id == "a"
    assert batch.num_samples(built.prompt, built.params) == 2 and batch.default_samples == 1

    no_request = batch.build(broken, seen)
    assert no_request.prompt.token_ids is None and "line 2" in (no_request.prompt.error_message or "")
    assert batch.num_samples(no_request.prompt, no_request.params) == 1  # an error line answers once
    error = batch.error_line("b", broken, no_request.prompt.error_type or "", no_request.prompt)
    assert error is not None and error["error"]["code"] == no_request.prompt.error_type

    assert batch.build(repeated, seen).prompt.error_type == DUPLICATE_ID
    assert batch.build(too_many, seen).prompt.token_ids is None

    # A row a committed part holds: a line that is no request has no id to remember.
    fresh: set[Any] = set()
    batch.see(broken, fresh)
    assert fresh == set()
    batch.see(good, fresh)
    assert batch.build(repeated, fresh).prompt.error_type == DUPLICATE_ID


def test_batch_row_line_waits_for_no_one_and_names_an_engine_failure(tmp_path, tiny_engine, tiny_llama_dir):
    """row_line is the request's one line: its choices in sample order, or an error line when the
    engine failed a sample."""
    config = _config(tmp_path, tiny_llama_dir, "data.format=openai_batch", "sampling.max_tokens=4")
    batch = select_format(config, tiny_engine)
    body = {"model": tiny_llama_dir, "prompt": "The Python language", "max_tokens": 4, "n": 2, "temperature": 1.0}
    path = tmp_path / "in" / "b.jsonl"
    _write_batch(path, [{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body}])
    (row,) = _rows(batch, path, _fs())
    built = batch.build(row, set())
    outs = list(tiny_engine.stream(iter([_request(built)]), SamplingParams(max_tokens=4), 4))
    entry = RowOutputs(row, built.prompt, {}, built.request, built.params, 2)
    for out in sorted(outs, key=lambda o: o.sample_index):
        entry.outputs[out.sample_index] = out
    assert entry.is_complete
    from batchrun.job.formats.logprobs import TokenTexts

    line = batch.row_line("b", entry, TokenTexts(tiny_engine.tokenizer))
    assert line is not None and line["custom_id"] == "c" and line["error"] is None
    assert [c["index"] for c in line["response"]["body"]["choices"]] == [0, 1]
    import dataclasses

    entry.outputs[1] = dataclasses.replace(outs[0], sample_index=1, finish_reason="error", error="boom")
    failed = batch.row_line("b", entry, TokenTexts(tiny_engine.tokenizer))
    assert failed is not None and failed["error"]["message"] == "boom"
    batch.check_lines(1, 1)
    with pytest.raises(ShardError, match="batch output lines"):
        batch.check_lines(0, 1)


def _request(built: Any) -> Any:
    from batchrun.engine import EngineRequest

    return EngineRequest(request_id=(0, 0), prompt=built.prompt.token_ids, params=built.params)
