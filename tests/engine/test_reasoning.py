"""Reasoning traces through the engine (engine/reasoning.py) on a tiny random reasoning model.

Its tokenizer has `<think>`/`</think>` as single tokens and a template that opens the trace; the
random model never closes it within a few tokens, so the budget's forced closing tag is seen for
real. Traces the model opens and closes itself use tags picked from the tokens the model emits
greedily (`_dynamic_tags`): what the engine does with them is then the model's doing, not a script.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from batchrun.engine import Engine, SamplingParams
from batchrun.engine.config import EngineConfigError
from batchrun.engine.reasoning import START, ThinkingState, ThinkTags, find_think_tags, single_token
from batchrun.engine.runners import GpuRunner, kv_bytes_per_block
from batchrun.testing import make_tiny_reasoning_model
from tests.support.engines import make_tiny_engine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MAX_TOKENS = 24
BUDGET = 8
QUESTIONS = ("what is two plus two?", "name a colour", "say hello to the world in three words")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_reasoning_model(tmp_path_factory.mktemp("reasoning")))


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[Engine]:
    with make_tiny_engine(model_dir) as e:
        yield e


def _prompts(engine: Engine, thinking: bool = True) -> list[str]:
    """Chat prompts: the template opens the trace, or (thinking off) closes an empty one."""
    kwargs = {} if thinking else {"enable_thinking": False}
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True, **kwargs
        )
        for q in QUESTIONS
    ]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


@pytest.fixture(scope="module")
def runs(engine: Engine) -> dict[str, list]:
    """The template-opened prompts greedy without and with the budget, and the closed-block prompts."""
    opened, closed = _prompts(engine), _prompts(engine, thinking=False)
    return {
        "free": engine.generate(opened, _greedy()),
        "budget": engine.generate(opened, _greedy(max_thinking_tokens=BUDGET)),
        "closed": engine.generate(closed, _greedy()),
    }


@pytest.fixture(scope="module")
def dynamic(engine: Engine, runs) -> tuple[ThinkTags, list[int], int]:
    """Tags the model uses by itself on the first closed-block prompt: its first greedy token opens,
    a later one (its first appearance) closes. (tags, that prompt's greedy tokens, the close's index)."""
    tok = engine.tokenizer
    prompt_ids = runs["closed"][0].prompt_token_ids
    out = runs["closed"][0].token_ids
    first = out[0]
    assert first not in prompt_ids and single_token(tok, tok.decode([first])) == first, "pick another prompt"
    for k in range(2, 12):
        close = out[k]
        if close not in out[:k] and close not in prompt_ids and single_token(tok, tok.decode([close])) == close:
            tags = find_think_tags(tok, [tok.decode([first]), tok.decode([close])])
            assert tags is not None and (tags.open_id, tags.close_id) == (first, close)
            assert ThinkingState.for_prompt(tags, prompt_ids, None, False).phase == START
            return tags, out, k
    raise AssertionError(f"no single-token closing tag among {out[:12]}")


@pytest.fixture
def retagged(engine: Engine, dynamic) -> Iterator[ThinkTags]:
    tags = dynamic[0]
    engine.think_tags = tags
    try:
        yield tags
    finally:
        engine.think_tags = find_think_tags(engine.tokenizer, None)


def test_engine_finds_the_tags_and_the_template_separator(engine: Engine):
    tags = engine.think_tags
    assert tags is not None and (tags.open, tags.close, tags.separator) == ("<think>", "</think>", "\n\n")
    assert (tags.open_id, tags.close_id) == (512, 513)
    assert engine.tokenizer.decode(list(tags.close_ids)) == "</think>\n\n"


def test_budget_forces_the_closing_tag_and_separator_and_changes_nothing_before(engine: Engine, runs):
    tags = engine.think_tags
    assert tags is not None
    for free, out in zip(runs["free"], runs["budget"]):
        assert tags.close_id not in free.token_ids[:BUDGET], "the random model was expected not to close early"
        ids = out.token_ids
        assert ids[:BUDGET] == free.token_ids[:BUDGET]  # the budget changes nothing before it bites
        assert ids[BUDGET : BUDGET + 1 + len(tags.separator_ids)] == list(tags.close_ids)
        assert out.num_reasoning_tokens == BUDGET
        assert out.num_answer_tokens == len(ids) - BUDGET - 1
        assert out.reasoning == engine.tokenizer.decode(ids[:BUDGET], skip_special_tokens=True).strip()
        answer = engine.tokenizer.decode(ids[BUDGET + 1 :], skip_special_tokens=True)
        assert out.text == answer.lstrip() and out.text
        assert out.finish_reason in ("stop", "length")


def test_a_whitespace_stop_string_does_not_match_the_separator(engine: Engine, runs):
    """Stop strings look at the answer past the template's separator: "\n" must not end a row at
    the "\n\n" the engine appends after the closing tag, nor cut its text there."""
    tok = engine.tokenizer
    prompts = _prompts(engine)
    outs = engine.generate(prompts, _greedy(max_thinking_tokens=BUDGET, stop=["\n"]))
    for out, budget in zip(outs, runs["budget"]):
        assert out.num_answer_tokens > len(engine.think_tags.separator_ids)  # went on past the separator
        answer = tok.decode(budget.token_ids[BUDGET + 1 + 2 :], skip_special_tokens=True)
        assert out.text == answer.split("\n")[0].lstrip()


def test_a_stop_token_id_does_not_match_the_forced_separator(engine: Engine, runs):
    """A newline token among stop_token_ids must not end a row at the separator the engine forces
    after a spent budget's closing tag (the template's whitespace, not the model's): the answer
    goes on, and ends at the model's own newline token, if any."""
    sep = engine.think_tags.separator_ids
    head = BUDGET + 1 + len(sep)
    outs = engine.generate(_prompts(engine), _greedy(max_thinking_tokens=BUDGET, stop_token_ids=[sep[0]]))
    for out, budget in zip(outs, runs["budget"]):
        answer = budget.token_ids[head:]
        cut = answer.index(sep[0]) + 1 if sep[0] in answer else len(answer)
        assert out.token_ids == budget.token_ids[: head + cut]
        assert out.num_answer_tokens == len(sep) + cut


