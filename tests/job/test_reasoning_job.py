"""Jobs over a reasoning model (a tiny random Qwen3 whose template opens a `<think>` trace,
batchrun.testing.make_tiny_reasoning_model), through the real engine, Parquet and batch files:
a thinking budget bounds every trace and the answer follows it; thinking off renders the closed
block and leaves no trace; a JSON schema applies to the answer after the trace; batch output
carries reasoning_content; every refusal is exit 2 with one line. One engine for the module;
the command-line runs load their own (the tiny model starts in well under a second)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.engine import EngineConfig, SamplingParams
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
from batchrun.job.operate.status import format_status, read_status, status_schema
from batchrun.job.operate.summary import format_summary
from batchrun.job.results import RunResult
from tests.support.engines import TINY_ENGINE, make_tiny_engine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BUDGET = 8
MAX_TOKENS = 24
NUM_ROWS = 4


@pytest.fixture(scope="module")
def engine(tiny_reasoning_dir):
    engine = make_tiny_engine(tiny_reasoning_dir, max_num_seqs=4)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def shard(tmp_path_factory, short_texts):
    data = tmp_path_factory.mktemp("reasoning_in")
    ids = [f"r{i}" for i in range(NUM_ROWS)]
    pq.write_table(pa.table({"id": ids, "text": short_texts[:NUM_ROWS]}), data / "part-00.parquet")
    return data


def config(model: str, data, out, **sampling) -> RunConfig:
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling}
    return RunConfig(
        job=JobConfig(name="think"),  # chat_template auto: text rows through the reasoning template
        model=ModelConfig(path=model),
        engine=EngineConfig(model=model, tune_kernels=False, **{**TINY_ENGINE, "max_num_seqs": 4}),
        sampling=SamplingParams(**params),
        data=DataConfig(uri=str(data)),
        output=OutputConfig(uri=str(out)),
        quiet=True,
    )


def run(cfg: RunConfig, engine) -> tuple[list[dict], RunResult]:
    result = run_job(cfg, engine=engine)
    assert (result.exit_code, [s.status for s in result.shards]) == (0, ["committed"]), result.message
    return pq.read_table(f"{cfg.output.uri}/results/part-00.parquet").to_pylist(), result


def test_a_thinking_budget_bounds_every_trace_and_the_answer_follows(tmp_path, tiny_reasoning_dir, engine, shard):
    out = tmp_path / "out"
    rows, result = run(config(tiny_reasoning_dir, shard, out, max_thinking_tokens=BUDGET), engine)
    schema = pq.read_schema(out / "results" / "part-00.parquet")
    assert (schema.field("reasoning").type, schema.field("num_reasoning_tokens").type) == (pa.string(), pa.int32())
    assert len(rows) == NUM_ROWS and all(r["error_type"] is None for r in rows)
    for r in rows:  # the template opened the trace: every row has one, closed by the model or the budget
        assert r["reasoning"] is not None and 0 < r["num_reasoning_tokens"] <= BUDGET, r
        assert r["output"] and r["num_answer_tokens"] > 0 and "</think>" not in r["reasoning"], r
        # the trace, the closing tag and the answer: every output token is one of them
        assert r["num_reasoning_tokens"] + 1 + r["num_answer_tokens"] == r["num_output_tokens"], r
        assert r["finish_reason"] == "length"  # ignore_eos: the answer runs to max_tokens
    metrics = pq.read_table(out / "metrics" / "part-00.parquet").to_pylist()[0]
    assert metrics["num_reasoning_tokens"] == sum(r["num_reasoning_tokens"] for r in rows)
    assert metrics["num_answer_tokens"] == sum(r["num_answer_tokens"] for r in rows)
    assert metrics["num_thinking_length"] == 0
    # where the run's token sums are shown, the traces' share is too
    reasoning = metrics["num_reasoning_tokens"]
    assert f"reasoning: {reasoning} tokens in traces" in format_summary(result)
    assert f"{reasoning:,} in traces" in (out / "report.html").read_text()
    status = read_status(str(out))
    jsonschema.validate(status.to_json(), status_schema())
    assert status.num_reasoning_tokens == reasoning
    assert f"({reasoning} output in reasoning traces)" in format_status(status)


def test_max_tokens_inside_the_trace_is_thinking_length(tmp_path, tiny_reasoning_dir, engine, shard):
    """No budget, and max_tokens too small for the random model to close its trace."""
    out = tmp_path / "out"
    rows, _ = run(config(tiny_reasoning_dir, shard, out, max_tokens=6), engine)
    assert [r["finish_reason"] for r in rows] == ["thinking_length"] * NUM_ROWS
    for r in rows:
        assert (r["output"], r["num_reasoning_tokens"], r["num_answer_tokens"]) == ("", 6, 0), r
        assert r["reasoning"] and r["error_type"] is None
    metrics = pq.read_table(out / "metrics" / "part-00.parquet").to_pylist()[0]
    assert (metrics["num_thinking_length"], metrics["num_reasoning_tokens"]) == (NUM_ROWS, 6 * NUM_ROWS)


def test_a_json_schema_constrains_the_answer_after_the_trace(tmp_path, tiny_reasoning_dir, engine, shard):
    pytest.importorskip("xgrammar")
    schema = {"type": "string", "enum": ["yes", "no"]}
    rows, _ = run(
        config(tiny_reasoning_dir, shard, tmp_path / "out", max_thinking_tokens=BUDGET, json_schema=schema), engine
    )
    for r in rows:
        assert r["error_type"] is None and r["finish_reason"] == "stop", r
        assert json.loads(r["output"]) in ("yes", "no"), r  # the answer alone: the trace is not in it
        assert r["reasoning"] is not None and 0 < r["num_reasoning_tokens"] <= BUDGET, r


def test_thinking_off_on_the_command_line_renders_the_closed_block(tmp_path, tiny_reasoning_dir, shard):
    """`job.enable_thinking=false`: the prompt ends with the template's closed, empty trace (seen
    in the engine's own prompt tokens, prompt_logprobs), and no row has a trace."""
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    overrides = [
        "job=generate",
        "job.chat_template=auto",
        "job.enable_thinking=false",
        "data.text_column=text",
        f"model.path={tiny_reasoning_dir}",
        f"data.uri={shard}",
        f"output.uri={out}",
        "engine.dtype=float32",
        "engine.kv_cache_memory=67108864",
        "engine.max_num_seqs=4",
        "engine.max_num_batched_tokens=1024",
        "engine.tune_kernels=false",
        f"sampling.max_tokens={MAX_TOKENS}",
        "sampling.ignore_eos=true",
        "sampling.prompt_logprobs=0",
        "quiet=true",
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(overrides)
    assert exit_info.value.code == 0
    rows = pq.read_table(out / "results" / "part-00.parquet").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(tiny_reasoning_dir)
    for r, text in zip(rows, pq.read_table(shard / "part-00.parquet").column("text").to_pylist()):
        messages = [{"role": "user", "content": text}]
        closed = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert r["num_prompt_tokens"] == len(tokenizer.encode(closed, add_special_tokens=False))
        tail = "".join(e["token"] for e in r["prompt_logprobs"][-6:])  # <think> \n \n </think> \n \n
        assert tail == "<think>\n\n</think>\n\n", tail
        assert (r["reasoning"], r["num_reasoning_tokens"]) == (None, 0), r
        assert r["num_answer_tokens"] == r["num_output_tokens"] and r["output"], r
    metrics = pq.read_table(out / "metrics" / "part-00.parquet").to_pylist()[0]
    assert (metrics["num_reasoning_tokens"], metrics["num_thinking_length"]) == (0, 0)


def batch_line(custom_id: str, model: str, **body) -> str:
    messages = [{"role": "user", "content": "Explain what a Python list is, briefly."}]
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, **body},
    }
    return json.dumps(line)


