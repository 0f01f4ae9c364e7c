"""Loading a model in bf16 never holds a float32 copy of it.

Peak bytes held by torch's CPU allocator while an Engine is built in bf16 from a float32 checkpoint
(what tiny models and converted GGUF files are), read from the profiler's allocation events. With W
the model's bf16 weight bytes, a float32 copy of the model is 2W, so building in float32 and then
casting peaks at 3W or more (checkpoint or model in bf16 beside it); reading and casting the
checkpoint whole (safetensors' own loader holds the file as one float32 storage) does too. Loading
tensor by tensor in the target dtype into a model built on the meta device holds at most the
checkpoint and the model at once: 2W, and the bound leaves a quarter W for everything else.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from batchrun.engine import Engine
from batchrun.testing import make_tiny_model
from tests.support.engines import make_tiny_engine, tiny_config


def _peak_allocated(fn):
    """(peak bytes allocated by torch on the CPU while fn runs, fn's result)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    assert events, "the profiler recorded no allocations"
    held = peak = 0
    for _, nbytes in events:  # allocations positive, frees negative
        held += nbytes
        peak = max(peak, held)
    return peak, result


def test_bf16_engine_never_holds_a_float32_copy(tmp_path):
    # Big enough that the weights dominate every other allocation of the engine's start-up.
    model_dir = make_tiny_model(
        tmp_path / "model", "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4
    )
    config = tiny_config(
        str(model_dir),
        dtype="bfloat16",
        kv_cache_memory=1 << 16,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        cache_dir=str(tmp_path / "cache"),
    )
    peak, engine = _peak_allocated(lambda: Engine(config))
    weights = {id(t): t for t in [*engine.model.parameters(), *engine.model.buffers()]}.values()
    assert all(t.dtype != torch.float32 for t in weights if t.is_floating_point())
    w = sum(t.numel() * t.element_size() for t in weights)
    assert w > 4 << 20
    assert peak < 2.25 * w, f"peak {peak / w:.2f}x the bf16 weights: a float32 copy was held"


def _cache_bytes(runner) -> int:
    """Bytes of a runner's K and V caches over all layers."""
    return sum(t.untyped_storage().nbytes() for kv in runner.kv_caches for t in kv)


def test_draft_model_cache_comes_out_of_the_same_kv_budget(tiny_model_factory):
    budget = 3 << 20
    engine = make_tiny_engine(
        tiny_model_factory("llama"),
        kv_cache_memory=budget,
        max_num_seqs=4,
        max_num_batched_tokens=128,
        speculative=dict(method="draft", draft_model=tiny_model_factory("mistral"), adaptive=False),
    )
    target, draft = _cache_bytes(engine.runner), _cache_bytes(engine.drafter.runner)
    assert draft > 0 and engine.drafter.runner is not engine.runner
    assert target + draft <= budget
    assert engine.settings.kv_cache_bytes == target + draft
