"""Tool calls in OpenAI batch files: tools rendered through the chat template, tool_choice
none/auto/required/named honoured, required and named calls constrained to their tool's schema, and
the output parsed back into message.tool_calls, in the output lines and the Parquet results alike.
Output lines are checked against a subset of OpenAI's published chat.completion schema."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow.parquet as pq
import pytest

from batchrun.engine import Engine, EngineConfig, SamplingParams
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
from batchrun.job.formats.openai_requests import CHAT_URL, COMPLETIONS_URL, RequestBuilder, RequestError, check_request
from batchrun.job.formats.openai_requests import sampling_params as body_params
from batchrun.job.formats.reader import InputRow
from batchrun.job.formats.tool_calls import CHATML_TOOLS_TEMPLATE, parse_calls, parse_output, tool_spec
from tests.support.engines import make_tiny_engine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ALIAS = "tiny"

# ---- OpenAI's chat.completion object (API reference), the fields batchrun writes ---------------

TOOL_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["index", "message", "finish_reason", "logprobs"],
                "properties": {
                    "index": {"type": "integer"},
                    "message": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"]},
                            "refusal": {"type": ["string", "null"]},
                            "tool_calls": {"type": "array", "items": TOOL_CALL},
                        },
                    },
                    "logprobs": {"type": ["object", "null"]},
                    "finish_reason": {"enum": ["stop", "length", "tool_calls", "content_filter", "function_call"]},
                },
            },
        },
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": {"type": "integer"},
                "completion_tokens": {"type": "integer"},
                "total_tokens": {"type": "integer"},
            },
        },
    },
}
# The Batch API's output line around it.
OUTPUT_LINE = {
    "type": "object",
    "required": ["id", "custom_id", "response", "error"],
    "properties": {
        "id": {"type": "string"},
        "custom_id": {"type": "string"},
        "error": {"type": "null"},
        "response": {
            "type": "object",
            "required": ["status_code", "request_id", "body"],
            "properties": {"status_code": {"const": 200}, "request_id": {"type": "string"}, "body": CHAT_COMPLETION},
        },
    },
}


def check_line(line: dict[str, Any]) -> None:
    jsonschema.validate(line, OUTPUT_LINE)
    for choice in line["response"]["body"]["choices"]:
        message = choice["message"]
        # OpenAI's contract: calls go with finish_reason tool_calls, and a message has content or calls
        assert ("tool_calls" in message) == (choice["finish_reason"] == "tool_calls"), choice
        assert message["content"] is not None or message.get("tool_calls"), choice


# ---- tools (bounded, so that even a random model's constrained call ends) ---------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "exact": {"type": "boolean"}},
    "required": ["a", "exact"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add numbers", "parameters": ADD}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},  # no parameters
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
HISTORY = [
    {"role": "user", "content": "What time is it?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    {"role": "user", "content": "And the weather in Oslo?"},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def tool_batch() -> list[dict[str, Any]]:
    """(custom_id, body) of a batch exercising every tool_choice."""
    greedy = {"temperature": 0, "max_tokens": 160}
    return [
        {"custom_id": "plain", "body": {"messages": ASK, **greedy, "max_tokens": 8}},
        {
            "custom_id": "none",
            "body": {"messages": ASK, "tools": TOOLS, "tool_choice": "none", **greedy, "max_tokens": 8},
        },
        {"custom_id": "auto", "body": {"messages": ASK, "tools": TOOLS, **greedy, "max_tokens": 16}},
        # parallel calls allowed: sampled, as a model greedy repeats its call until max_tokens; sampled,
        # a small model still repeats it past max_tokens in a share of its samples (SmolLM2: a third
        # to a half of seeds), so n choices, of which each is either validated calls or a typed
        # truncation, and at least one holds calls (check_tool_run)
        {
            "custom_id": "required",
            "body": {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": "required",
                "n": 6,
                "temperature": 1.0,
                "seed": 3,
                "max_tokens": 400,
            },
        },
        {
            "custom_id": "required-one",
            "body": {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": "required",
                "parallel_tool_calls": False,
                **greedy,
            },
        },
        {"custom_id": "named", "body": {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, **greedy}},
        {
            "custom_id": "named-sampled",
            "body": {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": NAMED,
                "n": 3,
                "temperature": 1.0,
                "seed": 7,
                "max_tokens": 160,
            },
        },
        {
            "custom_id": "history",
            "body": {
                "messages": HISTORY,
                "tools": TOOLS,
                "tool_choice": "required",
                "parallel_tool_calls": False,
                **greedy,
            },
        },
        # errors: each a typed line, the others go on
        {
            "custom_id": "unknown-name",
            "body": {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
        },
        {"custom_id": "choice-no-tools", "body": {"messages": ASK, "tool_choice": "required"}},
        {"custom_id": "custom-tool", "body": {"messages": ASK, "tools": [{"type": "custom", "custom": {"name": "x"}}]}},
        {
            "custom_id": "with-format",
            "body": {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
        },
        {"custom_id": "completions", "url": COMPLETIONS_URL, "body": {"prompt": "hi", "tools": TOOLS}},
    ]


ERRORS = {
    "unknown-name": "invalid_request",
    "choice-no-tools": "invalid_request",
    "custom-tool": "unsupported_parameter",
    "with-format": "unsupported_parameter",
    "completions": "unsupported_parameter",
}
CHOICES = {"named-sampled": 3, "required": 6}


def write_batch(path: Path, requests: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        {
            "custom_id": r["custom_id"],
            "method": "POST",
            "url": r.get("url", CHAT_URL),
            "body": {"model": ALIAS, **r["body"]},
        }
        for r in requests
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def batch_config(data_uri: Path, output_uri: Path, model: str, tools_chat_template: str | None = None, **engine):
    return RunConfig(
        job=JobConfig(name="openai_batch", tools_chat_template=tools_chat_template),
        model=ModelConfig(path=model),
        engine=EngineConfig(model=model, max_num_seqs=4, **engine),
        sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=0),
        data=DataConfig(uri=str(data_uri), format="openai_batch", openai_model_name=ALIAS),
        output=OutputConfig(uri=str(output_uri)),
        quiet=True,
    )


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def check_tool_run(out: Path, requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every line answered once, in OpenAI's shape; required and named calls parse and validate;
    the Parquet rows carry the same calls. Returns the output lines by custom_id."""
    outputs, errors = read_lines(out / "outputs" / "batch.jsonl"), read_lines(out / "errors" / "batch.jsonl")
    assert {x["custom_id"]: x["error"]["code"] for x in errors} == ERRORS
    ok = {x["custom_id"]: x for x in outputs}
    assert set(ok) == {r["custom_id"] for r in requests} - set(ERRORS)
    for line in outputs:
        check_line(line)
        assert len(line["response"]["body"]["choices"]) == CHOICES.get(line["custom_id"], 1)

    def calls(custom_id: str) -> list[list[dict[str, Any]]]:
        return [c["message"].get("tool_calls") for c in ok[custom_id]["response"]["body"]["choices"]]

    choices = {
        c: ok[c]["response"]["body"]["choices"]
        for c in ("required", "required-one", "named", "named-sampled", "history")
    }
    # a sampled parallel-call choice that repeats its call past max_tokens is a typed truncation
    looped = [c for c in choices["required"] if c["finish_reason"] == "length"]
    assert all(
        c.get("error_type") == "truncated_structured_output" and not c["message"].get("tool_calls") for c in looped
    )
    assert len(looped) < len(choices["required"]), "required: no choice closed its calls"
    for custom_id, custom_choices in choices.items():
        for choice in custom_choices:
            if choice in looped:
                continue
            choice_calls = choice["message"].get("tool_calls")
            assert choice_calls, f"{custom_id}: no tool calls"
            for call in choice_calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
                assert call["id"].startswith("call_")
    assert all(len(c) == 1 for c in calls("required-one") + calls("named") + calls("named-sampled"))
    assert {c[0]["function"]["name"] for c in calls("named") + calls("named-sampled")} == {"get_weather"}
    ids = [
        call["id"]
        for x in outputs
        for c in x["response"]["body"]["choices"]
        for call in c["message"].get("tool_calls", [])
    ]
    assert len(set(ids)) == len(ids)
    # tool_choice none: the tools are not in the prompt, and the output is plain content
    usage = {c: x["response"]["body"]["usage"] for c, x in ok.items()}
    assert usage["none"]["prompt_tokens"] == usage["plain"]["prompt_tokens"] < usage["auto"]["prompt_tokens"]
    assert calls("none") == [None] and isinstance(
        ok["none"]["response"]["body"]["choices"][0]["message"]["content"], str
    )

    # Parquet: one row per choice, its tool_calls and finish_reason the line's
    rows = pq.read_table(out / "results" / "batch.parquet").to_pylist()
    by_choice = {(r["id"], r["sample_index"]): r for r in rows if r["id"] in ok}
    for custom_id, line in ok.items():
        for choice in line["response"]["body"]["choices"]:
            row = by_choice[(custom_id, choice["index"])]
            assert row["tool_calls"] == choice["message"].get("tool_calls"), custom_id
            assert (row["finish_reason"], row["error_type"]) == (choice["finish_reason"], choice.get("error_type"))
    assert all(r["tool_calls"] is None for r in rows if r["error_type"] is not None)
    return ok


