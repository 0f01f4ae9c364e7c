"""The Triton grouped GEMM equals the torch segment GEMM: in Triton's interpreter on CPU (small
sizes), and on a real GPU when one is present (`-m gpu`).

The interpreter check runs in a child process: TRITON_INTERPRET must be set before triton is first
imported, and in a pytest session some other module may already have imported it.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from tests.support.interpreted import interpreted_output

pytest.importorskip("triton")

from batchrun.kernels.moe import fused_experts, grouped_gemm_reference, sort_by_expert  # noqa: E402
from batchrun.model.moe import route  # noqa: E402


def _case(num_tokens, num_experts, top_k, hidden, inter, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, -1] = -30.0  # one expert gets no tokens: an empty segment
    weights, ids = route(logits, top_k, renormalize=True, weights_fp32=True)
    cast = dict(device=device, dtype=dtype)
    return x.to(**cast), gate_up.to(**cast), down.to(**cast), weights.to(device), ids.to(device)


def _interpreted_check(num_tokens: int) -> None:
    from batchrun.kernels.triton_moe import grouped_gemm

    x, gate_up, down, weights, ids = _case(num_tokens, num_experts=4, top_k=2, hidden=32, inter=24)
    d = sort_by_expert(ids, 4)
    assert d.tokens_per_expert[-1] == 0
    # Gathered rows (first GEMM), identity rows (second GEMM), N and K not multiples of the tiles.
    for a, b, row_ids in ((x, gate_up, d.sorted_token_ids), (torch.randn(2 * num_tokens, 24), down, None)):
        got = grouped_gemm(a, b, d.expert_offsets, row_ids, block_m=16, block_n=16, block_k=16)
        torch.testing.assert_close(got, grouped_gemm_reference(a, b, d.expert_offsets, row_ids), rtol=1e-5, atol=1e-5)
    got = fused_experts(x, gate_up, down, weights, ids, F.silu, grouped_gemm=grouped_gemm)
    want = fused_experts(x, gate_up, down, weights, ids, F.silu)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_grouped_gemm_matches_reference_interpreted():
    assert interpreted_output(__file__, "1", "21", timeout=120).strip() == "ok 1\nok 21"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_fused_experts_matches_reference_on_gpu(dtype, tol):
    from batchrun.kernels.triton_moe import grouped_gemm

    x, gate_up, down, weights, ids = _case(
        3000, num_experts=16, top_k=4, hidden=512, inter=384, device="cuda", dtype=dtype
    )
    got = fused_experts(x, gate_up, down, weights, ids, F.silu, grouped_gemm=grouped_gemm)
    want = fused_experts(x, gate_up, down, weights, ids, F.silu)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


if __name__ == "__main__":
    for n in sys.argv[1:]:
        _interpreted_check(int(n))
        print("ok", n)
