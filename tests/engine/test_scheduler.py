"""Scheduler with a fake model (next token = a function of the whole sequence): no tensors."""

from __future__ import annotations

import random

from batchrun.engine.config import SamplingParams
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request, RequestStatus
from batchrun.engine.scheduler import Scheduler, SchedulerConfig, StepResult

EOS = 0


def fake_next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97 + 1  # never EOS


def make(max_num_seqs=4, budget=16, num_blocks=64, block_size=4, max_model_len=256, chunked=True, prefix=True):
    kv = KVCacheManager(num_blocks, block_size, prefix)
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, chunked, frozenset({EOS}))
    return Scheduler(cfg, kv), kv


def run(sched: Scheduler, reqs: list[Request], max_steps=10_000):
    for r in reqs:
        sched.add(r)
    steps = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert not batch.is_empty()
        assert batch.num_tokens <= sched.config.max_num_batched_tokens or not sched.config.enable_chunked_prefill
        assert len(sched.running) <= sched.config.max_num_seqs
        sampled = {}
        for r, n in zip(batch.requests, batch.num_new_tokens):
            if r.num_computed_tokens + n == r.num_tokens:
                sampled[r.seq_id] = [fake_next_token(r.token_ids)]
        steps.append([(r.seq_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
        sched.update(StepResult(batch, sampled))
        assert len(steps) < max_steps
    return steps


def reqs(lengths, max_tokens=5, seed=0):
    rng = random.Random(seed)
    return [
        Request(
            i,
            i,
            [rng.randint(1, 50) for _ in range(n)],
            SamplingParams(temperature=0, max_tokens=max_tokens),
            0.0,
        )
        for i, n in enumerate(lengths)
    ]


def test_chunked_prefill_runs_beside_decodes_under_the_budget():
    sched, _ = make(budget=16)
    rs = reqs([6, 40], max_tokens=3)
    steps = run(sched, rs)
    # step 1: all of request 0 (6) and 10 tokens of request 1; then 1 decode + 15 prefill, ...
    assert steps[0] == [(0, 6), (1, 10)]
    assert steps[1] == [(0, 1), (1, 15)]
    assert steps[2] == [(0, 1), (1, 15)]
    assert all(r.finish_reason == "length" and r.num_output_tokens == 3 for r in rs)


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    sched, _ = make(budget=16, chunked=False)
    rs = reqs([6, 40], max_tokens=2)
    steps = run(sched, rs)
    assert steps[0] == [(0, 6)]  # 40 does not fit beside it
    assert (1, 40) in steps[1] or (1, 40) in steps[2]


def test_max_num_seqs_limits_running_requests():
    sched, _ = make(max_num_seqs=2, budget=100)
    steps = run(sched, reqs([3, 3, 3, 3], max_tokens=2))
    assert all(len(s) <= 2 for s in steps)


def test_preemption_recomputes_and_gives_the_same_tokens():
    lengths = [30, 25, 20, 35, 10, 28]
    big, _ = make(num_blocks=200, budget=32)
    ref = reqs(lengths, max_tokens=12)
    run(big, ref)
    small, kv = make(num_blocks=24, budget=32)  # 96 tokens of cache for ~150 tokens of demand
    got = reqs(lengths, max_tokens=12)
    run(small, got)
    assert small.num_preemptions > 0
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in ref]
    assert kv.pool.num_free_blocks == 24  # everything returned
    assert all(r.status == RequestStatus.FINISHED and not r.block_ids for r in got)


def test_eos_and_stop_token_ids_and_max_model_len():
    sched, _ = make(max_model_len=12)
    r = Request(0, 0, [1, 2, 3], SamplingParams(temperature=0, max_tokens=100), 0.0)
    sched.add(r)
    batch = sched.schedule()
    sched.update(StepResult(batch, {0: [EOS]}))
    assert r.finish_reason == "stop" and r.output_token_ids == [EOS]
    r2 = Request(1, 1, [1, 2, 3], SamplingParams(temperature=0, max_tokens=100, stop_token_ids=(7,)), 0.0)
    sched.add(r2)
    sched.update(StepResult(sched.schedule(), {1: [7]}))
    assert r2.finish_reason == "stop"
    r3 = Request(2, 2, [1] * 10, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), 0.0)
    sched.add(r3)
    sched.update(StepResult(sched.schedule(), {2: [EOS]}))
    assert not r3.is_finished  # EOS ignored
    sched.update(StepResult(sched.schedule(), {2: [5]}))
    assert r3.finish_reason == "length" and r3.num_tokens == 12


def test_sibling_samples_wait_for_the_prompt_then_share_its_blocks():
    """Samples 1..n-1 of a prompt are admitted only once sample 0 has computed it (over several
    chunks), then compute only the last partial block: every full prompt block is shared."""
    for prefix in (True, False):
        sched, kv = make(budget=8, block_size=4, prefix=prefix)
        prompt = list(range(1, 19))  # 18 tokens: 4 full blocks before the last token's block
        params = SamplingParams(temperature=1.0, max_tokens=3, n=3)
        samples = [Request(i, "r", prompt, params, 0.0, i, i) for i in range(3)]
        sched.add(samples[0], samples[1:])
        assert sched.num_unfinished == 3 and list(sched.waiting) == [samples[0]]
        batch = sched.schedule()
        steps, shared = [], None
        while sched.has_unfinished():
            steps.append([(r.seq_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
            sampled = {
                r.seq_id: [fake_next_token(r.token_ids) + r.sample_index]
                for r, n in zip(batch.requests, batch.num_new_tokens)
                if r.num_computed_tokens + n == r.num_tokens
            }
            sched.update(StepResult(batch, sampled))
            if shared is None and samples[1].status == RequestStatus.RUNNING:
                shared = samples[0].block_ids[:4]
            if shared is not None:
                assert all(s.block_ids[:4] == shared for s in samples[1:] if s.block_ids), "one copy of the prompt"
            batch = sched.schedule() if sched.has_unfinished() else batch
        # sample 0 prefills 18 tokens in chunks of 8; the others join after it, with 2 tokens each
        assert steps[:3] == [[(0, 8)], [(0, 8)], [(0, 2)]]
        assert steps[3] == [(0, 1), (1, 2), (2, 2)]
        assert shared is not None and len(shared) == 4
        assert [s.metrics.num_cached_tokens for s in samples] == [0, 16, 16]
        assert all(s.num_output_tokens == 3 for s in samples)
        assert kv.pool.num_used_blocks == 0 and sched.num_unfinished == 0


def test_admission_min_slots_admits_in_batches_beside_decodes():
    """engine.admission_min_slots=3 with 4 slots: while every running request decodes, waiting
    requests start only once 3 slots are free (or all the waiting fit); a step with a prefill chunk
    in it admits at once; the tokens are those of admitting at every end (the fake model's next
    token depends only on the sequence)."""
    lengths = [3, 5, 2, 4, 6, 3, 2, 5, 4]
    max_tokens = [2, 9, 4, 12, 3, 7, 5, 2, 6]

    def requests():
        out = reqs(lengths, seed=4)
        for r, m in zip(out, max_tokens):
            r.params = SamplingParams(temperature=0, max_tokens=m)
        return out

    every_end, _ = make(max_num_seqs=4, budget=64)
    baseline = requests()
    base_steps = run(every_end, baseline)

    sched, _ = make(max_num_seqs=4, budget=64)
    sched.config = SchedulerConfig(4, 64, 256, True, frozenset({EOS}), admission_min_slots=3)
    batched = requests()
    steps = run(sched, batched)
    assert [r.token_ids for r in batched] == [r.token_ids for r in baseline]

    def admissions(trace):
        seen, out = set(), []
        for i, step in enumerate(trace):
            new = [seq for seq, _ in step if seq not in seen]
            seen.update(new)
            if new and i:
                out.append((i, new, all(n == 1 for seq, n in step if seq not in new)))
        return out

    later = admissions(steps)
    # after the first step, each admission brings 3 requests, or the last ones (all that waited)
    assert [len(new) for _, new, _ in later] == [3, 2], later
    assert len(admissions(base_steps)) > len(later)  # admitting at every end: more mixed steps
    # never admitted into a step whose running requests all decoded with fewer than 3 free
    for i, new, decodes_only in later:
        running_before = len([seq for seq, _ in steps[i] if seq not in new])
        assert not decodes_only or 4 - running_before >= min(3, len(new)), (i, new)


def test_admission_min_slots_lets_a_released_sibling_start_at_once():
    """4 slots, admission_min_slots 4: the first step fills them; then one request ends at its first
    token and the prompt's sibling sample is released holding the prompt's blocks. One slot is
    free and two requests wait, yet the sibling starts at once; the other waiting request does not."""
    sched, _ = make(max_num_seqs=4, budget=64)
    sched.config = SchedulerConfig(4, 64, 256, True, frozenset({EOS}), admission_min_slots=4)
    parent, short, *others = reqs([6, 3, 3, 4, 5], max_tokens=6)
    short.params = SamplingParams(temperature=0, max_tokens=1)
    sibling = Request(9, 9, list(parent.prompt_token_ids), SamplingParams(temperature=0, max_tokens=6), 0.0)
    sched.add(parent, [sibling])
    for r in (short, *others):
        sched.add(r)
    first = sched.schedule()
    assert len(first.requests) == 4  # nothing was running: admitted at once
    sched.update(StepResult(first, {r.seq_id: [fake_next_token(r.token_ids)] for r in first.requests}))
    assert short.is_finished and sched.waiting[0] is sibling and sibling.block_ids
    assert len(sched.waiting) == 2
    second = sched.schedule()
    assert sibling in second.requests and others[-1] not in second.requests
