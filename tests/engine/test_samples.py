"""Several samples per prompt (SamplingParams.n) and logprobs through the engine's public API.

Samples: indices, distinct texts, seeds independent of batching, one prefill shared by the n
samples. Logprobs (generated and prompt tokens): equal to log_softmax of a teacher-forced HF
forward over the same tokens in float32, whole and chunked prefill, prefix cache on.
"""

from __future__ import annotations

import pytest
import torch

from batchrun import Engine, EngineRequest, SamplingParams
from batchrun.testing import sample_texts
from tests.support.engines import make_tiny_engine

BLOCK = 16
# device: EngineConfig's default ("auto"), not TINY_ENGINE's "cpu"
SETTINGS = dict(
    device="auto",
    max_num_seqs=4,
    max_num_batched_tokens=512,
    max_model_len=256,
    kv_cache_memory=1 << 24,
    block_size=BLOCK,
)


def make_engine(model_dir: str, **kw) -> Engine:
    return make_tiny_engine(model_dir, **{**SETTINGS, **kw})


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def prompts(engine, count: int = 3, chars: int = 150) -> list[list[int]]:
    return [engine.tokenizer.encode(t[:chars]) for t in sample_texts()[:count]]


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "max_tokens": 10, "ignore_eos": True, "seed": 7, **kw})


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """(len(token_ids), vocab) float64: log_softmax of HF's logits at every position."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


# ---- several samples per prompt -------------------------------------------------------------------


def test_n_samples_come_back_per_prompt_in_sample_order_and_differ(engine):
    ps = prompts(engine)
    outs = engine.generate(ps, sampled(n=4))
    assert [(o.request_id, o.sample_index) for o in outs] == [(r, s) for r in range(3) for s in range(4)]
    for r in range(3):
        samples = outs[4 * r : 4 * r + 4]
        assert all(o.prompt_token_ids == ps[r] and len(o.token_ids) == 10 for o in samples)
        assert len({tuple(o.token_ids) for o in samples}) == 4, "independent samples should differ"


def test_sample_zero_is_the_lone_request_and_samples_ignore_the_batch(engine, tiny_llama_dir):
    ps = prompts(engine)
    alone = engine.generate([ps[0]], sampled(n=4))
    lone = engine.generate([ps[0]], sampled())[0]
    assert alone[0].token_ids == lone.token_ids  # sample 0 keeps the request's own seed
    # The same request among others (different params, other prompts first), on an engine that runs
    # two sequences at a time with the prefix cache off: same tokens for every sample.
    small = make_engine(tiny_llama_dir, max_num_seqs=2, enable_prefix_caching=False, max_num_batched_tokens=64)
    mixed = small.generate(
        [ps[1], ps[2], ps[0], ps[1]], [sampled(n=3, seed=1), sampled(seed=2), sampled(n=4), sampled(top_p=0.9)]
    )
    ours = [o for o in mixed if o.request_id == 2]
    assert [o.sample_index for o in ours] == [0, 1, 2, 3]
    assert [o.token_ids for o in ours] == [o.token_ids for o in alone]
    # and again on the first engine: reproducible run to run
    assert [o.token_ids for o in engine.generate([ps[0]], sampled(n=4))] == [o.token_ids for o in alone]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_prompt_is_prefilled_once_and_shared(tiny_llama_dir, prefix_caching):
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=prefix_caching)
    prompt = prompts(engine, 1, 400)[0]
    assert len(prompt) > 3 * BLOCK
    shared = (len(prompt) - 1) // BLOCK * BLOCK  # full blocks; the last prompt token is recomputed
    before = engine.stats()
    outs = engine.generate([prompt], sampled(n=4, max_tokens=3))
    after = engine.stats()
    assert [o.metrics.num_cached_tokens for o in outs] == [0, shared, shared, shared]
    assert after.num_cached_tokens - before.num_cached_tokens == 3 * shared
    # The samples held one copy of the prompt's blocks: 4 private copies would need far more.
    own_blocks = -(-(len(prompt) + 3) // BLOCK) - shared // BLOCK
    assert after.peak_kv_blocks_used <= shared // BLOCK + 4 * own_blocks


def test_n_samples_share_the_prompt_even_when_sample_zero_stops_at_once(engine):
    ps = prompts(engine, 2, 300)
    outs = engine.generate(ps, sampled(n=3, max_tokens=1))
    assert [len(o.token_ids) for o in outs] == [1] * 6
    assert all(o.metrics.num_cached_tokens > 0 for o in outs if o.sample_index > 0)
    assert engine.scheduler.num_unfinished == 0 and engine.kv.pool.num_used_blocks == 0


def test_a_bad_prompt_gives_an_error_per_sample(engine):
    outs = engine.generate(["", "fine"], sampled(n=2, max_tokens=2))
    assert [(o.request_id, o.sample_index, o.finish_reason) for o in outs] == [
        (0, 0, "error"),
        (0, 1, "error"),
        (1, 0, "length"),
        (1, 1, "length"),
    ]


def test_abandoning_a_stream_drops_waiting_samples(engine):
    stream = engine.stream([EngineRequest(i, p, sampled(n=4, max_tokens=30)) for i, p in enumerate(prompts(engine))])
    next(stream)
    stream.close()
    assert engine.scheduler.num_unfinished == 0 and engine.kv.pool.num_used_blocks == 0


def test_greedy_with_several_samples_is_refused():
    with pytest.raises(ValueError, match="temperature > 0"):
        SamplingParams(temperature=0.0, n=2)
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)


# ---- logprobs against a teacher-forced HF forward --------------------------------------------------


def assert_matches_hf(hf, prompt: list[int], tokens: list[int], logprobs: list[dict[int, float]], top_n: int) -> None:
    ref = hf_logprobs(hf, prompt + tokens)
    assert len(logprobs) == len(tokens)
    for j, (token, entry) in enumerate(zip(tokens, logprobs)):
        row = ref[len(prompt) - 1 + j]  # the logits that predicted output token j
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        top_vals, top_ids = torch.topk(row, top_n)
        for tid, val in zip(top_ids.tolist(), top_vals.tolist()):
            assert entry[tid] == pytest.approx(val, abs=1e-4)
        assert len(entry) in (top_n, top_n + 1)


def test_logprobs_equal_a_teacher_forced_hf_forward(engine, hf):
    ps = prompts(engine, 2)
    for out in engine.generate(ps, sampled(n=2, logprobs=3)):
        assert_matches_hf(hf, out.prompt_token_ids, out.token_ids, out.logprobs, 3)


@pytest.mark.parametrize("chunk", [512, 24])
def test_prompt_logprobs_equal_a_teacher_forced_hf_forward(tiny_llama_dir, hf, chunk):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=chunk)
    prompt = prompts(engine, 1, 200)[0]
    params = sampled(n=2, max_tokens=2, prompt_logprobs=4)
    engine.generate([prompt], params)  # its blocks are now in the prefix cache
    outs = engine.generate([prompt], params)
    ref = hf_logprobs(hf, prompt)
    for out in outs:
        assert len(out.prompt_logprobs) == len(prompt) - 1
        for j, entry in enumerate(out.prompt_logprobs):
            token = prompt[j + 1]
            assert entry[token] == pytest.approx(ref[j, token].item(), abs=1e-4)
            top_vals, top_ids = torch.topk(ref[j], 4)
            assert [entry[t] for t in top_ids.tolist()] == pytest.approx(top_vals.tolist(), abs=1e-4)
    assert outs[0].metrics.num_cached_tokens == 0, "a scoring request bypasses the prefix cache"
    assert outs[0].prompt_logprobs == outs[1].prompt_logprobs


def test_samples_survive_a_kv_pool_too_small_for_all_of_them(engine, tiny_llama_dir):
    per_block = engine.settings.kv_cache_bytes // engine.settings.num_kv_blocks
    tight = make_engine(tiny_llama_dir, kv_cache_memory=per_block * 16, max_model_len=200)
    ps = prompts(engine, 2, 300)
    params = sampled(n=4, max_tokens=40)
    squeezed = tight.generate(ps, params)
    assert tight.stats().num_preemptions > 0, "the pool should be too small to run every sample at once"
    assert tight.scheduler.num_unfinished == 0 and tight.kv.pool.num_used_blocks == 0
    # preemption recomputes, so every sample still samples what it samples with room to spare
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in engine.generate(ps, params)]
