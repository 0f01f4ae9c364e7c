"""The Triton KV-cache writes equal their torch references: the plain write and the write fused with
rotary embedding, in Triton's interpreter on CPU (one child process, see test_triton_attention.py
for why) and on a GPU when there is one (`-m gpu`).

q/k/v are strided views of one fused qkv projection, as the decoder makes them; one slot is -1 (the
CUDA-graph padding convention: nothing is written) and the reference is given the other rows only.
float32 must match exactly; bf16/fp16 within one rounding (the kernel rounds once, the reference after
each elementwise op).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from triton_child import interpreted_cases, report_cases

pytest.importorskip("triton")

_ON_GPU = torch.cuda.is_available()
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOLERANCES = {"float32": (0.0, 0.0), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}  # (rtol, atol)

CASES = {
    f"{dtype}-heads{heads}x{kv_heads}-dim{dim}-bs{bs}": dict(dtype=dtype, heads=heads, kv_heads=kv_heads, dim=dim, bs=bs)
    for dtype in ("float32", "bfloat16", "float16")
    for heads, kv_heads, dim, bs in ((4, 2, 16, 4), (3, 1, 24, 16))
}


def run_case(spec: dict[str, Any], device: str = "cpu", num_tokens: int = 9) -> None:
    from batchrun.kernels.attention import as_kv_cache_layout
    from batchrun.kernels.kv_layout import from_head_major
    from batchrun.kernels.triton_kv import (rotary_write_kv_cache, rotary_write_kv_cache_reference, write_kv_cache,
                                            write_kv_cache_reference)

    dtype, heads, kv_heads, dim, bs = (spec[k] for k in ("dtype", "heads", "kv_heads", "dim", "bs"))
    dtype = _DTYPES[dtype]
    gen = torch.Generator().manual_seed(heads * dim)
    num_blocks = -(-num_tokens // bs) + 2
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(num_tokens, heads, dim), k.view(num_tokens, kv_heads, dim), v.view(num_tokens, kv_heads, dim)
    angles = torch.randn(num_tokens, dim // 2, generator=gen)
    emb = torch.cat([angles, angles], dim=-1).to(device)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens].to(device)
    slots[2] = -1
    keep = slots >= 0

    def caches():  # in the engine's head-major layout, through the logical (blocks, block_size, heads, dim) view
        return [from_head_major(torch.randn(kv_heads, num_blocks, bs, dim, generator=gen).to(device, dtype))
                for _ in range(2)]

    want_k, want_v = caches()
    got_k, got_v = as_kv_cache_layout(want_k), as_kv_cache_layout(want_v)
    write_kv_cache_reference(want_k, want_v, k[keep], v[keep], slots[keep])
    write_kv_cache(got_k, got_v, k, v, slots)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)

    want_k, want_v = caches()
    got_k, got_v = as_kv_cache_layout(want_k), as_kv_cache_layout(want_v)
    want_q, want_kr = rotary_write_kv_cache_reference(q[keep], k[keep], v[keep], cos[keep], sin[keep], want_k, want_v,
                                                      slots[keep])
    got_q, got_kr = rotary_write_kv_cache(q, k, v, cos, sin, got_k, got_v, slots)
    rtol, atol = _TOLERANCES[spec["dtype"]]
    for got, want in ((got_q[keep], want_q), (got_kr[keep], want_kr), (got_k, want_k), (got_v, want_v)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    return interpreted_cases(__file__)


@pytest.mark.parametrize("case_id", list(CASES))
def test_triton_kv_write_matches_reference_interpreted(interpreted, case_id):
    assert case_id in interpreted, f"the child never reached {case_id}"
    assert interpreted[case_id]["ok"], interpreted[case_id]["msg"]


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case_id", list(CASES))
def test_triton_kv_write_matches_reference_on_gpu(case_id):
    run_case(CASES[case_id], "cuda", num_tokens=3000)


if __name__ == "__main__":
    report_cases(CASES, run_case)
