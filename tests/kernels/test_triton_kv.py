"""The Triton KV-cache write equals its torch reference, bitwise, in Triton's interpreter on CPU (one
child process, see tests/kernels/test_triton_attention.py for why) and on a GPU when there is one (`-m gpu`).

k/v are strided views of one fused qkv projection, as the decoder makes them; one slot is -1 (the
CUDA-graph padding convention: nothing is written) and the reference is given the other rows only.

Into an int8/fp8 cache (QuantizedKVCache) the reference is the cache's own torch write
(quantize_kv), bitwise in data and scales. Besides random rows of very different magnitudes (down
to rows whose scale is clamped at MIN_SCALE) some rows are made so that x / scale lands exactly
halfway between two int8 or e4m3 values, where only round-half-to-even gives torch's bytes, and
on e4m3's subnormals and on -0.0.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.interpreted import interpreted_and_on_gpu, report_cases, unary_minus_as_subtraction

pytest.importorskip("triton")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CASES = {
    f"{dtype}-heads{heads}x{kv_heads}-dim{dim}-bs{bs}": dict(
        dtype=dtype, heads=heads, kv_heads=kv_heads, dim=dim, bs=bs
    )
    for dtype in ("float32", "bfloat16", "float16")
    for heads, kv_heads, dim, bs in ((4, 2, 16, 4), (3, 1, 24, 16))
}
for _kv in ("int8", "fp8"):
    for _dtype, (_heads, _kv_heads, _dim, _bs) in (("bfloat16", (4, 2, 16, 4)), ("float32", (3, 1, 24, 16))):
        CASES[f"{_kv}-{_dtype}-heads{_heads}x{_kv_heads}-dim{_dim}-bs{_bs}"] = dict(
            dtype=_dtype, heads=_heads, kv_heads=_kv_heads, dim=_dim, bs=_bs, kv=_kv
        )
# e4m3 keeps the sign of entries that round to zero whatever Triton's unary minus does (see
# tests/support/interpreted.py: unary_minus_as_subtraction): checked where Triton compiles `-x` as `0 - x`.
for _dtype, (_heads, _kv_heads, _dim, _bs) in (("bfloat16", (4, 2, 16, 4)), ("float32", (3, 1, 24, 16))):
    CASES[f"fp8-{_dtype}-heads{_heads}x{_kv_heads}-dim{_dim}-bs{_bs}-minus-as-sub"] = dict(
        dtype=_dtype, heads=_heads, kv_heads=_kv_heads, dim=_dim, bs=_bs, kv="fp8", minus_as_sub=True
    )

# Rows whose amax makes the scale exactly 1 (127 for int8, 448 for fp8), so every other entry is
# x / scale as written: ties between two int8 values, and for e4m3 ties in a binade with step 2,
# at the subnormals' step 2**-9, below the smallest subnormal, and -0.0.
_TIE_ROWS = {
    "int8": [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 3.25],
    "fp8": [448.0, 17.0, -19.0, 2.0**-10, -(2.0**-10), 3 * 2.0**-10, -(2.0**-12), -0.0],
}


def _tie_rows(x: torch.Tensor, kv: str) -> None:
    """Overwrite x's first two tokens' heads (num_tokens, heads, dim) with the tie rows, in place."""
    row = torch.tensor(_TIE_ROWS[kv])
    n = min(x.shape[-1], row.numel())
    x[:2, :, :n] = row[:n].to(x.dtype)
    x[:2, :, n:] = 0.0


def run_case(spec: dict[str, Any], device: str = "cpu", num_tokens: int = 9) -> None:
    if spec.get("minus_as_sub"):
        if device != "cpu":
            return  # compiled, `-x` is whatever this Triton makes of it: the plain case covers that
        with unary_minus_as_subtraction():
            return run_case({k: v for k, v in spec.items() if k != "minus_as_sub"}, device, num_tokens)
    from batchrun.kernels.attention_torch import write_kv_cache_reference
    from batchrun.kernels.kv_layout import as_kv_cache_layout, from_head_major
    from batchrun.kernels.triton_kv import write_kv_cache

    dtype, heads, kv_heads, dim, bs = (spec[k] for k in ("dtype", "heads", "kv_heads", "dim", "bs"))
    dtype = _DTYPES[dtype]
    gen = torch.Generator().manual_seed(heads * dim)
    num_blocks = -(-num_tokens // bs) + 2
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    qkv *= torch.logspace(-13, 3, num_tokens)[torch.randperm(num_tokens, generator=gen), None]
    qkv = qkv.to(device, dtype)
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k, v = k.view(num_tokens, kv_heads, dim), v.view(num_tokens, kv_heads, dim)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens].to(device)
    slots[2] = -1
    keep = slots >= 0
    if "kv" in spec:
        return _quantized_case(spec["kv"], dtype, k, v, slots, (num_blocks, bs, kv_heads, dim))

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


def _quantized_case(kv: str, out_dtype: torch.dtype, k, v, slots, shape) -> None:
    from batchrun.kernels.quant.kv import KV_CACHE_DTYPES, QuantizedKVCache
    from batchrun.kernels.triton_kv import write_kv_cache

    _tie_rows(k, kv)
    _tie_rows(v, kv)
    k[3, 0, 1] = -0.0
    num_slots = shape[0] * shape[1]
    prior = torch.randn(num_slots, *shape[2:], generator=torch.Generator().manual_seed(7)).to(k.device, out_dtype)

    def cache() -> QuantizedKVCache:  # holding earlier entries, which the -1 row must leave alone
        c = QuantizedKVCache.empty(shape, KV_CACHE_DTYPES[kv], out_dtype, k.device)
        c.write(prior, torch.arange(num_slots, device=k.device))
        return c

    want_k, want_v, got_k, got_v = cache(), cache(), cache(), cache()
    keep = slots >= 0
    want_k.write(k[keep], slots[keep])
    want_v.write(v[keep], slots[keep])
    write_kv_cache(got_k, got_v, k, v, slots)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (got.data, want.data)
        torch.testing.assert_close(got.scale, want.scale, rtol=0, atol=0)


test_triton_kv_write_matches_reference_interpreted, test_triton_kv_write_matches_reference_on_gpu = (
    interpreted_and_on_gpu(CASES, lambda spec: run_case(spec, "cuda", num_tokens=3000))
)


if __name__ == "__main__":
    report_cases(CASES, run_case)
