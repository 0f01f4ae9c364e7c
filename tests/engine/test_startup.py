"""Engine start-up phases (engine/startup.py) and the settings they resolve (engine/settings.py).

The expected block counts and settings below are what the engine resolved for these configs before
start-up was split into phases: the split must not move a number, nor a byte of the manifest."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from batchrun.engine import Engine, EngineConfig, EngineSettings, SamplingParams, startup
from batchrun.engine.startup import KVPlan, load_target, plan_kv

# One float32 KV block of the tiny llama: K and V x 3 layers x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
FLOAT32_BLOCK = 12288
# int8: 16 one-byte entries plus a float32 scale per token and head.
INT8_BLOCK = 3840


def _config(model: str, **kw) -> EngineConfig:
    base = dict(model=model, dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=256)
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "kv_cache_dtype, speculative, expected",
    [
        ("auto", None, KVPlan(682, 16, FLOAT32_BLOCK, 512)),
        ("int8", None, KVPlan(2184, 16, INT8_BLOCK, 512)),
        ("fp8", None, KVPlan(2184, 16, INT8_BLOCK, 512)),
        # a draft model's cache shares the block ids: a block costs both models' entries
        ("auto", "draft", KVPlan(341, 16, 2 * FLOAT32_BLOCK, 512)),
    ],
)
def test_plan_kv_on_a_byte_budget_gives_the_block_count_start_up_always_gave(
    tiny_llama_dir, kv_cache_dtype, speculative, expected
):
    spec = {"method": "draft", "draft_model": tiny_llama_dir} if speculative else {}
    config = _config(tiny_llama_dir, kv_cache_memory=8 << 20, kv_cache_dtype=kv_cache_dtype, speculative=spec)
    plan = plan_kv(config, load_target(config))
    assert plan == expected and plan.kv_cache_bytes == expected.num_blocks * expected.bytes_per_block


def test_plan_kv_reads_free_memory_only_for_a_fraction_or_the_default(tiny_llama_dir, monkeypatch):
    config = _config(tiny_llama_dir, kv_cache_memory=0.5)
    target = load_target(config)
    monkeypatch.setattr(startup, "available_memory", lambda device: 1 << 20)
    assert plan_kv(config, target).num_blocks == (1 << 19) // FLOAT32_BLOCK  # half of 1 MiB: 42 blocks
    # None on a CPU: a quarter of the available memory (capped at 1 GiB)
    assert plan_kv(dataclasses.replace(config, kv_cache_memory=None), target).num_blocks == (1 << 18) // FLOAT32_BLOCK
    monkeypatch.setattr(startup, "available_memory", lambda device: pytest.fail("a byte budget reads no memory"))
    assert plan_kv(dataclasses.replace(config, kv_cache_memory=40000), target).num_blocks == 3


def test_plan_kv_caps_max_model_len_to_the_cache_and_refuses_a_cache_without_one_block(tiny_llama_dir, caplog):
    config = _config(tiny_llama_dir, kv_cache_memory=3 * FLOAT32_BLOCK, max_model_len=100)
    target = load_target(config)
    with caplog.at_level(logging.WARNING, logger="batchrun.engine.startup"):
        assert plan_kv(config, target) == KVPlan(3, 16, FLOAT32_BLOCK, 48)
    assert "max_model_len 100 capped to 48" in caplog.text
    # Without a configured max_model_len the model's limit is capped silently.
    assert plan_kv(dataclasses.replace(config, max_model_len=None), target).max_model_len == 48
    with pytest.raises(ValueError, match="engine.kv_cache_memory=100 leaves no room for one KV block"):
        plan_kv(dataclasses.replace(config, kv_cache_memory=100), target)


def _machine(engine: Engine) -> dict:
    """The settings that depend on the machine, not on the config: the kernel set names the native
    kernels where they are built (pinned per target by tests/kernels/test_kernel_set.py)."""
    return {
        "num_threads": engine.settings.num_threads,
        "native_cpu_kernels": engine.settings.native_cpu_kernels,
        "kernels": engine.model.kernels.describe(),
    }


def test_engine_settings_are_frozen_and_serialise_in_the_manifests_key_order(tiny_llama_dir):
    engine = Engine(_config(tiny_llama_dir, kv_cache_memory=8 << 20, quantization="w8a8", kv_cache_dtype="fp8"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.settings.max_num_seqs = 8  # type: ignore[misc]
    expected = {
        "model_type": "llama",
        "device": "cpu",
        "dtype": "float32",
        "num_threads": None,
        "block_size": 16,
        "num_kv_blocks": 2184,
        "kv_cache_bytes": 8386560,
        "max_model_len": 512,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "batch_limits_profile": {},  # both limits configured: nothing profiled
        "native_cpu_kernels": None,
        "packed_linears": 0,
        "native_linears": 0,
        "quantization": "w8a8",
        "quant_group_size": 32,
        "w8a8_outlier_channels": 64,
        "quant_formats": {"linear:w8a8/float8": 9, "linear:w8a8/float16": 3},
        "weight_bytes": 437888,
        "kv_cache_dtype": "fp8",
        "async_scheduling": False,
        "admission_min_slots": 1,
        "kernels": None,
        "tensor_parallel_size": 1,
        "rank_weight_bytes": [437888],  # one process holds the whole model
    }
    expected.update(_machine(engine))
    assert json.dumps(engine.settings.as_dict()) == json.dumps(expected)  # same keys, order and values
    copy = engine.settings.as_dict()
    copy["quant_formats"]["linear:w8a8/float8"] = 0
    assert engine.settings.quant_formats["linear:w8a8/float8"] == 9  # as_dict hands out copies


def test_speculative_settings_appear_only_on_an_engine_that_speculates(tiny_llama_dir):
    config = _config(
        tiny_llama_dir,
        kv_cache_memory=8 << 20,
        speculative={"method": "draft", "draft_model": tiny_llama_dir, "num_speculative_tokens": 3, "adaptive": False},
    )
    settings = Engine(config).settings.as_dict()
    assert list(settings)[-2:] == ["speculative", "draft_model"] and "warmup" not in settings
    assert settings["speculative"] == {"method": "draft", "k": 3, "self_layers": None, "adaptive": False}
    assert settings["draft_model"] == tiny_llama_dir and settings["num_kv_blocks"] == 341
    plain = Engine(_config(tiny_llama_dir, kv_cache_memory=8 << 20)).settings
    assert plain.speculative is None and not {"speculative", "draft_model"} & set(plain.as_dict())


def test_engine_assigns_the_parts_it_is_given(tiny_llama_dir):
    config = _config(tiny_llama_dir, kv_cache_memory=8 << 20)
    parts = startup.start_engine(config)
    engine = Engine(config, parts)
    assert engine.runner is parts.cache.runner and engine.kv is parts.cache.kv
    assert engine.scheduler is parts.core.scheduler and engine.settings is parts.settings
    assert engine.max_model_len == parts.kv_plan.max_model_len and engine.max_num_seqs == parts.limits.max_num_seqs
    out = engine.generate(["def read(path):"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].token_ids) == 4


def test_the_job_manifest_and_fingerprint_record_the_settings_as_before(
    tiny_llama_dir, tmp_path, make_shards, monkeypatch
):
    """The manifest's engine_settings is EngineSettings.as_dict, byte for byte the dict start-up
    used to build; the model fingerprint reads the resolved dtype from it."""
    from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
    from batchrun.job.commit.fingerprint import tokenizer_sha256

    engine_cfg = _config(tiny_llama_dir, kv_cache_memory=8 << 20, quantization="int8", kv_cache_dtype="int8")
    engine = Engine(engine_cfg)
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2)
    cfg = RunConfig(
        job=JobConfig(name="summarize", prompt_template="Summarize:\n{text}"),
        model=ModelConfig(path=tiny_llama_dir),
        engine=engine_cfg,
        sampling=SamplingParams(temperature=0.0, max_tokens=4),
        data=DataConfig(uri=str(tmp_path / "in")),
        output=OutputConfig(uri=str(tmp_path / "out")),
        quiet=True,
    )
    assert run_job(cfg, engine=engine).exit_code == 0
    manifest_text = (tmp_path / "out" / "_manifest.json").read_text()
    manifest = json.loads(manifest_text)
    expected = {
        "model_type": "llama",
        "device": "cpu",
        "dtype": "float32",
        "num_threads": None,
        "block_size": 16,
        "num_kv_blocks": 2184,
        "kv_cache_bytes": 8386560,
        "max_model_len": 512,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "batch_limits_profile": {},
        "native_cpu_kernels": None,
        "packed_linears": 0,
        "native_linears": 0,
        "quantization": "int8",
        "quant_group_size": 32,
        "w8a8_outlier_channels": None,
        "quant_formats": {"linear:int8/g32": 12},
        "weight_bytes": 388352,
        "kv_cache_dtype": "int8",
        "async_scheduling": False,
        "admission_min_slots": 1,
        "kernels": None,
        "tensor_parallel_size": 1,
        "rank_weight_bytes": [388352],  # one process holds the whole model
    }
    expected.update(_machine(engine))
    # The manifest is written with indent=2: its engine_settings block is the dict's text at that indent.
    block = json.dumps({"engine_settings": expected}, indent=2)[2:-2]
    assert block in manifest_text
    assert manifest["model"] == {"path": engine.model_path, "fingerprint": engine.model_fingerprint}
    marker = json.loads(next((tmp_path / "out" / "_commits").glob("*.json")).read_text())
    assert marker["fingerprint"]["model"] == {
        "model.sha256": engine.model_fingerprint,
        "tokenizer.sha256": tokenizer_sha256(engine.tokenizer),
        "engine.resolved_dtype": "float32",
        "engine.think_tags": None,  # the tiny Llama's tokenizer has no think tags
    }
    assert isinstance(engine.settings, EngineSettings)


def test_w8a8_calibration_stays_within_a_short_position_limit(tmp_path):
    """SmoothQuant's calibration prompts are cut to the model's positions (256 here, fewer than the
    512 calibration tokens): a shorter model starts instead of indexing past its rope table."""
    from batchrun.testing import build_tokenizer
    from tests.support.generic_models import save_tiny

    model_dir = save_tiny(tmp_path / "llama", build_tokenizer(), "llama", num_key_value_heads=2)
    engine = Engine(_config(model_dir, kv_cache_memory=8 << 20, quantization="w8a8"))
    out = engine.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert engine.settings.quantization == "w8a8" and len(out.token_ids) == 4
