"""The fused Triton GEMMs and the embedding + norm kernel equal the unfused launches they replace.

- `gemm_silu_mul` against `silu_mul(F.linear(x, w))`, `gemm_logits` against `F.linear(x, w).float()`;
- `gemm_qkv_norm_rope_write` against `qkv_norm_rope_write(F.linear(x, w, b), ...)` (the Triton qkv
  kernel): q, k, v and the cache contents, with and without q/k-norm (plain and Gemma's (1 + w)),
  bias, cos/sin per token or as tables read by position, one slot -1 (nothing written: the
  cache row keeps its old value), head dims whose half is below tl.dot's 16 or not a power of two;
- `embed_rms_norm` against the embedding followed by `triton_elementwise.rms_norm`: bitwise.

In Triton's interpreter (one child process), and on a GPU (`-m gpu`). float32 cases hold the
epilogue's logic tight (the only difference is the GEMM's sum order); half-precision cases, what
the decoder runs, hold it to a few units in the last place of the largest value: a different sum
order may tip the projection's rounding, and the interpreter casts float32 to bf16 by truncating.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.interpreted import interpreted_and_on_gpu, report_cases

pytest.importorskip("triton")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    for dtype in ("float32", "bfloat16", "float16"):
        cases[f"silu_mul-{dtype}"] = dict(op="silu_mul", dtype=dtype, k=96, n=40)
        cases[f"embed_norm-{dtype}"] = dict(op="embed_norm", dtype=dtype, n=48)
        cases[f"logits-{dtype}"] = dict(op="logits", dtype=dtype, k=64, n=300)  # ragged column tiles
    cases["silu_mul-wide-bfloat16"] = dict(op="silu_mul", dtype="bfloat16", k=200, n=130)  # ragged tiles
    qkv = dict(op="qkv", heads=4, kv_heads=2, dim=16, bias=False, tables=False)
    for dtype in ("float32", "bfloat16"):
        for norm in ("none", "plain", "gemma"):
            cases[f"qkv-{norm}-{dtype}"] = {**qkv, "dtype": dtype, "norm": norm}
    cases["qkv-plain-bias-tables-float16"] = {**qkv, "dtype": "float16", "norm": "plain", "bias": True, "tables": True}
    cases["qkv-none-bias-float32"] = {**qkv, "dtype": "float32", "norm": "none", "bias": True}
    # Qwen3's tiny head (24: half 12, padded to 16) and a half of 16 exactly, GQA 3:1 and MQA
    cases["qkv-plain-dim24-tables-bfloat16"] = dict(
        op="qkv", dtype="bfloat16", norm="plain", heads=6, kv_heads=2, dim=24, bias=False, tables=True
    )
    cases["qkv-gemma-mqa-dim32-tables-float32"] = dict(
        op="qkv", dtype="float32", norm="gemma", heads=2, kv_heads=1, dim=32, bias=False, tables=True
    )
    return cases


CASES = _cases()


def _gpu(device: str) -> Any:
    """The GPU the launches are sized for: the device's own, or None for Triton's interpreter."""
    from batchrun.kernels.target import find_target

    return find_target(device).gpu if device == "cuda" else None


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)
    else:  # a few units in the last place of the largest value (module docstring)
        atol = 6 * 2 ** -(8 if dtype == torch.bfloat16 else 11) * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0.0, atol=atol, msg=what)


def _qkv_case(spec: dict[str, Any], device: str, num_tokens: int) -> None:
    import torch.nn.functional as F

    from batchrun.kernels.kv_layout import as_kv_cache_layout, from_head_major
    from batchrun.kernels.qkv_heads import QKVHeads
    from batchrun.kernels.triton_elementwise import qkv_norm_rope_write
    from batchrun.kernels.triton_fused_gemm import gemm_qkv_norm_rope_write

    dtype = _DTYPES[spec["dtype"]]
    heads, kv_heads, dim, hidden, bs = spec["heads"], spec["kv_heads"], spec["dim"], 80, 4
    gen = torch.Generator().manual_seed(heads * dim + len(spec["norm"]))

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=gen) * scale).to(device, dtype)

    x = randn(num_tokens, hidden)
    weight = randn((heads + 2 * kv_heads) * dim, hidden, scale=hidden**-0.5)
    bias = randn((heads + 2 * kv_heads) * dim, scale=0.5) if spec["bias"] else None
    q_norm = k_norm = None
    if spec["norm"] != "none":
        q_norm, k_norm = randn(dim, scale=0.5) + 1.0, randn(dim, scale=0.5) + 1.0
    layout = QKVHeads(heads, kv_heads, dim, q_norm, k_norm, 1e-6, spec["norm"] == "gemma")
    positions = None
    num_rows = 3 * num_tokens if spec["tables"] else num_tokens
    angles = torch.rand(num_rows, dim // 2, generator=gen) * 6.0
    emb = torch.cat((angles, angles), dim=-1)  # (rows, dim), rotary's layout
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    if spec["tables"]:
        positions = torch.randperm(num_rows, generator=gen)[:num_tokens].to(device)
    num_blocks = -(-num_tokens // bs) + 2
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens].to(device)
    slots[1] = -1
    prior_k, prior_v = (from_head_major(randn(kv_heads, num_blocks, bs, dim)) for _ in range(2))
    want_k, want_v = as_kv_cache_layout(prior_k.clone()), as_kv_cache_layout(prior_v.clone())
    got_k, got_v = as_kv_cache_layout(prior_k.clone()), as_kv_cache_layout(prior_v.clone())
    want = qkv_norm_rope_write(F.linear(x, weight, bias), layout, cos, sin, want_k, want_v, slots, positions)
    got = gemm_qkv_norm_rope_write(x, weight, bias, layout, cos, sin, got_k, got_v, slots, positions, gpu=_gpu(device))
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        _close(g, w, dtype, name)
    _close(got_k, want_k, dtype, "K cache")
    _close(got_v, want_v, dtype, "V cache")
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool, device=device)  # slots no kept token writes
    untouched[slots[slots >= 0]] = False
    for cache, prior in ((got_k, prior_k), (got_v, prior_v)):
        assert torch.equal(cache.flatten(0, 1)[untouched], prior.flatten(0, 1)[untouched]), "a -1 slot wrote"


def run_case(spec: dict[str, Any], device: str = "cpu", num_tokens: int = 7) -> None:
    import torch.nn.functional as F

    from batchrun.kernels import triton_elementwise as tew

    if spec["op"] == "qkv":
        return _qkv_case(spec, device, num_tokens)
    dtype = _DTYPES[spec["dtype"]]
    gen = torch.Generator().manual_seed(spec["n"])

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=gen) * scale).to(device, dtype)

    if spec["op"] == "silu_mul":
        from batchrun.kernels.triton_fused_gemm import gemm_silu_mul

        x, weight = randn(num_tokens, spec["k"]), randn(2 * spec["n"], spec["k"], scale=3 * spec["k"] ** -0.5)
        want = tew.silu_mul(F.linear(x, weight))
        got = gemm_silu_mul(x, weight, gpu=_gpu(device))
        assert got.shape == want.shape == (num_tokens, spec["n"])
        _close(got, want, dtype, "silu(gate) * up")
    elif spec["op"] == "logits":
        from batchrun.kernels.triton_fused_gemm import gemm_logits

        x, weight = randn(num_tokens, spec["k"]), randn(spec["n"], spec["k"], scale=spec["k"] ** -0.5)
        want = F.linear(x, weight).float()
        got = gemm_logits(x, weight, gpu=_gpu(device))
        assert got.dtype == torch.float32 and got.shape == want.shape
        _close(got, want, dtype, "logits")
        assert torch.equal(got.to(dtype).float(), got), "each logit is a value of the dtype"
    elif spec["op"] == "embed_norm":
        from batchrun.kernels.triton_embed_norm import embed_rms_norm

        table, weight = randn(50, spec["n"]), randn(spec["n"], scale=0.5) + 1.0
        ids = torch.randint(0, 50, (num_tokens,), generator=gen).to(device)
        normed, x = embed_rms_norm(ids, table, weight, 1e-6)
        assert torch.equal(x, table[ids])
        assert torch.equal(normed, tew.rms_norm(table[ids], weight, 1e-6))  # the same op sequence: bitwise
    else:
        raise ValueError(spec["op"])


# On a GPU, compiled at a decode batch's size (several row tiles, the tuned tiles of the first call).
test_fused_kernels_match_the_unfused_launches_interpreted, test_fused_kernels_match_the_unfused_launches_on_gpu = (
    interpreted_and_on_gpu(CASES, lambda spec: run_case(spec, "cuda", num_tokens=300))
)


@pytest.mark.gpu
def test_fused_or_unfused_is_measured_per_bucket_at_start_up_on_gpu():
    """On a GPU start-up tuning times the fused GEMM against cuBLAS + the elementwise kernel per row
    bucket (kernels/tuning.py); the kernel set bound with that tuning takes the faster of the two
    for each bucket, and either gives the unfused result."""
    from torch import nn

    from batchrun.kernels import elementwise as ew
    from batchrun.kernels.binding import bind_kernels, with_tuning
    from batchrun.kernels.target import find_target
    from batchrun.kernels.tuning import GemmShape, measured_tuning
    from batchrun.kernels.tuning_cases import tuning_cases

    kernels = bind_kernels(find_target("cuda"), torch.bfloat16)
    cases = tuning_cases([GemmShape("silu_mul", 2 * 3072, 1024)], kernels, 256)
    tuning = measured_tuning(kernels.target, cases)
    assert tuning.source == "measured"
    assert sorted(c.rows for c in tuning.fused) == [16, 32, 64, 128, 256], tuning.fused
    assert all(c.fused_ms is not None and c.unfused_ms is not None for c in tuning.fused)
    kernels = with_tuning(kernels, tuning)
    gen = torch.Generator(device="cuda").manual_seed(0)
    proj = nn.Linear(1024, 2 * 3072, bias=False, dtype=torch.bfloat16, device="cuda")
    for m in (1, 256):
        x = torch.randn(m, 1024, generator=gen, device="cuda").to(torch.bfloat16)
        got = kernels.gate_up_act(x, proj, "silu")
        _close(got, ew.act_mul_triton(proj(x), "silu"), torch.bfloat16, f"M={m}")


if __name__ == "__main__":
    report_cases(CASES, run_case)
