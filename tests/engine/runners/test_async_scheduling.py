"""engine.async_scheduling: decode steps launched before the previous step's tokens are read.

On the CPU the decode graphs are stood in for by `EagerReplay` (tests/engine/runners/test_cuda_graphs.py), so the
whole protocol runs: places held in the scheduler, input ids gathered from the previous step's token
tensor by row, the extra row of a request that ended while its step ran ahead (dropped), steps
that must be synchronous (admission, preemption, grammar, logprobs), and the failed-capture
fallback. A GPU run checks the same outputs with real graphs and a real overlap (`-m gpu`).
"""

from __future__ import annotations

import numpy as np
import pytest

from batchrun.engine import Engine, EngineConfig, EngineRequest, SamplingParams
from batchrun.engine.runners import GpuRunner, kv_bytes_per_block
from batchrun.engine.runners.cuda_graphs import DecodeGraphs, EagerReplay
from batchrun.engine.scheduler import PENDING_TOKEN
from tests.support.engines import tiny_config


def _config(model: str, **kw) -> EngineConfig:
    return tiny_config(model, **{"kv_cache_memory": 16 << 20, "max_num_batched_tokens": 256, **kw})


def _with_graphs(engine: Engine, capture=None) -> DecodeGraphs:
    """The GPU runner's stand-in (EagerReplay graphs, no CUDA) in place of the engine's runner."""
    engine.runner = GpuRunner.stand_in(engine.runner, 16, capture)
    assert engine.runner.graphs is not None
    return engine.runner.graphs


def _prompts(n: int = 7, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, int(k)).tolist() for k in rng.integers(2, 40, n)]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """(synchronous engine, async engine), both on stand-in graphs, built once."""
    sync = Engine(_config(tiny_llama_dir))
    _with_graphs(sync)
    ahead = Engine(_config(tiny_llama_dir, async_scheduling=True))
    _with_graphs(ahead)
    return sync, ahead


def _run(engine: Engine, prompts, params):
    before = engine.stats()
    outs = engine.generate(prompts, params)
    after = engine.stats()
    assert not engine.scheduler.has_unfinished() and engine._ahead is None
    assert engine.kv.pool.num_used_blocks == 0, "a step run ahead left blocks held"
    return outs, after.num_steps - before.num_steps, (after.num_async_steps or 0) - (before.num_async_steps or 0)


