"""Grammar masks off the critical path (filled during the forward, applied in one op, skipped for
rows that admit every token), length-bounded strings spelled out so their masks are precomputed,
and the typed marker of a constrained output that max_tokens cut (Parquet rows and batch lines)."""

from __future__ import annotations

import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchrun.engine import EngineConfig, SamplingParams
from batchrun.engine.grammar import MAX_SPELLED_REPETITION, build_grammar
from batchrun.engine.runners import sampling as step_sampler_module
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DOC_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "keywords": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6}, "maxItems": 3},
    },
    "required": ["title", "color", "keywords"],
    "additionalProperties": False,
}
PROMPTS = ["The weather today is", "Once upon a time", "def main():", "Numbers: 1, 2,", "A list of"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=150, json_schema=DOC_SCHEMA),
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=0.9, seed=3, max_tokens=12, regex="[a-c]{2,5}"),
    SamplingParams(temperature=0.0, max_tokens=12, choice=["yes", "no"]),
    SamplingParams(temperature=0.8, seed=5, max_tokens=150, json_schema=DOC_SCHEMA),
]


def test_length_bounds_are_spelled_out_and_keep_their_language():
    """No repetition of the JSON string character is left to xgrammar (it masks one by running the
    whole vocabulary through its parser every step); the strings accepted stay the same."""
    xgr = pytest.importorskip("xgrammar")
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "minLength": 2, "maxLength": 3},
            "b": {"type": "string", "minLength": 2},
        },
        "required": ["a", "b"],
    }
    ebnf = str(build_grammar("json_schema", json.dumps(schema)))
    assert "_characters{" not in ebnf, ebnf
    past_cap = {"type": "string", "maxLength": MAX_SPELLED_REPETITION + 1}
    assert "_characters{0, " in str(build_grammar("json_schema", json.dumps(past_cap)))  # kept as it was

    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar("json_schema", json.dumps(schema)))
    for a, b, valid in [
        ("xy", "zz", True),
        ('x\\"y', "zzzzzzzzzzzz", True),  # an escape counts one character
        ("\\u00e9\\n", "zz", True),
        ("x", "zz", False),  # under minLength
        ("wxyz", "zz", False),  # past maxLength
        ("xy", "z", False),
    ]:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        text = f'{{"a": "{a}", "b": "{b}"}}'
        assert (matcher.accept_string(text) and matcher.is_terminated()) == valid, text


def test_spelled_out_bounds_mask_exactly_as_the_repetition_did():
    """Every step of a walk through a document, the spelled-out grammar's mask is bit for bit the
    mask of the repetition form it replaces: constrained outputs are the same tokens."""
    xgr = pytest.importorskip("xgrammar")
    from batchrun.engine.grammar import _BOUNDED_STRING_CHAR, _JSON_STRING_CHAR, JSON_SEPARATORS

    text = json.dumps(DOC_SCHEMA)
    repetition = str(xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS))
    repetition = repetition.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
    vocab = [chr(c) for c in range(32, 127)] + ['", "', '"]', "title", "ab", 'xy"', "\\n", "abcdefgh", '": ["']
    info = xgr.TokenizerInfo(vocab)
    compiler = xgr.GrammarCompiler(info)
    matchers = [
        xgr.GrammarMatcher(compiler.compile_grammar(grammar), terminate_without_stop_token=True)
        for grammar in (xgr.Grammar.from_ebnf(repetition), build_grammar("json_schema", text))
    ]
    doc = '{"title": "ab\\nxyzabc", "color": "red", "keywords": ["ab", "xy", "abcdef"]}'
    masks = xgr.allocate_token_bitmask(2, len(vocab))
    for ch in doc:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(masks, i)
        assert torch.equal(masks[0], masks[1]), ch
        assert all(m.accept_string(ch) for m in matchers), ch
    assert all(m.is_terminated() for m in matchers)


def _fills_by_thread(monkeypatch) -> list[str]:
    names: list[str] = []
    fill = step_sampler_module.fill_bitmask

    def spy(states, vocab_size):
        names.append(threading.current_thread().name)
        return fill(states, vocab_size)

    monkeypatch.setattr(step_sampler_module, "fill_bitmask", spy)
    return names


def test_masks_filled_during_the_forward_give_the_tokens_of_masks_filled_after_it(
    tiny_engine, one_torch_thread, monkeypatch
):
    step_sampler = tiny_engine.runner.step_sampler
    names = _fills_by_thread(monkeypatch)
    try:
        step_sampler.overlap_masks = False
        after = tiny_engine.generate(PROMPTS, PARAMS)
        sync_names, names[:] = list(names), []
        step_sampler.overlap_masks = True
        during = tiny_engine.generate(PROMPTS, PARAMS)
    finally:
        step_sampler.overlap_masks = True
    assert [o.token_ids for o in during] == [o.token_ids for o in after]
    assert sync_names and all(n == threading.current_thread().name for n in sync_names)
    # Overlapped: every step's masks come from the worker, except at the first sampling step,
    # whose grammars were still compiling when the forward started.
    in_worker = [n for n in names if n.startswith("grammar-mask")]
    assert len(in_worker) >= len(names) - 2 and len(in_worker) > 10, names
    assert after[0].finish_reason == "stop" and json.loads(after[0].text)["color"] in ("red", "green", "blue")


