"""The fused Triton elementwise kernels equal their torch references: add+RMSNorm and RMSNorm
(Gemma's (1 + w) too, and on strided head views), silu(gate) * up, and q/k-norm + rotary + KV write.
In Triton's interpreter on CPU (one child process, see tests/kernels/test_triton_attention.py for why), and on a
GPU when there is one (`-m gpu`).

The qkv cases take q, k and v from one fused projection row as the decoder does, write into the
engine's head-major cache, and give one token slot -1 (the CUDA-graph padding convention: nothing is
written; the reference is given the other rows only). Tolerances: the kernels round to the dtype
where the references do, so float32 and float16 agree to their rounding and bf16 to about one unit
in the last place: rsqrt's and exp's last bits may tip a rounding, and Triton's interpreter casts
float32 to bf16 by truncating (numpy has no bf16; compiled kernels round to nearest even).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.interpreted import interpreted_and_on_gpu, report_cases, unary_minus_as_subtraction

pytest.importorskip("triton")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOL = {"float32": (1e-5, 1e-5), "bfloat16": (1.6e-2, 1e-2), "float16": (2e-3, 2e-3)}  # (rtol, atol)


def _cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    for dtype in ("float32", "bfloat16"):
        cases[f"rms_norm-{dtype}"] = dict(op="rms_norm", dtype=dtype, n=48, gemma=False)
        cases[f"rms_norm-gemma-{dtype}"] = dict(op="rms_norm", dtype=dtype, n=48, gemma=True)
        cases[f"rms_norm-heads-{dtype}"] = dict(op="rms_norm_heads", dtype=dtype, n=16, gemma=False)
        cases[f"add_rms_norm-{dtype}"] = dict(op="add_rms_norm", dtype=dtype, n=40, gemma=False)
        cases[f"silu_mul-{dtype}"] = dict(op="silu_mul", dtype=dtype, n=40)
    cases["silu_mul-wide-bfloat16"] = dict(op="silu_mul", dtype="bfloat16", n=1100)  # two column blocks
    for dtype in ("float32", "bfloat16", "float16"):
        for norm in ("none", "plain", "gemma"):
            cases[f"qkv-{norm}-{dtype}"] = dict(op="qkv", dtype=dtype, norm=norm, heads=4, kv_heads=2, dim=16, bs=4)
    cases["qkv-plain-mqa3-dim24-float32"] = dict(
        op="qkv", dtype="float32", norm="plain", heads=3, kv_heads=1, dim=24, bs=16
    )
    # Into an int8/fp8 cache (engine.kv_cache_dtype), the whole head quantized in the kernel.
    quant = dict(op="qkv", heads=4, kv_heads=2, dim=16, bs=4)
    cases["qkv-plain-int8-bfloat16"] = {**quant, "dtype": "bfloat16", "norm": "plain", "kv": "int8"}
    cases["qkv-none-fp8-bfloat16"] = {**quant, "dtype": "bfloat16", "norm": "none", "kv": "fp8"}
    cases["qkv-gemma-fp8-float32"] = {**quant, "dtype": "float32", "norm": "gemma", "kv": "fp8"}
    cases["qkv-plain-int8-mqa3-dim24-float16"] = dict(
        op="qkv", dtype="float16", norm="plain", heads=3, kv_heads=1, dim=24, bs=16, kv="int8"
    )
    # Signs of zero: V entries so small they round to -0.0 in e4m3, and a K head whose rotation at
    # angle 0 is -0.0 + -(+0.0) * 0, all under Triton's `-x` as `0 - x` (how it compiles up to 3.6).
    cases["qkv-none-fp8-float32-minus-as-sub"] = {
        **quant,
        "dtype": "float32",
        "norm": "none",
        "kv": "fp8",
        "zeros": True,
        "minus_as_sub": True,
    }
    return cases


CASES = _cases()


def _qkv_case(spec: dict[str, Any], device: str, num_tokens: int) -> None:
    from batchrun.kernels.attention_torch import qkv_norm_rope_write_reference
    from batchrun.kernels.kv_layout import as_kv_cache_layout, from_head_major
    from batchrun.kernels.qkv_heads import QKVHeads
    from batchrun.kernels.triton_elementwise import qkv_norm_rope_write

    dtype = _DTYPES[spec["dtype"]]
    heads, kv_heads, dim, bs = spec["heads"], spec["kv_heads"], spec["dim"], spec["bs"]
    gen = torch.Generator().manual_seed(heads * dim + len(spec["norm"]))

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen).to(device, dtype)

    qkv = randn(num_tokens, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(num_tokens, dim // 2, generator=gen) * 6.0
    if spec.get("zeros"):
        k0, v0 = heads * dim, (heads + kv_heads) * dim  # token 0's first K head; every token's V heads
        qkv[0, k0], qkv[0, k0 + dim // 2], angles[0, 0] = -0.0, 0.0, 0.0
        qkv[:, v0 + 1 :: dim] = -1e-7 * qkv[:, v0:].abs().amax()
    emb = torch.cat((angles, angles), dim=-1)  # (num_tokens, dim), rotary's layout
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    q_norm = k_norm = None
    if spec["norm"] != "none":
        q_norm, k_norm = randn(dim) * 0.5 + 1.0, randn(dim) * 0.5 + 1.0
    gemma = spec["norm"] == "gemma"
    num_blocks = -(-num_tokens // bs) + 2
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens].to(device)
    slots[1] = -1
    keep = slots >= 0
    want_k, want_v = (from_head_major(randn(kv_heads, num_blocks, bs, dim)) for _ in range(2))
    got_k, got_v = as_kv_cache_layout(want_k), as_kv_cache_layout(want_v)
    # The reference writes every row, so it writes into a scratch copy; the expected cache holds the
    # kept rows only (-1 writes nothing).
    layout = QKVHeads(heads, kv_heads, dim, q_norm, k_norm, 1e-6, gemma)
    q_ref, k_ref, v_ref = qkv_norm_rope_write_reference(
        qkv, layout, cos, sin, want_k.clone(), want_v.clone(), slots.clamp(0)
    )
    want_k.flatten(0, 1).index_copy_(0, slots[keep], k_ref[keep])
    want_v.flatten(0, 1).index_copy_(0, slots[keep], v_ref[keep])
    q, k, v = qkv_norm_rope_write(qkv, layout, cos, sin, got_k, got_v, slots)
    rtol, atol = _TOL[spec["dtype"]]
    if dtype == torch.bfloat16:
        # Rotary's difference of two rounded products cancels: an error of a unit in the products'
        # last place is large relative to a small result, and the interpreter's truncating casts
        # (four in a row with q/k-norm) all err the same way. So bf16 is held to a few units of the
        # largest value; a wrong head, half or sign is off by the values themselves.
        rtol, atol = 0.0, 6 * 2**-8 * float(q_ref.abs().max())
    torch.testing.assert_close(q, q_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(k, k_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)
    if spec.get("zeros"):
        assert torch.equal(k.signbit(), k_ref.signbit()), "the sign of a zero K entry"
    if "kv" in spec:
        return _check_quantized_write(spec["kv"], layout, qkv, cos, sin, slots, (num_blocks, bs, kv_heads, dim), k, v)
    torch.testing.assert_close(got_k, want_k, rtol=rtol, atol=atol)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)
    _check_tables(layout, qkv, cos, sin, slots, got_k, got_v, (q, k, v), gen)


def _check_tables(layout, qkv, cos, sin, slots, got_k, got_v, outputs, gen) -> None:
    """cos/sin given as per-position tables and the tokens' positions (how the decoder passes them
    on a GPU) give bitwise what the kernel gives for the same rows given per token, and so does the
    reference."""
    from batchrun.kernels.attention_torch import qkv_norm_rope_write_reference
    from batchrun.kernels.triton_elementwise import qkv_norm_rope_write

    num_tokens, dim = cos.shape
    num_positions = 3 * num_tokens
    positions = torch.randperm(num_positions, generator=gen)[:num_tokens].to(cos.device)
    cos_table = torch.randn(num_positions, dim, generator=gen).to(cos.device, cos.dtype)  # rows no token reads
    sin_table = torch.randn(num_positions, dim, generator=gen).to(cos.device, cos.dtype)
    cos_table[positions], sin_table[positions] = cos, sin
    k_cache, v_cache = got_k.clone(), got_v.clone()  # the kernel's rows zeroed: it must write them again
    keep = slots >= 0
    assert k_cache.stride() == got_k.stride()
    k_cache.flatten(0, 1)[slots[keep]] = 0
    v_cache.flatten(0, 1)[slots[keep]] = 0
    got = qkv_norm_rope_write(qkv, layout, cos_table, sin_table, k_cache, v_cache, slots, positions)
    for a, b in zip(got, outputs):
        assert torch.equal(a, b)
    assert torch.equal(k_cache, got_k) and torch.equal(v_cache, got_v)
    ref = qkv_norm_rope_write_reference(
        qkv, layout, cos_table, sin_table, k_cache.clone(), v_cache.clone(), slots.clamp(0), positions
    )
    want = qkv_norm_rope_write_reference(qkv, layout, cos, sin, k_cache.clone(), v_cache.clone(), slots.clamp(0))
    for a, b in zip(ref, want):
        assert torch.equal(a, b)


def _check_quantized_write(kv: str, layout, qkv, cos, sin, slots, shape, k, v) -> None:
    """The fused kernel into an int8/fp8 cache stores exactly what QuantizedKVCache.write stores
    for the K it returned (checked against the reference above) and V, and no -1 row."""
    from batchrun.kernels.quant.kv import KV_CACHE_DTYPES, QuantizedKVCache
    from batchrun.kernels.triton_elementwise import qkv_norm_rope_write

    num_slots = shape[0] * shape[1]
    prior = torch.randn(num_slots, *shape[2:], generator=torch.Generator().manual_seed(5)).to(qkv.device, qkv.dtype)

    def cache() -> QuantizedKVCache:  # holding earlier entries, which the -1 row must leave alone
        c = QuantizedKVCache.empty(shape, KV_CACHE_DTYPES[kv], qkv.dtype, qkv.device)
        c.write(prior, torch.arange(num_slots, device=qkv.device))
        return c

    got_k, got_v, want_k, want_v = cache(), cache(), cache(), cache()
    q2, k2, v2 = qkv_norm_rope_write(qkv, layout, cos, sin, got_k, got_v, slots)
    assert torch.equal(k2, k) and torch.equal(v2, v)  # the cache's kind changes nothing else
    keep = slots >= 0
    want_k.write(k[keep], slots[keep])
    want_v.write(v[keep], slots[keep])
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (got.data, want.data)
        torch.testing.assert_close(got.scale, want.scale, rtol=0, atol=0)


def run_case(spec: dict[str, Any], device: str = "cpu", num_tokens: int = 7) -> None:
    if spec.get("minus_as_sub"):
        if device != "cpu":
            return  # compiled, `-x` is whatever this Triton makes of it: the plain cases cover that
        with unary_minus_as_subtraction():
            return run_case({k: v for k, v in spec.items() if k != "minus_as_sub"}, device, num_tokens)
    from batchrun.kernels import elementwise as ew
    from batchrun.kernels import triton_elementwise as tew

    if spec["op"] == "qkv":
        return _qkv_case(spec, device, num_tokens)
    dtype = _DTYPES[spec["dtype"]]
    rtol, atol = _TOL[spec["dtype"]]
    gen = torch.Generator().manual_seed(spec["n"])
    n = spec["n"]

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen).to(device, dtype)

    weight = randn(n) * 0.5 + 1.0
    if spec["op"] == "rms_norm":
        x = randn(num_tokens, n)
        torch.testing.assert_close(
            tew.rms_norm(x, weight, 1e-6, spec["gemma"]),
            ew.rms_norm_reference(x, weight, 1e-6, spec["gemma"]),
            rtol=rtol,
            atol=atol,
        )
    elif spec["op"] == "rms_norm_heads":  # the k heads of a qkv row: a strided 3-d view
        x = randn(num_tokens, 6 * n)[:, 2 * n : 5 * n].view(num_tokens, 3, n)
        torch.testing.assert_close(
            tew.rms_norm(x, weight, 1e-6), ew.rms_norm_reference(x, weight, 1e-6), rtol=rtol, atol=atol
        )
    elif spec["op"] == "add_rms_norm":
        h, residual = randn(num_tokens, n), randn(num_tokens, n)
        want_out, want_res = ew.add_rms_norm_reference(h, residual, weight, 1e-6)
        got_out, got_res = tew.add_rms_norm(h, residual.clone(), weight, 1e-6)
        exact = (0, 0) if dtype != torch.bfloat16 else (rtol, atol)  # the add rounds once, as torch's
        torch.testing.assert_close(got_res, want_res, rtol=exact[0], atol=exact[1])
        torch.testing.assert_close(got_out, want_out, rtol=rtol, atol=atol)
    elif spec["op"] == "silu_mul":
        gate_up = randn(num_tokens, 2 * n) * 3.0
        torch.testing.assert_close(tew.silu_mul(gate_up), ew.act_mul_reference(gate_up, "silu"), rtol=rtol, atol=atol)
    else:
        raise ValueError(spec["op"])


test_triton_elementwise_matches_reference_interpreted, test_triton_elementwise_matches_reference_on_gpu = (
    interpreted_and_on_gpu(CASES, lambda spec: run_case(spec, "cuda", num_tokens=3000))
)


if __name__ == "__main__":
    report_cases(CASES, run_case)
