"""Structured output on the real SmolLM2: every constrained output parses and validates, greedy and
sampled, including for a schema the model does not follow when left unconstrained."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from batchrun.engine import SamplingParams
from benchmarks.quality import make_engine

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
ENUM = {"enum": ["positive", "negative", "neutral"]}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
CHOICES = ["Paris", "London", "Berlin"]
# Asked a plain question, the model answers in prose, which this schema does not allow.
STRICT = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 20}, "confidence": {"type": "integer", "maximum": 100}},
    "required": ["confidence", "answer"],
    "additionalProperties": False,
}


def _chat(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _check(text: str, kind: str, value) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), value)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    return text in value


def test_every_constrained_output_parses_and_validates(smollm2_cache_dir):
    engine = make_engine(cache_dir=smollm2_cache_dir, kv_cache_memory=64 << 20, max_num_seqs=32)
    tok = engine.tokenizer
    cases = [
        ("json_schema", NESTED, ["Describe a person who lives in Rome as JSON."]),
        ("json_schema", ENUM, ["Is 'I loved this film' positive or negative?"]),
        ("regex", REGEX, ["Give me a phone number."]),
        ("choice", CHOICES, ["Which city is in Germany?"]),
        ("json_schema", STRICT, ["What is the capital of France?", "How many legs does a spider have?"]),
    ]
    prompts, params, expected = [], [], []
    for kind, value, questions in cases:
        for question in questions:
            for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=7)):
                prompts.append(_chat(tok, question))
                params.append(SamplingParams(max_tokens=64, **sampling, **{kind: value}))
                expected.append((kind, value))
    free_questions = cases[-1][2]
    prompts += [_chat(tok, q) for q in free_questions]
    params += [SamplingParams(temperature=0.0, max_tokens=24)] * len(free_questions)

    outs = engine.generate(prompts, params)
    constrained, free = outs[: len(expected)], outs[len(expected) :]
    for out, (kind, value), p in zip(constrained, expected, params):
        assert out.finish_reason == "stop", (kind, p.temperature, out.text)
        assert _check(out.text, kind, value), (kind, p.temperature, out.text)
    # The strict schema is one the model violates when not constrained.
    assert not any(_check(o.text, "json_schema", STRICT) for o in free), [o.text for o in free]
