"""The stop rule (engine/stop.py): every end of a request and its priorities, and stop strings found
on an incremental text tail exactly where a full re-decode of the output finds them."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchrun.engine.config import SamplingParams
from batchrun.engine.detokenizer import IncrementalDetokenizer, output_text
from batchrun.engine.grammar import GrammarState
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request
from batchrun.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from batchrun.engine.stop import StopRule
from batchrun.testing import build_tokenizer

TINY = build_tokenizer()


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer as Llama's and Mistral's decode: "▁" for spaces, byte
    fallback for what the vocabulary lacks, and the leading space of the whole text stripped (so a
    decode that starts at a later token strips that token's space instead)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from batchrun.testing import sample_texts

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(
        sample_texts()[:20], trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, show_progress=False)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _outputs(tokenizer):
    """Output token lists: random ids (byte tokens that end inside a UTF-8 character, special
    tokens) mixed with encodings of random text (multi-byte characters, emoji, combining marks)."""
    vocab = len(tokenizer)
    piece = st.one_of(
        st.integers(0, vocab - 1).map(lambda t: [t]),
        st.sampled_from(tokenizer.all_special_ids).map(lambda t: [t]),
        st.text(max_size=12).map(lambda text: tokenizer.encode(text, add_special_tokens=False)),
    )
    return st.lists(piece, max_size=16).map(lambda pieces: [t for p in pieces for t in p])


def _steps(num_tokens: int, sizes: list[int]) -> list[int]:
    """Cut num_tokens into steps of the given sizes (1 to 4 tokens: verification steps give
    several), the rest in steps of one."""
    steps, left = [], num_tokens
    for k in sizes:
        if left <= 0:
            break
        steps.append(min(k, left))
        left -= steps[-1]
    return steps + [1] * left


def check_text_tail(tokenizer, data) -> None:
    prompt = data.draw(st.lists(st.integers(3, 200), min_size=1, max_size=5), label="prompt")
    out = data.draw(_outputs(tokenizer), label="output")
    steps = _steps(len(out), data.draw(st.lists(st.integers(1, 4), max_size=len(out)), label="sizes"))

    # 1. Kept whole, the tail is the full decode of the output after every step.
    detok = IncrementalDetokenizer(keep=1 << 30)
    ids, n = list(prompt), 0
    for k in steps:
        ids += out[n : n + k]
        n += k
        assert detok.step(tokenizer, ids, len(prompt)) == _decode(tokenizer, out[:n]), (out, steps, n)

    # 2. The stop rule ends the request at the step where a full re-decode first holds a stop string.
    full = _decode(tokenizer, out)
    cuts = st.tuples(st.integers(0, len(full)), st.integers(1, 6)).map(lambda c: full[c[0] : c[0] + c[1]])
    stop = data.draw(st.lists(st.one_of(cuts, st.text(min_size=1, max_size=3)), min_size=1, max_size=3), label="stop")
    want = None
    n = 0
    for i, k in enumerate(steps):
        n += k
        if any(s in _decode(tokenizer, out[:n]) for s in stop):
            want = i
            break
    rule = StopRule(frozenset(), 1 << 30, tokenizer)
    req = Request(0, 0, list(prompt), SamplingParams(temperature=0.0, stop=stop), 0.0)
    got = None
    n = 0
    for i, k in enumerate(steps):
        req.token_ids += out[n : n + k]
        n += k
        if rule.hits_stop_string(req):
            got = i
            break
    assert got == want, (out, steps, stop)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_text_tail_finds_stop_strings_where_a_full_decode_does(data):
    check_text_tail(TINY, data)


def test_the_text_tail_follows_a_sentencepiece_decoder():
    """Its first token's space is dropped by whichever decode starts there: the tail's two decodes
    start at the same token, and it moves on only past text (the case a byte-level BPE never has)."""
    tokenizer = _metaspace_tokenizer()

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        check_text_tail(tokenizer, data)

    check()


@pytest.mark.slow
def test_the_text_tail_finds_stop_strings_where_a_full_decode_does_with_smollm2(smollm2_cache_dir):
    """SmolLM2's tokenizer (49,152 byte-level tokens, most of them multi-byte pieces)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    (converted,) = (Path(smollm2_cache_dir) / "converted").iterdir()
    tokenizer = AutoTokenizer.from_pretrained(converted, local_files_only=True)

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        check_text_tail(tokenizer, data)

    check()


class _Rewriting:
    """A decoder that rewrites earlier text as tokens arrive (each decode reversed)."""

    clean_up_tokenization_spaces = False

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)[::-1]


def test_a_decoder_the_tail_cannot_follow_is_decoded_whole():
    rewriting = _Rewriting()
    rule = StopRule(frozenset(), 1 << 30, rewriting)
    req = Request(0, 0, [5], SamplingParams(temperature=0.0, stop=["ab"]), 0.0)
    req.token_ids += [1]  # "b"
    assert not rule.hits_stop_string(req)
    req.token_ids += [0]  # "ab" reversed: "ba", then "ab" only in the whole decode of the reversal
    assert rule.hits_stop_string(req) == ("ab" in rewriting.decode([1, 0]))
    assert req.detokenizer is not None and not req.detokenizer.is_exact
    clean = build_tokenizer()
    clean.clean_up_tokenization_spaces = True  # " ." -> "." across tokens: never incremental
    assert not StopRule(frozenset(), 1 << 30, clean).is_incremental