def test_batch_output_carries_reasoning_content(tmp_path, tiny_reasoning_dir, engine):
    data = tmp_path / "in"
    data.mkdir()
    lines = [
        batch_line("think", tiny_reasoning_dir),
        batch_line("off", tiny_reasoning_dir, chat_template_kwargs={"enable_thinking": False}),
        batch_line("cut", tiny_reasoning_dir, max_tokens=4),  # under the budget: the trace is cut
        batch_line("bad", tiny_reasoning_dir, chat_template_kwargs=["enable_thinking"]),
    ]
    (data / "batch.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    cfg = RunConfig(
        job=JobConfig(name="openai_batch", chat_template="auto"),
        model=ModelConfig(path=tiny_reasoning_dir),
        engine=EngineConfig(model=tiny_reasoning_dir, tune_kernels=False, **{**TINY_ENGINE, "max_num_seqs": 4}),
        sampling=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, max_thinking_tokens=BUDGET),
        data=DataConfig(uri=str(data), format="openai_batch"),
        output=OutputConfig(uri=str(out)),
        quiet=True,
    )
    result = run_job(cfg, engine=engine)
    assert result.exit_code == 0, result.message
    answers = {x["custom_id"]: x for x in map(json.loads, (out / "outputs" / "batch.jsonl").read_text().splitlines())}
    errors = [json.loads(x) for x in (out / "errors" / "batch.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("bad", "invalid_request")]
    assert "chat_template_kwargs must be an object" in errors[0]["error"]["message"]
    think = answers["think"]["response"]["body"]
    choice = think["choices"][0]
    assert choice["message"]["reasoning_content"] and choice["message"]["content"] is not None
    assert 0 < think["usage"]["completion_tokens_details"]["reasoning_tokens"] <= BUDGET
    off = answers["off"]["response"]["body"]
    assert off["choices"][0]["message"]["reasoning_content"] is None
    assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert off["usage"]["prompt_tokens"] > think["usage"]["prompt_tokens"]  # the closed block
    cut = answers["cut"]["response"]["body"]["choices"][0]
    assert (cut["finish_reason"], cut["message"]["content"]) == ("length", "")
    assert cut["message"]["reasoning_content"]
    rows = {r["id"]: r for r in pq.read_table(out / "results" / "batch.parquet").to_pylist()}
    assert rows["cut"]["finish_reason"] == "thinking_length" and rows["off"]["reasoning"] is None
    assert rows["think"]["reasoning"] == choice["message"]["reasoning_content"]


def exit_2(overrides: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(overrides)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    return err


def test_refusals_are_exit_2_with_one_line(tmp_path, tiny_reasoning_dir, shard, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = [f"model.path={tiny_reasoning_dir}", f"data.uri={shard}", f"output.uri={tmp_path / 'out'}", "quiet=true"]
    err = exit_2(
        ["job=generate", *base, "job.enable_thinking=false", "job.chat_template_kwargs={enable_thinking: true}"], capsys
    )
    assert err == (
        "batchrun: config error: job.enable_thinking, job.chat_template_kwargs: both set enable_thinking; "
        "set it in one of them only"
    )
    err = exit_2(["job=embed", *base, "sampling.max_thinking_tokens=8"], capsys)
    assert err.splitlines() == [
        "batchrun: config error: sampling.max_thinking_tokens: a embed job generates no reasoning trace; leave it null"
    ]


def test_a_budget_without_think_tags_stops_after_the_engine_loads(tmp_path, tiny_reasoning_dir, shard):
    """engine.think_tags=[]: the engine recognises no trace, so a budget cannot work; a real
    `python -m batchrun` process, one line on stderr, nothing committed."""
    out = tmp_path / "out"
    args = [
        "job=generate",
        f"model.path={tiny_reasoning_dir}",
        f"data.uri={shard}",
        f"output.uri={out}",
        "engine.dtype=float32",
        "engine.kv_cache_memory=67108864",
        "engine.max_num_seqs=2",
        "engine.max_num_batched_tokens=1024",
        "engine.tune_kernels=false",
        "engine.think_tags=[]",
        "sampling.max_thinking_tokens=8",
        "quiet=true",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "batchrun", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "sampling.max_thinking_tokens" in line]
    assert len(errors) == 1 and errors[0].startswith("batchrun: config error: sampling.max_thinking_tokens:"), (
        proc.stderr
    )
    assert "no think tags" in errors[0]
    assert not (out / "results").exists() or not any((out / "results").iterdir())