def test_an_output_without_a_trace_meets_its_stop_strings_as_without_tags(engine: Engine, runs):
    """Only a trace's answer starts past the separator: an output without a trace that begins with
    the separator's tokens stops where it would on an engine without tags (here the separator is
    made of the model's own first greedy tokens on a thinking-off prompt)."""
    tok = engine.tokenizer
    plain = runs["closed"][0].token_ids
    stop = [tok.decode(plain[:1])]
    assert stop[0].strip() and stop[0] not in tok.decode(plain[1:]), "pick another prompt"
    prompt, params = _prompts(engine, thinking=False)[:1], _greedy(stop=stop)
    default = engine.think_tags
    assert default is not None
    try:
        engine.think_tags = None
        (want,) = engine.generate(prompt, params)
        engine.think_tags = ThinkTags(
            default.open, default.close, default.open_id, default.close_id, tok.decode(plain[:2]), tuple(plain[:2])
        )
        (got,) = engine.generate(prompt, params)
    finally:
        engine.think_tags = default
    assert want.token_ids == plain[:1]
    assert (got.token_ids, got.text, got.finish_reason, got.reasoning) == (want.token_ids, want.text, "stop", None)


def test_a_forced_tokens_logprobs_are_the_models(engine: Engine):
    """A forced row is masked to one token, yet its logprobs are the raw distribution's."""
    tags = engine.think_tags
    assert tags is not None
    prompt = _prompts(engine)[:1]
    (free,) = engine.generate(prompt, _greedy(max_tokens=BUDGET + 1, logprobs=2))
    (out,) = engine.generate(prompt, _greedy(max_tokens=BUDGET + 1, logprobs=2, max_thinking_tokens=BUDGET))
    assert out.logprobs is not None and free.logprobs is not None
    assert out.logprobs[:BUDGET] == free.logprobs[:BUDGET]
    forced = dict(out.logprobs[BUDGET])
    assert out.token_ids[BUDGET] == tags.close_id and forced.pop(tags.close_id) < -0.01
    assert forced.items() <= free.logprobs[BUDGET].items() and len(forced) == 2


def test_max_tokens_inside_the_trace_is_thinking_length(engine: Engine, runs):
    tags = engine.think_tags
    assert tags is not None
    for free in runs["free"]:
        assert tags.close_id not in free.token_ids
        assert free.finish_reason == "thinking_length" and free.text == ""
        assert free.num_reasoning_tokens == MAX_TOKENS and free.num_answer_tokens == 0
        assert free.reasoning == engine.tokenizer.decode(free.token_ids, skip_special_tokens=True).strip()
    # A budget larger than max_tokens never bites: the same.
    (short,) = engine.generate(_prompts(engine)[:1], _greedy(max_tokens=5, max_thinking_tokens=BUDGET))
    assert short.token_ids == runs["free"][0].token_ids[:5] and short.finish_reason == "thinking_length"


def test_a_stop_token_inside_the_trace_is_not_a_trace_token(engine: Engine, runs):
    """A stop token id (or EOS) that ends a row inside its open trace ends it "stop"; like a stop
    token in an answer, it is not part of the trace's text nor of its token count."""
    free = runs["free"][0]
    ids = free.token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # the stop token's first appearance
    (out,) = engine.generate(_prompts(engine)[:1], _greedy(stop_token_ids=[ids[k]]))
    assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop"
    assert out.num_reasoning_tokens == k and out.num_answer_tokens == 0 and out.text == ""
    assert out.reasoning == engine.tokenizer.decode(ids[:k], skip_special_tokens=True).strip()


