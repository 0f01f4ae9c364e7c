"""Engine behaviour through its public API on a tiny model: streaming, errors, stops, seeds."""

from __future__ import annotations

import itertools

import pytest

from batchrun import Engine, EngineConfig, EngineRequest, SamplingParams
from batchrun.testing import sample_texts


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(
        EngineConfig(model=tiny_llama_dir, dtype="float32", max_num_seqs=4, max_model_len=256, kv_cache_memory=1 << 24)
    )


def test_generate_accepts_text_and_token_ids_in_input_order(engine):
    texts = [t[:80] for t in sample_texts()[:5]]
    ids = [engine.tokenizer.encode(t) for t in texts]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    a = engine.generate(texts, greedy)
    b = engine.generate(ids, greedy)
    assert [o.request_id for o in a] == list(range(5))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.prompt_token_ids == i for o, i in zip(a, ids))
    for o in a:
        assert o.finish_reason in ("stop", "length")
        assert o.text == engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        m = o.metrics
        assert m.ttft_s is not None and 0 <= m.ttft_s <= m.latency_s
        assert len(o.token_ids) < 2 or m.itl_s is not None


def test_stream_is_lazy_and_bounded(engine):
    pulled = []

    def source():
        for i in itertools.count():
            if i == 40:
                return
            pulled.append(i)
            yield EngineRequest(request_id=f"r{i}", prompt=sample_texts()[i % 10][:60])

    seen = []
    max_unfinished = 0
    for out in engine.stream(source(), SamplingParams(temperature=0.0, max_tokens=4), max_in_flight=6):
        seen.append(out.request_id)
        # outputs come back while the source is still being pulled: never more than 6 ahead
        max_unfinished = max(max_unfinished, len(pulled) - len(seen))
    assert sorted(seen) == sorted(f"r{i}" for i in range(40))
    assert max_unfinished <= 6
    assert engine.scheduler.num_unfinished == 0


def test_bad_requests_become_error_outputs_and_the_rest_go_on(engine):
    long_prompt = list(range(1, 300))  # max_model_len is 256
    prompts = ["fine prompt", "", long_prompt, [1, 2, 10**9], "another fine one"]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3))
    assert [o.finish_reason for o in outs][1:4] == ["error"] * 3
    assert "empty" in outs[1].error
    assert "max_model_len" in outs[2].error and "299" in outs[2].error
    assert "token ids" in outs[3].error
    assert outs[0].error is None and outs[4].error is None and len(outs[4].token_ids) > 0


def test_stop_strings_are_cut_from_the_text(engine):
    base = engine.generate(["The following"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = engine.generate(
        ["The following"], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[: base.text.find(stop)]
    assert stop not in out.text


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = engine.generate(["Once upon a time"], p)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=7) for _ in range(3)]
    mixed = engine.generate(
        ["noise one", "Once upon a time", "noise two", "noise three"], [others[0], p, others[1], others[2]]
    )
    assert mixed[1].token_ids == alone
    different = engine.generate(
        ["Once upon a time"], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    )[0]
    assert different.token_ids != alone


def test_seeded_requests_keep_their_tokens_beside_greedy_and_other_sampled_rows(engine):
    """Each seeded request alone against the same requests in one mixed batch: greedy rows, an
    unseeded row, other seeded rows with other masks (and more requests than max_num_seqs, so the
    batch changes while they run)."""
    seeded = [
        ("Once upon a time", SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=5, max_tokens=10)),
        ("The weather today", SamplingParams(temperature=1.3, seed=6, max_tokens=10, ignore_eos=True)),
        ("In a distant land", SamplingParams(temperature=0.9, top_k=3, seed=7, max_tokens=10, ignore_eos=True)),
    ]
    alone = [engine.generate([prompt], p)[0].token_ids for prompt, p in seeded]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    mixed = engine.generate(
        ["noise one", seeded[0][0], "noise two", seeded[1][0], "noise three", seeded[2][0]],
        [greedy, seeded[0][1], SamplingParams(temperature=1.0, max_tokens=9), seeded[1][1], greedy, seeded[2][1]],
    )
    assert [mixed[i].token_ids for i in (1, 3, 5)] == alone
    assert mixed[0].token_ids == engine.generate(["noise one"], greedy)[0].token_ids


def test_logprobs_are_returned_per_token(engine):
    out = engine.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and max(lp.values()) == lp[tok] and len(lp) == 3


def test_unknown_model_name_says_what_was_tried(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        Engine(EngineConfig(model="no-such-model-xyz"))
    assert "no-such-model-xyz" in str(err.value)


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match="engine.dtype"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