# ---- a tiny random model with a tool-capable template, and one without -------------------------


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory) -> dict[str, str]:
    """{"own": a tiny qwen2 whose own chat template renders tools, "plain": the same model with the
    tool-less ChatML template}. Room for the tools' prompt: 2048 positions."""
    from transformers import AutoTokenizer

    from batchrun.testing import make_tiny_model

    root = tmp_path_factory.mktemp("tool_models")
    plain = make_tiny_model(root / "plain", "qwen2", max_position_embeddings=2048)
    own = root / "own"
    shutil.copytree(plain, own)
    tokenizer = AutoTokenizer.from_pretrained(own)
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    tokenizer.save_pretrained(own)
    return {"own": str(own), "plain": str(plain)}


@pytest.mark.parametrize("which, template", [("own", None), ("plain", "chatml")])
def test_every_tool_choice_on_a_tiny_model(tmp_path, tool_models, which, template):
    """The model's own tool template, and a tool-less model given job.tools_chat_template=chatml."""
    requests = tool_batch()
    write_batch(tmp_path / "in" / "batch.jsonl", requests)
    model = tool_models[which]
    result = run_job(batch_config(tmp_path / "in", tmp_path / "out", model, template), engine=make_tiny_engine(model))
    assert (result.exit_code, [s.status for s in result.shards]) == (0, ["committed"])
    ok = check_tool_run(tmp_path / "out", requests)
    # greedy named call: what the engine writes for the same prompt under the same schema
    named = ok["named"]["response"]["body"]["choices"][0]
    args = json.loads(named["message"]["tool_calls"][0]["function"]["arguments"])
    assert set(args) == {"city", "unit"}