def test_greedy_and_seeded_outputs_unchanged_and_steps_run_ahead(engines):
    """Greedy and seeded sampling give the same tokens (and finish reasons) with steps run ahead:
    requests of different lengths end while a step ahead already computes them, the batch shrinks
    through the 8, 4, 2 and 1 buckets, EOS ends some (no ignore_eos), and 7 requests with
    max_num_seqs 8 leave nothing to admit, so most decode steps run ahead."""
    sync, ahead = engines
    prompts = _prompts()
    lengths = (12, 3, 8, 20, 5, 1, 9)
    for temperature, seed in ((0.0, None), (0.8, 11)):
        params = [
            SamplingParams(temperature=temperature, seed=seed, max_tokens=m, ignore_eos=(i % 2 == 0))
            for i, m in enumerate(lengths)
        ]
        want, want_steps, no_async = _run(sync, prompts, params)
        got, steps, num_async = _run(ahead, prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        assert no_async == 0 and sync.stats().num_async_steps is None
        # Every decode step after the first of a run of decodes went ahead; a step ahead is also
        # launched for requests that all end with the previous step's tokens: it is dropped.
        assert num_async >= want_steps - 3, (num_async, want_steps)
        assert steps >= want_steps


def test_inputs_are_gathered_from_the_device_tokens(engines, monkeypatch):
    """A step run ahead packs no token ids on the host: its held places are PENDING_TOKEN while it
    is scheduled and packed, and its ids come from the previous step's token tensor, by row."""
    _, ahead = engines
    graphs = ahead.runner.graphs
    seen = []
    real = graphs.execute

    def execute(batch, token_source=None):
        if token_source is not None:
            tokens, rows = token_source
            seen.append([r.token_ids[-1] for r in batch.requests])
            assert len(rows) == len(batch.requests) and max(rows) < tokens.shape[0]
        return real(batch, token_source)

    monkeypatch.setattr(graphs, "execute", execute)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = ahead.generate(_prompts(3, seed=1), params)
    assert seen and all(t == PENDING_TOKEN for step in seen for t in step)
    assert all(PENDING_TOKEN not in o.token_ids for o in outs)


def test_admission_and_preemption_steps_are_synchronous(tiny_llama_dir):
    """More requests than max_num_seqs (admitted as others end) in a KV pool too small for all of
    them: steps that admit, or whose blocks would run out, run synchronously, and the tokens are
    the synchronous engine's (when requests are admitted, and so who is preempted, may differ: a
    request's end is seen a step later)."""
    prompts = _prompts(12, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    probe = Engine(_config(tiny_llama_dir))
    per_block = kv_bytes_per_block(probe.model, 16, probe.dtype)
    outs = {}
    for on in (False, True):
        # 12 blocks of 16 tokens: 4 running requests of up to 80 tokens need up to 20
        engine = Engine(
            _config(
                tiny_llama_dir,
                async_scheduling=on,
                kv_cache_memory=12 * per_block,
                max_num_seqs=4,
                max_num_batched_tokens=64,
                enable_prefix_caching=False,
            )
        )
        assert engine.kv.num_blocks == 12
        _with_graphs(engine)
        outs[on] = _run(engine, prompts, params), engine.stats()
    (want, _, _), sync_stats = outs[False]
    (got, _, num_async), stats = outs[True]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert num_async > 0
    assert sync_stats.num_preemptions > 0 and stats.num_preemptions > 0, "the pool must be small enough to preempt"


def test_shared_prefixes_samples_and_a_trickling_stream(engines):
    """Hostile mixes, each against the synchronous engine: prompts sharing a 48-token prefix (the
    prefix cache serves later ones from blocks of requests that ended while a step ran ahead of
    them), n=2 seeded samples per prompt (siblings share the prompt's blocks), and a stream that
    keeps only 3 requests in flight (admission between steps while one is in flight)."""
    sync, ahead = engines
    rng = np.random.default_rng(8)
    prefix = rng.integers(3, 500, 48).tolist()
    prompts = [prefix + rng.integers(3, 500, int(k)).tolist() for k in (1, 7, 16, 3, 20, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 17, 2, 11, 8, 14)]
    for engine in engines:
        engine.reset_prefix_cache()
    want, _, _ = _run(sync, prompts, params)
    hits = ahead.kv.num_hit_tokens
    got, _, num_async = _run(ahead, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] and num_async > 0
    assert ahead.kv.num_hit_tokens > hits

    samples = SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=9)
    want, _, _ = _run(sync, prompts[:3], samples)
    got, _, num_async = _run(ahead, prompts[:3], samples)
    assert [(o.token_ids, o.sample_index) for o in got] == [(o.token_ids, o.sample_index) for o in want]
    assert num_async > 0

    trickle = [EngineRequest(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    outs = {}
    for engine in engines:
        outs[engine is ahead] = {o.request_id: o.token_ids for o in engine.stream(trickle, max_in_flight=3)}
        assert engine._ahead is None and engine.kv.pool.num_used_blocks == 0
    assert outs[True] == outs[False] and len(outs[True]) == len(prompts)


def test_admission_in_batches_keeps_tokens_and_lets_steps_run_ahead(tiny_llama_dir, engines):
    """engine.admission_min_slots: 14 requests through 4 slots. Admitting only once 3 slots are
    free gives the same tokens as admitting at every end, fewer steps with a prefill in them, and
    (with async scheduling) more steps run ahead, since a step that would admit runs synchronously."""
    sync, _ = engines
    prompts = _prompts(14, seed=9)
    lengths = np.random.default_rng(9).integers(2, 30, len(prompts)).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    want, _, _ = _run(sync, prompts, params)
    seen = {}
    for slots in (1, 3):
        engine = Engine(_config(tiny_llama_dir, max_num_seqs=4, async_scheduling=True, admission_min_slots=slots))
        _with_graphs(engine)
        mixed: list[bool] = []

        def execute(batch, *args, _real=engine.runner.execute, _mixed=mixed, **kwargs):
            _mixed.append(any(n > 1 for n in batch.num_new_tokens))
            return _real(batch, *args, **kwargs)

        engine.runner.execute = execute
        got, steps, num_async = _run(engine, prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], slots
        assert engine.settings.admission_min_slots == slots
        seen[slots] = (sum(mixed), num_async)
    assert seen[3][0] < seen[1][0], seen  # fewer steps with a prefill chunk
    assert seen[3][1] > seen[1][1], seen  # more steps ran ahead


def test_grammar_and_logprob_rows_keep_steps_synchronous(engines):
    """Requests with logprobs or a grammar need their tokens on the host every step (a grammar's
    next mask follows its last token): while one runs no step goes ahead, and logprobs, the
    constrained text and everyone's tokens are the synchronous engine's."""
    sync, ahead = engines
    prompts = _prompts(4, seed=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=8, regex="[a-c]{2,5}"),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    want, _, _ = _run(sync, prompts, params)
    got, _, num_async = _run(ahead, prompts, params)
    assert num_async == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].logprobs == want[0].logprobs
    assert got[2].text == want[2].text and got[2].finish_reason == "stop"

    grammar_only = [params[2], *params[1:2] * 3]  # steps go ahead once the grammar's request ended
    runs_ahead = ahead.runner.execute_ahead
    batches = []

    def execute_ahead(batch, previous):
        batches.append([r.grammar is None for r in batch.requests])
        return runs_ahead(batch, previous)

    want, _, _ = _run(sync, prompts, grammar_only)
    ahead.runner.execute_ahead = execute_ahead
    try:
        got, _, num_async = _run(ahead, prompts, grammar_only)
    finally:
        del ahead.runner.execute_ahead
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert batches and all(all(plain) for plain in batches) and len(batches) == num_async


def test_stop_strings_end_requests_found_out_a_step_late(engines):
    """A stop string is seen when the host reads the tokens, after the step ahead was launched:
    the extra token is dropped and the text is cut where the synchronous engine cuts it."""
    sync, ahead = engines
    prompts = _prompts(4, seed=4)
    probe = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stops = [o.text[3:6] or "x" for o in probe]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[s]) for s in stops]
    want, _, _ = _run(sync, prompts, params)
    got, _, num_async = _run(ahead, prompts, params)
    assert num_async > 0
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in want
    ]


