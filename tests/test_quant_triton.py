"""The Triton W8A16/W4A16 dequantize-GEMMs equal the torch references: in Triton's interpreter on
CPU tensors (small sizes), and on a real GPU when one is present (`-m gpu`), where the fp8 and
W8A8 paths and an int8/int4 engine are also checked.

The interpreter check runs in a child process: TRITON_INTERPRET must be set before triton is first
imported, and in a pytest session some other module may already have imported it.
"""

from __future__ import annotations

import pytest
import torch
from triton_child import run_interpreted

pytest.importorskip("triton")

from batchrun.kernels import quant as qk  # noqa: E402

_ON_GPU = torch.cuda.is_available()
# (rows, in_features, out_features, int8 group size or None for per channel, int4 group size):
# rows below and above one tile, K and N not multiples of the tiles.
_CASES = [(1, 64, 40, None, 32), (21, 96, 72, 32, 32), (5, 160, 48, None, 32), (3, 128, 64, 64, 64)]


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
    proc = run_interpreted(__file__)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_quant_gemms_match_reference_on_gpu(dtype):
    _check_all("cuda", dtype, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
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
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
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


if __name__ == "__main__":  # the interpreted check (TRITON_INTERPRET=1, see above)
    _check_all("cpu", torch.float32, rtol=1e-5, atol=1e-5, block_n=32, block_k=32)
    print("ok")
