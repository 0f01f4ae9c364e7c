"""Structured output on the tiny model: the batched bitmask, constrained decoding through the engine,
schema errors (engine, job config, per-row column) and a resumed job with per-row schemas."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchrun import cli
from batchrun.engine import SamplingParams
from batchrun.engine.drafter import is_eligible
from batchrun.engine.grammar import apply_bitmask, choice_ebnf
from batchrun.engine.request import Request
from batchrun.job import ConfigError, run_job

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

OBJECT_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


def _masked_reference(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for j, row in enumerate(rows):
        for token in range(logits.shape[1]):
            if not (int(bitmask[j, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2], [1]])
def test_apply_bitmask_masks_exactly_the_cleared_bits_of_the_given_rows(rows):
    g = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word's spare bits must be ignored
    logits = torch.randn(3, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), 3), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[:, 0] |= 1  # token 0 always allowed: every row keeps a finite logit
    before = logits.clone()
    masked = apply_bitmask(logits, rows, bitmask)
    assert torch.equal(masked, _masked_reference(before, rows, bitmask))
    assert torch.equal(logits, before)  # a new tensor: the caller's logits are untouched
    bf16 = apply_bitmask(before.bfloat16(), rows, bitmask)
    assert torch.equal(bf16.isinf(), masked.isinf())


def test_sampling_params_check_the_constraint():
    p = SamplingParams(json_schema=OBJECT_SCHEMA)
    assert p.is_constrained and json.loads(p.json_schema) == OBJECT_SCHEMA
    assert SamplingParams(json_schema=json.dumps(OBJECT_SCHEMA, indent=2)).json_schema == p.json_schema
    assert hash(p) == hash(SamplingParams(json_schema=dict(OBJECT_SCHEMA)))  # stays hashable, canonical text
    assert not SamplingParams().is_constrained
    for kwargs, key in [
        (dict(json_schema={"type": "nope"}), "json_schema:"),
        (dict(json_schema="{not json"), "json_schema:"),
        (dict(json_schema=[1, 2]), "json_schema:"),
        (dict(regex="(("), "regex:"),
        (dict(choice=["a", ""]), "choice:"),
        (dict(regex="a+", choice=["a"]), "choice:"),
    ]:
        with pytest.raises(ValueError, match=f"^{key}"):
            SamplingParams(**kwargs)
    assert SamplingParams(choice=['say "hi"\n', "a\\b"]).constraint_key == (
        "choice",
        choice_ebnf(['say "hi"\n', "a\\b"]),
    )


def test_length_bounded_json_strings_admit_escapes_and_no_control_characters():
    """xgrammar's own lowering of minLength/maxLength strings admits a raw tab (invalid JSON) and no
    escapes; build_grammar's fix counts one JSON character per repetition."""
    xgr = pytest.importorskip("xgrammar")
    from batchrun.engine.grammar import build_grammar

    schema = {
        "type": "object",
        "properties": {
            "q": {"type": "string", "maxLength": 4},
            "tags": {"type": "array", "items": {"type": "string", "minLength": 1}},
        },
        "required": ["q", "tags"],
    }
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar("json_schema", json.dumps(schema)))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()

    for text, valid in [
        ('{"q": "abcd", "tags": ["x"]}', True),
        ('{"q": "a\\"\\\\d", "tags": ["x"]}', True),  # escapes count one character each
        ('{"q": "\\u00e9\\n", "tags": ["x"]}', True),
        ('{"q": "abcde", "tags": ["x"]}', False),  # past maxLength
        ('{"q": "a\tb", "tags": ["x"]}', False),  # a raw tab
        ('{"q": "ab", "tags": ["\x01"]}', False),  # a raw control character, minLength path
        ('{"q": "ab", "tags": [""]}', False),  # under minLength
    ]:
        assert accepts(text) == valid, text
        if valid:
            json.loads(text)  # strict: what the grammar accepts, Python's parser accepts


def test_constrained_requests_never_draft():
    def decoding(params: SamplingParams) -> Request:
        req = Request(0, 0, [1, 2, 3], params, 0.0)
        req.num_computed_tokens = 2
        return req

    assert is_eligible(decoding(SamplingParams(temperature=0.0)))
    assert not is_eligible(decoding(SamplingParams(temperature=0.0, regex="[ab]+")))


