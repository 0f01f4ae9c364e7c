"""Decode CUDA graphs: the bucket, padding and packing logic on CPU, and greedy output unchanged.

On CPU the graphs are stood in for by `EagerReplay` (a "replay" reruns the step on the same static
buffers), so everything but the capture itself runs: packing rows on the host, the one upload,
unpacking into static inputs, padding to a bucket by repeating the last row, slicing the outputs,
and the fallback to eager steps when a capture fails. The real capture is checked on a GPU (`-m gpu`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchrun.engine import Engine, SamplingParams
from batchrun.engine.config import SamplingParams as Params
from batchrun.engine.request import Request
from batchrun.engine.runners import GpuRunner, ModelRunner
from batchrun.engine.runners.cuda_graphs import (
    NUM_FIXED,
    DecodeGraphs,
    EagerReplay,
    bucket_sizes,
    pack_decode_inputs,
    packed_views,
    pick_bucket,
)
from batchrun.engine.scheduler import ScheduledBatch
from tests.support.engines import make_tiny_engine


def test_buckets_cover_every_batch_size_with_the_smallest_fit():
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(512)[-3:] == [480, 496, 512]
    buckets = bucket_sizes(100)
    for n in range(1, 101):
        b = pick_bucket(buckets, n)
        assert b is not None and b >= n
        assert all(x < n for x in buckets if x < b)
    assert pick_bucket(buckets, 101) is None


def _request(seq_id: int, num_tokens: int, num_computed: int, block_size: int, rng: np.random.Generator) -> Request:
    req = Request(seq_id, seq_id, rng.integers(0, 500, num_tokens).tolist(), Params(temperature=0.0), 0.0)
    req.num_computed_tokens = num_computed
    num_blocks = -(-(num_computed + 1) // block_size)
    req.block_ids = rng.permutation(200)[:num_blocks].tolist()
    return req


@pytest.mark.parametrize("block_size", [4, 16])
def test_packed_rows_match_what_the_runner_prepares(block_size):
    """The graph path's host inputs equal ModelRunner.prepare's for the same decode batch, padding
    rows repeat the last request, and a one-token prompt chunk is computed but not sampled."""
    rng = np.random.default_rng(block_size)
    reqs = [_request(i, n, n - 1, block_size, rng) for i, n in enumerate((5, 17, 1, 40, 33))]
    reqs.append(_request(5, 30, 11, block_size, rng))  # mid-prompt chunk of one token: samples nothing
    batch = ScheduledBatch(reqs, [1] * len(reqs))
    runner = ModelRunner.__new__(ModelRunner)  # prepare() needs only these three
    runner.block_size, runner.device, runner.batch_invariant = block_size, torch.device("cpu"), False
    input_ids, positions, meta, logits_rows, sample_seq_ids, _ = runner.prepare(batch)

    width = max(len(r.block_ids) for r in reqs)
    host = np.full(8 * (NUM_FIXED + width) + 5, -7, dtype=np.int64)  # stale values must all be overwritten
    fixed, tables = packed_views(host, 8, width)
    sample = pack_decode_inputs(reqs, block_size, fixed, tables)
    n = len(reqs)
    assert fixed[0, :n].tolist() == input_ids.tolist()
    assert fixed[1, :n].tolist() == positions.tolist()
    assert fixed[2, :n].tolist() == meta.slot_mapping.tolist()
    assert fixed[3, :n].tolist() == meta.decode_seq_lens.tolist()  # what the graphs read, uncomputed
    assert (tables[:n] == meta.block_tables.numpy()[:, :width]).all()
    assert (fixed[:, n:] == fixed[:, n - 1 : n]).all() and (tables[n:] == tables[n - 1]).all()
    assert (host[: 8 * (NUM_FIXED + width)] != -7).all() and (host[8 * (NUM_FIXED + width) :] == -7).all()
    assert sample == logits_rows == [0, 1, 2, 3, 4]
    assert [reqs[i].seq_id for i in sample] == sample_seq_ids


@pytest.fixture(scope="module")
def tiny_engine_factory(tiny_llama_dir):
    def make(kv_cache_dtype: str = "auto") -> Engine:
        return make_tiny_engine(
            tiny_llama_dir,
            kv_cache_memory=16 << 20,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            kv_cache_dtype=kv_cache_dtype,
        )

    return make


def _attach_graphs(engine: Engine, capture=None, max_batch: int = 16) -> DecodeGraphs:
    """The engine's runner replaced by the GPU runner's stand-in over the same cache: its graphs'
    block tables are max_model_len wide, and `capture` (default EagerReplay) makes each graph."""
    engine.runner = GpuRunner.stand_in(engine.runner, max_batch, capture or EagerReplay)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.block_tables.shape[1] == -(-engine.max_model_len // engine.runner.block_size)
    return graphs


def test_graph_tables_are_as_wide_as_max_model_len(tiny_llama_dir):
    """The graphs' block tables (whose width sets a graphed decode's split count on a GPU) span the
    engine's max_model_len, which start-up hands the runner, not the model's max_position_embeddings."""
    engine = make_tiny_engine(
        tiny_llama_dir, kv_cache_memory=16 << 20, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96
    )
    graphs = GpuRunner.stand_in(engine.runner, 4).graphs
    assert engine.model.spec.max_position_embeddings == 512 and engine.runner.max_model_len == 96
    assert graphs is not None and graphs.block_tables.shape == (4, 96 // 16)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 500, n).tolist() for n in (5, 23, 9, 40, 2, 17, 31)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_graph_path_keeps_greedy_output_and_pads_to_buckets(tiny_engine_factory, kv_cache_dtype):
    """Same tokens with and without the decode-graph path; batches of 7 shrinking to 1 as requests
    finish at different lengths use the 8, 4, 2 and 1 buckets with padding rows. With int8/fp8
    caches too: padding rows write their slot's quantized K/V again, which changes nothing."""
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 3, 8, 20, 5, 1, 9)]
    eager = tiny_engine_factory(kv_cache_dtype)
    assert eager.runner.graphs is None, "CPU engines never build graphs"
    want = [o.token_ids for o in eager.generate(prompts, params)]

    engine = tiny_engine_factory(kv_cache_dtype)
    graphs = _attach_graphs(engine)
    replays = []
    real_execute = graphs.execute
    graphs.execute = lambda batch: replays.append(len(batch.requests)) or real_execute(batch)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    assert replays, "no decode step went through the graph path"
    assert {pick_bucket(graphs.buckets, n) for n in replays} >= {8, 4, 2, 1}
    assert set(graphs.graphs) == {pick_bucket(graphs.buckets, n) for n in replays}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_capture_all_dummy_rows_leave_a_quantized_cache_alone(tiny_engine_factory, kv_cache_dtype):
    """capture_all's dummy rows (slot -1) run through the model and write nothing into an int8/fp8
    cache (int8: the native CPU write; fp8: QuantizedKVCache.write, the torch path a GPU without
    float8 support takes too), after a real run filled it."""
    engine = tiny_engine_factory(kv_cache_dtype)
    engine.generate(_prompts()[:3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    graphs = _attach_graphs(engine)
    before = [(c.data.view(torch.uint8).clone(), c.scale.clone()) for layer in engine.runner.kv_caches for c in layer]
    for bucket in (8, 1):
        graphs._fill_dummy_rows(bucket)
        graphs._graph(bucket).replay()
    after = [(c.data.view(torch.uint8), c.scale) for layer in engine.runner.kv_caches for c in layer]
    for (data0, scale0), (data1, scale1) in zip(before, after):
        assert torch.equal(data0, data1) and torch.equal(scale0, scale1)
    assert torch.isfinite(graphs.outputs[8]).all() and graphs.outputs[8].shape[0] == 8


def test_failed_capture_falls_back_to_eager_steps(tiny_engine_factory):
    def broken_capture(step, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in tiny_engine_factory().generate(prompts, params)]
    engine = tiny_engine_factory()
    graphs = _attach_graphs(engine, capture=broken_capture)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert graphs.is_broken and not graphs.graphs


def test_batches_the_graphs_cannot_take_run_eagerly(tiny_engine_factory):
    engine = tiny_engine_factory()
    graphs = _attach_graphs(engine, max_batch=2)
    rng = np.random.default_rng(1)
    decode = [_request(i, 9, 8, 16, rng) for i in range(3)]
    assert not graphs.can_run(ScheduledBatch(decode, [1, 1, 1]))  # more than the largest bucket
    assert graphs.can_run(ScheduledBatch(decode[:2], [1, 1]))
    assert not graphs.can_run(ScheduledBatch(decode[:2], [1, 2]))  # a prefill chunk
    spec = ScheduledBatch(decode[:1], [1], spec_token_ids={0: [5]})
    assert not graphs.can_run(spec)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_cuda_graphs_keep_greedy_output_on_gpu(tiny_llama_dir, monkeypatch, kv_cache_dtype):
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 3, 8, 20, 5, 1, 9)]
    cfg = dict(device="cuda", max_num_seqs=16, max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype)
    monkeypatch.setenv("BATCHRUN_CUDA_GRAPHS", "0")
    eager = make_tiny_engine(tiny_llama_dir, **cfg)
    assert eager.runner.graphs is None
    want = [o.token_ids for o in eager.generate(prompts, params)]
    monkeypatch.setenv("BATCHRUN_CUDA_GRAPHS", "1")
    engine = make_tiny_engine(tiny_llama_dir, **cfg)
    assert engine.runner.graphs is not None
    engine.runner.graphs.capture_all(max_batch=16)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    assert not engine.runner.graphs.is_broken
