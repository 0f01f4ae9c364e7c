"""Speculative decoding: proposers, lossless verification, policy, KV rollback, engine identity."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchrun import Engine, EngineConfig, SamplingParams
from batchrun.engine.config import SpeculativeConfig
from batchrun.engine.drafter import is_eligible
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request
from batchrun.engine.sampler import Sampler
from batchrun.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from batchrun.engine.speculative import (
    PROBE_GAP,
    DraftProbs,
    SpeculationPolicy,
    StepCostModel,
    expected_accepted,
    ngram_propose,
    verify,
)
from batchrun.testing import sample_texts

# ---- proposers and helpers ---------------------------------------------------------------------


def test_ngram_prefers_longest_and_latest_match():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1,2,3] occurs at 0 -> propose what followed: 4, 5
    assert ngram_propose(tokens, 2, 1, 3) == [4, 5]
    # with n_max=2 the latest [2,3] (index 6) wins -> 7, 8, 1
    assert ngram_propose(tokens, 3, 1, 2) == [7, 8, 1]
    assert ngram_propose([5, 6, 7], 3, 1, 3) == []  # nothing repeats
    assert ngram_propose([4, 4], 5, 1, 1) == [4]  # proposals stop at the end of the text


def test_expected_accepted_and_cost_model():
    assert expected_accepted(0.0, 4) == 0.0
    assert expected_accepted(1.0, 4) == 4.0
    assert expected_accepted(0.5, 2) == pytest.approx(0.5 + 0.25)
    cost = StepCostModel({1: 10.0, 8: 80.0, 64: 128.0})  # tok/s by width
    assert cost(1) == pytest.approx(0.1) and cost(8) == pytest.approx(0.1)
    assert cost(64) == pytest.approx(0.5) and cost(128) == pytest.approx(1.0)  # linear beyond the profile


def _req(seq_id: int, n: int = 5, greedy: bool = True) -> Request:
    r = Request(seq_id, seq_id, list(range(1, n + 1)), SamplingParams(temperature=0.0 if greedy else 1.0), 0.0)
    r.num_computed_tokens = n - 1
    return r


def test_policy_speculates_when_the_step_is_cheap_and_stands_aside_when_compute_bound():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    # memory-bound: a step of 5 tokens costs the same as 1 -> speculate
    cheap = SpeculationPolicy(cfg, StepCostModel({1: 100.0, 8: 800.0, 64: 6400.0}), 0.0)
    assert cheap.choose([(_req(0), 4)], num_decodes=1) == {0: 4}
    # compute-bound: cost linear in width -> never worth it (expected gain < 1 token per draft)
    bound = SpeculationPolicy(cfg, StepCostModel({1: 100.0, 8: 100.0, 64: 100.0}), 0.0)
    assert bound.choose([(_req(i), 4) for i in range(32)], num_decodes=32) == {}
    assert bound.num_steps_off == 1
    # a request whose drafts keep failing rests, then is probed again (the device measured a
    # 5-token speculative step at the profile's price, so the prior's margin does not apply)
    assert cheap.observe(5, 1, 4, 0.01)
    r = _req(1)
    r.spec_acceptance = 0.0
    picks = [bool(cheap.choose([(r, 4)], num_decodes=1)) for _ in range(16)]
    assert picks.count(True) == 2 and cheap.num_switches >= 2
    always = SpeculationPolicy(SpeculativeConfig(method="ngram", adaptive=False), StepCostModel({1: 1.0}), 0.0)
    assert always.choose([(_req(i), 2) for i in range(3)], num_decodes=3) == {0: 2, 1: 2, 2: 2}


@pytest.mark.parametrize("max_num_seqs, k", [(1, 4), (3, 2)])
def test_the_decode_profile_covers_the_widths_a_speculative_step_has(tiny_llama_dir, max_num_seqs, k):
    """At max_num_seqs=1 the profile used to stop at width 4 * max_num_seqs and hold width 1 alone;
    the cost model then took a 5-token step for 5x a 1-token one and never speculated at batch 1."""
    engine = Engine(
        EngineConfig(
            model=tiny_llama_dir,
            dtype="float32",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=256,
            kv_cache_memory=16 << 20,
            speculative=dict(method="ngram", num_speculative_tokens=k),
        )
    )
    widths = set(engine.settings.batch_limits_profile["decode_tok_s"])
    assert {1, 1 + k, max_num_seqs * (1 + k)} <= widths
    assert engine.max_num_seqs == max_num_seqs


def test_at_batch_1_a_memory_bound_profile_speculates_and_width_1_alone_would_not():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    measured = SpeculationPolicy(cfg, StepCostModel({1: 100.0, 5: 450.0}), 0.0)  # 5 tokens: 1.1x one token
    assert measured.choose([(_req(0), 4)], num_decodes=1) == {0: 4}
    width_1_only = SpeculationPolicy(cfg, StepCostModel({1: 100.0}), 0.0)  # the old profile at max_num_seqs=1
    assert width_1_only.choose([(_req(0), 4)], num_decodes=1) == {}


# ---- the cost model learns the step costs of the device it runs on ------------------------------

# A GPU-like profile: plain decode steps (CUDA-graphed) cost about the same up to hundreds of rows.
GPU_PROFILE = {1: 250.0, 8: 2000.0, 64: 16000.0, 256: 50000.0, 1280: 100000.0}


def _drive(policy, candidates, num_decodes, step_s, steps):
    """Run `steps` steps of a fixed batch: choose, then report the step as the engine would, its
    seconds from step_s(kind, width). Returns how many steps speculated."""
    on = 0
    for _ in range(steps):
        chosen = policy.choose(candidates, num_decodes)
        num_drafts = sum(chosen.values())
        width = num_decodes + num_drafts
        policy.observe(width, num_decodes, num_drafts, step_s("spec" if chosen else "plain", width))
        on += bool(chosen)
    return on


def test_measured_speculative_steps_that_cost_far_more_than_the_profile_says_stop_speculation():
    """256 seqs, k=4: the profile prices the 1280-token verification step at 2.5x a plain step and
    acceptance is high enough that the profile alone would speculate; the device's verification
    step (eager, wide) costs 8x. After a few measured steps the policy stands aside."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    cost = StepCostModel(GPU_PROFILE)
    policy = SpeculationPolicy(cfg, cost, 0.0)
    reqs = [_req(i) for i in range(256)]
    for r in reqs:
        r.spec_acceptance = 0.9
    candidates = [(r, 4) for r in reqs]
    assert policy._pick([(expected_accepted(0.9, 4), r, 4) for r in reqs], 256, measured=False)  # profile: yes
    plain_s = cost(256)

    def step_s(kind, width):
        return plain_s if kind == "plain" else 8 * plain_s

    _drive(policy, candidates, 256, step_s, 20)
    assert policy.choose(candidates, 256) == {}
    tail = _drive(policy, candidates, 256, step_s, 400)
    assert tail <= 400 / PROBE_GAP  # only probes speculate, and they back off
    assert cost.spec(1280) == pytest.approx(8 * plain_s / cost(1280) * cost(1280), rel=1e-6)
    assert "spec/1024" in cost.learned() and "plain/256" in cost.learned()


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_a_copy_heavy_small_batch_keeps_speculating_when_measured_steps_cost_barely_more(batch):
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    cost = StepCostModel(GPU_PROFILE)
    policy = SpeculationPolicy(cfg, cost, 0.0)
    reqs = [_req(i) for i in range(batch)]
    for r in reqs:
        r.spec_acceptance = 0.95
    plain_s = cost(batch)

    def step_s(kind, width):
        return plain_s * (1.1 if kind == "spec" else 1.0)

    assert _drive(policy, [(r, 4) for r in reqs], batch, step_s, 50) == 50
    assert policy.num_probes == 0 and policy.num_steps_off == 0