def test_rows_that_admit_every_token_are_not_masked(tiny_engine, one_torch_thread, monkeypatch):
    """xgrammar reports per row whether its mask blocks anything; rows that block nothing skip the
    apply. A vocabulary with special tokens never gives a grammar such a state (they are always
    blocked), so the any-text regex row's report is made to say it: true for every token that
    greedy decoding picks here, which are all plain text (checked first)."""
    anything = r"[\s\S]*"
    free = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    regex = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, regex=anything)
    free_out = tiny_engine.generate(PROMPTS[:1], free)[0]
    special = set(tiny_engine.tokenizer.all_special_ids)
    assert not special & set(free_out.token_ids)

    fill, apply = step_sampler_module.fill_bitmask, step_sampler_module.apply_bitmask
    applied_rows: list[int] = []

    def fill_reporting_the_regex_rows_as_admitting_all(states, vocab_size):
        bitmask, needed = fill(states, vocab_size)
        for i, state in enumerate(states):
            if state.matcher is not None and state in regex_states:
                bitmask[i], needed[i] = -1, False
        return bitmask, needed

    def counting_apply(logits, rows, bitmask):
        applied_rows.append(len(rows))
        return apply(logits, rows, bitmask)

    regex_states: list = []
    new_state = tiny_engine.grammars.new_state

    def recording_new_state(key):
        state = new_state(key)
        if key == ("regex", anything):
            regex_states.append(state)
        return state

    monkeypatch.setattr(tiny_engine.grammars, "new_state", recording_new_state)
    monkeypatch.setattr(step_sampler_module, "fill_bitmask", fill_reporting_the_regex_rows_as_admitting_all)
    monkeypatch.setattr(step_sampler_module, "apply_bitmask", counting_apply)
    alone = tiny_engine.generate(PROMPTS[:1], regex)[0]
    assert applied_rows == []  # its one row admitted every token at every step: nothing applied
    assert alone.token_ids == free_out.token_ids
    both = tiny_engine.generate(PROMPTS[:2], [regex, PARAMS[0]])
    assert applied_rows and all(n == 1 for n in applied_rows)  # only the JSON row was masked
    assert both[0].token_ids == free_out.token_ids


def test_a_cut_constrained_output_is_typed_in_its_result_row(tmp_path, short_texts, tiny_engine, job_overrides):
    from batchrun import cli

    data, out = tmp_path / "in", tmp_path / "out"
    data.mkdir()
    schemas = [json.dumps(DOC_SCHEMA), None]
    table = pa.table({"id": ["c", "f"], "text": short_texts[:2], "schema": pa.array(schemas, pa.string())})
    pq.write_table(table, data / "part-00.parquet")
    config = cli.load_config(job_overrides(data, out, "data.schema_column=schema", "sampling.max_tokens=3"))
    result = run_job(config, engine=tiny_engine)
    assert result.exit_code == 0, result.message
    cut, free = pq.read_table(out / "results" / "part-00.parquet").to_pylist()
    assert (cut["finish_reason"], cut["error_type"]) == ("length", "truncated_structured_output")
    assert cut["output"] and "max_tokens" in cut["error_message"]  # the text is kept, typed
    assert (free["finish_reason"], free["error_type"]) == ("length", None)  # a free output cut is fine


def test_a_cut_constrained_choice_is_typed_in_its_batch_line(tmp_path, tiny_engine, tiny_llama_dir):
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": DOC_SCHEMA}}
    chat = [{"role": "user", "content": "Describe a module."}]
    lines = [
        {"custom_id": "cut", "body": {"messages": chat, "max_tokens": 3, "response_format": fmt}},
        {"custom_id": "done", "body": {"messages": chat, "max_tokens": 150, "temperature": 0, "response_format": fmt}},
        {"custom_id": "free", "body": {"messages": chat, "max_tokens": 3}},
    ]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "batch.jsonl").write_text(
        "".join(
            json.dumps({**x, "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny", **x["body"]}})
            + "\n"
            for x in lines
        )
    )
    config = RunConfig(
        job=JobConfig(name="openai_batch"),
        model=ModelConfig(path=tiny_llama_dir),
        engine=EngineConfig(model=tiny_llama_dir, max_num_seqs=4),
        sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=0),
        data=DataConfig(uri=str(tmp_path / "in"), format="openai_batch", openai_model_name="tiny"),
        output=OutputConfig(uri=str(tmp_path / "out")),
        quiet=True,
    )
    result = run_job(config, engine=tiny_engine)
    assert result.exit_code == 0, result.message
    out_lines = [json.loads(x) for x in (tmp_path / "out" / "outputs" / "batch.jsonl").read_text().splitlines()]
    choices = {x["custom_id"]: x["response"]["body"]["choices"][0] for x in out_lines}
    assert all(x["error"] is None for x in out_lines)  # answered: the lines stay in the outputs file
    assert choices["cut"]["finish_reason"] == "length"
    assert choices["cut"]["error_type"] == "truncated_structured_output"
    assert choices["done"]["finish_reason"] == "stop" and "error_type" not in choices["done"]
    json.loads(choices["done"]["message"]["content"])
    assert choices["free"]["finish_reason"] == "length" and "error_type" not in choices["free"]
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results" / "batch.parquet").to_pylist()}
    assert rows["cut"]["error_type"] == "truncated_structured_output" and rows["done"]["error_type"] is None