def test_engine_constrains_rows_and_leaves_the_others_alone(tiny_engine, one_torch_thread):
    prompts = ["The weather today is", "Once upon a time", "def main():", "Numbers: 1, 2,"]
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = tiny_engine.generate(prompts, free)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, json_schema=OBJECT_SCHEMA),
        free,
        SamplingParams(temperature=0.9, seed=3, max_tokens=12, regex="[a-c]{2,5}"),
        SamplingParams(temperature=0.0, max_tokens=12, choice=["yes", "no", 'a "quoted"\nchoice']),
    ]
    outs = tiny_engine.generate(prompts, params)
    jsonschema.validate(json.loads(outs[0].text), OBJECT_SCHEMA)
    assert re.fullmatch("[a-c]{2,5}", outs[2].text)
    assert outs[3].text in ("yes", "no", 'a "quoted"\nchoice')
    for i in (0, 2, 3):
        # Finished by the grammar: the last token is EOS, allowed only once the output is complete.
        assert outs[i].finish_reason == "stop" and outs[i].token_ids[-1] == tiny_engine.tokenizer.eos_token_id
    assert outs[1].token_ids == alone[1].token_ids  # an unconstrained row in the same batch is unchanged
    again = tiny_engine.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # cached grammars, same tokens


def test_a_grammar_that_fails_to_compile_ends_its_request_only(tiny_engine, one_torch_thread, monkeypatch):
    def broken(kind, text):
        raise RuntimeError("[12:00:00] /project/cpp/x.cc:1: compiler exploded")

    monkeypatch.setattr(tiny_engine.grammars, "_compile", broken)
    outs = tiny_engine.generate(
        ["Hello there", "Goodbye"],
        [SamplingParams(temperature=0.0, max_tokens=4, regex="x[0-9]{7}z"), SamplingParams(max_tokens=4)],
    )
    assert outs[0].finish_reason == "error" and outs[0].error == "compiler exploded"
    assert outs[1].finish_reason in ("stop", "length") and outs[1].token_ids
    assert tiny_engine.kv.pool.num_free_blocks == tiny_engine.kv.num_blocks  # the failed request's blocks came back
    tiny_engine.grammars._cache.clear()  # the failed future must not outlive the monkeypatch


def test_invalid_job_constraints_are_config_errors_naming_the_key(tmp_path, job_overrides):
    data, out = tmp_path / "in", tmp_path / "out"
    for override, key in [
        ("sampling.json_schema={type: nope}", "sampling.json_schema"),
        ("sampling.regex='(('", "sampling.regex"),
        (f"sampling.json_schema={tmp_path / 'missing.json'}", "sampling.json_schema"),
        ("sampling.choice=[a,'']", "sampling.choice"),
    ]:
        with pytest.raises(ConfigError) as info:
            cli.load_config(job_overrides(data, out, override))
        assert info.value.key == key, (override, info.value)
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(OBJECT_SCHEMA, indent=2))
    config = cli.load_config(job_overrides(data, out, f"sampling.json_schema={schema_file}"))
    assert json.loads(config.sampling.json_schema) == OBJECT_SCHEMA
    inline = cli.load_config(job_overrides(data, out, "sampling.json_schema={type: object}"))
    assert inline.sampling.json_schema == '{"type":"object"}'


ROW_SCHEMAS = [
    json.dumps({"enum": ["red", "green"]}),
    json.dumps(OBJECT_SCHEMA),
    json.dumps({"type": "nope"}),  # valid JSON, not a schema
    "{oops",  # not JSON
    None,  # the job's constraint (none here)
]