def test_an_unmeasured_speculative_step_is_probed_on_a_bounded_share_of_steps():
    """The prior prices speculation out at this batch, the profile alone would not: the policy
    probes, and measured probes that pay turn it on; probes that lose back off."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    cost = StepCostModel({1: 100.0, 16: 1600.0, 80: 3200.0})  # width 80 costs 2.5x width 16
    reqs = [_req(i) for i in range(16)]
    for r in reqs:
        r.spec_acceptance = 0.8  # E = 2.36 of 4: 3.36 tokens per row for 2.5x: pays, but not by 1.5x more
    candidates = [(r, 4) for r in reqs]
    losing = SpeculationPolicy(cfg, cost, 0.0)
    on = _drive(losing, candidates, 16, lambda kind, w: 10.0 if kind == "spec" else 1.0, 2000)
    assert 1 <= losing.num_probes == on <= 2000 / PROBE_GAP
    assert losing.num_probes <= 12  # the gap doubled: 16 + 32 + ... + 512 x 3 covers 2000 steps
    paying = SpeculationPolicy(cfg, StepCostModel({1: 100.0, 16: 1600.0, 80: 3200.0}), 0.0)
    on = _drive(paying, candidates, 16, lambda kind, w: 0.01 * 1.2 if kind == "spec" else 0.01, 100)
    # the prior (1.5 x 2.5 is too dear) keeps it off until the first probe; measured, it stays on
    assert paying.num_probes == 1 and paying.num_steps_off == PROBE_GAP - 1 and on == 100 - (PROBE_GAP - 1)


def test_steps_with_prefill_chunks_do_not_price_decoding():
    cost = StepCostModel(GPU_PROFILE)
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram"), cost, 0.0)
    assert not policy.observe(300, 8, 0, 5.0)  # 8 requests, 300 tokens: prefill chunks in the step
    assert not policy.observe(300, 8, 12, 5.0)
    assert cost.learned() == {} and cost.plain(8) == cost(8)
    assert policy.observe(20, 8, 12, 0.5) and policy.observe(8, 8, 0, 0.1)
    assert cost.spec(20) == pytest.approx(0.5) and cost.plain(8) == pytest.approx(0.1)


def test_draft_passes_are_priced_by_their_measured_time():
    cfg = SpeculativeConfig(method="self", num_speculative_tokens=2)
    cost = StepCostModel({1: 100.0, 8: 800.0})
    policy = SpeculationPolicy(cfg, cost, 0.25)
    assert cost.draft(1, 0.25) == pytest.approx(0.0025)
    policy.observe_draft(1, 2, 0.2)  # two passes of 0.1 s: 10x a whole target step
    assert cost.draft(1, 0.25) == pytest.approx(0.1)
    r = _req(0)
    r.spec_acceptance = 0.9
    assert policy.choose([(r, 2)], 1) == {}


# ---- verification ------------------------------------------------------------------------------


def _verify_one(logits: torch.Tensor, drafts: list[int], params: SamplingParams, seed=None) -> list[int]:
    """verify() for one request whose rows are all of `logits` (prompt of 3 tokens)."""
    req = Request(0, 0, [1, 2, 3], params, 0.0, seed)
    return verify(logits, [0], [req], [drafts], Sampler(seed=0))[0]


def test_greedy_verify_accepts_the_matching_prefix_plus_the_target_token():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 4, 9, 1]):
        logits[row, tok] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert _verify_one(logits, [3, 4, 5], greedy) == [3, 4, 9]
    assert _verify_one(logits, [3, 4, 9], greedy) == [3, 4, 9, 1]  # all accepted + bonus
    assert _verify_one(logits, [0, 4, 9], greedy) == [3]


def _tv(counts: Counter, probs: torch.Tensor, n: int) -> float:
    return 0.5 * sum(abs(counts.get(i, 0) / n - float(probs[i])) for i in range(len(probs)))


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("proposal", ["point_mass", "draft_probs"])
def test_rejection_sampling_keeps_the_target_distribution(proposal, seeded):
    """Tiny vocabulary, many draws: the first token follows p0 and the second, given the first was
    the accepted draft, follows p1 (total-variation bound for 20k samples). All draws are one
    batched verification of 20k requests over the same logits rows: seeded requests each with
    their own seed, unseeded ones drawing from the sampler's generator."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(torch.randn(2, vocab), dim=-1)
    g = torch.Generator().manual_seed(1)
    n = 20_000
    first, second = Counter(), Counter()
    reqs = [Request(i, i, [1, 2, 3], params, 0.0, 1000 + i if seeded else None) for i in range(n)]
    if proposal == "point_mass":
        drafts, dp = [[2, 4]] * n, None
    else:
        drafts = torch.stack(
            [torch.multinomial(q[0], n, True, generator=g), torch.multinomial(q[1], n, True, generator=g)], 1
        )
        drafts, dp = drafts.tolist(), DraftProbs(q, {i: [0, 1] for i in range(n)})
    for out in verify(logits, [0] * n, reqs, drafts, Sampler(seed=2), dp):
        first[out[0]] += 1
        if proposal == "point_mass" and out[0] == 2:
            second[out[1]] += 1
    assert _tv(first, p[0], n) < 0.02
    if proposal == "point_mass":
        assert _tv(second, p[1], sum(second.values())) < 0.03


