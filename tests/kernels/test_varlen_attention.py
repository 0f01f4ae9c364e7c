"""The Triton varlen attention (kernels/triton_varlen_attention.py) equals the torch reference: in
Triton's interpreter on CPU (small sizes), on a real GPU when one is present (`-m gpu`), and it
compiles for sm_90 without one (registers, spills, shared memory) as the kernel sets bind it.

Every case packs rows of 1, 5, 17 and 33 tokens back to back (a one-token row, rows shorter than a
tile, rows over two and three tiles); over that: bidirectional and causal, float32, bfloat16 and
float16, head_dim 16, 32 and 24 (not a power of two), 2 to 4 heads, grouped-query heads, and q/k/v
as strided views of one packed qkv projection (the encoder's layout).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.interpreted import interpreted_and_on_gpu, report_cases

pytest.importorskip("triton")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOLERANCES = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 3e-2)}  # (rtol, atol)
LENS = [1, 5, 17, 33]

_BASE: dict[str, Any] = dict(lens=LENS, heads=2, kv_heads=2, head_dim=16, causal=False, dtype="float32", fused=False)
CASES: dict[str, dict[str, Any]] = {
    "bidirectional-d16-fp32": _BASE,
    "causal-d32-h4-fp32": {**_BASE, "head_dim": 32, "heads": 4, "kv_heads": 4, "causal": True},
    "bidirectional-d32-h3-bf16": {**_BASE, "head_dim": 32, "heads": 3, "kv_heads": 3, "dtype": "bfloat16"},
    "causal-d16-fp16": {**_BASE, "causal": True, "dtype": "float16"},
    "gqa-4:2-causal-fp32": {**_BASE, "heads": 4, "kv_heads": 2, "causal": True},
    "packed-qkv-d24-h3-fp32": {**_BASE, "heads": 3, "kv_heads": 3, "head_dim": 24, "fused": True},
}
GPU_CASES = {
    **CASES,
    "minilm-shape-bf16": {**_BASE, "lens": [3, 128, 256, 77, 512, 1], "heads": 12, "kv_heads": 12, "head_dim": 32,
                          "dtype": "bfloat16"},
    "bert-base-causal-fp32": {**_BASE, "lens": [300, 2, 129], "heads": 12, "kv_heads": 12, "head_dim": 64,
                              "causal": True},
}  # fmt: skip


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float, causal: bool
) -> torch.Tensor:
    """The torch reference in float32 (kernels/varlen_attention.py), K/V heads repeated for grouped
    queries (the reference takes one KV head per query head)."""
    from batchrun.kernels.varlen_attention import varlen_attention

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return varlen_attention(q.float(), k.float(), v.float(), seq_lens, scale, causal)


def _inputs(spec: dict[str, Any], device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(spec["lens"]) + spec["heads"] + spec["head_dim"])
    tokens, h, kvh, d = sum(spec["lens"]), spec["heads"], spec["kv_heads"], spec["head_dim"]
    dtype = _DTYPES[spec["dtype"]]
    if spec["fused"]:  # views of one (tokens, (h + 2 kvh) * d) projection: row stride (h + 2 kvh) * d
        qkv = torch.randn(tokens, (h + 2 * kvh) * d, generator=gen).to(device, dtype)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=1)
        return q.view(tokens, h, d), k.view(tokens, kvh, d), v.view(tokens, kvh, d)
    q = torch.randn(tokens, h, d, generator=gen).to(device, dtype)
    k = torch.randn(tokens, kvh, d, generator=gen).to(device, dtype)
    return q, k, torch.randn(tokens, kvh, d, generator=gen).to(device, dtype)


def run_case(spec: dict[str, Any], device: str = "cpu") -> None:
    """Raise AssertionError when the Triton result differs from the reference beyond tolerance."""
    from batchrun.kernels.target import find_target
    from batchrun.kernels.triton_varlen_attention import varlen_attention

    q, k, v = _inputs(spec, device)
    scale = spec["head_dim"] ** -0.5
    want = reference(q, k, v, spec["lens"], scale, spec["causal"])
    gpu = find_target(device).gpu if device != "cpu" else None
    got = varlen_attention(q, k, v, spec["lens"], scale, spec["causal"], gpu=gpu)
    assert got.dtype == q.dtype and got.shape == q.shape
    rtol, atol = _TOLERANCES[spec["dtype"]]
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


test_varlen_attention_matches_reference_interpreted, test_varlen_attention_matches_reference_on_gpu = (
    interpreted_and_on_gpu(CASES, lambda spec: run_case(spec, "cuda"), GPU_CASES)
)


def test_the_cpu_binds_the_reference_and_a_gpu_the_triton_kernel():
    from batchrun.kernels import triton_varlen_attention, varlen_attention
    from batchrun.kernels.binding import bind_kernels, reference_kernels
    from batchrun.kernels.target import SM90, DeviceTarget

    assert reference_kernels().varlen_attention is varlen_attention.varlen_attention
    sm90 = bind_kernels(DeviceTarget(torch.device("cpu"), SM90, True, False, True), torch.bfloat16)
    assert sm90.varlen_attention.func is triton_varlen_attention.varlen_attention  # partial(..., gpu=SM90)
    assert sm90.varlen_attention.keywords == {"gpu": SM90}


# ---------------------------------------------------------------------------------------------
# compiled for sm_90 without a GPU (kernels/triton_aot.py), as the Triton kernel set launches it

SPILL_BOUND_BYTES = 64  # as tests/kernels/test_triton_compile.py: bf16/fp16 variants keep a small stack only


def _pointer_dtype(v) -> str:
    return next(t for t in v.signature.values() if t.startswith("*"))[1:]


def test_varlen_attention_compiles_for_sm90():
    from batchrun.kernels import triton_aot
    from batchrun.kernels.triton_attention import shared_bytes
    from benchmarks import compile_counts

    if triton_aot.triton_supported() is not None:
        pytest.skip(triton_aot.triton_supported())
    if compile_counts.interpreted():
        pytest.skip("under TRITON_INTERPRET the kernels are not JITFunctions")
    from benchmarks.compile_cases import compile_cases, varlen_attention_cases

    log = compile_cases(90, varlen_attention_cases())
    assert not log.failures, "\n".join(f"{v.label}: {v.error}" for v in log.failures)
    variants = log.of("_varlen_attention_kernel")
    assert {_pointer_dtype(v) for v in variants} == {"bf16", "fp16", "fp32"}
    assert {v.constexprs["CAUSAL"] for v in variants} == {True, False}
    assert {v.constexprs["HEAD_DIM"] for v in variants} >= {32, 64}
    # the launcher picks its tiles by triton_attention.shared_bytes (the prefill kernel's tiles, no
    # cache): it must bound what the compiler lays out
    for v in variants:
        c = v.constexprs
        elem = 4 if _pointer_dtype(v) == "fp32" else 2
        bound = shared_bytes(
            log.target.gpu, c["BLOCK_M"], c["BLOCK_N"], c["HEAD_DIM_PAD"], v.num_stages, elem, False, True
        )
        assert v.shared is not None and v.shared <= min(bound, triton_aot.ARCHS[90].max_shared), (v.label, v.shared)
    if any(v.n_regs is None for v in variants):
        pytest.skip("no cuobjdump: register and local-memory counts unknown")
    assert all(v.n_regs <= 255 for v in variants)
    spilling = [
        f"{v.label}: {v.n_regs} registers, {v.n_spills} B local"
        for v in variants
        if _pointer_dtype(v) != "fp32" and v.n_spills > SPILL_BOUND_BYTES
    ]
    assert not spilling, "\n".join(spilling)


if __name__ == "__main__":
    report_cases(CASES, run_case)
