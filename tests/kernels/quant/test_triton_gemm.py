"""The Triton W8A16/W4A16 dequantize-GEMMs equal the torch references: in Triton's interpreter on
CPU tensors (small sizes), and on a real GPU when one is present (`-m gpu`), where the fp8 and
W8A8 paths and an int8/int4 engine are also checked.

The interpreter check runs in a child process: TRITON_INTERPRET must be set before triton is first
imported, and in a pytest session some other module may already have imported it.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.interpreted import interpreted_output

pytest.importorskip("triton")

from batchrun.kernels import quant as qk  # noqa: E402

# (rows, in_features, out_features, int8 group size or None for per channel, int4 group size):
# rows below and above one tile, K and N not multiples of the tiles, a group size no power of two.
_CASES = [
    (1, 64, 40, None, 32),
    (21, 96, 72, 32, 32),
    (5, 160, 48, None, 32),
    (3, 128, 64, 64, 64),
    (4, 96, 40, 48, 48),
]


def _check_all(device: str, dtype: torch.dtype, rtol: float, atol: float, **tiles) -> None:
    from batchrun.kernels.quant.triton_gemm import w4a16_matmul, w8a16_matmul

    gen = torch.Generator().manual_seed(0)
    for m, k, n, g8, g4 in _CASES:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = torch.randn(n, k, generator=gen) * 0.1
        bias = torch.randn(n, generator=gen).to(device, dtype)
        q, s = (t.to(device) for t in qk.quantize_int8(w, g8))
        want = qk.int8_weight_matmul(x.float(), q, s, bias.float())
        torch.testing.assert_close(w8a16_matmul(x, q, s, bias, **tiles).float(), want, rtol=rtol, atol=atol)
        q4, s4, z4 = (t.to(device) for t in qk.quantize_int4(w, g4))
        want = qk.int4_weight_matmul(x.float(), q4, s4, z4)
        torch.testing.assert_close(w4a16_matmul(x, q4, s4, z4, **tiles).float(), want, rtol=rtol, atol=atol)


def test_triton_quant_gemms_match_reference_interpreted():
    assert interpreted_output(__file__).strip() == "ok"


def test_the_tile_table_splits_k_only_where_few_tiles_would_leave_sms_idle():
    from batchrun.kernels.quant import triton_gemm as tg

    sms = 132  # an H100/H200
    # Qwen3-0.6B's o_proj at decode: 16 column tiles, K split 8 ways -> 128 programs
    assert tg.default_config(1, 1024, 2048, 32, sms).split_k == 8
    # Llama-3-8B's down projection: 64 tiles, 2 splits; gate/up: 448 tiles, no split
    assert tg.default_config(16, 4096, 14336, 32, sms).split_k == 2
    assert tg.default_config(16, 28672, 4096, 32, sms).split_k == 1
    # 256 rows of a narrow projection: 32 tiles of 64 x 128, split 4 ways; of a wide one: none
    assert tg.default_config(256, 1024, 2048, 32, sms).split_k == 4
    assert tg.default_config(200, 1024, 2048, 32, sms) == tg.default_config(256, 1024, 2048, 32, sms)  # per bucket
    assert tg.default_config(256, 28672, 4096, 32, sms).split_k == 1
    # a long prefill chunk (past the last bucket), or no GPU to size for: never split
    assert tg.default_config(257, 1024, 2048, 32, sms).split_k == 1
    assert tg.default_config(1, 1024, 2048, 32, None).split_k == 1
    assert {tg.m_bucket(m) for m in (1, 16)} == {16} and tg.m_bucket(17) == 32 and tg.m_bucket(4000) == 256
    # every tuning candidate keeps the table's split (timing never changes a run's sums)
    base = tg.default_config(1, 1024, 2048, 32, sms)
    assert {c.split_k for c in tg.candidates(base)} == {8}
    for group in (32, 64, 128, 256):
        for c in tg.candidates(base):
            bk = tg._fit(c, 1, 1024, 2048, group).block_k
            assert bk % group == 0 or group % bk == 0, (c, group)


def test_fastest_takes_the_quickest_config_that_runs():
    from batchrun.kernels.gemm_tiles import GemmConfig, fastest

    a, b, c = GemmConfig(16, 64, 128), GemmConfig(16, 32, 128), GemmConfig(16, 128, 256)
    times = {a: 3.0, b: 1.0}

    def time_ms(cfg):
        if cfg not in times:
            raise RuntimeError("out of shared memory")
        return times[cfg]

    assert fastest([a, b, c], time_ms) == (b, 1.0)
    assert fastest([c], time_ms) == (c, None)  # nothing runs: the table's choice stays, untimed


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_quant_gemms_match_reference_on_gpu(dtype):
    _check_all("cuda", dtype, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_w8a8_and_fp8_on_gpu():
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 256, device="cuda") * 0.05
    q, s = qk.quantize_int8(w)
    want = x.float() @ qk.dequantize_int8(q, s).T
    got = qk.w8a8_matmul(x, q, s).float()
    assert ((got - want).norm() / want.norm()).item() < 0.02
    got1 = qk.w8a8_matmul(x[:1], q, s).float()  # one row: padded past cuBLAS's 16-row minimum
    assert ((got1 - want[:1]).norm() / want[:1].norm()).item() < 0.02
    if torch.cuda.get_device_capability() >= (8, 9):
        q8, s8 = qk.quantize_fp8(w)
        want = x.float() @ qk.dequantize_fp8(q8, s8).T
        got = qk.fp8_scaled_matmul(x, q8, s8).float()
        assert ((got - want).norm() / want.norm()).item() < 0.08


@pytest.mark.gpu
def test_fused_activation_paths_and_torch_int4_on_gpu():
    """The GPU's 2- and 3-kernel fp8/W8A8 linears equal the torch references (bitwise where the
    interpreter test is: the quantization, W8A8 without float channels); torch's int4 kernel over
    our int4 weight (the GEMM benchmark's side-by-side) equals our reference."""
    from batchrun.kernels.quant import triton_act as ta
    from benchmarks.gpu_gemm import TorchInt4

    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 256, device="cuda") * 0.05
    q, s = qk.quantize_int8(w)
    xq, sx = ta.quantize_rows(x, torch.int8)
    want_q, want_s = qk.quantize_per_token_int8(x.cpu())
    assert torch.equal(xq.cpu(), want_q) and torch.equal(sx.cpu(), want_s)
    y = ta.w8a8_linear(x, q, s.reshape(-1))
    assert torch.equal(y.cpu(), qk.w8a8_matmul(x.cpu(), q.cpu(), s.cpu()))
    if torch.cuda.get_device_capability() >= (8, 9):
        q8, s8 = qk.quantize_fp8(w)
        xq8, sx8 = ta.quantize_rows(x, torch.float8_e4m3fn)
        want_q8, want_s8 = qk.quantize_per_token_fp8(x.cpu())
        assert torch.equal(xq8.cpu().view(torch.uint8), want_q8.view(torch.uint8)) and torch.equal(sx8.cpu(), want_s8)
        got = ta.fp8_linear(x, q8, s8.t()).float()
        want = qk.fp8_scaled_matmul(x, q8, s8).float()
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    wb = w.to(torch.bfloat16)
    q4, s4, z4 = qk.quantize_int4(wb, 32)
    got = TorchInt4(wb)(x).float()
    want = qk.int4_weight_matmul(x.float(), q4, s4, z4)
    assert ((got - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.gpu
def test_norm_that_quantizes_equals_norm_then_quantize_on_gpu():
    """Compiled, the RMSNorm's QUANT variant writes the unfused norm's rows and residual and
    quantize_rows' codes and scales of them, bitwise (the interpreter checks the same on the CPU:
    tests/model/test_quant_launches.py)."""
    from batchrun.kernels import triton_elementwise as tew
    from batchrun.kernels.quant import triton_act as ta
    from batchrun.kernels.quant.act import ActQuant

    h = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16) * 3
    res = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    res[1] = -h[1]  # a zero row: MIN_SCALE
    w = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
    skip = torch.zeros(4096, dtype=torch.bool, device="cuda")
    skip[::97] = True
    quants = [ActQuant(torch.int8, skip, ta.INT_MM_MIN_ROWS), ActQuant(torch.int8)]
    if torch.cuda.get_device_capability() >= (8, 9):
        quants.append(ActQuant(torch.float8_e4m3fn))
    for quant in quants:
        for residual in (res, None):
            r = None if residual is None else residual.clone()
            got, got_res = tew.rms_norm_quant(h.clone(), r, w, 1e-6, quant)
            if residual is None:
                want_x, want_res = tew.rms_norm(h, w, 1e-6), h
            else:
                want_x, want_res = tew.add_rms_norm(h.clone(), residual.clone(), w, 1e-6)
            want_q, want_s = ta.quantize_rows(want_x, quant.dtype, quant.skip, quant.min_rows)
            assert torch.equal(got.x, want_x) and torch.equal(got_res, want_res)
            assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8)), quant
            assert torch.equal(got.scale, want_s), quant


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8", "fp8"])
def test_quantized_engine_on_gpu(mode, smollm2_cache_dir):
    from batchrun.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(
        EngineConfig(
            device="cuda",
            dtype="bfloat16",
            quantization=mode,
            kv_cache_dtype="int8",
            kv_cache_memory=256 << 20,
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            cache_dir=smollm2_cache_dir,
        )
    )
    out = engine.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.finish_reason in ("stop", "length") and out.token_ids