def test_verify_of_a_batch_equals_each_request_verified_alone():
    """Greedy, point-mass and sampled-draft requests with different draft counts and masks, verified
    in one call, give what each gives alone: every draw is keyed by (seed, position, stream), none
    by a row's place in the batch."""
    g = torch.Generator().manual_seed(3)
    vocab = 40
    cases = [  # (params, number of drafts, whether the drafts were sampled from a distribution)
        (SamplingParams(temperature=0.0), 3, False),
        (SamplingParams(temperature=1.0, seed=5), 2, False),
        (SamplingParams(temperature=0.8, top_k=6, seed=6), 4, True),
        (SamplingParams(temperature=1.2, top_p=0.7, seed=7), 1, True),
        (SamplingParams(temperature=1.0, seed=8), 3, True),
    ]
    reqs, drafts, blocks, probs, rows = [], [], [], [], {}
    for i, (params, k, has_probs) in enumerate(cases):
        reqs.append(Request(i, i, list(range(5 + i)), params, 0.0, params.seed))
        block = torch.randn(k + 1, vocab, generator=g) * 2
        q = torch.softmax(block[:k] + torch.randn(k, vocab, generator=g), dim=-1)  # a draft near the target
        d = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
        d[0] = int(block[0].argmax()) if i % 2 == 0 else d[0]  # some drafts that greedy accepts
        blocks.append(block)
        drafts.append(d)
        if has_probs:
            rows[i] = list(range(sum(len(x) for x in probs), sum(len(x) for x in probs) + k))
            probs.append(q)
    logits = torch.cat(blocks)
    first_rows = [sum(len(b) for b in blocks[:i]) for i in range(len(blocks))]
    dp = DraftProbs(torch.cat(probs), rows)
    together = verify(logits, first_rows, reqs, drafts, Sampler(seed=0), dp)
    for i in range(len(reqs)):
        alone_dp = DraftProbs(dp.probs, {i: rows[i]}) if i in rows else None
        alone = verify(blocks[i], [0], [reqs[i]], [drafts[i]], Sampler(seed=1), alone_dp)[0]
        assert together[i] == alone, i
        assert 1 <= len(alone) <= len(drafts[i]) + 1 and alone[:-1] == drafts[i][: len(alone) - 1]
    reordered = verify(logits, first_rows[::-1], reqs[::-1], drafts[::-1], Sampler(seed=2), dp)
    assert reordered[::-1] == together


