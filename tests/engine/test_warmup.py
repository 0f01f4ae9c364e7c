"""Engine warm-up: it covers every step kind and decode split count, and leaves no trace.

On a GPU the warm-up is what keeps Triton compilation and CUDA-graph capture out of timed runs;
its plan and its bookkeeping are the same on the CPU, so they are checked here: the attention
metadata of every step it runs is recorded (a forward pre-hook on the model) and compared with what
default_num_splits can choose, found by brute force over batch sizes and table widths.
"""

from __future__ import annotations

import dataclasses

import pytest

from batchrun import Engine, EngineConfig, SamplingParams
from batchrun.engine.warmup import decode_split_fn, warmup_plan, width_class
from batchrun.kernels import triton_attention
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.target import SM90
from batchrun.testing import sample_texts

BLOCK = 16
MAX_NUM_SEQS = 4


def _reachable(split_fn, max_num_seqs: int, max_blocks: int) -> set[tuple[int, str]]:
    """Every (split count, width class) a decode step can have: any batch size, any table width."""
    return {
        (split_fn(n, w * BLOCK), width_class(w)) for n in range(1, max_num_seqs + 1) for w in range(1, max_blocks + 1)
    }


def test_the_plan_covers_every_split_count_a_gpu_step_can_get():
    """GPU-sized shapes without a GPU: default_num_splits for a 132-SM device (an H200, simulated),
    8 KV heads, 8k context, 256 sequences: split counts 1 to 32."""

    def split_fn(n: int, ctx: int) -> int:
        return triton_attention.default_num_splits(n, 8, ctx, SM90, 64)

    max_model_len, max_num_seqs = 8192, 256
    plan = warmup_plan(BLOCK, max_model_len, 2048, max_num_seqs, split_fn)
    for kind, max_decodes in (("decode", max_num_seqs), ("mixed", max_num_seqs - 1)):  # a mixed step: one prompt
        reachable = _reachable(split_fn, max_decodes, max_model_len // BLOCK)
        assert {s for s, _ in reachable} == set(range(1, 33))
        assert {(1, "div16"), (32, "div16"), (5, "other")} <= reachable
        steps = [s for s in plan if s.kind == kind]
        assert {(s.num_splits, width_class(s.table_blocks)) for s in steps} == reachable, kind
        for s in steps:  # each step's stated split count is the one its own shape gets
            assert s.num_splits == split_fn(len(s.decodes), s.table_blocks * BLOCK)
            assert max(s.decodes) <= max_model_len and -(-max(s.decodes) // BLOCK) == s.table_blocks
            assert len(s.decodes) + len(s.prefills) <= max_num_seqs
    prefills = [s for s in plan if s.kind == "prefill"]
    assert {width_class(s.table_blocks) for s in prefills} == {"one", "other", "div16"}
    assert {s.prefills[0][1] for s in prefills} == {16, 32, 64, 128, 256, 512}  # every GEMM tile bucket, one past
    (chunked,) = [s for s in plan if s.kind == "chunked_prefill"]
    assert chunked.prefills[0][0] > 0  # reads a cached prefix
    assert all(sum(new for _, new in s.prefills) + len(s.decodes) <= 2048 for s in plan)  # within the budget


def test_the_plan_fits_a_short_context_and_a_small_budget():
    plan = warmup_plan(BLOCK, 40, 20, 8, lambda n, ctx: 1)
    for s in plan:
        assert all(cached + new <= 39 for cached, new in s.prefills)  # room for a generated token
        assert all(ctx <= 40 for ctx in s.decodes)
        assert sum(new for _, new in s.prefills) + len(s.decodes) <= 20
    assert {s.kind for s in plan} == {"prefill", "chunked_prefill", "decode", "mixed"}
    assert not [s for s in warmup_plan(BLOCK, 40, 20, 1, lambda n, ctx: 1) if s.kind == "mixed"]  # one seq at most


def _config(model: str, **kw) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=128,
        kv_cache_memory=4 << 20,
        **kw,
    )


def _state(engine: Engine) -> dict:
    """Everything a warm-up could leave behind that a later request would see."""
    pool = engine.kv.pool
    return {
        "free": list(pool.free),
        "ref_counts": list(pool.ref_counts),
        "cached": dict(pool.hash_to_block),
        "table_rows": engine.kv.block_tables.num_rows_used,
        "stats": dataclasses.asdict(engine.stats()),
        "next_seq_id": engine.admission.next_seq_id,
        "generator": engine.sampler._generator.get_state().tolist(),
        "unfinished": engine.scheduler.num_unfinished,
    }


def _prompts() -> list[str]:
    doc = sample_texts()[7][:200]
    return [doc, doc + " and then", sample_texts()[8][:90]]  # a shared prefix: the prefix cache hits


def test_warmup_covers_every_step_kind_and_leaves_no_trace(tiny_llama_dir, one_torch_thread):
    fresh = Engine(_config(tiny_llama_dir))
    engine = Engine(_config(tiny_llama_dir))
    # The CPU's attention splits no context; the warm-up plans by the kernel set's split count, so
    # the set here splits as the Triton decode kernel in the interpreter does (several counts).
    kernels = engine.model.kernels
    assert kernels.decode_num_splits(1, 2, 4096) == 1
    engine.model.use_kernels(
        dataclasses.replace(
            kernels, decode_num_splits=lambda n, heads, ctx: triton_attention.default_num_splits(n, heads, ctx, None)
        )
    )
    assert engine.settings.warmup is None and "warmup" not in engine.settings.as_dict()  # null: on a GPU only
    before = _state(fresh)
    assert _state(engine) == before

    metas: list[AttentionMetadata] = []
    hook = engine.runner.model.register_forward_pre_hook(lambda module, args: metas.append(args[3]))
    summary = engine.warmup()
    hook.remove()
    assert summary["num_steps"] == len(metas) and engine.settings.warmup == summary
    assert summary["graph_buckets"] == []  # no CUDA graphs on the CPU

    kinds = set()
    observed: dict[str, set[tuple[int, str]]] = {"decode": set(), "mixed": set()}
    split_fn = decode_split_fn(engine.model.kernels, engine.model.spec.num_kv_heads)
    for meta in metas:
        num_decode = int(meta.decode_seq_ids.shape[0])
        q_lens = [meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in range(len(meta.seq_lens))]
        if meta.prefill_seq_ids and any(meta.seq_lens[i] > q_lens[i] for i in meta.prefill_seq_ids):
            kinds.add("chunked_prefill")
        kind = "mixed" if meta.prefill_seq_ids and num_decode else "decode" if num_decode else "prefill"
        kinds.add(kind)
        if num_decode:
            width = meta.block_tables.shape[1]
            observed[kind].add((split_fn(num_decode, width * BLOCK), width_class(width)))
    assert kinds == {"prefill", "chunked_prefill", "decode", "mixed"}
    max_blocks = -(-engine.max_model_len // BLOCK)
    for kind, max_decodes in (("decode", engine.max_num_seqs), ("mixed", engine.max_num_seqs - 1)):
        reachable = _reachable(split_fn, max_decodes, max_blocks)
        assert len({s for s, _ in reachable}) > 1  # the tiny model's shapes do reach several split counts
        assert observed[kind] == reachable, kind

    assert _state(engine) == before  # no block held or cached, no id or random draw used, stats zero
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # unseeded: ids and generator
    want = [o.token_ids for o in fresh.generate(_prompts(), greedy)] + [
        o.token_ids for o in fresh.generate(_prompts(), sampled)
    ]
    got = [o.token_ids for o in engine.generate(_prompts(), greedy)] + [
        o.token_ids for o in engine.generate(_prompts(), sampled)
    ]
    assert got == want
    assert engine.stats() == fresh.stats()

    # Later, with the prefix cache full: the warm-up forgets it first, so what its steps write into
    # free blocks is never read back as a cached prefix.
    assert engine.kv.pool.hash_to_block
    engine.warmup()
    assert not engine.kv.pool.hash_to_block
    assert [o.token_ids for o in engine.generate(_prompts(), greedy)] == want[:3]


def test_warmup_true_runs_at_start_up_and_needs_an_idle_engine(tiny_llama_dir, one_torch_thread):
    engine = Engine(_config(tiny_llama_dir, warmup=True))
    assert engine.settings.warmup["num_steps"] > 0
    assert engine.admission.next_seq_id == 0 and engine.kv.pool.num_free_blocks == engine.kv.num_blocks
    (request,) = engine.admission.build([1, 2, 3], 0, SamplingParams(temperature=0.0, max_tokens=2))
    engine.scheduler.add(request)
    with pytest.raises(AssertionError, match="idle"):
        engine.warmup()  # its steps write into free blocks, which an admitted request may be about to use
    engine.abort_all()
    with pytest.raises(ValueError, match="engine.warmup"):
        EngineConfig(warmup="auto")


def test_a_draft_model_is_warmed_up_too_and_greedy_output_is_unchanged(tiny_model_factory, one_torch_thread):
    spec = dict(method="draft", draft_model=tiny_model_factory("mistral"), adaptive=False, num_speculative_tokens=2)
    plain = Engine(_config(tiny_model_factory("llama"), speculative=spec))
    warmed = Engine(_config(tiny_model_factory("llama"), speculative=spec, warmup=True))
    runners = [warmed.runner, warmed.drafter.runner]
    plans = [
        warmup_plan(
            BLOCK,
            warmed.max_model_len,
            warmed.max_num_batched_tokens,
            warmed.max_num_seqs,
            decode_split_fn(r.model.kernels, r.model.spec.num_kv_heads),
        )
        for r in runners
    ]
    assert warmed.settings.warmup["num_steps"] == sum(len(p) for p in plans)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    assert [o.token_ids for o in warmed.generate(_prompts(), greedy)] == [
        o.token_ids for o in plain.generate(_prompts(), greedy)
    ]
    # the measured step costs are wall times: the same kinds and widths measured, not the same seconds
    timed_w, timed_p = warmed.stats().spec_step_s, plain.stats().spec_step_s
    assert timed_w is not None and timed_p is not None and timed_w.keys() == timed_p.keys()
    assert dataclasses.replace(warmed.stats(), spec_step_s=None) == dataclasses.replace(plain.stats(), spec_step_s=None)
