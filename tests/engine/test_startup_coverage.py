"""What engine start-up compiles and chooses before the first request, against what a run can reach,
on a simulated sm_90 (no GPU: nothing runs, the start-up phases only plan).

A timed phase of the GPU check (and a job's first steps) must not compile a Triton GEMM variant or
ask for a tuning choice that start-up did not make. So for an engine of each weight mode (bf16's
fused projections, int8's and int4's dequantize-GEMMs) the tuning cases are compared with an
enumeration written here: every (kernel, row bucket, weight shape) a step of 1 to
max_num_batched_tokens rows reaches, from the model's config (not from model/gemm_shapes.py). The
warm-up plan is compared with every tile bucket those row counts reach (a step's tokens for the
projections; its sequences for the LM head, up to max_num_seqs) and with every decode split count
a step can get, from max_model_len (not the model's max_position_embeddings). Then the same at the
GPU check's engine shapes (Qwen3-0.6B and Llama-3-8B, 256 sequences, 16384 tokens, sm_90): every
launch configuration a row count from 1 to the budget gets is one a warm-up step launches.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchrun.engine import startup, warmup  # noqa: E402
from batchrun.engine.config import EngineConfig  # noqa: E402
from batchrun.engine.warmup import WarmupStep, width_class  # noqa: E402
from batchrun.kernels import triton_attention  # noqa: E402
from batchrun.kernels.gemm_tiles import group_constexpr, w4a16_group  # noqa: E402
from batchrun.kernels.target import SM90  # noqa: E402
from batchrun.kernels.tuning import Tuning  # noqa: E402

BLOCK = 16
MAX_NUM_SEQS = 40  # decode steps reach the 16-, 32- and 64-row buckets
BUDGET = 600  # prefill steps reach every tile bucket and past the last (512 and 1024-row buckets)
MAX_MODEL_LEN = 2048  # the model allows 8192: split counts must come from 2048


def _bucket(m: int) -> int:
    """The row bucket of m rows, written out: 16, 32, 64, 128, 256, then powers of two."""
    for b in (16, 32, 64, 128, 256):
        if m <= b:
            return b
    b = 512
    while b < m:
        b *= 2
    return b


def _tile(m: int) -> tuple[int, bool]:
    """The tile a GEMM of m rows takes: its bucket up to 256, and whether it is past the last (then
    the 256 bucket's tile without split-K)."""
    return min(_bucket(m), 256), m > 256


def _rows(step: WarmupStep) -> tuple[int, int]:
    """(tokens: the projections' rows, sequences: the LM head's rows) of a warm-up step."""
    return sum(new for _, new in step.prefills) + len(step.decodes), len(step.prefills) + len(step.decodes)


def _start(tmp_path_factory, monkeypatch, quantization: str):
    """Start an engine of the tiny Qwen3-shaped model for a simulated sm_90 with warm-up on; return
    (the model's config, the tuning cases, the tuning, the warm-up plan run)."""
    from batchrun.testing import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("qwen3_8k"), "qwen3", max_position_embeddings=8192)
    cases: list = []
    plans: list = []
    real_table = startup.table_tuning

    def table_tuning(gpu, these):
        these = list(these)
        cases.extend(these)
        return real_table(gpu, these)

    monkeypatch.setattr(startup, "table_tuning", table_tuning)
    monkeypatch.setattr(warmup, "run_warmup", lambda runner, plan, num_blocks: plans.append(plan))
    config = EngineConfig(
        model=str(model),
        dtype="bfloat16",
        device="cpu",
        quantization=quantization,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=32 << 20,
        warmup=True,
    )
    parts = startup.start_engine(config, simulate=SM90)
    assert parts.kernels.target.name == "sm_90 (simulated)" and parts.kernels.binder == "triton"
    assert parts.kv_plan.max_model_len == MAX_MODEL_LEN
    (plan,) = plans
    return parts.target.hf_config, cases, parts.kernels.tuning, plan