def test_a_template_without_tools_gives_a_typed_error_line(tmp_path, tool_models):
    requests = [r for r in tool_batch() if r["custom_id"] in ("plain", "none", "required", "auto")]
    write_batch(tmp_path / "in" / "batch.jsonl", requests)
    model = tool_models["plain"]
    result = run_job(batch_config(tmp_path / "in", tmp_path / "out", model), engine=make_tiny_engine(model))
    assert result.exit_code == 0
    errors = read_lines(tmp_path / "out" / "errors" / "batch.jsonl")
    assert {x["custom_id"]: x["error"]["code"] for x in errors} == {
        "required": "tools_unsupported",
        "auto": "tools_unsupported",
    }
    assert "job.tools_chat_template" in errors[0]["error"]["message"]
    assert [x["custom_id"] for x in read_lines(tmp_path / "out" / "outputs" / "batch.jsonl")] == ["plain", "none"]
    rows = pq.read_table(tmp_path / "out" / "results" / "batch.parquet").to_pylist()
    assert {r["id"]: r["error_type"] for r in rows} == {
        "plain": None,
        "none": None,
        "required": "tools_unsupported",
        "auto": "tools_unsupported",
    }


def test_a_bad_tools_template_path_is_one_config_line(tmp_path, tool_models):
    from batchrun.job import ConfigError

    write_batch(tmp_path / "in" / "batch.jsonl", tool_batch()[:1])
    model = tool_models["plain"]
    config = batch_config(tmp_path / "in", tmp_path / "out", model, str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="job.tools_chat_template"):
        run_job(config, engine=make_tiny_engine(model))