def test_all_drafts_accepted_end_with_the_token_the_plain_sampler_draws():
    """The bonus token after fully accepted drafts is the sampler's own draw at its position, so a
    step that speculated draws that position exactly as a plain step would have."""
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.9, top_k=20, seed=77)
    logits = torch.randn(4, 50, generator=g)
    drafts = [7, 8, 9]
    for row, token in enumerate(drafts):
        logits[row, token] = 60.0  # p(draft) = 1 in float32: accepted whatever the uniform
    out = _verify_one(logits, drafts, params, seed=77)
    # The bonus token's position: after _verify_one's 3 prompt tokens and the 3 drafts.
    plain, _ = Sampler().sample(logits[3:], [params], [77], [3 + len(drafts)])
    assert out[:3] == drafts and out[3] == plain[0]
    # A different seed or position draws differently somewhere (so the check above can fail).
    others = {Sampler().sample(logits[3:], [params], [s], [14])[0][0] for s in range(20)}
    assert len(others) > 1


def test_seeded_samples_draft_only_under_a_per_request_policy():
    req = Request(0, 0, [1, 2, 3], SamplingParams(temperature=1.0, seed=3), 0.0, 3)
    req.num_computed_tokens = 2
    assert not is_eligible(req, is_adaptive=True)  # on/off would follow the batch and the timings
    assert is_eligible(req, is_adaptive=False)
    unseeded = Request(1, 1, [1, 2, 3], SamplingParams(temperature=1.0), 0.0, 12)
    unseeded.num_computed_tokens = 2
    assert is_eligible(unseeded, is_adaptive=True)


