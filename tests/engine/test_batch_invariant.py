"""engine.batch_invariant: in bf16 a row's greedy tokens (and its logprobs, bitwise) are the same
alone or in a batch of 7 or 32, with its prompt chunked (token budgets 64 and 512) or not, its
prefix cached or not, and with n-gram speculation on or off.

Tiny random models of every family (the native CPU kernels serve head_dims 16 and 32; Qwen3's 24
takes the torch path), and the real SmolLM2 for the chunked and speculated cases. Each comparison
runs the same prompts through engines that differ only in how the rows are computed. Logprobs are
compared where they are asked (a request that asks for them is never speculated), tokens
everywhere. Without the option these comparisons fail: a row's prefill chunk or verification
block takes other reduction orders than a plain decode (see docs/configuration.md).
"""

from __future__ import annotations

import pytest

from batchrun.engine import Engine, SamplingParams, SpeculativeConfig
from batchrun.testing import FAMILIES, sample_texts
from tests.support.engines import make_tiny_engine

MAX_TOKENS = 16


def _prompts(n: int) -> list[str]:
    """n real-text prompts of 10-330 characters (a few to ~150 tokens of the tiny tokenizer)."""
    texts = sample_texts()
    return [texts[3 + i][: 10 + (97 * i) % 320] for i in range(n)]


def _engine(model: str, **kw) -> Engine:
    settings = dict(dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=512, batch_invariant=True)
    return make_tiny_engine(model, **{**settings, **kw})


def _rows(engine: Engine, prompts: list[str], logprobs: bool = True, max_tokens: int = MAX_TOKENS) -> list[tuple]:
    """Per prompt: (greedy tokens, their logprobs) — logprobs None where not asked."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0 if logprobs else None)
    outs = engine.generate(prompts, params)
    return [(o.token_ids, [lp[t] for t, lp in zip(o.token_ids, o.logprobs)] if logprobs else None) for o in outs]


def _tokens(rows: list[tuple]) -> list[list[int]]:
    return [r[0] for r in rows]


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    """family -> (model dir, prompts, rows of all 32 prompts at once: budget 512, nothing chunked)."""
    cache: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in cache:
            model, prompts = tiny_model_factory(family), _prompts(32)
            engine = _engine(model)
            cache[family] = (model, prompts, engine, _rows(engine, prompts))
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_identical_across_batch_sizes_chunking_and_prefix_cache(family, reference, one_torch_thread):
    model, prompts, plain, want = reference(family)
    # The same engine: a batch of 7 and one row alone, their prefixes now served from the cache.
    assert _rows(plain, prompts[:7]) == want[:7]
    assert _rows(plain, prompts[9:10]) == want[9:10]
    # Budget 64: prompts chunked and mixed with decodes; no prefix cache.
    chunked = _engine(model, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert _rows(chunked, prompts) == want
    assert _rows(chunked, prompts[:7]) == want[:7]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_identical_with_ngram_speculation(family, reference, one_torch_thread):
    model, prompts, _, want = reference(family)
    ngram = SpeculativeConfig("ngram", adaptive=False)  # drafts wherever the prompt lookup finds one
    for budget in (64, 512):  # verification blocks with and without chunked prompts beside them
        speculated = _engine(model, max_num_batched_tokens=budget, speculative=ngram)
        assert _tokens(_rows(speculated, prompts, logprobs=False)) == _tokens(want)
        assert speculated.stats().num_spec_accepted  # it did speculate, and drafts were accepted


@pytest.mark.slow
def test_smollm2_rows_identical_chunked_and_speculated(smollm2_cache_dir):
    """The real SmolLM2 in bf16: all rows at once with whole prompts, against the same rows with
    prompts chunked under a 64-token budget and n-gram speculation on."""
    texts = sample_texts()
    prompts = [f"Summarize this documentation:\n{texts[5 + i][:600]}" for i in range(6)]

    def engine(**kw) -> Engine:
        return _engine("smollm2-135m", cache_dir=smollm2_cache_dir, max_num_seqs=8, kv_cache_memory=256 << 20, **kw)

    want = _rows(engine(), prompts, max_tokens=32)
    ngram = SpeculativeConfig("ngram", adaptive=False)
    chunked = engine(max_num_batched_tokens=64, speculative=ngram)
    assert _tokens(_rows(chunked, prompts, logprobs=False, max_tokens=32)) == _tokens(want)
    assert chunked.stats().num_spec_accepted


def test_native_linear_rows_do_not_depend_on_the_row_count():
    """What the option relies on for linear layers on the CPU: the native bf16 kernel (every
    projection of the tiny models and SmolLM2) sums each row over k in one fixed order, so a row's
    output is bitwise the same in a product of 1 row or 300 (oneDNN's is not, at wide shapes)."""
    import torch

    from batchrun.kernels import cpu_linear as ck

    if not ck.native_supported(1536, 576):
        pytest.skip("the native bf16 linear kernel is not built here (needs AVX512-BF16)")
    gen = torch.Generator().manual_seed(0)
    for n, k in ((1536, 576), (576, 1536), (64, 96)):
        w = ck.pack_native_weight(torch.randn(n, k, generator=gen).bfloat16())
        x = torch.randn(300, k, generator=gen).bfloat16()
        whole = ck.native_linear(x, w, None)
        for m in (1, 7, 12, 13, 32, 97):
            assert torch.equal(ck.native_linear(x[-m:].contiguous(), w, None), whole[-m:]), (n, k, m)