# ---- units: the body, the prompt, the parse ---------------------------------------------------


def params_of(body: dict[str, Any]) -> Any:
    line = {"custom_id": "r", "method": "POST", "url": CHAT_URL, "body": {"model": ALIAS, "messages": ASK, **body}}
    request = check_request(line, frozenset([ALIAS]))
    assert not isinstance(request, RequestError)
    return body_params(request, SamplingParams())


def test_required_and_named_become_a_schema_of_the_whole_call():
    named = json.loads(params_of({"tools": TOOLS, "tool_choice": NAMED}).json_schema)
    assert named["properties"] == {"name": {"const": "get_weather"}, "arguments": WEATHER}
    required = json.loads(params_of({"tools": TOOLS, "tool_choice": "required"}).json_schema)
    assert required["type"] == "array" and required["minItems"] == 1
    assert [c["properties"]["name"]["const"] for c in required["items"]["anyOf"]] == ["get_weather", "add", "now"]
    one = json.loads(params_of({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).json_schema)
    assert "anyOf" in one and one.get("type") != "array"
    for choice in ("auto", "none", None):
        assert params_of({"tools": TOOLS, "tool_choice": choice}).json_schema is None
    assert params_of({"tools": []}).json_schema is None  # an empty list means no tools, as before
    # each valid call validates against the constraint, an argument outside its tool's schema does not
    jsonschema.validate([{"name": "add", "arguments": {"a": 3, "exact": True}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "arguments": {"a": 300, "exact": True}}], required)


@pytest.mark.parametrize(
    "body, code, words",
    [
        ({"tools": "x"}, "invalid_request", "must be a list"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "invalid_request", "function.name"),
        ({"tools": TOOLS + TOOLS[:1]}, "invalid_request", "unique"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "invalid_request",
            "parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "invalid_request", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "unsupported_parameter", "allowed_tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "invalid_request", "parallel_tool_calls"),
        ({"tool_choice": "auto"}, "invalid_request", "needs body.tools"),
    ],
)
def test_bad_tools_are_typed_errors(body, code, words):
    error = params_of(body)
    assert isinstance(error, RequestError) and error.code == code and words in error.message, error


def build(tokenizer: Any, body: dict[str, Any], template: str | None = None):
    line = {"custom_id": "r", "method": "POST", "url": CHAT_URL, "body": {"model": ALIAS, **body}}
    builder = RequestBuilder(tokenizer, 4096, frozenset([ALIAS]), SamplingParams(max_tokens=8), None, template)
    return builder.build(InputRow(0, "r", {"line": line, "error": None, "line_no": 1}))


def test_tool_history_is_rendered_and_bad_history_is_a_typed_error():
    from batchrun.testing import build_tokenizer

    tokenizer = build_tokenizer()
    prompt, _, _ = build(tokenizer, {"messages": HISTORY, "tools": TOOLS}, CHATML_TOOLS_TEMPLATE)
    text = tokenizer.decode(prompt.token_ids)
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text and '"name": "get_weather"' in text
    bad_args = [{**HISTORY[1], "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": "{"}}]}]
    prompt, _, _ = build(tokenizer, {"messages": [*HISTORY[:1], *bad_args], "tools": TOOLS}, CHATML_TOOLS_TEMPLATE)
    assert prompt.error_type == "invalid_request" and "arguments is not JSON" in prompt.error_message
    no_id = [{"role": "tool", "content": "12:00"}]
    prompt, _, _ = build(tokenizer, {"messages": ASK + no_id, "tools": TOOLS}, CHATML_TOOLS_TEMPLATE)
    assert prompt.error_type == "invalid_request" and "tool_call_id" in prompt.error_message