def _expected_shapes(hf, quantization: str) -> set[tuple[str, int, int]]:
    """(kernel, N, K) of every GEMM a step runs through a tuned Triton kernel, from the config: a bf16
    model fuses qkv (+ norm, rotary, KV write), gate/up (+ SiLU) and the LM head; int8 and int4
    quantize every decoder projection (qkv, o, gate/up, down) and leave the LM head to fuse."""
    hidden, heads, kv_heads, head_dim = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim
    qkv = ((heads + 2 * kv_heads) * head_dim, hidden)
    logits = {("logits", hf.vocab_size, hidden)}
    if quantization == "none":
        return {("qkv", *qkv), ("silu_mul", 2 * hf.intermediate_size, hidden)} | logits
    kernel = {"int8": "w8a16", "int4": "w4a16"}[quantization]
    projections = [qkv, (hidden, heads * head_dim), (2 * hf.intermediate_size, hidden), (hidden, hf.intermediate_size)]
    return {(kernel, n, k) for n, k in projections} | logits


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_start_up_tunes_and_warms_every_gemm_bucket_a_run_can_reach(tmp_path_factory, monkeypatch, quantization):
    hf, cases, tuning, plan = _start(tmp_path_factory, monkeypatch, quantization)

    # tuning: one case per (kernel, row bucket, shape); fused kinds per row bucket, tile kernels per
    # tile bucket (past 256 rows they take the 256 bucket's)
    shapes = _expected_shapes(hf, quantization)
    reachable = {
        (kernel, _bucket(m) if kernel in ("qkv", "silu_mul", "logits") else _tile(m)[0], n, k)
        for kernel, n, k in shapes
        for m in range(1, BUDGET + 1)
    }
    got = [(c.shape.kernel, c.rows, c.shape.n, c.shape.k) for c in cases]
    assert len(got) == len(set(got)) and set(got) == reachable
    described = tuning.describe()
    fused = {(c["kind"], c["rows"], *c["weight"]) for c in described["fused"]}
    tiles = {(c["kernel"], c["rows"], *c["weight"]) for c in described["tiles"]}
    tile_kernel = {"qkv": "qkv_rope", "silu_mul": "silu_mul", "logits": "logits", "w8a16": "w8a16", "w4a16": "w4a16"}
    for kernel, rows, n, k in reachable:
        if kernel in ("qkv", "silu_mul", "logits"):
            assert (kernel, rows, n, k) in fused
        assert (tile_kernel[kernel], min(rows, 256), n, k) in tiles

    # warm-up: every tile a step's tokens reach (to the budget), and its sequences (to max_num_seqs)
    tokens = {_tile(_rows(s)[0]) for s in plan}
    sequences = {_tile(_rows(s)[1]) for s in plan}
    assert {_tile(m) for m in range(1, BUDGET + 1)} <= tokens
    assert {_tile(m) for m in range(1, MAX_NUM_SEQS + 1)} <= sequences
    assert all(_rows(s)[0] <= BUDGET and _rows(s)[1] <= MAX_NUM_SEQS for s in plan)

    # decode split counts: every (split count, table width class) a step gets up to max_model_len
    def split(n: int, blocks: int) -> int:
        return triton_attention.default_num_splits(n, hf.num_key_value_heads, blocks * BLOCK, SM90)

    def pairs(max_len: int, max_decodes: int) -> set[tuple[int, str]]:
        widths = range(1, max_len // BLOCK + 1)
        return {(split(n, w), width_class(w)) for n in range(1, max_decodes + 1) for w in widths}

    for kind, max_decodes in (("decode", MAX_NUM_SEQS), ("mixed", MAX_NUM_SEQS - 1)):
        steps = [s for s in plan if s.kind == kind]
        assert {(s.num_splits, width_class(s.table_blocks)) for s in steps} == pairs(MAX_MODEL_LEN, max_decodes)
        assert all(s.num_splits == split(len(s.decodes), s.table_blocks) for s in steps)
    assert max(s.table_blocks for s in plan) <= MAX_MODEL_LEN // BLOCK
    assert pairs(MAX_MODEL_LEN, MAX_NUM_SEQS) != pairs(hf.max_position_embeddings, MAX_NUM_SEQS)  # it would tell


# The GPU check's engines (benchmarks/gpu_engine.py) and the GEMM phase's shapes
QWEN3_0_6B = dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936)
LLAMA_3_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)