def test_a_closed_block_in_the_prompt_leaves_the_output_whole(engine: Engine, runs):
    with_budget = engine.generate(_prompts(engine, thinking=False), _greedy(max_thinking_tokens=2))
    for out, again in zip(runs["closed"], with_budget):
        assert out.reasoning is None and out.num_reasoning_tokens == 0
        assert out.num_answer_tokens == len(out.token_ids)
        assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)  # not stripped
        assert (again.token_ids, again.text, again.reasoning) == (out.token_ids, out.text, None)


def test_a_grammar_after_a_closed_block_in_the_prompt_does_not_let_a_trace_open(engine: Engine):
    """Thinking off (the template closed this turn's trace): a grammar's mask must not allow the
    opening tag, or the model opens the trace the user turned off (the random model does, greedily)
    and spends max_tokens on it."""
    tags = engine.think_tags
    assert tags is not None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    outs = engine.generate(_prompts(engine, thinking=False), _greedy(max_tokens=12, json_schema=schema))
    for out in outs:
        assert out.token_ids[0] != tags.open_id and out.reasoning is None and out.num_reasoning_tokens == 0
        assert out.text.startswith("{") and out.finish_reason in ("stop", "length")


def test_a_trace_the_model_opens_and_closes(engine: Engine, runs, dynamic, retagged):
    tags, plain, k = dynamic
    tok = engine.tokenizer
    prompt = _prompts(engine, thinking=False)[:1]
    (out,) = engine.generate(prompt, _greedy())
    assert out.token_ids == plain  # unconstrained: the tags change no token
    assert out.num_reasoning_tokens == k - 1 and out.num_answer_tokens == len(plain) - k - 1
    assert out.reasoning == tok.decode(plain[1:k], skip_special_tokens=True).strip()
    assert out.text == tok.decode(plain[k + 1 :], skip_special_tokens=True).lstrip()
    # A budget under the model's trace: forced close and separator after it, the model's tokens before.
    budget = max(1, k - 2)
    (cut,) = engine.generate(prompt, _greedy(max_thinking_tokens=budget))
    assert cut.token_ids[: 1 + budget] == plain[: 1 + budget]
    assert cut.token_ids[1 + budget : 2 + budget + len(tags.separator_ids)] == list(tags.close_ids)
    assert cut.num_reasoning_tokens == budget


def test_grammar_waits_for_the_answer_of_a_template_opened_trace(engine: Engine, runs):
    tags = engine.think_tags
    assert tags is not None
    opened = _prompts(engine)
    budget = 4
    choices = ("yes", "no")
    schema = {"enum": ["red", "green"]}
    outs = engine.generate(
        opened + opened,
        [_greedy(max_thinking_tokens=budget, choice=choices)] * len(opened)
        + [_greedy(max_thinking_tokens=budget, json_schema=schema)] * len(opened),
    )
    for free, out in zip(runs["free"] * 2, outs):
        assert out.token_ids[:budget] == free.token_ids[:budget]  # the trace is not constrained
        assert out.token_ids[budget : budget + 1 + len(tags.separator_ids)] == list(tags.close_ids)
        assert out.finish_reason == "stop" and out.reasoning is not None
    assert all(o.text in choices for o in outs[: len(opened)])
    assert all(json.loads(o.text) in schema["enum"] for o in outs[len(opened) :])


def test_grammar_allows_the_opening_tag_first_and_forces_the_separator(engine: Engine, dynamic, retagged):
    """The model's first greedy token is the (dynamic) opening tag, which no choice allows: the
    grammar's mask lets it through, the trace runs free until the model closes it, the separator is
    forced after the model's closing tag, then the answer is one of the choices."""
    tags, plain, k = dynamic
    choices = ("yes", "no")
    (out,) = engine.generate(_prompts(engine, thinking=False)[:1], _greedy(choice=choices))
    assert out.token_ids[: k + 1] == plain[: k + 1]
    assert out.token_ids[k + 1 : k + 1 + len(tags.separator_ids)] == list(tags.separator_ids)
    assert out.text in choices and out.finish_reason == "stop"
    assert out.num_reasoning_tokens == k - 1


