"""Every Triton kernel compiles for an H100/H200 (sm_90), checked on a machine without a GPU.

The interpreter tests (tests/kernels/test_triton_*.py) check the kernels' numbers but never lower them, so
a kernel that only fails in the compiler (a tl type mismatch, a constexpr misuse, float8 on an
architecture without it, shared memory past the GPU's limit) would pass them. Here every kernel is
compiled ahead of time for sm_90 (kernels/triton_aot.py: compile_only) through the launchers a run
calls, with the tile sizes, warps and split counts they pick on an H200 (benchmarks/compile_cases.py:
the fast set; `python -m benchmarks.triton_compile` compiles every case). Triton's on-disk
cache keeps a rerun quick. On sm_89 (99 KB of shared memory per block) a few attention launches
check that the launchers shrink their tiles to fit, with the estimate they choose by bounding the
compiled figure.

Spills are a speed problem, not an error: bf16 and fp16 variants (what runs on a GPU) must not
spill past SPILL_BOUND_BYTES; float32 variants are reported, not bounded (some spill: the IEEE
float32 dots take no tensor cores and hold their tiles in registers).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from batchrun.kernels import triton_aot  # noqa: E402
from batchrun.kernels.binding import bind_kernels  # noqa: E402
from batchrun.kernels.target import GpuTarget, find_target  # noqa: E402
from benchmarks import compile_counts  # noqa: E402
from benchmarks.cases import attention_case  # noqa: E402
from benchmarks.compile_cases import compile_cases, launch_cases  # noqa: E402
from tests.support import REPO

SPILL_BOUND_BYTES = 64  # local memory per thread a bf16/fp16 variant may use: a small stack frame, no real spills

if triton_aot.triton_supported() is not None:
    pytestmark = pytest.mark.skip(reason=triton_aot.triton_supported())
elif compile_counts.interpreted():
    pytestmark = pytest.mark.skip(reason="under TRITON_INTERPRET the kernels are not JITFunctions")


@pytest.fixture(scope="module")
def sm90() -> triton_aot.CompileLog:
    return compile_cases(90, launch_cases())


def _describe(v: triton_aot.CompiledVariant) -> str:
    return f"{v.name} ({v.label}): {v.error}"


def _first_pointer_dtype(v: triton_aot.CompiledVariant) -> str:
    return next(t for t in v.signature.values() if t.startswith("*"))[1:]


def test_every_kernel_compiles_for_sm90(sm90):
    assert not sm90.failures, "\n".join(_describe(v) for v in sm90.failures)
    every_kernel = {f"batchrun.kernels.{name}" for name in compile_counts.entry_kernels()}
    assert every_kernel - sm90.kernels() == set(), "kernels the cases never launch"


def test_the_cases_cover_the_variants_a_run_uses(sm90):
    """Coverage of the case set itself, so that trimming it fails here instead of silently
    compiling less."""
    decode = sm90.of("_decode_kernel")
    assert {v.constexprs["IS_SPLIT"] for v in decode} == {True, False}  # one split and several
    assert {v.constexprs["HAS_Q_ROWS"] for v in decode} == {True, False}  # mixed and pure-decode steps
    assert {v.constexprs["HEAD_DIM"] for v in decode} >= {64, 128, 256}
    assert any(v.constexprs["GROUP"] > 1 for v in decode)  # GQA
    assert any(v.constexprs["HAS_WINDOW"] for v in decode)
    for name in ("_decode_kernel", "_prefill_kernel", "_qkv_kernel", "_write_kv_kernel"):
        caches = {v.signature["k_cache_ptr"] for v in sm90.of(name)}
        assert {"*i8", "*fp8e4nv"} <= caches, (name, caches)  # int8 and fp8 caches
    for name in ("_decode_kernel", "_prefill_kernel", "_rms_norm_kernel", "_w8a16_kernel", "_w4a16_kernel"):
        assert {_first_pointer_dtype(v) for v in sm90.of(name)} >= {"bf16", "fp32"}, name
    assert "fp16" in {_first_pointer_dtype(v) for v in sm90.of("_prefill_kernel")}
    assert len(sm90.of("_merge_splits_kernel")) >= 2
    # engine.batch_invariant's matmul: every dtype and column-tile width, one variant per weight shape
    # whatever the row count (M = 1, 16 and 37 launch each)
    invariant = sm90.of("_invariant_matmul_kernel")
    assert {_first_pointer_dtype(v) for v in invariant} == {"bf16", "fp16", "fp32"}
    assert {v.constexprs["BLOCK_N"] for v in invariant if _first_pointer_dtype(v) == "bf16"} == {32, 64, 128}
    launches = [(v.label, v.launches) for v in invariant]
    assert all(v.launches % 3 == 0 and "M" not in v.constexprs for v in invariant), launches
    # the decoder's rotary: cos/sin tables read at each token's position
    assert {v.constexprs["HAS_POSITIONS"] for v in sm90.of("_qkv_kernel")} == {True}
    # the norms that quantize for the fp8 / W8A8 linears: both codes, with and without a residual
    norm_quant = {
        (v.signature["q_ptr"], v.constexprs["HAS_RESIDUAL"], v.constexprs["HAS_SKIP"])
        for v in sm90.of("_rms_norm_kernel")
        if v.constexprs["QUANT"] and _first_pointer_dtype(v) == "bf16"
    }
    assert {("*i8", True, True), ("*i8", False, False), ("*fp8e4nv", True, False), ("*fp8e4nv", False, False)} <= (
        norm_quant
    ), norm_quant
    # the H200's tile sizes, not the interpreter's
    assert {v.constexprs["BLOCK_N"] for v in decode} == {64, 128}  # decode_tiles() on sm_90: 64 for wide K rows
    assert {v.constexprs["GROUP_PAD"] for v in decode} == {16}


def test_production_dtypes_do_not_spill_on_sm90(sm90):
    if any(v.n_regs is None for v in sm90.variants):
        pytest.skip("no cuobjdump: register and local-memory counts unknown")
    spilling = [
        f"{v.name} ({v.label}): {v.n_regs} registers, {v.n_spills} B local"
        for v in sm90.variants
        if _first_pointer_dtype(v) in ("bf16", "fp16") and v.n_spills > SPILL_BOUND_BYTES
    ]
    assert not spilling, "\n".join(spilling)
    assert all(v.n_regs <= 255 and v.shared <= triton_aot.ARCHS[90].max_shared for v in sm90.variants)


def _estimate(v: triton_aot.CompiledVariant) -> int:
    """triton_attention.shared_bytes for a compiled attention variant, from its constexprs."""
    from batchrun.kernels import triton_attention as ta

    c = v.constexprs
    prefill = v.name == "_prefill_kernel"
    return ta.shared_bytes(
        GpuTarget((v.arch // 10, v.arch % 10), 1, triton_aot.ARCHS[v.arch].max_shared),
        c["BLOCK_M"] if prefill else c["GROUP_PAD"],
        c["BLOCK_N"],
        c["HEAD_DIM_PAD"],
        v.num_stages,
        4 if _first_pointer_dtype(v) == "fp32" else 2,
        c["IS_QUANT"],
        prefill,
    )


def _estimates_bound_the_compiler(compile_log: triton_aot.CompileLog) -> list[str]:
    """Attention variants whose compiled shared memory passes the launchers' estimate, which the
    tile choice relies on being an upper bound."""
    variants = compile_log.of("_decode_kernel") + compile_log.of("_prefill_kernel")
    return [f"{v.name} ({v.label}): {v.shared} B > {_estimate(v)} B" for v in variants if v.shared > _estimate(v)]


def test_attention_shared_memory_estimate_bounds_sm90(sm90):
    assert not _estimates_bound_the_compiler(sm90)


def test_attention_tiles_shrink_to_fit_sm89_shared_memory():
    """An L40S/RTX 4090 (sm_89) has 99 KB of shared memory per block: the default 64x64 prefill
    tiles pass it at bf16 head_dim 256 (Gemma 2/3) and float32 head_dim 128, so the launcher takes
    smaller ones there, and keeps the defaults where they fit (bf16 head_dim 128)."""
    from batchrun.kernels import triton_attention as ta

    with triton_aot.compile_only(89) as log:
        for head_dim, dtype in ((256, torch.bfloat16), (128, torch.float32), (128, torch.bfloat16)):
            c = attention_case([(0, 9)], 4, 2, head_dim, 16, dtype)  # one prefill, no decodes
            m = c.meta
            starts, seq_lens = torch.tensor(m.query_start_loc), torch.tensor(m.seq_lens)
            ids = torch.tensor(m.prefill_seq_ids)
            ta.prefill_attention(
                c.q, c.k_cache, c.v_cache, m.block_tables, starts, seq_lens, ids, 9, 0.1, gpu=log.target.gpu
            )
    assert not log.failures, "\n".join(_describe(v) for v in log.failures)
    assert not _estimates_bound_the_compiler(log)
    tiles = {
        (v.constexprs["HEAD_DIM"], _first_pointer_dtype(v)): (v.constexprs["BLOCK_M"], v.constexprs["BLOCK_N"])
        for v in log.of("_prefill_kernel")
    }
    assert tiles[(128, "bf16")] == (64, 64)
    assert tiles[(256, "bf16")] != (64, 64) and tiles[(128, "fp32")] != (64, 64)


def _padded(table: torch.Tensor, width: int) -> torch.Tensor:
    """The block table as a step with a longer context elsewhere in the batch pads it: (num_seqs, width)."""
    out = torch.zeros(table.shape[0], width, dtype=table.dtype)
    out[:, : table.shape[1]] = table
    return out


def test_ints_marked_do_not_specialize_compile_no_new_variants():
    """Block-table width, split count and GEMM token count change from step to step; each value
    class (1, divisible by 16, other) must not compile a variant of its own in the middle of a run."""
    from batchrun.kernels import triton_attention as ta
    from batchrun.kernels.quant import quantize_int4, quantize_int8
    from batchrun.kernels.quant.triton_gemm import w4a16_matmul, w8a16_matmul

    c = attention_case([(3, 1), (9, 1), (4, 6)], 4, 2, 64, 16, torch.bfloat16)  # every context in one block
    m = c.meta
    assert m.block_tables.shape[1] == 1
    starts, seq_lens = torch.tensor(m.query_start_loc), torch.tensor(m.seq_lens)
    prefill_ids = torch.tensor(m.prefill_seq_ids)
    qw8, s8 = quantize_int8(torch.randn(64, 128), None)
    qw4, s4, mins4 = quantize_int4(torch.randn(64, 128), 32)

    with triton_aot.compile_only(90) as log:
        gpu = log.target.gpu

        def decode(table: torch.Tensor, num_splits: int) -> None:
            ids, lens = m.decode_seq_ids, m.decode_seq_lens
            ta.decode_attention(c.q, c.k_cache, c.v_cache, table, ids, lens, 0.1, num_splits=num_splits, gpu=gpu)

        for width in (1, 16, 17, 48):
            table = _padded(m.block_tables, width)
            decode(table, 2)
            ta.prefill_attention(c.q, c.k_cache, c.v_cache, table, starts, seq_lens, prefill_ids, 6, 0.1, gpu=gpu)
        for num_splits in (9, 12, 16):  # one SPLITS_PAD (16)
            decode(m.block_tables, num_splits)
        for tokens in (1, 7, 16):  # one BLOCK_M (16)
            x = torch.randn(tokens, 128, dtype=torch.bfloat16)
            w8a16_matmul(x, qw8, s8, gpu=gpu)
            w4a16_matmul(x, qw4, s4, mins4, gpu=gpu)
    assert not log.failures, "\n".join(_describe(v) for v in log.failures)
    launches = {name: [v.launches for v in log.of(name)] for name in ("_prefill_kernel", "_w8a16_kernel")}
    assert launches == {"_prefill_kernel": [4], "_w8a16_kernel": [3]}
    assert [v.launches for v in log.of("_w4a16_kernel")] == [3]
    # two splits, then 9..16: the decode kernel takes the split count from the grid only
    assert [v.launches for v in log.of("_decode_kernel")] == [7]
    assert sorted((v.constexprs["SPLITS_PAD"], v.launches) for v in log.of("_merge_splits_kernel")) == [(2, 4), (16, 3)]


def test_an_int_left_to_specialize_compiles_a_variant_per_value_class():
    """The check above can fail: without do_not_specialize, 1, a multiple of 16 and any other int
    are three variants (Triton folds 1 into a constant and marks multiples of 16)."""
    import triton
    import triton.language as tl

    @triton.jit
    def specialized(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    @triton.jit(do_not_specialize=["n"])
    def unspecialized(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(64)
    with triton_aot.compile_only(90) as log:
        for n in (1, 16, 17):
            specialized[(1,)](x, n, BLOCK=64)
            unspecialized[(1,)](x, n, BLOCK=64)
    assert [v.launches for v in log.of("specialized")] == [1, 1, 1]
    assert [v.constexprs.get("n") for v in log.of("specialized")] == [1, None, None]
    assert [v.divisible_by_16 for v in log.of("specialized")][1:] == [["x_ptr", "n"], ["x_ptr"]]
    assert [v.launches for v in log.of("unspecialized")] == [3]


def test_fp8_caches_compile_for_sm90_and_are_refused_below_sm89(sm90):
    """sm_80 has no e4m3 conversions: its kernel set sends an fp8 cache to the torch path there, and
    a launch forced past it does not compile."""
    from batchrun.kernels import triton_attention as ta

    fp8 = [v for v in sm90.of("_decode_kernel") if v.signature["k_cache_ptr"] == "*fp8e4nv"]
    assert fp8 and all(v.ok for v in fp8)
    c = attention_case([(5, 1), (0, 9)], 4, 2, 64, 16, torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn)
    with triton_aot.compile_only(80) as log:
        gpu = log.target.gpu
        assert gpu is not None and not gpu.has_fp8
        kernels = bind_kernels(log.target, torch.bfloat16, kv_cache_dtype="fp8")
        kernels.paged_attention(c.q, c.k_cache, c.v_cache, c.meta, 0.125)  # runs on the torch path
        assert log.variants == []
        m = c.meta
        ta.decode_attention(
            c.q, c.k_cache, c.v_cache, m.block_tables, m.decode_seq_ids, m.decode_seq_lens, 0.125, gpu=gpu
        )
    (v,) = log.of("_decode_kernel")
    assert not v.ok and "fp8e4nv" in v.error


def test_the_simulated_gpu_is_a_value_compile_only_hands_out():
    with triton_aot.compile_only(90) as log:
        assert log.target.gpu == GpuTarget((9, 0), 132, triton_aot.ARCHS[90].max_shared)
        assert log.target.is_simulated and log.target.name == "sm_90 (simulated)"
        assert bind_kernels(log.target, torch.bfloat16).binder == "triton"
        # nothing process-wide: the CPU's target, found meanwhile, is still the CPU's
        assert find_target("cpu").gpu is None and bind_kernels(find_target("cpu"), torch.bfloat16).binder == "cpu"


def test_the_benchmark_script_prints_a_row_per_variant(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.triton_compile", "--fast", "--only", "kv write bf16"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("_write_kv_kernel")]
    assert len(rows) == 3, proc.stdout  # float, int8 and fp8 caches
    assert all("sm_90" in r and "ok" in r for r in rows), proc.stdout
