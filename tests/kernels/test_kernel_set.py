"""Which kernel serves what, per target: the kernel sets the binders make (kernels/bind_cpu.py,
kernels/bind_triton.py), pinned as `KernelSet.describe()` gives them, which is what
EngineSettings.kernels records in a run's manifest. Read this file to learn which function runs the
attention of "int4 + int8 KV on sm_90" without running anything; a change of binding fails here.

The targets are values (kernels/target.py): the CPU with its native kernels, and an sm_90 simulated
on the CPU, which binds exactly what a real H100/H200 binds (only the float32 fp8 path and the
timing differ: real GPUs only).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from batchrun.kernels.binding import bind_kernels
from batchrun.kernels.target import MAX_SHARED_PER_BLOCK, SM90, DeviceTarget, GpuTarget
from tests.support.engines import make_tiny_engine

BF16 = torch.bfloat16
CPU_NATIVE = DeviceTarget(torch.device("cpu"), None, False, True, False)  # csrc kernels built and on
SM90_SIMULATED = DeviceTarget(torch.device("cpu"), SM90, True, False, True)
SM80_SIMULATED = DeviceTarget(
    torch.device("cpu"), GpuTarget((8, 0), 108, MAX_SHARED_PER_BLOCK[(8, 0)]), True, False, True
)

CPU_BF16 = {
    "kernels": {
        "rms_norm": "kernels.elementwise.rms_norm_native",
        "add_rms_norm": "kernels.elementwise.add_rms_norm_native",
        "rms_norm_quant": None,
        "act_mul": "kernels.elementwise.act_mul_native",
        "write_kv_cache": "kernels.attention.write_kv_cache_native",
        "qkv_norm_rope_write": "kernels.attention.qkv_norm_rope_write_separate(rms_norm=kernels.elementwise."
        "rms_norm_native, apply_rotary=kernels.elementwise.apply_rotary_native, write_kv_cache=kernels.attention."
        "write_kv_cache_native)",
        "paged_attention": "kernels.cpu_attention.paged_attention_cpu(native=True)",
        "varlen_attention": "kernels.varlen_attention.varlen_attention",
        "rope_reads_tables": False,
        "decode_num_splits": "kernels.bind_cpu._one_split",
        "qkv_project": "kernels.fused_projections.qkv_project_separate(qkv_norm_rope_write=kernels.attention."
        "qkv_norm_rope_write_separate)",
        "gate_up_act": "kernels.fused_projections.gate_up_act_separate(act_mul=kernels.elementwise.act_mul_native)",
        "lm_head_logits": "kernels.fused_projections.lm_head_logits_separate",
        "embed_norm": None,
        "sample": "kernels.sampling.gumbel_sample_native",
        "spill": "kernels.sampling.spill_thresholds_reference",
        "gather_in_place": "kernels.sampling.gather_in_place_reference",
        "moe_grouped_gemm": "kernels.moe.grouped_gemm_reference",
        "invariant_matmul": None,
        "lora_rows": "kernels.lora.lora_rows_native",
    },
    "linears": {
        "float": {"packing": "native"},
        "int8": {"matmul": "kernels.quant.linears.int8_linear_cpu"},
        "int4": {
            "matmul": "kernels.quant.weight_only.int4_weight_matmul",
            "packed_matmul": "kernels.quant.linears.int4_linear_cpu",
        },
        "w8a8": {
            "matmul": "kernels.quant.w8a8.w8a8_matmul(native=True, min_rows=0)",
            "packed_matmul": "kernels.quant.w8a8.w8a8_matmul_native",
        },
        "w4a8": {
            "matmul": "kernels.quant.w4a8.w4a8_matmul(native=True)",
            "packed_matmul": "kernels.quant.w4a8.w4a8_matmul_native",
            "fused_silu": "kernels.quant.w4a8.w4a8_silu_quant_native",
        },
        "fp8": {"matmul": "kernels.quant.weight_only.fp8_weight_matmul"},
    },
}

SM90_BF16 = {
    "kernels": {
        "rms_norm": "kernels.elementwise.rms_norm_triton",
        "add_rms_norm": "kernels.elementwise.add_rms_norm_triton",
        "rms_norm_quant": "kernels.triton_elementwise.rms_norm_quant",
        "act_mul": "kernels.elementwise.act_mul_triton",
        "write_kv_cache": "kernels.triton_kv.write_kv_cache",
        "qkv_norm_rope_write": "kernels.attention.qkv_norm_rope_write_triton(separate=kernels.attention."
        "qkv_norm_rope_write_separate)",
        "paged_attention": "kernels.triton_attention.paged_attention",
        "varlen_attention": "kernels.triton_varlen_attention.varlen_attention",
        "rope_reads_tables": True,
        "decode_num_splits": "kernels.bind_triton._decode_num_splits",
        "qkv_project": "kernels.fused_projections.qkv_project_fused(separate=kernels.fused_projections."
        "qkv_project_separate)",
        "gate_up_act": "kernels.fused_projections.gate_up_act_fused(separate=kernels.fused_projections."
        "gate_up_act_separate)",
        "lm_head_logits": "kernels.fused_projections.lm_head_logits_fused",
        "embed_norm": "kernels.fused_projections.embed_norm_triton",
        "sample": "kernels.triton_sampling.gumbel_sample",
        "spill": "kernels.triton_sampling.spill_thresholds",
        "gather_in_place": "kernels.triton_sampling.gather_in_place",
        "moe_grouped_gemm": "kernels.triton_moe.grouped_gemm",
        "invariant_matmul": "kernels.bind_triton.invariant_linear",
        "lora_rows": None,
    },
    "linears": {
        "float": {"packing": "none"},
        "int8": {"matmul": "kernels.quant.triton_gemm.w8a16_linear"},
        "int4": {"matmul": "kernels.quant.triton_gemm.w4a16_linear"},
        "w8a8": {"matmul": "kernels.quant.linears.w8a8_linear_triton", "takes_quantized_rows": True},
        "w4a8": {"matmul": "kernels.quant.w4a8.w4a8_matmul"},
        "fp8": {
            "matmul": "kernels.quant.linears.fp8_linear_triton(wide=kernels.quant.weight_only.fp8_weight_matmul)",
            "takes_quantized_rows": True,
        },
    },
}

# An int8 or fp8 cache: the qkv GEMM is not fused (it writes a float cache only); the Triton qkv
# front end quantizes on its write, the attention dequantizes its tiles.
QUANTIZED_KV_ON_SM90 = {
    "qkv_project": "kernels.fused_projections.qkv_project_separate(qkv_norm_rope_write="
    "kernels.attention.qkv_norm_rope_write_triton)"
}
# Below sm_89 an fp8 cache takes the torch paths (no e4m3 in Triton there), and the decode splits none.
FP8_KV_ON_SM80 = {
    "write_kv_cache": "kernels.attention_torch.write_kv_cache_reference",
    "qkv_norm_rope_write": "kernels.attention.qkv_norm_rope_write_separate(rms_norm=kernels.elementwise."
    "rms_norm_triton, apply_rotary=kernels.elementwise.apply_rotary_reference, write_kv_cache=kernels."
    "attention_torch.write_kv_cache_reference)",
    "paged_attention": "kernels.cpu_attention.paged_attention_cpu(native=False)",
    "decode_num_splits": "kernels.bind_triton._one_split",
    "qkv_project": "kernels.fused_projections.qkv_project_separate(qkv_norm_rope_write=kernels.attention."
    "qkv_norm_rope_write_separate)",
}
FP8_LINEAR_ON_SM80 = {"matmul": "kernels.quant.weight_only.fp8_weight_matmul"}  # no fp8 tensor cores


def _described(target: DeviceTarget, kv_cache_dtype: str = "auto") -> dict:
    return bind_kernels(target, BF16, kv_cache_dtype=kv_cache_dtype).describe()


def test_cpu_bf16_kernel_set():
    got = _described(CPU_NATIVE)
    assert {k: got[k] for k in CPU_BF16} == CPU_BF16
    assert got["binder"] == "cpu" and got["target"]["name"] == "cpu" and got["tuning"]["source"] == "table"
    assert got["gguf"] == {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
    # without the native kernels (BATCHRUN_CPU_KERNELS=0, or no compiler): the torch ops, oneDNN's packing
    off = _described(dataclasses.replace(CPU_NATIVE, native_cpu_kernels=False))
    assert off["kernels"]["paged_attention"] == "kernels.cpu_attention.paged_attention_cpu(native=False)"
    assert off["kernels"]["rms_norm"] == "kernels.elementwise.rms_norm_reference"
    assert off["kernels"]["sample"] == "kernels.sampling.gumbel_sample_reference"
    assert off["linears"]["float"] == {"packing": "onednn"} and "packed_matmul" not in off["linears"]["w8a8"]
    assert off["linears"]["int4"] == CPU_BF16["linears"]["int4"]  # torch's own packed int4 kernel either way


def test_simulated_sm90_bf16_kernel_set():
    pytest.importorskip("triton")
    got = _described(SM90_SIMULATED)
    assert {k: got[k] for k in SM90_BF16} == SM90_BF16
    assert got["target"] == {
        "name": "sm_90 (simulated)",
        "device": "cpu",
        "capability": [9, 0],
        "num_sms": 132,
        "max_shared": 232448,
        "native_cpu_kernels": False,
        "triton": True,
    }
    assert got["binder"] == "triton" and got["kv_cache_dtype"] == "auto" and got["fuse"]
    unfused = bind_kernels(SM90_SIMULATED, BF16, fuse=False).describe()["kernels"]
    assert unfused["embed_norm"] is None and unfused["lm_head_logits"].endswith("lm_head_logits_separate")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_simulated_sm90_quantized_kv_kernel_sets(kv_cache_dtype):
    pytest.importorskip("triton")
    got = _described(SM90_SIMULATED, kv_cache_dtype)
    assert got["kernels"] == {**SM90_BF16["kernels"], **QUANTIZED_KV_ON_SM90}
    assert got["linears"] == SM90_BF16["linears"] and got["kv_cache_dtype"] == kv_cache_dtype


def test_an_fp8_kv_cache_below_sm89_takes_the_torch_attention():
    pytest.importorskip("triton")
    got = _described(SM80_SIMULATED, "fp8")
    assert got["kernels"] == {**SM90_BF16["kernels"], **FP8_KV_ON_SM80}
    assert got["linears"] == {**SM90_BF16["linears"], "fp8": FP8_LINEAR_ON_SM80}


def _engine_settings(tiny_llama_dir: str, simulate=None, **config):
    base = dict(dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20, warmup=False)
    engine = make_tiny_engine(
        tiny_llama_dir, simulate=simulate, **{**base, **config}
    )  # no step runs: nothing is interpreted
    return engine, engine.settings.as_dict()["kernels"]


def test_the_engine_records_its_kernel_set_in_its_settings(tiny_llama_dir):
    engine, kernels = _engine_settings(tiny_llama_dir, tune_kernels=False)  # measured: tests/engine/
    assert kernels == engine.model.kernels.describe()
    assert json.loads(json.dumps(kernels)) == kernels  # JSON as it is, for the manifest
    assert kernels["binder"] == "cpu" and kernels["tuning"] == {"source": "table", "fused": [], "tiles": []}


def test_int4_with_an_int8_kv_cache_on_sm90_and_its_tuned_tiles(tiny_llama_dir):
    """What serves "int4 + int8 KV on sm_90", through start-up: the W4A16 Triton GEMM with the
    tiles the start-up tuning chose per M bucket (the table's: nothing is timed off a GPU), the
    Triton attention over the int8 cache, the LM head fused with its float32 cast."""
    pytest.importorskip("triton")
    engine, kernels = _engine_settings(tiny_llama_dir, SM90, quantization="int4", kv_cache_dtype="int8")
    assert kernels["target"]["name"] == "sm_90 (simulated)" and kernels["kv_cache_dtype"] == "int8"
    assert kernels["kernels"] == {**SM90_BF16["kernels"], **QUANTIZED_KV_ON_SM90}
    assert kernels["linears"]["int4"] == {"matmul": "kernels.quant.triton_gemm.w4a16_linear"}
    tuning = kernels["tuning"]
    assert tuning["source"] == "table"
    # the tiny llama (hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, vocab 512): per
    # projection shape (N, K) and M bucket up to the 64-token budget, W4A16 in groups of 32
    tiles = {(t["kernel"], t["rows"], tuple(t["weight"])): t["tile"] for t in tuning["tiles"]}
    shapes = [(128, 64), (64, 64), (256, 64), (64, 128)]  # qkv, o, gate_up, down
    for n, k in shapes:
        block_k = 64 if k == 64 else 128  # the table's 128-deep steps, at most K's
        for rows in (16, 32, 64):
            assert tiles[("w4a16", rows, (n, k))] == f"{rows}x64x{block_k}, 4 warps, 3 stages", (n, k, rows)
    assert {t["group"] for t in tuning["tiles"] if t["kernel"] == "w4a16"} == {32}
    assert tiles[("logits", 16, (512, 64))] == "16x64x64, 4 warps, 3 stages"
    assert [(f["kind"], f["rows"], f["fused"]) for f in tuning["fused"]] == [
        ("logits", 16, True),
        ("logits", 32, True),
        ("logits", 64, True),
    ]  # the quantized projections and the int8 cache leave the LM head the one fused GEMM