def test_stream_abandoned_mid_run_leaves_nothing_in_flight(engines):
    """A consumer that stops after the first output aborts the rest; the step launched ahead is
    dropped and the next run starts clean with the same outputs."""
    sync, ahead = engines
    prompts = _prompts(5, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    requests = [EngineRequest(i, p, params) for i, p in enumerate(prompts)]
    stream = ahead.stream(requests)
    next(stream)
    stream.close()
    assert ahead._ahead is None and not ahead.scheduler.has_unfinished()
    assert ahead.kv.pool.num_used_blocks == 0
    want, _, _ = _run(sync, prompts, params)
    got, _, _ = _run(ahead, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_failed_capture_of_a_step_ahead_falls_back_to_host_ids(tiny_llama_dir):
    """The batch shrinks from 4 to 2 in a step run ahead, whose bucket's first capture fails: that
    step takes its ids on the host and runs eagerly, and later steps are eager and synchronous."""
    sync = Engine(_config(tiny_llama_dir))
    prompts = _prompts(4, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (9, 4, 9, 4)]
    want = [o.token_ids for o in sync.generate(prompts, params)]

    ahead = Engine(_config(tiny_llama_dir, async_scheduling=True))
    failed_ahead = []
    running_ahead = [False]

    def capture(step, pool):
        if len(ahead.runner.graphs.graphs) == 0:  # the first bucket (4) captures
            return EagerReplay(step, pool)
        failed_ahead.append(running_ahead[0])
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = _with_graphs(ahead, capture=capture)
    real = graphs.execute

    def execute(batch, token_source=None):
        running_ahead[0] = token_source is not None
        return real(batch, token_source)

    graphs.execute = execute
    got = [o.token_ids for o in ahead.generate(prompts, params)]
    assert got == want
    assert graphs.is_broken and failed_ahead == [True]


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="engine.async_scheduling"):
        EngineConfig(async_scheduling="yes")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="engine.admission_min_slots"):
            EngineConfig(admission_min_slots=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_async_scheduling_keeps_outputs_on_gpu(tiny_llama_dir, kv_cache_dtype):
    """Real graphs, pinned read-back and events: greedy and seeded tokens equal the synchronous
    engine's, and steps ran ahead."""
    prompts = _prompts(16, seed=7)
    lengths = np.random.default_rng(7).integers(1, 40, len(prompts)).tolist()
    results = {}
    for on in (False, True):
        engine = Engine(
            _config(
                tiny_llama_dir,
                device="cuda",
                kv_cache_memory=64 << 20,
                max_num_seqs=16,
                kv_cache_dtype=kv_cache_dtype,
                async_scheduling=on,
            )
        )
        assert engine.runner.graphs is not None
        for temperature in (0.0, 0.7):
            params = [SamplingParams(temperature=temperature, seed=3, max_tokens=m, ignore_eos=True) for m in lengths]
            results[on, temperature] = [o.token_ids for o in engine.generate(prompts, params)]
        if on:
            assert engine.stats().num_async_steps > 0
    for temperature in (0.0, 0.7):
        assert results[True, temperature] == results[False, temperature]