# ---- KV rollback through the scheduler (fake target: next = f(sequence)) --------------------------


def _fake_next(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 13 + 1


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 4), num_blocks=st.integers(14, 40))
def test_rollback_keeps_pool_consistent_and_output_unchanged(seed, k, num_blocks):
    rng = random.Random(seed)
    prompts = [[rng.randint(1, 13) for _ in range(rng.randint(3, 20))] for _ in range(5)]

    def run(spec: bool) -> tuple[list[list[int]], KVCacheManager]:
        kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
        sched = Scheduler(SchedulerConfig(4, 32, 200, True, frozenset()), kv)
        reqs = [
            Request(i, i, list(p), SamplingParams(temperature=0.0, max_tokens=15), 0.0) for i, p in enumerate(prompts)
        ]
        for r in reqs:
            sched.add(r)
        while sched.has_unfinished():
            plan = {r.seq_id: k for r in sched.running if spec and r.num_computed_tokens == r.num_tokens - 1}
            batch = sched.schedule(plan)
            sampled = {}
            for r, n in zip(batch.requests, batch.num_new_tokens):
                if r.num_computed_tokens + n < r.num_tokens:
                    continue
                # drafts: right or wrong at random, so every acceptance length occurs
                seq = list(r.token_ids)
                drafts = []
                for _ in range(batch.num_spec.get(r.seq_id, 0)):
                    truth = _fake_next(seq + drafts)
                    drafts.append(truth if rng.random() < 0.6 else truth % 13 + 1)
                batch.spec_token_ids[r.seq_id] = drafts
                out = []
                for d in drafts:
                    t = _fake_next(seq + out)
                    out.append(t)
                    if d != t:
                        break
                else:
                    out.append(_fake_next(seq + out))
                sampled[r.seq_id] = out
            sched.update(StepResult(batch, sampled))
            used = {b for r in sched.running for b in r.block_ids}
            for b in range(num_blocks):
                assert kv.pool.ref_counts[b] >= 0
                assert (b in kv.pool.free) == (kv.pool.ref_counts[b] == 0)
            assert used.isdisjoint(kv.pool.free)
            for r in sched.running:  # computed tokens are all real: never a rejected draft
                assert r.num_computed_tokens <= r.num_tokens
        return [r.output_token_ids for r in reqs], kv

    plain, _ = run(False)
    spec, kv = run(True)
    assert spec == plain
    assert kv.pool.num_free_blocks == num_blocks


# ---- the engine: greedy identity on and off ------------------------------------------------------


def _prompts() -> list[str]:
    texts = sample_texts()
    prompts = [texts[i][:n] for i, n in zip(range(6), [60, 300, 120, 420, 25, 260])]
    return prompts + [p + " " + p[:80] for p in prompts[:2]]  # text that repeats: n-grams hit