def _schema_shard(path, prefix: str, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = [f"{prefix}{i}" for i in range(len(ROW_SCHEMAS))]
    pq.write_table(pa.table({"id": ids, "text": texts[: len(ids)], "schema": pa.array(ROW_SCHEMAS, pa.string())}), path)


def _check_schema_rows(rows: list[dict]) -> None:
    by_schema = dict(zip(ROW_SCHEMAS, rows))
    for schema in ROW_SCHEMAS[:2]:
        row = by_schema[schema]
        assert row["error_type"] is None and row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["output"]), json.loads(schema))
    for schema in ROW_SCHEMAS[2:4]:
        row = by_schema[schema]
        assert row["error_type"] == "invalid_schema" and row["output"] is None, row
        assert "column 'schema'" in row["error_message"] and "json_schema" in row["error_message"]
    assert by_schema[None]["error_type"] is None and by_schema[None]["output"] is not None


def test_per_row_schema_column_through_the_job_and_resume(
    tmp_path, short_texts, tiny_engine, tiny_llama_dir, job_overrides
):
    data, out = tmp_path / "in", tmp_path / "out"
    _schema_shard(data / "part-00.parquet", "a", short_texts)
    overrides = job_overrides(data, out, "data.schema_column=schema", "sampling.max_tokens=40")
    proc = subprocess.run([sys.executable, "-m", "batchrun", *overrides], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = out / "results" / "part-00.parquet"
    _check_schema_rows(pq.read_table(first).to_pylist())
    committed = first.read_bytes()

    # A resumed run (same settings) skips the committed shard and does only the new one.
    _schema_shard(data / "part-01.parquet", "b", short_texts[5:])
    result = run_job(cli.load_config(overrides), engine=tiny_engine)
    assert result.exit_code == 0, result.message
    assert [s.status for s in sorted(result.shards, key=lambda s: s.name)] == ["skipped", "committed"]
    assert first.read_bytes() == committed
    _check_schema_rows(pq.read_table(out / "results" / "part-01.parquet").to_pylist())


def test_the_synth_qa_preset_gives_n_samples_of_schema_json(tmp_path, make_shards, tiny_engine, job_overrides):
    """job=synth_qa: several samples per row, each constrained to its question/answer schema."""
    ids = make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2)[0]
    # The schema's maxLengths bound an object's length, so with room for the longest one every
    # sample of even a random model ends, and every one must parse and validate (the lengths are
    # cut to fit the tiny model's 512-token context).
    overrides = [
        *job_overrides(tmp_path / "in", tmp_path / "out"),
        "sampling.max_tokens=200",
        "sampling.json_schema.properties.question.maxLength=40",
        "sampling.json_schema.properties.answer.maxLength=60",
    ]
    config = cli.load_config(["job=synth_qa", *overrides])
    assert config.sampling.n == 4 and config.sampling.is_constrained
    result = run_job(config, engine=tiny_engine)
    assert result.exit_code == 0, result.message
    rows = pq.read_table(tmp_path / "out" / "results" / "part-00.parquet").to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [(i, k) for i in ids for k in range(4)]
    schema = json.loads(config.sampling.json_schema)
    assert [(r["finish_reason"], r["error_type"]) for r in rows] == [("stop", None)] * len(rows)
    for r in rows:
        jsonschema.validate(json.loads(r["output"]), schema)
    assert len({r["output"] for r in rows}) == len(rows)  # distinct samples


def test_speculation_skips_constrained_rows_and_keeps_the_others(tiny_llama_dir, tiny_engine, one_torch_thread):
    from batchrun.engine import Engine, EngineConfig
    from batchrun.engine.config import SpeculativeConfig

    spec = SpeculativeConfig(method="self", adaptive=False, num_speculative_tokens=3)
    engine = Engine(
        EngineConfig(
            model=tiny_llama_dir,
            dtype="float32",
            kv_cache_memory=64 << 20,
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            speculative=spec,
        )
    )
    prompts = ["The weather today is", "Once upon a time", "def main():"]
    free = SamplingParams(temperature=0.0, max_tokens=16)
    constrained = SamplingParams(temperature=0.0, max_tokens=40, json_schema=OBJECT_SCHEMA)
    outs = engine.generate(prompts, [free, constrained, free])
    plain = tiny_engine.generate(prompts, [free, constrained, free])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # speculation changes no greedy token
    jsonschema.validate(json.loads(outs[1].text), OBJECT_SCHEMA)
    assert outs[1].metrics.num_spec_proposed == 0 and outs[0].metrics.num_spec_proposed > 0
