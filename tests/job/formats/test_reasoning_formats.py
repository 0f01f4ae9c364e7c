"""The job layer of reasoning models, function by function: the chat template's variables
(job.enable_thinking, job.chat_template_kwargs, a batch request's own) reach every render, the
config refuses what cannot work with one line naming the key, and a reasoning output becomes its
result columns, its shard metrics and its OpenAI batch choice. The runs themselves are in
tests/job/test_reasoning_job.py."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pytest

from batchrun.engine import RequestMetrics, RequestOutput, SamplingParams
from batchrun.engine.reasoning import find_think_tags
from batchrun.job import ConfigError, DataConfig, JobConfig
from batchrun.job.commit.fingerprint import differences, model_fingerprint, settings_fingerprint
from batchrun.job.config import REASONING_COLUMNS, build_run_config, check_thinking
from batchrun.job.formats.openai_requests import (
    INVALID_REQUEST,
    UNSUPPORTED_PARAMETER,
    BatchRequest,
    RequestBuilder,
    check_request,
    response_line,
)
from batchrun.job.formats.prompts import PromptBuilder
from batchrun.job.formats.reader import InputRow
from batchrun.job.formats.writer import (
    TRUNCATED_STRUCTURED_OUTPUT,
    is_truncated_structured,
    optional_columns,
    output_result,
    reasoning_columns,
    result_schema,
)
from batchrun.job.operate.metrics import ShardTally, metrics_row

MODEL = "tiny-reasoner"


@pytest.fixture(scope="module")
def tokenizer(tiny_reasoning_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_reasoning_dir)


@pytest.fixture(scope="module")
def tags(tokenizer):
    found = find_think_tags(tokenizer, None)
    assert found is not None and found.separator == "\n\n"
    return found


def raw(overrides: dict) -> dict:
    return {"model": {"path": "/m"}, "data": {"uri": "/d"}, **overrides}


# ---- config -----------------------------------------------------------------------------------


def test_enable_thinking_set_twice_or_a_template_parameter_in_the_kwargs_is_one_line():
    with pytest.raises(ConfigError) as e:
        build_run_config(raw({"job": {"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": True}}}))
    assert str(e.value).startswith("job.enable_thinking, job.chat_template_kwargs: both set enable_thinking")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^job.chat_template_kwargs: add_generation_prompt, tokenize: set by"):
        build_run_config(raw({"job": {"chat_template_kwargs": {"tokenize": True, "add_generation_prompt": False}}}))
    with pytest.raises(ConfigError, match=r"^job.chat_template_kwargs: expected a mapping"):
        build_run_config(raw({"job": {"chat_template_kwargs": "enable_thinking"}}))
    config = build_run_config(raw({"job": {"enable_thinking": False, "chat_template_kwargs": {"lang": "fr"}}}))
    assert config.job.template_kwargs == {"lang": "fr", "enable_thinking": False}
    assert JobConfig().template_kwargs == {}  # nothing passed: every existing template renders as before


def test_a_thinking_budget_needs_think_tags_and_a_generation_job(tags):
    budget = build_run_config(raw({"sampling": {"max_thinking_tokens": 8}}))
    with pytest.raises(ConfigError, match=r"^sampling.max_thinking_tokens: the model's tokenizer has no think tags"):
        check_thinking(budget, None)
    check_thinking(budget, tags)
    check_thinking(build_run_config(raw({})), None)
    for task in ("embed", "score"):
        with pytest.raises(ConfigError, match=rf"^sampling.max_thinking_tokens: a {task} job generates no reasoning"):
            build_run_config(raw({"job": {"task": task}, "sampling": {"max_thinking_tokens": 8}}))
    # the reasoning columns are the run's own only where the engine has tags: a kept input column
    # of that name is refused there, and kept as it is for any other model
    keep = build_run_config(raw({"output": {"keep_columns": ["reasoning"]}}))
    check_thinking(keep, None)
    with pytest.raises(ConfigError, match=r"^output.keep_columns: reasoning would overwrite"):
        check_thinking(keep, tags)


def test_the_fingerprint_covers_thinking_settings_and_the_resolved_tags(tokenizer, tags):
    base = build_run_config(raw({}))
    for overrides, key in [
        ({"job": {"enable_thinking": False}}, "job.enable_thinking"),
        ({"job": {"chat_template_kwargs": {"enable_thinking": False}}}, "job.chat_template_kwargs"),
        ({"sampling": {"max_thinking_tokens": 16}}, "sampling.max_thinking_tokens"),
    ]:
        changes = differences(settings_fingerprint(base), settings_fingerprint(build_run_config(raw(overrides))))
        assert [c.split(":")[0] for c in changes] == [key], changes
    with_tags = model_fingerprint("sha", tokenizer, "float32", tags)
    without = model_fingerprint("sha", tokenizer, "float32", None)
    assert with_tags["engine.think_tags"] == ["<think>", "</think>", "\n\n"]
    assert [c.split(":")[0] for c in differences(without, with_tags)] == ["engine.think_tags"]


# ---- prompts ----------------------------------------------------------------------------------


def prompt_ids(tokenizer, job: JobConfig, value) -> list[int]:
    builder = PromptBuilder(job, DataConfig(uri="/d"), tokenizer, 400)
    prompt = builder.build(InputRow(0, "r0", {"text": value}))
    assert prompt.token_ids is not None, prompt
    return prompt.token_ids


@pytest.mark.parametrize(
    "job",
    [JobConfig(enable_thinking=False), JobConfig(chat_template_kwargs={"enable_thinking": False})],
    ids=["enable_thinking", "chat_template_kwargs"],
)
def test_thinking_off_renders_a_closed_trace_in_text_and_message_rows(tokenizer, tags, job):
    on = JobConfig()
    for value in ("What is a list?", [{"role": "user", "content": "What is a list?"}]):
        off_ids, on_ids = prompt_ids(tokenizer, job, value), prompt_ids(tokenizer, on, value)
        assert tokenizer.decode(on_ids).endswith("<|im_start|>assistant\n<think>\n")
        assert off_ids[-len(tags.close_ids) :] == list(tags.close_ids)  # </think> and the separator
        assert tokenizer.decode(off_ids).endswith("<think>\n\n</think>\n\n")
    # data.response_column's conversations (score jobs) get the variables too
    builder = PromptBuilder(job, DataConfig(uri="/d", response_column="r"), tokenizer, 400, task="score")
    pair = builder.build(InputRow(0, "r0", {"text": "q", "r": "a"}))
    assert pair.token_ids is not None and tokenizer.decode(pair.token_ids).endswith(
        "<|im_start|>assistant\na<|im_end|>\n"
    )


def batch_row(body: dict, url: str = "/v1/chat/completions") -> InputRow:
    key = {"messages": [{"role": "user", "content": "What is a list?"}]} if "chat" in url else {"prompt": "hi"}
    line = {"custom_id": "c", "method": "POST", "url": url, "body": {"model": MODEL, **key, **body}}
    return InputRow(0, "c", {"line": line, "error": None, "line_no": 1})


def test_a_batch_request_merges_its_chat_template_kwargs_over_the_jobs(tokenizer, tags):
    defaults = SamplingParams(temperature=0.0, max_tokens=16)

    def build(body, job_kwargs=None, url="/v1/chat/completions"):
        builder = RequestBuilder(tokenizer, 512, frozenset([MODEL]), defaults, template_kwargs=job_kwargs)
        return builder.build(batch_row(body, url))[0]

    on, off = build({}), build({"chat_template_kwargs": {"enable_thinking": False}})
    assert tags.close_id not in on.token_ids and off.token_ids[-len(tags.close_ids) :] == list(tags.close_ids)
    job_off = build({}, {"enable_thinking": False})
    assert job_off.token_ids == off.token_ids
    assert (
        build({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": False}).token_ids == on.token_ids
    )
    bad = build({"chat_template_kwargs": "off"})
    assert (bad.error_type, bad.error_message) == (
        INVALID_REQUEST,
        "line 1: body.chat_template_kwargs must be an object, got str",
    )
    reserved = build({"chat_template_kwargs": {"tokenize": True}})
    assert reserved.error_type == INVALID_REQUEST and "tokenize" in (reserved.error_message or "")
    completion = build({"chat_template_kwargs": {"enable_thinking": False}}, url="/v1/completions")
    assert completion.error_type == UNSUPPORTED_PARAMETER


# ---- results, metrics, batch output -----------------------------------------------------------


def output(finish: str = "length", reasoning="why", trace: int = 3, answer: int = 4, **kw) -> RequestOutput:
    tokens = list(range(trace + answer + (2 if reasoning is not None else 0)))
    return RequestOutput(
        request_id=0,
        prompt_token_ids=[1, 2, 3],
        token_ids=tokens,
        text="" if finish == "thinking_length" else "the answer",
        finish_reason=finish,
        metrics=RequestMetrics(),
        reasoning=reasoning,
        num_reasoning_tokens=trace,
        num_answer_tokens=answer,
        **kw,
    )


def test_reasoning_columns_are_in_the_schema_once_per_run_and_null_on_errors():
    sampling = SamplingParams()
    assert optional_columns(sampling) == [] and optional_columns(sampling, reasoning=True) == REASONING_COLUMNS
    schema = result_schema([], None, optional_columns(sampling, reasoning=True))
    assert [(f.name, f.type) for f in schema][-3:] == [
        ("reasoning", pa.string()),
        ("num_reasoning_tokens", pa.int32()),
        ("num_answer_tokens", pa.int32()),
    ]
    row = {**output_result("r", output(), None, {}), **reasoning_columns(output())}
    assert (row["output"], row["reasoning"], row["num_reasoning_tokens"], row["num_answer_tokens"]) == (
        "the answer",
        "why",
        3,
        4,
    )
    no_trace = reasoning_columns(output(reasoning=None, trace=0))
    assert no_trace == {"reasoning": None, "num_reasoning_tokens": 0, "num_answer_tokens": 4}
    assert reasoning_columns(dataclasses.replace(output(), finish_reason="error")) == {}
    table = pa.Table.from_pylist(
        [row, output_result("e", dataclasses.replace(output(), finish_reason="error"), None, {})], schema=schema
    )
    assert table.column("reasoning").to_pylist() == ["why", None]
    # a trace max_tokens cut before a constrained answer began is a cut structured output too
    cut = output("thinking_length", answer=0, constrained=True)
    assert (
        is_truncated_structured(cut) and output_result("r", cut, None, {})["error_type"] == TRUNCATED_STRUCTURED_OUTPUT
    )
    assert not is_truncated_structured(output("thinking_length", answer=0))


def test_shard_metrics_sum_reasoning_tokens_only_for_reasoning_runs():
    from batchrun.engine import EngineStats

    rows = [
        {**output_result("a", output(), None, {}), **reasoning_columns(output())},
        {**output_result("b", out := output("thinking_length", answer=0), None, {}), **reasoning_columns(out)},
        {**output_result("c", o := output(reasoning=None, trace=0), None, {}), **reasoning_columns(o)},
    ]
    stats = EngineStats(16, 4, 0, 0, 0, 0, 0)
    tally = ShardTally(reasoning=True)
    for row in rows:
        tally.add(row)
    m = metrics_row("s", 0, tally, 1.0, stats, stats)
    assert (m["num_reasoning_tokens"], m["num_answer_tokens"], m["num_thinking_length"]) == (6, 8, 1)
    plain = ShardTally()
    plain.add(output_result("a", output(reasoning=None, trace=0), None, {}))
    m = metrics_row("s", 0, plain, 1.0, stats, stats)
    assert (m["num_reasoning_tokens"], m["num_answer_tokens"], m["num_thinking_length"]) == (None, None, None)


def test_batch_choices_carry_reasoning_content_and_usage_counts_the_traces():
    request = check_request(batch_row({}).values["line"], frozenset([MODEL]))
    assert isinstance(request, BatchRequest)
    outs = [
        output(),
        dataclasses.replace(output("thinking_length", answer=0), sample_index=1),
        output(reasoning=None, trace=0),
    ]
    line = response_line("s", 0, request, outs, reasoning=True)
    body = line["response"]["body"]
    messages = [c["message"] for c in body["choices"]]
    assert [m["reasoning_content"] for m in messages] == ["why", "why", None]
    assert [m["content"] for m in messages] == ["the answer", "", "the answer"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length", "length"]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in outs)
    json.dumps(line)
    # a model without tags: the lines are what they always were
    plain = response_line("s", 0, request, [output(reasoning=None, trace=0)])["response"]["body"]
    assert (
        "reasoning_content" not in plain["choices"][0]["message"] and "completion_tokens_details" not in plain["usage"]
    )
    completion = check_request(batch_row({}, "/v1/completions").values["line"], frozenset([MODEL]))
    assert isinstance(completion, BatchRequest)
    line = response_line("s", 0, completion, [output("thinking_length", answer=0)], reasoning=True)
    choice = line["response"]["body"]["choices"][0]
    assert (choice["finish_reason"], choice["reasoning_content"], choice["text"]) == ("length", "why", "")
