"""Start-up tuning (kernels/tuning.py): the choices a kernel set reads, made once before the KV cache
is sized. The timing itself needs a GPU (tests/kernels/test_triton_fused_gemm.py, `-m gpu`); here its
bookkeeping runs on fake timings, and the engine's phase order and table choices on the CPU."""

from __future__ import annotations

import pytest
import torch

from batchrun.kernels import tuning
from batchrun.kernels.gemm_tiles import GemmConfig, candidates, default_config
from batchrun.kernels.target import SM90
from batchrun.kernels.tuning import FusedChoice, GemmShape, TileChoice, Tuning, TuningCase, row_buckets
from tests.support.engines import tiny_config

BF16 = torch.bfloat16


def test_row_buckets_cover_every_step_size_up_to_the_budget():
    assert row_buckets(1) == [16]
    assert row_buckets(100) == [16, 32, 64, 128]
    assert row_buckets(256) == [16, 32, 64, 128, 256]
    assert row_buckets(300) == [16, 32, 64, 128, 256, 512]
    assert row_buckets(4096) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def test_a_lookup_reads_the_choice_of_its_bucket_and_the_tables_elsewhere():
    fast_tile = GemmConfig(16, 32, 128, split_k=1, num_warps=4, num_stages=4)
    t = Tuning(
        "measured",
        fused=(FusedChoice("silu_mul", 32, 256, 64, "bfloat16", False, 0.2, 0.1),),
        tiles=(TileChoice("w8a16", 256, 1024, 2048, 32, "bfloat16", replace_split(fast_tile, 4)),),
    )
    assert not t.is_fused("silu_mul", 20, 256, 64, BF16)  # bucket 32: measured slower
    assert t.is_fused("silu_mul", 16, 256, 64, BF16)  # bucket 16: never seen, the table's preference
    assert t.is_fused("silu_mul", 20, 256, 64, torch.float16)  # another dtype: another choice
    assert t.tile("w8a16", 200, 1024, 2048, 32, BF16, SM90) == replace_split(fast_tile, 4)
    # past the last bucket the tuned tile keeps, without the bucket's split (long chunks never split)
    assert t.tile("w8a16", 4096, 1024, 2048, 32, BF16, SM90) == fast_tile
    assert t.tile("w8a16", 1, 1024, 2048, 32, BF16, SM90) == default_config(1, 1024, 2048, 32, SM90.num_sms)
    assert t.describe()["fused"][0] == {
        "kind": "silu_mul",
        "rows": 32,
        "weight": [256, 64],
        "dtype": "bfloat16",
        "fused": False,
        "fused_ms": 0.2,
        "unfused_ms": 0.1,
    }


def replace_split(config: GemmConfig, split: int) -> GemmConfig:
    import dataclasses

    return dataclasses.replace(config, split_k=split)


def _case(kernel: str, rows: int, run_ms, unfused_ms: float, prepared: list) -> TuningCase:
    """A case whose launches return fake times (`_bench` is patched to report what they return)."""

    def prepare():
        prepared.append((kernel, rows))
        return run_ms, (lambda m: unfused_ms)

    return TuningCase(GemmShape(kernel, 256, 64), rows, BF16, prepare)


def test_measuring_keeps_the_fastest_tile_with_the_tables_split(monkeypatch):
    monkeypatch.setattr(tuning, "_bench", lambda fn: float(fn()))
    base = default_config(16, 256, 64, 0, SM90.num_sms)
    best = candidates(base)[2]
    times = {best: 0.3, candidates(base)[1]: 0.5}

    def run(m, config):
        if config == candidates(base)[3]:
            raise RuntimeError("out of shared memory")  # not a candidate, not a failure
        return times.get(config, 9.0)

    tiles: dict = {}
    tuning._measure(_case("w8a16", 16, run, 0.0, []), SM90, {}, tiles)
    (choice,) = tiles.values()
    assert choice.config == best and choice.ms == 0.3 and choice.config.split_k == base.split_k


def test_measuring_keeps_the_faster_of_fused_and_unfused_per_row_bucket(monkeypatch):
    monkeypatch.setattr(tuning, "_bench", lambda fn: float(fn()))

    def fails(m, config):
        raise RuntimeError("the fused kernel does not run here")

    prepared: list = []
    cases = [
        _case("silu_mul", 16, lambda m, config: 0.5, 1.0, prepared),
        _case("silu_mul", 32, lambda m, config: 2.0, 1.0, prepared),
        _case("silu_mul", 16, lambda m, config: 9.0, 1.0, prepared),  # the same bucket again: not timed again
        _case("logits", 512, fails, 1.0, prepared),  # past the tile buckets: the 256 bucket's tile is timed
    ]
    fused: dict = {}
    tiles: dict = {}
    for c in cases:
        tuning._measure(c, SM90, fused, tiles)
    assert prepared == [("silu_mul", 16), ("silu_mul", 32), ("logits", 512)]  # no inputs for a known bucket
    choices = {(k[0], k[1]): (c.fused, c.fused_ms, c.unfused_ms) for k, c in fused.items()}
    assert choices == {
        ("silu_mul", 16): (True, 0.5, 1.0),
        ("silu_mul", 32): (False, 2.0, 1.0),
        ("logits", 512): (False, None, None),
    }
    assert {(k[0], k[1]) for k in tiles} == {("silu_mul", 16), ("silu_mul", 32), ("logits", 256)}


def test_the_engine_tunes_before_it_sizes_the_kv_cache_and_records_the_tables_on_the_cpu(tiny_llama_dir, monkeypatch):
    from batchrun.engine import startup

    order = []
    for phase in ("tune", "plan_kv"):
        real = getattr(startup, phase)
        monkeypatch.setattr(startup, phase, lambda *a, _real=real, _name=phase: order.append(_name) or _real(*a))
    monkeypatch.setattr(tuning, "measured_tuning", lambda *a: pytest.fail("nothing is timed off a GPU"))
    config = tiny_config(
        tiny_llama_dir,
        dtype="bfloat16",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_memory=4 << 20,
        tune_kernels=False,  # the CPU's own measurement: tests/engine/test_cpu_tuned_engine.py
    )
    parts = startup.start_engine(config)
    assert order == ["tune", "plan_kv"]
    assert parts.kernels is parts.target.model.kernels and parts.kernels.tuning.source == "table"
    assert parts.settings.kernels == parts.kernels.describe()