@pytest.fixture(scope="module")
def greedy_baseline(tiny_model_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            e = Engine(EngineConfig(model=tiny_model_factory(family), dtype="float32", max_num_seqs=8))
            cache[family] = [
                o.token_ids for o in e.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=24))
            ]
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_identical_with_speculation(family, method, adaptive, tiny_model_factory, greedy_baseline):
    spec = SpeculativeConfig(
        method=method,
        adaptive=adaptive,
        num_speculative_tokens=3,
        draft_model=tiny_model_factory("mistral") if method == "draft" else None,
    )
    if method == "draft" and family != "llama":
        pytest.skip("one draft pairing is enough; the tiny models share one tokenizer")
    engine = Engine(EngineConfig(model=tiny_model_factory(family), dtype="float32", max_num_seqs=8, speculative=spec))
    outs = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.token_ids for o in outs] == greedy_baseline(family)
    stats = engine.stats()
    assert stats.num_spec_proposed is not None
    if not adaptive:
        assert stats.num_spec_proposed > 0 and stats.num_spec_steps > 0
        assert sum(o.metrics.num_spec_proposed for o in outs) == stats.num_spec_proposed
        assert sum(o.metrics.num_spec_accepted for o in outs) == stats.num_spec_accepted
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("spec_price", [1.0, 40.0])
def test_the_engine_prices_speculation_by_the_steps_it_timed(spec_price, tiny_model_factory, greedy_baseline):
    """The cost model's inputs faked: a GPU-like profile (a step's time flat in its width, so the
    profile alone would speculate) and the engine's step clock, on which every step takes the
    profile's time for its width and a verification step `spec_price` times that. The prior keeps
    speculation off until the first probe; from the measured probe on, the policy speculates when
    verification is as cheap as the profile says and stands aside when it is dear. Greedy output
    is the same either way."""
    engine = Engine(
        EngineConfig(
            model=tiny_model_factory("llama"),
            dtype="float32",
            max_num_seqs=8,
            speculative=dict(method="ngram", num_speculative_tokens=3),
        )
    )
    policy = engine.drafter.policy
    policy.cost = cost = StepCostModel({1: 100.0, 8: 800.0, 64: 6400.0})
    now = [0.0]
    engine.step_clock = lambda: now[0]
    execute = engine.runner.execute

    def timed_execute(batch, **kw):
        now[0] += cost(batch.num_tokens) * (spec_price if batch.num_spec else 1.0)
        return execute(batch, **kw)

    engine.runner.execute = timed_execute
    outs = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.token_ids for o in outs] == greedy_baseline("llama")
    stats = engine.stats()
    assert stats.num_spec_probes == policy.num_probes == 1  # one probe in the run's steps
    measured = {k: v / cost(int(k.split("/")[1])) for k, v in stats.spec_step_s.items()}
    assert any(k.startswith("spec/") for k in measured)
    assert all(m == pytest.approx(spec_price if k.startswith("spec/") else 1.0) for k, m in measured.items())
    if spec_price > 1:
        assert stats.num_spec_steps == 1  # the probe alone
    else:
        assert stats.num_spec_steps > policy.num_probes  # on by its own choice once measured


def test_speculation_under_preemption_keeps_output(tiny_llama_dir, greedy_baseline):
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny_llama_dir)
    per_block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    engine = Engine(
        EngineConfig(
            model=tiny_llama_dir,
            dtype="float32",
            max_num_seqs=8,
            max_num_batched_tokens=64,
            kv_cache_memory=per_block * 34,
            speculative=dict(method="self", adaptive=False),
        )
    )
    outs = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=24))
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == greedy_baseline("llama")