NAMES = {"get_weather", "add", "now"}


@pytest.mark.parametrize(
    "text, content, calls",
    [
        # Hermes / Qwen blocks, after optional content; the last block may lack its closing tag
        ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', None, [("now", "{}")]),
        (
            'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "exact": true}}\n</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": {}}',
            "Let me check.",
            [("add", '{"a":1,"exact":true}'), ("now", "{}")],
        ),
        # Llama 3.1: the whole output is the call, "parameters" for "arguments", maybe after <|python_tag|>
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
            None,
            [("get_weather", '{"city":"Oslo","unit":"c"}')],
        ),
        ('<|python_tag|>[{"name": "now", "arguments": "{}"}]', None, [("now", "{}")]),
        # not calls: prose, an unknown tool, malformed JSON in a block
        ("It is sunny.", "It is sunny.", []),
        ('{"name": "rm", "arguments": {}}', '{"name": "rm", "arguments": {}}', []),
        (
            '<tool_call>{"name": "now", "arguments": </tool_call>',
            '<tool_call>{"name": "now", "arguments": </tool_call>',
            [],
        ),
    ],
)
def test_free_output_is_parsed_for_calls(text, content, calls):
    got_content, got_calls = parse_calls(text, NAMES)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls


def test_only_a_finished_output_holds_calls():
    spec = tool_spec({"tools": TOOLS, "tool_choice": "required"})
    text = '[{"name": "now", "arguments": {}}]'
    assert parse_output(spec, text, "stop").finish_reason == "tool_calls"
    cut = parse_output(spec, text[:-3], "length")
    assert (cut.content, cut.calls, cut.finish_reason) == (text[:-3], (), "length")
    none = parse_output(tool_spec({"tools": TOOLS, "tool_choice": "none"}), text, "stop")
    assert (none.content, none.calls, none.finish_reason) == (text, (), "stop")


# ---- the real SmolLM2 ---------------------------------------------------------------------------


@pytest.mark.slow
def test_every_tool_choice_on_smollm2(tmp_path, smollm2_cache_dir):
    """SmolLM2's own template has no tools: its tool requests are tools_unsupported lines; with
    job.tools_chat_template=chatml (its ChatML plus the Hermes tools section) every tool_choice
    works, and every required and named call parses and validates."""
    requests = tool_batch()
    write_batch(tmp_path / "in" / "batch.jsonl", requests)
    config = batch_config(
        tmp_path / "in",
        tmp_path / "own",
        "smollm2-135m",
        cache_dir=smollm2_cache_dir,
        dtype="bfloat16",
        device="cpu",
        max_num_batched_tokens=2048,
        kv_cache_memory=256 << 20,
    )
    engine = Engine(config.engine)
    result = run_job(config, engine=engine)
    assert result.exit_code == 0
    errors = read_lines(tmp_path / "own" / "errors" / "batch.jsonl")
    with_tools = {r["custom_id"] for r in requests if r["body"].get("tools") and r["body"].get("tool_choice") != "none"}
    assert {x["custom_id"] for x in errors if x["error"]["code"] == "tools_unsupported"} == with_tools - set(ERRORS)

    config = batch_config(
        tmp_path / "in",
        tmp_path / "chatml",
        "smollm2-135m",
        "chatml",
        cache_dir=smollm2_cache_dir,
        dtype="bfloat16",
        device="cpu",
        max_num_batched_tokens=2048,
        kv_cache_memory=256 << 20,
    )
    result = run_job(config, engine=engine)
    assert (result.exit_code, [s.status for s in result.shards]) == (0, ["committed"])
    ok = check_tool_run(tmp_path / "chatml", requests)
    # a real model asked about the weather in Oslo names it
    named = json.loads(
        ok["named"]["response"]["body"]["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    )
    assert "oslo" in named["city"].lower()