def _split_order_reference(run, x, qweight, scales, mins, config, group) -> torch.Tensor:
    """What a split-K launch must give: each split's float32 partial (a one-split launch of the same
    tile over that split's K range, so the same dot products in the same order), summed in split
    order 0, 1, ... from zero, as the last split's program sums them."""
    from dataclasses import replace

    k = x.shape[1]
    steps = -(-k // config.block_k)
    k_split = -(-steps // config.split_k) * config.block_k  # triton_gemm._k_split: whole K steps per split
    one = replace(config, split_k=1)
    total = torch.zeros(x.shape[0], qweight.shape[0])
    for lo in range(0, k, k_split):
        hi = min(lo + k_split, k)
        cols = slice(lo // 2, hi // 2) if mins is not None else slice(lo, hi)  # int4: two k per byte
        groups = slice(lo // group, hi // group)
        args = [x[:, lo:hi].contiguous(), qweight[:, cols].contiguous(), scales[:, groups].contiguous()]
        if mins is not None:
            args.append(mins[:, groups].contiguous())
        total = total + run(*args, None, one)
    return total


def _check_split_k() -> None:
    """Split-K in one launch sums the splits' partials in split order: bitwise the partials of
    one-split launches over each K range added 0, 1, 2, ... (the order a reordering would change,
    with 3 and more splits), for shapes that split (a few rows, two row tiles, and 256 rows, where
    the table of a simulated sm_90 splits a narrow projection); the counters it takes tickets from
    are left at zero (the next launch, or a graph replay, starts clean), and a second run gives the
    same bits."""
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.quant import triton_gemm as tg
    from batchrun.kernels.target import SM90, find_target

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 1024, generator=gen) * 0.1
    q, s = qk.quantize_int8(w, 32)  # groups of 32: scales applied per group inside each split
    q4, s4, z4 = qk.quantize_int4(w, 32)
    for m, config in ((5, tg.GemmConfig(16, 32, 64, split_k=3)), (19, tg.GemmConfig(16, 32, 64, split_k=6))):
        x = torch.randn(m, 1024, generator=gen)
        got = tg.w8a16_matmul(x, q, s, None, config)
        assert torch.equal(got, _split_order_reference(tg.w8a16_matmul, x, q, s, None, config, 32)), m
        assert torch.equal(got, tg.w8a16_matmul(x, q, s, None, config))
        got4 = tg.w4a16_matmul(x, q4, s4, z4, None, config)
        assert torch.equal(got4, _split_order_reference(tg.w4a16_matmul, x, q4, s4, z4, config, 32)), m
        assert not tg._LOCKS[x.device].any(), "split-K counters not reset"
    # 256 rows through the int8 linear a simulated sm_90's kernel set binds: the table splits K 8 ways
    kernels = bind_kernels(find_target("cpu", simulate=SM90), torch.float32)
    config = kernels.tuning.tile("w8a16", 256, 40, 1024, 32, torch.float32, SM90)
    assert config.split_k == 8, config
    x = torch.randn(256, 1024, generator=gen)
    got = kernels.linear_int8.matmul(x, q, s, None, None)
    assert torch.equal(got, _split_order_reference(tg.w8a16_matmul, x, q, s, None, config, 32))
    assert not tg._LOCKS[x.device].any(), "split-K counters not reset"


if __name__ == "__main__":  # the interpreted check (TRITON_INTERPRET=1, see above)
    from batchrun.kernels.quant.triton_gemm import GemmConfig

    # the table's choice (no split off a GPU); steps of one group, of several (scales broadcast over
    # each group), and split K ranges
    for config in (None, GemmConfig(16, 32, 64, split_k=2)):
        _check_all("cpu", torch.float32, rtol=1e-5, atol=1e-5, config=config)
    _check_split_k()
    print("ok")
