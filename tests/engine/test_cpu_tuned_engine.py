"""A bf16 CPU engine's start-up measurement of the native kernels against torch's (engine/startup.py:
tune), on injected timings: it runs before the KV cache is sized, its choices are the kernel set's
and the settings', the layers take the layout chosen (weight_bytes counting it), and the outputs
stay what the static choice gives where the same kernels are chosen. float32, tune_kernels=false
and batch_invariant measure nothing. Nothing here depends on how fast anything runs."""

from __future__ import annotations

import pytest
import torch

from batchrun.kernels import cpu_linear, cpu_tuning
from batchrun.kernels.cpu_choices import NATIVE, PACKED, TORCH, AttentionChoice, LinearChoice
from batchrun.kernels.cpu_tuning import CpuMeasurement
from tests.support.engines import make_tiny_engine

pytestmark = pytest.mark.skipif(
    not cpu_linear.native_supported(32, 64), reason="native kernels not built here, or built without AVX512-BF16"
)

PROMPTS = [[5 + (3 * i + j) % 150 for j in range(10 + 9 * i)] for i in range(4)]


def _engine(model_dir: str, **config):
    base = dict(dtype="bfloat16", kv_cache_memory=8 << 20, max_num_seqs=4, max_num_batched_tokens=64)
    return make_tiny_engine(model_dir, **{**base, **config})


def _generate(engine) -> list[tuple[list[int], list]]:
    from batchrun.engine import SamplingParams

    outputs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, logprobs=2))
    return [(o.token_ids, o.logprobs) for o in outputs]


def _native_everywhere(candidates):
    """Timings where the native kernel wins every comparison: each candidate still runs once."""
    for fn in candidates.values():
        fn()
    return {name: 1.0 if name == "native" else 2.0 for name in candidates}


def test_native_winning_everywhere_keeps_the_static_kernels_and_their_outputs(tiny_llama_dir, monkeypatch):
    from batchrun.engine import startup

    order = []
    real_plan = startup.plan_kv
    monkeypatch.setattr(startup, "plan_kv", lambda *a: order.append("plan_kv") or real_plan(*a))
    real_measure = startup.measure_cpu
    monkeypatch.setattr(startup, "measure_cpu", lambda *a: order.append("measure") or real_measure(*a))
    monkeypatch.setattr(cpu_tuning, "best_ms", _native_everywhere)
    tuned = _engine(tiny_llama_dir)
    assert order == ["measure", "plan_kv"]  # timed while the KV cache's memory is still free
    kernels = tuned.settings.kernels
    assert kernels == tuned.model.kernels.describe()
    tuning = kernels["tuning"]
    assert tuning["source"] == "measured" and tuning["cpu_seconds"] is not None
    assert {c["kind"] for c in tuning["cpu_linears"]} == {"qkv", "o", "gate_up_silu", "down", "lm_head"}
    assert all(c["small"] == c["large"] == NATIVE for c in tuning["cpu_linears"])
    assert tuning["cpu_attention"]["decode"] == tuning["cpu_attention"]["prefill"] == NATIVE
    assert kernels["linears"]["float"] == {"packing": "native"}
    static = _engine(tiny_llama_dir, tune_kernels=False)
    assert static.settings.kernels["tuning"]["source"] == "table"
    assert static.settings.kernels["kernels"] == kernels["kernels"]
    assert static.settings.weight_bytes == tuned.settings.weight_bytes
    assert static.settings.native_linears == tuned.settings.native_linears
    assert _generate(tuned) == _generate(static)  # the same kernels: bitwise the same tokens and logprobs


def test_an_amx_like_measurement_lays_out_the_layers_and_counts_their_memory(tiny_llama_dir, monkeypatch):
    from batchrun.engine import startup
    from batchrun.model.linear import RowSplitLinear
    from batchrun.model.prepare import module_weight_bytes

    def measure(linears, attention, rows):
        assert rows == cpu_tuning.CpuRows(4, 64)  # the engine's limits
        split = {"qkv": (NATIVE, TORCH, 16, PACKED), "gate_up_silu": (NATIVE, TORCH, 16, "unpacked")}
        choices = tuple(
            LinearChoice(s.kind, s.n, s.k, *split.get(s.kind, (NATIVE, NATIVE, None, None))) for s in linears
        )
        return CpuMeasurement(choices, AttentionChoice(NATIVE, TORCH), 0.01)

    monkeypatch.setattr(startup, "measure_cpu", measure)
    tuned = _engine(tiny_llama_dir)
    static = _engine(tiny_llama_dir, tune_kernels=False)
    layers = tuned.model.layers
    assert all(isinstance(layer.self_attn.qkv_proj, RowSplitLinear) for layer in layers)
    assert all(isinstance(layer.mlp.gate_up_proj, RowSplitLinear) for layer in layers)
    assert tuned.settings.weight_bytes == module_weight_bytes(tuned.model)
    spec = tuned.model.spec
    qkv_bytes = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * spec.hidden_size * 2
    gate_up_bytes = 2 * spec.intermediate_size * spec.hidden_size * 2
    # qkv's weight held twice in every layer, one buffer for the largest unpacked gate/up weight
    assert tuned.settings.weight_bytes == static.settings.weight_bytes + spec.num_layers * qkv_bytes + gate_up_bytes
    assert tuned.settings.native_linears == static.settings.native_linears  # the decode side is native
    kernels = tuned.settings.kernels
    assert kernels["kernels"]["paged_attention"].endswith("(native=True, native_prefill=False)")
    assert [c["kind"] for c in kernels["linears"]["float"]["torch_kernels"]] == ["qkv", "gate_up_silu"]
    # prompts of 10-37 tokens prefill through torch's kernels, decodes through the native ones
    for (tokens, logprobs), (want, _) in zip(_generate(tuned), _generate(static)):
        assert len(tokens) == len(want) == 12 and all(len(lp) >= 2 for lp in logprobs)


@pytest.mark.parametrize("config", [dict(dtype="float32"), dict(tune_kernels=False), dict(batch_invariant=True)])
def test_nothing_is_measured_for_float32_without_tuning_or_under_batch_invariance(tiny_llama_dir, monkeypatch, config):
    from batchrun.engine import startup

    monkeypatch.setattr(startup, "measure_cpu", lambda *a: pytest.fail("measured"))
    engine = _engine(tiny_llama_dir, **config)
    assert engine.settings.kernels["tuning"]["source"] == "table"


def test_float32_outputs_do_not_depend_on_tune_kernels(tiny_llama_dir):
    tuned, static = (_engine(tiny_llama_dir, dtype="float32", tune_kernels=t) for t in (True, False))
    assert tuned.settings.kernels == static.settings.kernels
    assert _generate(tuned) == _generate(static)


def test_the_measurement_runs_on_the_engines_threads(tiny_llama_dir, monkeypatch):
    seen = []

    def timer(candidates):
        seen.append(torch.get_num_threads())
        return _native_everywhere(candidates)

    monkeypatch.setattr(cpu_tuning, "best_ms", timer)
    before = torch.get_num_threads()
    try:
        _engine(tiny_llama_dir, num_threads=1)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
