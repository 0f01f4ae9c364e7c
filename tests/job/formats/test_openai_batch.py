"""OpenAI batch files in and out (data.format=openai_batch): request lines checked into prompts and
sampling params, every line answered exactly once in OpenAI's batch output or errors format, and
the files committed and resumed like Parquet shards. Output lines are checked against the format
by a validator written from OpenAI's spec (BatchRequestOutput, chat.completion, text_completion)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchrun.engine import EngineConfig, SamplingParams
from batchrun.job import ConfigError, DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
from batchrun.job.formats.openai_requests import (
    BatchRequest,
    RequestError,
    check_request,
    sampling_params,
)
from tests.support import REPO

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ALIAS = "tiny-llama"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# ---- a validator written from OpenAI's batch output spec ------------------------------------


def check_output_line(line: dict[str, Any], url: str, n: int = 1, top_logprobs: int | None = None) -> None:
    """A line of a batch output file: a 200 response whose body is a chat.completion (chat url) or
    a text_completion (completions url) with n choices and consistent usage; with `top_logprobs`,
    each choice's logprobs in the url's shape with that many alternatives per token."""
    assert set(line) == {"id", "custom_id", "response", "error"}, line
    assert isinstance(line["id"], str) and line["id"].startswith("batch_req_")
    assert isinstance(line["custom_id"], str) and line["error"] is None
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"}
    assert response["status_code"] == 200 and isinstance(response["request_id"], str)
    body = response["body"]
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
    assert isinstance(body["id"], str) and isinstance(body["created"], int) and isinstance(body["model"], str)
    assert body["object"] == ("chat.completion" if url == CHAT else "text_completion")
    assert len(body["choices"]) == n
    for i, choice in enumerate(body["choices"]):
        assert choice["index"] == i and choice["finish_reason"] in ("stop", "length")
        check_logprobs(choice["logprobs"], url, top_logprobs)
        if url == CHAT:
            assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        else:
            assert isinstance(choice["text"], str)
    usage = body["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert isinstance(usage[key], int) and usage[key] >= 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0


def check_logprobs(logprobs: Any, url: str, top_logprobs: int | None) -> None:
    if top_logprobs is None:
        assert logprobs is None
        return
    if url == CHAT:
        assert set(logprobs) == {"content", "refusal"} and logprobs["refusal"] is None
        for entry in logprobs["content"]:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert isinstance(entry["token"], str) and entry["logprob"] <= 0
            assert entry["bytes"] == list(entry["token"].encode())
            tops = entry["top_logprobs"]
            assert len(tops) == top_logprobs and all(set(t) == {"token", "logprob", "bytes"} for t in tops)
            assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    else:
        assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        k = len(logprobs["tokens"])
        assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == k
        assert all(lp <= 0 for lp in logprobs["token_logprobs"])
        assert all(1 <= len(top) <= top_logprobs for top in logprobs["top_logprobs"])
        assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(k)]


def check_error_line(line: dict[str, Any]) -> None:
    """A line of a batch errors file."""
    assert set(line) == {"id", "custom_id", "response", "error"}, line
    assert isinstance(line["id"], str) and line["id"].startswith("batch_req_")
    assert line["custom_id"] is None or isinstance(line["custom_id"], str)
    assert line["response"] is None
    assert set(line["error"]) == {"code", "message"}
    assert isinstance(line["error"]["code"], str) and isinstance(line["error"]["message"], str)


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- request lines: unit checks ---------------------------------------------------------------


def request(body: dict[str, Any], url: str = CHAT, **line: Any) -> dict[str, Any]:
    key = {"messages": [{"role": "user", "content": "hi"}]} if url == CHAT else {"prompt": "hi"}
    return {"custom_id": "r", "method": "POST", "url": url, "body": {"model": ALIAS, **key, **body}, **line}


CHAT_LOGPROBS = {"logprobs": True, "top_logprobs": 2}
JSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "pick",
        "schema": {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]},
    },
}


def params_of(body: dict[str, Any], url: str = CHAT, defaults: SamplingParams | None = None):
    req = check_request(request(body, url), frozenset([ALIAS]))
    assert isinstance(req, BatchRequest), req
    return sampling_params(req, defaults or SamplingParams(temperature=1.0, max_tokens=64, seed=0))


def test_body_fields_override_the_job_defaults():
    defaults = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64, stop=("###",), seed=0)
    assert params_of({}, defaults=defaults) == defaults
    p = params_of(
        {"max_tokens": 3, "temperature": 0, "top_p": 0.5, "stop": "\n", "seed": 42, "n": 1}, defaults=defaults
    )
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed) == (3, 0.0, 0.5, ("\n",), 42)
    assert params_of({"n": 3}, defaults=defaults).n == 3 and params_of({}, defaults=defaults).n == 1
    # logprobs as OpenAI spells them: chat true + top_logprobs, completions an integer
    assert params_of({"logprobs": True, "top_logprobs": 4}).logprobs == 4
    assert params_of({"logprobs": True}).logprobs == 0 and params_of({"logprobs": False}).logprobs is None
    assert (
        params_of({"logprobs": 3}, COMPLETIONS).logprobs == 3 and params_of({"logprobs": 0}, COMPLETIONS).logprobs == 0
    )
    assert params_of({"max_completion_tokens": 5, "max_tokens": 9}).max_tokens == 5  # chat: the newer key wins
    assert params_of({"max_tokens": 7}, COMPLETIONS).max_tokens == 7
    assert params_of({"stop": ["a", "b"]}).stop == ("a", "b")
    # null means unset; fields that change nothing, and "off" values of unsupported ones, are accepted
    quiet = {"temperature": None, "user": "u", "stream": False, "presence_penalty": 0, "logprobs": False}
    assert params_of({**quiet, "response_format": {"type": "text"}, "logit_bias": {}}) == params_of({})
    # response_format: JSON mode is any object; a json_schema's schema constrains the output
    assert params_of({"response_format": {"type": "json_object"}}).json_schema == '{"type":"object"}'
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    assert json.loads(params_of({"response_format": fmt}).json_schema) == schema


@pytest.mark.parametrize(
    "body, url, code, words",
    [
        ({"n": 129}, CHAT, "invalid_request", "at most 128"),
        ({"n": 0}, CHAT, "invalid_request", "body.n"),
        ({"n": 2, "temperature": 0}, CHAT, "invalid_request", "temperature > 0"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, CHAT, "invalid_request", "schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            CHAT,
            "invalid_request",
            "json_schema",
        ),
        ({"response_format": "json"}, CHAT, "invalid_request", "response_format"),
        ({"temperature": "hot"}, CHAT, "invalid_request", "temperature"),
        ({"temperature": 2.5}, CHAT, "invalid_request", "temperature"),
        ({"top_p": 0}, CHAT, "invalid_request", "top_p"),
        ({"max_tokens": 0}, CHAT, "invalid_request", "max_tokens"),
        ({"max_tokens": True}, CHAT, "invalid_request", "max_tokens"),
        ({"max_tokens": 2.5}, COMPLETIONS, "invalid_request", "max_tokens"),
        ({"max_completion_tokens": 4}, COMPLETIONS, "unsupported_parameter", "max_completion_tokens"),
        ({"seed": "x"}, CHAT, "invalid_request", "seed"),
        ({"stop": ["a", 1]}, CHAT, "invalid_request", "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, CHAT, "invalid_request", "at most 4"),
        ({"presence_penalty": 0.5}, CHAT, "unsupported_parameter", "presence_penalty"),
        ({"logprobs": "yes"}, CHAT, "invalid_request", "true or false"),
        ({"top_logprobs": 3}, CHAT, "invalid_request", "needs body.logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, CHAT, "invalid_request", "[0, 20]"),
        ({"logprobs": 6}, COMPLETIONS, "invalid_request", "[0, 5]"),
        ({"logprobs": True}, COMPLETIONS, "invalid_request", "[0, 5]"),
        ({"top_logprobs": 2}, COMPLETIONS, "unsupported_parameter", "use logprobs"),
        ({"frobnicate": 1}, CHAT, "unsupported_parameter", "frobnicate"),
    ],
)
def test_bad_or_unsupported_body_fields_are_typed_errors(body, url, code, words):
    error = params_of(body, url)
    assert isinstance(error, RequestError) and error.code == code and words in error.message, error


@pytest.mark.parametrize(
    "change, code, words",
    [
        ({"method": "GET"}, "invalid_request", "method"),
        ({"url": "/v1/audio/speech"}, "invalid_request", "url"),
        ({"body": "text"}, "invalid_request", "body must be an object"),
        ({"body": {"model": ALIAS}}, "invalid_request", "body.messages is required"),
        ({"url": COMPLETIONS, "body": {"model": ALIAS}}, "invalid_request", "body.prompt is required"),
        ({"body": {"messages": []}}, "invalid_request", "body.model"),
        ({"body": {"model": "gpt-4o", "messages": []}}, "model_not_found", "gpt-4o"),
        ({"extra": 1}, "invalid_request", "unknown field"),
    ],
)
def test_bad_request_lines_are_typed_errors(change, code, words):
    error = check_request({**request({}), **change}, frozenset([ALIAS]))
    assert isinstance(error, RequestError) and error.code == code and words in error.message, error


def test_bundled_example_has_good_and_bad_requests_for_the_default_model():
    lines = read_lines(REPO / "batchrun" / "data" / "openai_batch" / "requests.jsonl")
    outcomes = []
    for line in lines:
        req = check_request(line, frozenset(["smollm2-135m"]))
        if isinstance(req, BatchRequest):
            req = sampling_params(req, SamplingParams())
        outcomes.append(req.code if isinstance(req, RequestError) else "ok")
    assert outcomes == ["ok", "ok", "ok", "model_not_found", "ok", "unsupported_parameter"]
    assert {line["url"] for line in lines} == {CHAT, COMPLETIONS}


# ---- whole runs ---------------------------------------------------------------------------------

GOOD_PROMPT = "The Python language reference describes"


def mixed_batch() -> tuple[list[str], dict[str, tuple[str, str]]]:
    """Lines of a batch file with good, malformed and mismatched lines; and what each custom_id
    expects: (output|error code, url)."""
    good_chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a module?"}]
    text_parts = [
        {"role": "user", "content": [{"type": "text", "text": "What is a "}, {"type": "text", "text": "class?"}]}
    ]
    lines: list[Any] = [
        ("chat-greedy", CHAT, {"messages": good_chat, "max_tokens": 6, "temperature": 0}),
        ("chat-parts", CHAT, {"messages": text_parts, "max_completion_tokens": 4, "temperature": 0}),
        ("cmpl-3", COMPLETIONS, {"prompt": GOOD_PROMPT, "max_tokens": 3, "temperature": 0}),
        ("cmpl-ids", COMPLETIONS, {"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0}),
        ("seeded-a", COMPLETIONS, {"prompt": GOOD_PROMPT, "seed": 123}),
        ("seeded-b", COMPLETIONS, {"prompt": GOOD_PROMPT, "seed": 123}),
        ("unseeded-a", COMPLETIONS, {"prompt": GOOD_PROMPT}),
        ("unseeded-b", COMPLETIONS, {"prompt": GOOD_PROMPT}),
        "{not json",
        "",  # a blank line is no request
        '["a", "list"]',
        {"method": "POST", "url": CHAT, "body": {"model": ALIAS, "messages": good_chat}},  # no custom_id
        {"custom_id": 17, "method": "POST", "url": CHAT, "body": {"model": ALIAS, "messages": good_chat}},
        {"custom_id": "wrong-method", "method": "GET", "url": CHAT, "body": {"model": ALIAS, "messages": good_chat}},
        {"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {"model": ALIAS, "input": "x"}},
        ("no-messages", CHAT, {}),
        ("no-prompt", COMPLETIONS, {}),
        ("bad-type", CHAT, {"messages": good_chat, "temperature": "hot"}),
        ("bad-message", CHAT, {"messages": [{"role": "user"}]}),
        ("other-model", CHAT, {"messages": good_chat, "model": "gpt-4o-mini"}),
        ("chat-greedy", CHAT, {"messages": good_chat, "max_tokens": 6}),  # a duplicate custom_id
        ("three-choices", CHAT, {"messages": good_chat, "n": 3}),
        ("json-schema", CHAT, {"messages": good_chat, "max_tokens": 40, "response_format": JSON_FORMAT}),
        ("too-long", COMPLETIONS, {"prompt": "word " * 600, "max_tokens": 2}),
        ("model-path", CHAT, {"messages": good_chat, "max_tokens": 2, "model": "<path>"}),
        ("chat-logprobs", CHAT, {"messages": good_chat, "max_tokens": 5, "temperature": 0, **CHAT_LOGPROBS}),
        ("cmpl-logprobs", COMPLETIONS, {"prompt": GOOD_PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 3}),
    ]
    expected = {
        "chat-greedy": "output",
        "chat-parts": "output",
        "cmpl-3": "output",
        "cmpl-ids": "output",
        "seeded-a": "output",
        "seeded-b": "output",
        "unseeded-a": "output",
        "unseeded-b": "output",
        "wrong-method": "invalid_request",
        "wrong-url": "invalid_request",
        "no-messages": "invalid_request",
        "no-prompt": "invalid_request",
        "bad-type": "invalid_request",
        "bad-message": "invalid_request",
        "other-model": "model_not_found",
        "three-choices": "output",
        "json-schema": "output",
        "too-long": "context_length_exceeded",
        "model-path": "output",
        "chat-logprobs": "output",
        "cmpl-logprobs": "output",
    }
    text = []
    for line in lines:
        if isinstance(line, tuple):
            custom_id, url, body = line
            line = {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": ALIAS, **body}}
        text.append(line if isinstance(line, str) else json.dumps(line))
    return text, expected


CHOICES = {"three-choices": 3}  # mixed_batch's requests with n > 1, and with logprobs
TOP_LOGPROBS = {"chat-logprobs": 2, "cmpl-logprobs": 3}


def write_batch(path: Path, lines: list[str], model_path: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).replace('"<path>"', json.dumps(model_path)) + "\n")


def batch_config(data_uri, output_uri, model_dir, **data) -> RunConfig:
    return RunConfig(
        job=JobConfig(name="openai_batch"),
        model=ModelConfig(path=model_dir),
        engine=EngineConfig(model=model_dir, max_num_seqs=4),
        sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=0),
        data=DataConfig(uri=str(data_uri), format="openai_batch", openai_model_name=ALIAS, **data),
        output=OutputConfig(uri=str(output_uri)),
        quiet=True,
    )


def test_round_trip_every_line_answered_once_in_openai_format(tmp_path, tiny_engine, tiny_llama_dir):
    lines, expected = mixed_batch()
    write_batch(tmp_path / "in" / "batch.jsonl", lines, tiny_llama_dir)
    (tmp_path / "in" / "notes.txt").write_text("not a batch file")
    (tmp_path / "in" / "_hidden.jsonl").write_text("{}\n")
    out = tmp_path / "out"
    result = run_job(batch_config(tmp_path / "in", out, tiny_llama_dir), engine=tiny_engine)
    assert (result.exit_code, [(s.name, s.status) for s in result.shards]) == (0, [("batch", "committed")])

    outputs, errors = read_lines(out / "outputs" / "batch.jsonl"), read_lines(out / "errors" / "batch.jsonl")
    urls = {json.loads(x)["custom_id"]: json.loads(x)["url"] for x in lines if x.startswith('{"custom_id": "')}
    for line in outputs:
        custom_id = line["custom_id"]
        check_output_line(line, urls[custom_id], CHOICES.get(custom_id, 1), TOP_LOGPROBS.get(custom_id))
    for line in errors:
        check_error_line(line)
    # One line per non-blank input line, none twice, input order kept within each file.
    num_requests = sum(1 for x in lines if x.strip())
    assert len(outputs) + len(errors) == num_requests
    assert len({x["id"] for x in outputs + errors}) == num_requests
    ok = {x["custom_id"]: x for x in outputs}
    assert list(ok) == [c for c, want in expected.items() if want == "output"]
    codes = [(x["custom_id"], x["error"]["code"]) for x in errors]
    assert codes == [
        (None, "invalid_json"),
        (None, "invalid_json"),
        (None, "invalid_request"),  # no custom_id
        (None, "invalid_request"),  # custom_id 17
        ("wrong-method", "invalid_request"),
        ("wrong-url", "invalid_request"),
        ("no-messages", "invalid_request"),
        ("no-prompt", "invalid_request"),
        ("bad-type", "invalid_request"),
        ("bad-message", "invalid_request"),
        ("other-model", "model_not_found"),
        ("chat-greedy", "duplicate_id"),
        ("too-long", "context_length_exceeded"),
    ]
    messages = {c: x["error"]["message"] for c, x in zip([c for c, _ in codes], errors) if c}
    assert "line 16: body.messages" in messages["no-messages"] and "gpt-4o-mini" in messages["other-model"]
    # response_format json_schema: the content parses and follows the schema
    content = json.loads(ok["json-schema"]["response"]["body"]["choices"][0]["message"]["content"])
    assert content in ({"a": "x"}, {"a": "y"})

    # body.n: one line, n choices sampled from one prefill, each its own sample (seeded from the
    # row's seed and its index), usage counting the prompt once and every choice's tokens
    three = ok["three-choices"]["response"]["body"]
    texts = [c["message"]["content"] for c in three["choices"]]
    assert len(set(texts)) > 1
    assert three["usage"]["prompt_tokens"] == ok["chat-greedy"]["response"]["body"]["usage"]["prompt_tokens"]

    # Per-request overrides: max_tokens bounds the completion; greedy requests say exactly what the
    # engine says for the same prompt ids alone; one body seed gives one text whatever the custom_id.
    usage = {c: x["response"]["body"]["usage"] for c, x in ok.items()}
    assert usage["cmpl-3"]["completion_tokens"] <= 3 and usage["chat-parts"]["completion_tokens"] <= 4
    assert (
        usage["cmpl-ids"] == {**usage["cmpl-ids"], "prompt_tokens": 4} and usage["cmpl-ids"]["completion_tokens"] <= 2
    )
    # the job's sampling.max_tokens, where the body does not set its own
    assert all(u["completion_tokens"] <= 8 for c, u in usage.items() if c not in ("json-schema", "three-choices"))
    assert usage["three-choices"]["completion_tokens"] <= 3 * 8
    tok = tiny_engine.tokenizer
    messages_ids = tok.encode(
        tok.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a module?"}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    greedy = tiny_engine.generate(
        [messages_ids, tok.encode(GOOD_PROMPT)],
        [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=3)],
    )
    assert ok["chat-greedy"]["response"]["body"]["choices"][0]["message"]["content"] == greedy[0].text
    assert ok["cmpl-3"]["response"]["body"]["choices"][0]["text"] == greedy[1].text
    text = {c: x["response"]["body"]["choices"][0]["text"] for c, x in ok.items() if urls[c] == COMPLETIONS}
    assert text["seeded-a"] == text["seeded-b"]
    assert text["unseeded-a"] != text["unseeded-b"]  # seeded per row from (sampling.seed, custom_id)
    assert (
        ok["model-path"]["response"]["body"]["model"] == tiny_llama_dir
        and ok["chat-greedy"]["response"]["body"]["model"] == ALIAS
    )

    # The Parquet results and metrics are written as for Parquet shards: one row per (request,
    # choice), sample_index saying which choice.
    rows = pq.read_table(out / "results" / "batch.parquet").to_pylist()
    assert len(rows) == num_requests + 2
    assert [(r["id"], r["sample_index"], r["output"]) for r in rows if r["error_type"] is None] == [
        (x["custom_id"], c["index"], c.get("text", c.get("message", {}).get("content")))
        for x in outputs
        for c in x["response"]["body"]["choices"]
    ]
    assert all(r["sample_index"] == 0 for r in rows if r["error_type"])
    # logprobs: greedy picks the top alternative; the Parquet logprobs column holds the same numbers
    # for the rows that asked, null for the others
    by_id = {r["id"]: r for r in rows if r["error_type"] is None}
    chat_lp = ok["chat-logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(chat_lp) == usage["chat-logprobs"]["completion_tokens"] > 0
    assert all(e["logprob"] == e["top_logprobs"][0]["logprob"] for e in chat_lp)
    assert [e["logprob"] for e in by_id["chat-logprobs"]["logprobs"]] == [e["logprob"] for e in chat_lp]
    assert by_id["chat-logprobs"]["cumulative_logprob"] == pytest.approx(sum(e["logprob"] for e in chat_lp))
    cmpl_lp = ok["cmpl-logprobs"]["response"]["body"]["choices"][0]["logprobs"]
    assert cmpl_lp["token_logprobs"] == [e["logprob"] for e in by_id["cmpl-logprobs"]["logprobs"]]
    assert all(max(top.values()) == lp for top, lp in zip(cmpl_lp["top_logprobs"], cmpl_lp["token_logprobs"]))
    assert by_id["cmpl-3"]["logprobs"] is None and by_id["cmpl-3"]["cumulative_logprob"] is None
    three_rows = [r for r in rows if r["id"] == "three-choices"]
    assert sum(r["num_output_tokens"] for r in three_rows) == three["usage"]["completion_tokens"]
    assert all(r["num_prompt_tokens"] == three["usage"]["prompt_tokens"] for r in three_rows)
    assert [(r["id"], r["error_type"]) for r in rows if r["error_type"]] == codes
    metrics = pq.read_table(out / "metrics" / "batch.parquet").to_pylist()[0]
    assert (metrics["num_rows"], metrics["num_ok"], metrics["num_errors"]) == (
        num_requests + 2,
        len(outputs) + 2,
        len(errors),
    )
    assert json.loads((out / "_commits" / "batch.json").read_text())["files"] == [
        "results.parquet",
        "metrics.parquet",
        "output.jsonl",
        "errors.jsonl",
    ]
    assert not (out / "_attempts").exists()

    from batchrun.job import committed_urls

    assert committed_urls(str(out), kind="outputs") == {"batch": f"file://{out}/outputs/batch.jsonl"}


def test_n_choices_default_from_sampling_n_and_reproducible_per_seed(tmp_path, tiny_engine, tiny_llama_dir):
    """sampling.n is the default number of choices, a body's n overrides it, and a seeded request's
    choice i is the same text whatever n it was asked with and whatever else is in the batch."""
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6}
    lines = [
        ("default-n", CHAT, chat),
        ("one", CHAT, {**chat, "n": 1}),
        ("seeded-3", CHAT, {**chat, "n": 3, "seed": 11}),
        ("seeded-1", CHAT, {**chat, "n": 1, "seed": 11}),
        ("cmpl-4", COMPLETIONS, {"prompt": GOOD_PROMPT, "max_tokens": 4, "n": 4, "seed": 11}),
    ]
    write_batch(
        tmp_path / "in" / "b.jsonl",
        [json.dumps({"custom_id": c, "method": "POST", "url": u, "body": {"model": ALIAS, **b}}) for c, u, b in lines],
        tiny_llama_dir,
    )
    cfg = batch_config(tmp_path / "in", tmp_path / "out", tiny_llama_dir)
    cfg = RunConfig(**{**cfg.__dict__, "sampling": SamplingParams(temperature=1.0, max_tokens=8, seed=0, n=2)})
    assert run_job(cfg, engine=tiny_engine).exit_code == 0
    outputs = {x["custom_id"]: x for x in read_lines(tmp_path / "out" / "outputs" / "b.jsonl")}
    want_n = {"default-n": 2, "one": 1, "seeded-3": 3, "seeded-1": 1, "cmpl-4": 4}
    for custom_id, n in want_n.items():
        check_output_line(outputs[custom_id], COMPLETIONS if custom_id == "cmpl-4" else CHAT, n=n)

    def texts(custom_id: str) -> list[str]:
        return [
            c.get("text", c.get("message", {}).get("content"))
            for c in outputs[custom_id]["response"]["body"]["choices"]
        ]

    assert texts("seeded-3")[0] == texts("seeded-1")[0]
    assert len(set(texts("seeded-3"))) > 1
    rows = pq.read_table(tmp_path / "out" / "results" / "b.parquet").to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [(c, i) for c, n in want_n.items() for i in range(n)]
    assert [r["output"] for r in rows] == [t for c in want_n for t in texts(c)]
    # alone, the seeded request gives the same choices
    write_batch(
        tmp_path / "alone" / "b.jsonl",
        [json.dumps({"custom_id": "seeded-3", "method": "POST", "url": CHAT, "body": {"model": ALIAS, **lines[2][2]}})],
        tiny_llama_dir,
    )
    cfg_alone = batch_config(tmp_path / "alone", tmp_path / "out-alone", tiny_llama_dir)
    assert run_job(cfg_alone, engine=tiny_engine).exit_code == 0
    alone = read_lines(tmp_path / "out-alone" / "outputs" / "b.jsonl")[0]["response"]["body"]["choices"]
    assert [c["message"]["content"] for c in alone] == texts("seeded-3")


def test_parquet_only_keys_are_refused_with_openai_batch(tmp_path, tiny_engine, tiny_llama_dir):
    write_batch(tmp_path / "in" / "b.jsonl", mixed_batch()[0][:1], tiny_llama_dir)
    cfg = batch_config(tmp_path / "in", tmp_path / "out", tiny_llama_dir)
    with pytest.raises(ConfigError, match="job.prompt_template"):
        run_job(RunConfig(**{**cfg.__dict__, "job": JobConfig(prompt_template="Q: {text}")}), engine=tiny_engine)
    with pytest.raises(ConfigError, match="output.keep_columns"):
        run_job(RunConfig(**{**cfg.__dict__, "output": OutputConfig(uri=str(tmp_path / "o"), keep_columns=("x",))}))
    with pytest.raises(ValueError, match="data.group_column"):
        DataConfig(uri="x", format="openai_batch", group_column="doc")
    (tmp_path / "parquet_only").mkdir()
    (tmp_path / "parquet_only" / "a.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match=r"no OpenAI batch files \(\*.jsonl\)"):
        run_job(batch_config(tmp_path / "parquet_only", tmp_path / "out2", tiny_llama_dir), engine=tiny_engine)


def test_cli_job_resumes_without_writing_anything_twice(tmp_path, tiny_llama_dir, job_overrides):
    """`python -m batchrun job=openai_batch` over two files; one commit is then lost (as if its
    worker died before the marker) and the rerun redoes that file only."""
    lines, _ = mixed_batch()
    write_batch(tmp_path / "in" / "a.jsonl", lines[:8], tiny_llama_dir)
    write_batch(tmp_path / "in" / "b.jsonl", lines[8:], tiny_llama_dir)
    out = tmp_path / "out"
    overrides = job_overrides(tmp_path / "in", out, "job=openai_batch", f"data.openai_model_name={ALIAS}")

    def run() -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "batchrun", *overrides],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ},
        )
        assert proc.returncode == 0, proc.stderr
        return proc

    first = run()
    assert re.search(r"^a +committed", first.stdout, re.M) and re.search(r"^b +committed", first.stdout, re.M)
    published = {p.relative_to(out): p.read_bytes() for d in ("outputs", "errors") for p in (out / d).iterdir()}
    assert sorted(map(str, published)) == ["errors/a.jsonl", "errors/b.jsonl", "outputs/a.jsonl", "outputs/b.jsonl"]
    assert published[Path("errors/a.jsonl")] == b""  # a's lines are all good
    (out / "_commits" / "b.json").unlink()
    for d in ("outputs", "errors"):
        (out / d / "b.jsonl").write_text("stale, never committed\n")

    second = run()
    assert re.search(r"^a +skipped", second.stdout, re.M) and re.search(r"^b +committed", second.stdout, re.M)
    assert (out / "outputs" / "a.jsonl").read_bytes() == published[Path("outputs/a.jsonl")]
    # The redone file is whole again, and every request is answered exactly once across both files.
    custom_ids = [
        x["custom_id"] for d in ("outputs", "errors") for p in sorted((out / d).glob("*.jsonl")) for x in read_lines(p)
    ]
    assert len(custom_ids) == sum(1 for x in lines if x.strip())
    named = [c for c in custom_ids if c is not None]
    # custom_ids are unique per file: chat-greedy's second line is b's own first chat-greedy
    assert len(named) == len(set(named)) + 1
    for p in sorted((out / "outputs").glob("*.jsonl")):
        for line in read_lines(p):
            custom_id = line["custom_id"]
            url = COMPLETIONS if custom_id.startswith(("cmpl", "seeded", "unseeded")) else CHAT
            check_output_line(line, url, CHOICES.get(custom_id, 1), TOP_LOGPROBS.get(custom_id))
    assert [x["error"]["code"] for x in read_lines(out / "errors" / "b.jsonl")][:2] == ["invalid_json", "invalid_json"]


def _parsed(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def test_two_local_workers_answer_every_request_exactly_once(tmp_path, tiny_llama_dir, job_overrides):
    """launcher.num_workers=2 over batch files: the launcher lists the same *.jsonl files as its
    workers, and each request line gets one output or error line across the run."""
    lines, _ = mixed_batch()
    files = {"a": lines[:4], "b": lines[4:6] + lines[8:9] + lines[19:20]}  # b: a bad line, another model
    for name, part in files.items():
        write_batch(tmp_path / "in" / f"{name}.jsonl", part, tiny_llama_dir)
    out = tmp_path / "out"
    overrides = job_overrides(
        tmp_path / "in", out, "job=openai_batch", f"data.openai_model_name={ALIAS}", "launcher.num_workers=2"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "batchrun", *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 workers: 2 committed" in proc.stdout
    for name, part in files.items():
        answered = [x for d in ("outputs", "errors") for x in read_lines(out / d / f"{name}.jsonl")]
        wanted = [x.get("custom_id") if isinstance(x, dict) else None for x in map(_parsed, part)]
        assert sorted(map(str, (x["custom_id"] for x in answered))) == sorted(map(str, wanted))
        assert len({x["id"] for x in answered}) == len(part)
    assert [x["error"]["code"] for x in read_lines(out / "errors" / "b.jsonl")] == ["invalid_json", "model_not_found"]
    merged = json.loads((out / "_manifest.json").read_text())
    assert merged["status"] == "completed"
    assert [(s["name"], s["status"]) for s in merged["shards"]] == [("a", "committed"), ("b", "committed")]


def test_s3_in_and_out(s3, tmp_path, tiny_engine, tiny_llama_dir):
    fs, bucket, _ = s3
    lines, _ = mixed_batch()
    write_batch(tmp_path / "b.jsonl", lines[:3] + lines[8:9] + lines[19:20], tiny_llama_dir)
    fs.put_file(str(tmp_path / "b.jsonl"), f"{bucket}/in/b.jsonl")
    cfg = batch_config(f"s3://{bucket}/in", f"s3://{bucket}/run", tiny_llama_dir)
    assert run_job(cfg, engine=tiny_engine).exit_code == 0
    fs.invalidate_cache()
    outputs = [json.loads(x) for x in fs.cat_file(f"{bucket}/run/outputs/b.jsonl").decode().splitlines()]
    errors = [json.loads(x) for x in fs.cat_file(f"{bucket}/run/errors/b.jsonl").decode().splitlines()]
    assert [x["custom_id"] for x in outputs] == ["chat-greedy", "chat-parts", "cmpl-3"]
    assert [x["error"]["code"] for x in errors] == ["invalid_json", "model_not_found"]
    assert fs.find(f"{bucket}/run/_attempts") == []
    assert [s.status for s in run_job(cfg, engine=tiny_engine).shards] == ["skipped"]


def test_a_publication_cut_short_leaves_results_last_so_the_next_run_finishes_it(tmp_path, monkeypatch):
    from batchrun.job.commit.store import RunStore, committed_files

    store = RunStore(str(tmp_path / "run"), {})
    attempt = store.begin("b")
    for path in (attempt.results_tmp, attempt.metrics_tmp, attempt.file("output.jsonl"), attempt.file("errors.jsonl")):
        Path(path).write_bytes(Path(path).name.encode())
    real_move = store._move_if_needed

    def dies_at_errors(source: str, final: str) -> bool:
        if source.endswith("errors.jsonl"):
            raise OSError("the worker died here")
        return real_move(source, final)

    monkeypatch.setattr(store, "_move_if_needed", dies_at_errors)
    files = ("results.parquet", "metrics.parquet", "output.jsonl", "errors.jsonl")
    assert store.commit(attempt, {"shard": "b"}, files)
    # Committed, half published: results/ (what a rerun takes as "published") is not there yet.
    assert (tmp_path / "run" / "outputs" / "b.jsonl").exists() and store.published_shards() == set()
    assert committed_files(store, "errors")["b"] == attempt.file("errors.jsonl")  # readers see it all the same
    monkeypatch.setattr(store, "_move_if_needed", real_move)
    assert store.publish("b", store.read_marker("b"))
    for kind, suffix in (("results", "parquet"), ("metrics", "parquet"), ("outputs", "jsonl"), ("errors", "jsonl")):
        assert committed_files(store, kind)["b"] == str(tmp_path / "run" / kind / f"b.{suffix}")
    assert (tmp_path / "run" / "errors" / "b.jsonl").read_bytes() == b"errors.jsonl"
    assert not Path(attempt.directory).exists()