@pytest.mark.parametrize("model", [QWEN3_0_6B, LLAMA_3_8B], ids=["qwen3-0.6b", "llama-3-8b"])
def test_the_warm_up_launches_every_gemm_tile_a_run_gets_at_gpu_shapes(model):
    """Per Triton GEMM the launch configuration (tile, split-K) a step of m rows gets, for every m up
    to the token budget (the LM head: up to max_num_seqs sequences), is one a warm-up step of the
    GPU check's engine launches: with the tables' tiles nothing else compiles them (start-up tuning
    on a GPU also times each bucket's candidates, at the bucket's own row count)."""
    max_num_seqs, budget, max_model_len = 256, 16384, 4096
    hidden, inter = model["hidden"], model["intermediate"]
    q_size, qkv_n = model["heads"] * model["head_dim"], (model["heads"] + 2 * model["kv_heads"]) * model["head_dim"]

    def split(n: int, context: int) -> int:
        return triton_attention.default_num_splits(n, model["kv_heads"], context, SM90)

    plan = warmup.warmup_plan(BLOCK, max_model_len, budget, max_num_seqs, split)
    tokens = {_rows(s)[0] for s in plan}
    sequences = {_rows(s)[1] for s in plan}
    tuning = Tuning()  # the tables' choices: what a simulated GPU and engine.tune_kernels=false run
    bf16 = torch.bfloat16
    # (kernel, N, K, GROUP, rows a step can give it, whether split-K is its own: the fused GEMMs never split)
    gemms = [
        ("qkv_rope", qkv_n, hidden, 0, budget, False),
        ("silu_mul", 2 * inter, hidden, 0, budget, False),
        ("logits", model["vocab"], hidden, 0, max_num_seqs, False),
    ]
    for n, k in ((qkv_n, hidden), (hidden, q_size), (2 * inter, hidden), (hidden, inter)):
        gemms.append(("w8a16", n, k, group_constexpr(32, k), budget, True))
        gemms.append(("w4a16", n, k, w4a16_group(32, k), budget, True))

    def launched(gemm: tuple, m: int) -> tuple:
        kernel, n, k, group, _, splits = gemm
        c = tuning.tile(kernel, m, n, k, group, bf16, SM90)
        return (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.split_k if splits else 1)

    for gemm in gemms:
        warm = {launched(gemm, m) for m in (sequences if gemm[0] == "logits" else tokens)}
        missing = {launched(gemm, m) for m in range(1, gemm[4] + 1)} - warm
        assert not missing, (gemm, missing)


def test_measured_tuning_hands_its_scratch_memory_back_before_the_kv_cache_is_sized(monkeypatch):
    """Start-up tunes before it sizes the KV cache (tests/test_tuning.py checks the order), and the
    tuning's inputs and outputs must not stay reserved by torch's caching allocator, which
    torch.cuda.mem_get_info (the KV budget's free memory) counts as used: after the last case is
    timed the device is synchronized and the cache emptied. Timing and CUDA calls are stand-ins."""
    from batchrun.kernels import tuning
    from batchrun.kernels.target import DeviceTarget
    from batchrun.kernels.tuning import GemmShape, TuningCase

    events: list[str] = []
    monkeypatch.setattr(tuning, "_bench", lambda fn: float(fn()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))

    def case(kernel: str, rows: int) -> TuningCase:
        def prepare():
            events.append(f"{kernel} {rows}")
            return (lambda m, config: 1.0), (lambda m: 2.0)

        return TuningCase(GemmShape(kernel, 256, 64), rows, torch.bfloat16, prepare)

    gpu = DeviceTarget(torch.device("cuda", 0), SM90, False, False, True)  # a real GPU, as far as tuning sees
    result = tuning.measured_tuning(gpu, [case("silu_mul", 16), case("logits", 512)])
    assert result.source == "measured" and len(result.fused) == 2
    assert events == ["silu_mul 16", "logits 512", "synchronize", "empty_cache"]
