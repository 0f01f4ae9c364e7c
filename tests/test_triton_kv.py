"""The Triton KV-cache write equals its torch reference, bitwise, in Triton's interpreter on CPU (one
child process, see test_triton_attention.py for why) and on a GPU when there is one (`-m gpu`).

k/v are strided views of one fused qkv projection, as the decoder makes them; one slot is -1 (the
CUDA-graph padding convention: nothing is written) and the reference is given the other rows only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_child import interpreted_cases, report_cases

pytest.importorskip("triton")

_ON_GPU = torch.cuda.is_available()
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CASES = {
    f"{dtype}-heads{heads}x{kv_heads}-dim{dim}-bs{bs}": dict(
        dtype=dtype, heads=heads, kv_heads=kv_heads, dim=dim, bs=bs
    )
    for dtype in ("float32", "bfloat16", "float16")
    for heads, kv_heads, dim, bs in ((4, 2, 16, 4), (3, 1, 24, 16))
}


def run_case(spec: dict[str, Any], device: str = "cpu", num_tokens: int = 9) -> None:
    from batchrun.kernels.attention_torch import write_kv_cache_reference
    from batchrun.kernels.kv_layout import as_kv_cache_layout, from_head_major
    from batchrun.kernels.triton_kv import write_kv_cache

    dtype, heads, kv_heads, dim, bs = (spec[k] for k in ("dtype", "heads", "kv_heads", "dim", "bs"))
    dtype = _DTYPES[dtype]
    gen = torch.Generator().manual_seed(heads * dim)
    num_blocks = -(-num_tokens // bs) + 2
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k, v = k.view(num_tokens, kv_heads, dim), v.view(num_tokens, kv_heads, dim)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens].to(device)
    slots[2] = -1
    keep = slots >= 0

    def caches():  # in the engine's head-major layout, through the logical (blocks, block_size, heads, dim) view
        return [
            from_head_major(torch.randn(kv_heads, num_blocks, bs, dim, generator=gen).to(device, dtype))
            for _ in range(2)
        ]

    want_k, want_v = caches()
    got_k, got_v = as_kv_cache_layout(want_k), as_kv_cache_layout(want_v)
    write_kv_cache_reference(want_k, want_v, k[keep], v[keep], slots[keep])
    write_kv_cache(got_k, got_v, k, v, slots)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)


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