def test_sampled_tokens_follow_the_target_distribution_in_the_engine(tiny_llama_dir):
    """Unseeded sampling with speculation forced on: with max_tokens=3 the second token comes out of
    verification (one self-draft, accepted or resampled from the residual). The joint distribution
    of the first two tokens (top_k=3: 9 cells) must match speculation off (total variation; the
    noise level for 1,500 draws each is about 0.04)."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    prompt = sample_texts()[3][:40]
    n = 1500

    def pairs(spec: dict, seed: int) -> tuple[Counter, Engine]:
        e = Engine(
            EngineConfig(
                model=tiny_llama_dir,
                dtype="float32",
                max_num_seqs=64,
                max_num_batched_tokens=512,
                seed=seed,
                speculative=spec,
            )
        )
        return Counter(tuple(o.token_ids[:2]) for o in e.generate([prompt] * n, params)), e

    off, _ = pairs({}, seed=1)
    on, engine = pairs(dict(method="self", self_layers=1, adaptive=False, num_speculative_tokens=1), seed=2)
    stats = engine.stats()
    assert 0 < stats.num_spec_accepted < stats.num_spec_proposed  # both branches of verification ran
    tv = 0.5 * sum(abs(off[c] / n - on[c] / n) for c in set(off) | set(on))
    assert tv < 0.1, (off, on)


@pytest.mark.parametrize("method, text, temperature, top_k", [("self", 5, 0.8, 8), ("ngram", 4, 1.0, 2)])
def test_a_seeded_request_with_speculation_gives_the_same_tokens_alone_and_batched(
    tiny_llama_dir, method, text, temperature, top_k
):
    """Speculation forced on (not adaptive): the seeded request drafts (self: sampled drafts with
    their distributions; ngram: point masses) and is verified alone, then beside greedy, unseeded
    and other seeded requests that also speculate. Its tokens must not change. (Prompt and params
    are ones where the tiny random model both accepts and rejects some of the drafts.)"""
    engine = Engine(
        EngineConfig(
            model=tiny_llama_dir,
            dtype="float32",
            max_num_seqs=8,
            max_num_batched_tokens=512,
            kv_cache_memory=16 << 20,
            speculative=dict(method=method, self_layers=1, adaptive=False, num_speculative_tokens=3),
        )
    )
    texts = sample_texts()
    prompt = texts[text][:50] + " " + texts[text][:50]  # repeats: n-gram lookup finds drafts
    seeded = SamplingParams(temperature=temperature, top_k=top_k, seed=2024, max_tokens=24, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0]
    others = [texts[i][:40] + " " + texts[i][:40] for i in (1, 2, 3)]
    batch = engine.generate(
        [others[0], prompt, others[1], others[2]],
        [
            SamplingParams(temperature=0.0, max_tokens=24),
            seeded,
            SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=1, max_tokens=30, ignore_eos=True),
        ],
    )
    assert 0 < alone.metrics.num_spec_accepted < alone.metrics.num_spec_proposed  # both verification branches
    assert batch[1].metrics.num_spec_proposed == alone.metrics.num_spec_proposed
    assert sum(o.metrics.num_spec_proposed for o in batch) > batch[1].metrics.num_spec_proposed
    assert batch[1].token_ids == alone.token_ids
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks


@pytest.mark.slow
def test_real_model_greedy_identical_with_ngram_and_self(smollm2_cache_dir):
    base = Engine(EngineConfig(model="smollm2-135m", dtype="float32", cache_dir=smollm2_cache_dir, max_num_seqs=4))
    tok = base.tokenizer
    docs = sample_texts()[10:12]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": "Summarize:\n" + d[:400]}], tokenize=False, add_generation_prompt=True
        )
        for d in docs
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    ref = [o.token_ids for o in base.generate(prompts, sp)]
    del base
    for method in ("ngram", "self"):
        e = Engine(
            EngineConfig(
                model="smollm2-135m",
                dtype="float32",
                cache_dir=smollm2_cache_dir,
                max_num_seqs=4,
                speculative=dict(method=method, adaptive=False),
            )
        )
        assert [o.token_ids for o in e.generate(prompts, sp)] == ref, method
        assert e.stats().num_spec_accepted > 0