def test_output_text_is_cut_before_the_earliest_stop_string():
    ids = TINY.encode("The value of x is 42.", add_special_tokens=False)
    assert output_text(TINY, ids, ["42", "x"]) == "The value of "
    assert output_text(TINY, ids, []) == "The value of x is 42."
    assert output_text(TINY, [], ["x"]) == ""


# ---- the rule's priorities, through the scheduler's update ------------------------------------

EOS = TINY.eos_token_id


def _scheduler(max_model_len: int = 64) -> Scheduler:
    config = SchedulerConfig(4, 64, max_model_len, True, frozenset({EOS}))
    return Scheduler(config, KVCacheManager(32, 4, True), TINY)


def _run(sched: Scheduler, params: SamplingParams, steps: list[list[int]], prompt=(5, 6, 7)) -> Request:
    """One request through the scheduler, given the tokens each step produces; stops at its end."""
    req = Request(0, 0, list(prompt), params, 0.0)
    sched.add(req)
    for tokens in steps:
        batch = sched.schedule()
        sched.update(StepResult(batch, {0: tokens}))
        if req.is_finished:
            break
    return req


def _failed_grammar() -> GrammarState:
    compiled: Future = Future()
    compiled.set_exception(RuntimeError("no such rule"))
    return GrammarState(compiled, vocab_size=len(TINY))


def test_each_end_and_its_reason():
    x, y = TINY.encode("x", add_special_tokens=False), TINY.encode("y", add_special_tokens=False)
    assert len(x) == len(y) == 1
    free = dict(temperature=0.0, max_tokens=20)
    assert _run(_scheduler(), SamplingParams(**free), [x, [EOS], y]).finish_reason == "stop"
    ignored = _run(_scheduler(), SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3), [x, [EOS], y])
    assert (ignored.finish_reason, ignored.output_token_ids) == ("length", [*x, EOS, *y])
    assert _run(_scheduler(), SamplingParams(**free, stop_token_ids=y), [x, y]).finish_reason == "stop"
    assert _run(_scheduler(max_model_len=5), SamplingParams(**free), [x, x, x]).finish_reason == "length"
    cut = _run(_scheduler(), SamplingParams(**free, stop=["yx"]), [x, y, x, y])
    assert (cut.finish_reason, cut.output_token_ids) == ("stop", [*x, *y, *x])
    assert output_text(TINY, cut.output_token_ids, cut.params.stop) == "x"


def test_priorities_within_a_step():
    """A verification step's tokens: the first stop token ends the request there (later tokens
    dropped, a stop string after it unseen); a token that reaches max_tokens and completes a stop
    string ends it with "length"; a failed grammar ends it with "error" before any token."""
    x, y = TINY.encode("x", add_special_tokens=False), TINY.encode("y", add_special_tokens=False)
    eos_first = _run(_scheduler(), SamplingParams(temperature=0.0, max_tokens=9, stop=["xy"]), [[*x, EOS, *y]])
    assert (eos_first.finish_reason, eos_first.output_token_ids) == ("stop", [*x, EOS])
    both = _run(_scheduler(), SamplingParams(temperature=0.0, max_tokens=3, stop=["yx"]), [y, y, x])
    assert both.finish_reason == "length" and output_text(TINY, both.output_token_ids, both.params.stop) == "y"
    sched = _scheduler()
    req = Request(0, 0, [5, 6], SamplingParams(temperature=0.0, max_tokens=9), 0.0)
    req.grammar = _failed_grammar()
    req.grammar.ready()
    sched.add(req)
    batch = sched.schedule()
    finished = sched.update(StepResult(batch, {}, grammar_errors={0: "no such rule"}))
    assert finished == [req] and (req.finish_reason, req.error, req.output_token_ids) == ("error", "no such rule", [])
    assert not req.block_ids and not sched.has_unfinished()


def test_ends_are_returned_errors_first_then_tokens_then_text_in_the_runners_order():
    """One step ending four requests: a failed grammar, a stop string (sampled first, as drafted
    requests are on a verification step), EOS and max_tokens; the order today's engine gave."""
    x = TINY.encode("x", add_special_tokens=False)
    sched = _scheduler()
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, stop=["x"]),
        SamplingParams(temperature=0.0, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=9),
    ]
    reqs = [Request(i, i, [5, 6], p, 0.0) for i, p in enumerate(params)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    tokens = {0: x, 1: [EOS], 2: x}
    finished = sched.update(StepResult(batch, {2: tokens[2], 0: tokens[0], 1: tokens[1]}, grammar_errors={3: "bad"}))
    assert [r.seq_id for r in finished] == [3, 1, 2, 0]
    assert [r.finish_reason for r in finished] == ["error", "stop", "length", "stop"]
    assert sched.num_generated_tokens == 3 and not sched.has_unfinished()
