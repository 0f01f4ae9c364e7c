"""The Triton KV kernels address caches past 2**31 elements: offsets are int64, not int32.

A KV cache of one layer larger than 2**31 elements is an ordinary GPU size (tens of GiB), and an
int32 product such as `kv_head * stride_kh` wraps there into a negative offset (an illegal access
on the GPU). The test builds such a cache on the CPU without paying for it: `torch.empty` maps
virtual memory only, and the kernels touch only the pages of the few blocks a case uses. Three KV
heads with a head stride just over 2**30 put head 2 past 2**31, while every stride and every index
still fits in int32, which is exactly where an int32 product overflows. The case's blocks sit at the
far end of the cache; the same case on a small cache is the expected result (benchmarks.cases builds
both; the GPU check runs the same case compiled).

It runs in Triton's interpreter (TRITON_INTERPRET=1), where the kernels read memory through raw
addresses as compiled ones do: an overflowed offset reads or writes outside the cache (a crash or
wrong numbers). Each kernel runs in its own child process, so a crash fails its test alone.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.support.interpreted import interpreted_rows

pytest.importorskip("triton")

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 3, 16, 16  # three heads: benchmarks.cases.far_blocks_case puts head 2 past 2**31
SEQS = [(20, 1), (0, 5), (37, 1), (9, 6)]  # (cached tokens, new tokens): decodes and prefills


def run(kernel: str) -> None:
    from batchrun.kernels.attention_torch import paged_attention_reference, write_kv_cache_reference
    from batchrun.kernels.triton_attention import paged_attention
    from batchrun.kernels.triton_kv import write_kv_cache
    from benchmarks.cases import far_blocks_case

    far = far_blocks_case(SEQS, 6, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype=torch.float16, seed=3)
    c = far.small
    num_small = c.k_cache.shape[0]
    if kernel == "write":
        k_rows = torch.randn(c.k_new.shape).to(c.k_new.dtype)
        v_rows = torch.randn(c.v_new.shape).to(c.v_new.dtype)
        write_kv_cache_reference(c.k_cache, c.v_cache, k_rows, v_rows, c.meta.slot_mapping)
        write_kv_cache(far.k_cache, far.v_cache, k_rows, v_rows, far.meta.slot_mapping)
        torch.testing.assert_close(far.k_cache[far.num_blocks - num_small :], c.k_cache, rtol=0, atol=0)
        torch.testing.assert_close(far.v_cache[far.num_blocks - num_small :], c.v_cache, rtol=0, atol=0)
        return
    want = paged_attention_reference(c.q, c.k_cache, c.v_cache, c.meta, HEAD_DIM**-0.5)
    got = paged_attention(c.q, far.k_cache, far.v_cache, far.meta, HEAD_DIM**-0.5)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("kernel", ["write", "attention"])
def test_kernel_addresses_past_int32_interpreted(kernel):
    assert interpreted_rows(__file__, kernel)[-1] == {"kernel": kernel, "ok": True}


if __name__ == "__main__":
    run(sys.argv[1])
    print(json.dumps({"kernel": sys.argv[1], "ok": True}), flush=True)