def test_budget_without_tags_is_an_error_row_and_bad_tags_fail_start_up(engine: Engine, model_dir: str):
    engine.think_tags = None
    try:
        (bad, good) = engine.generate(_prompts(engine)[:2], [_greedy(max_thinking_tokens=4), _greedy(max_tokens=3)])
    finally:
        engine.think_tags = find_think_tags(engine.tokenizer, None)
    assert bad.finish_reason == "error"
    assert bad.error == "max_thinking_tokens: the model's tokenizer has no think tags (set engine.think_tags)"
    assert good.finish_reason == "length" and good.reasoning is None and good.num_answer_tokens == 3
    with pytest.raises(EngineConfigError, match=r"engine\.think_tags: 'no such tag' is not one token"):
        make_tiny_engine(model_dir, think_tags=["<think>", "no such tag"])
    with make_tiny_engine(model_dir, think_tags=[]) as off:
        assert off.think_tags is None


def test_scheduling_sampling_and_speculation_leave_the_outputs_alone(engine: Engine, model_dir: str, runs):
    """Chunked prefill (a 16-token budget), preemption (a 10-block cache), n-gram speculation and
    n=2 seeded samples: the tokens, traces and answers of a plain engine. (Seeded samples run with
    the drafter off: a drafted sample draws from other uniforms by design, engine/drafter.py.)"""
    opened = _prompts(engine)
    sampled = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=MAX_TOKENS, max_thinking_tokens=BUDGET)
    want = runs["budget"] + engine.generate(opened, sampled)
    per_block = kv_bytes_per_block(engine.model, 16, engine.dtype)
    with make_tiny_engine(
        model_dir,
        max_num_batched_tokens=16,
        kv_cache_memory=10 * per_block,
        speculative=dict(method="ngram", num_speculative_tokens=3, ngram_min=1, adaptive=False),
    ) as stressed:
        got = stressed.generate(opened, _greedy(max_thinking_tokens=BUDGET))
        assert stressed.stats().num_spec_accepted
        # The second prompt's trace repeats itself: n-gram drafts are accepted in it, and budgets
        # spent at each place a verification step can hold must drop the step's later tokens.
        tags, plain = engine.think_tags, runs["free"][1].token_ids
        assert tags is not None
        budgets = range(10, MAX_TOKENS - len(tags.close_ids))
        cut = stressed.generate(opened[1:2] * len(budgets), [_greedy(max_thinking_tokens=b) for b in budgets])
        for b, out in zip(budgets, cut):
            assert out.token_ids[: b + len(tags.close_ids)] == plain[:b] + list(tags.close_ids)
            assert out.num_reasoning_tokens == b
        stressed.drafter = None
        got += stressed.generate(opened, sampled)
        assert stressed.stats().num_preemptions > 0
    assert [o.sample_index for o in got] == [0, 0, 0, 0, 1, 0, 1, 0, 1]

    def key(outs):
        return [(o.token_ids, o.reasoning, o.text, o.finish_reason, o.num_reasoning_tokens) for o in outs]

    assert key(got) == key(want)
    assert all(o.num_reasoning_tokens == BUDGET for o in got)


def test_steps_run_ahead_stop_for_a_forced_token(engine: Engine, runs):
    """engine.async_scheduling on the GPU runner's code (stand-in graphs): decode steps run ahead
    while no trace can spend its budget, and the forced tokens still come out right."""
    cpu = engine.runner
    engine.runner = GpuRunner.stand_in(cpu, 8)
    try:
        assert engine.set_async_scheduling(True)
        before = engine.stats().num_async_steps or 0
        ahead = engine.generate(_prompts(engine), _greedy(max_thinking_tokens=BUDGET))
        num_ahead = (engine.stats().num_async_steps or 0) - before
    finally:
        engine.set_async_scheduling(False)
        engine.runner = cpu
    assert num_ahead > 0
    assert [o.token_ids for o in ahead] == [o.token_ids for o in runs["budget"]]


def test_a_tag_in_the_users_text_does_not_open_the_trace(engine: Engine):
    """A prompt whose user turn mentions `<think>` (a question about reasoning models, a quoted
    transcript) tokenizes it as the tag; with a template that does not open the trace (Qwen3's,
    thinking on) the output must not be taken for a trace: the tag is followed by the user's text,
    not by the end of the generation prompt."""
    tags = engine.think_tags
    prompt = "<|im_start|>user\nWhat does the <think> tag do?<|im_end|>\n<|im_start|>assistant\n"
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert tags.open_id in ids and ThinkingState.for_prompt(tags, ids, None, False).phase == START
    (out,) = engine.generate([ids], _greedy(max_tokens=4))
    if out.token_ids[0] != tags.open_id:  # the model did not open one either: all answer
        assert (out.reasoning, out.num_reasoning_tokens, out.num_answer_tokens) == (None, 0, 4)
        assert out.finish_reason == "length"
    # the template's own opening tag at the end of the prompt (R1's, `<think>\n`) still opens it
    opened = engine.tokenizer.encode(prompt + "<think>\n", add_special_tokens=False)
    assert ThinkingState.for_prompt(tags, opened, None, False).in_trace
