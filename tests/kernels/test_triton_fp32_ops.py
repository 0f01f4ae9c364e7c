"""In float32 the fused elementwise kernels issue the operations torch does, compiled for sm_90 on a
machine without a GPU (kernels/triton_aot.py: compile_only), read from their PTX.

Float32 greedy output is held to HF's token for token, and HF runs each op as its own torch kernel:
every product and sum rounded on its own, IEEE division. Triton contracts a product and a sum into
one fused multiply-add unless told not to (rotary's x * cos + rotate_half(x) * sin then rounds once
where torch rounds three times), and lowers `/` on float32 to approximate divisions (div.full,
div.approx: up to 2 ulp). Each is an ulp on some elements, which through a dozen norms compounds
into a flipped argmax now and then; neither shows in the interpreter, which runs numpy.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from batchrun.kernels import triton_aot  # noqa: E402
from benchmarks import compile_counts  # noqa: E402

if triton_aot.triton_supported() is not None:
    pytestmark = pytest.mark.skip(reason=triton_aot.triton_supported())
elif compile_counts.interpreted():
    pytestmark = pytest.mark.skip(reason="TRITON_INTERPRET is set: nothing is compiled")

_INEXACT = re.compile(r"^\s*(fma\.rn\.f32|div\.(?:full|approx)[.a-z]*f32)\b", re.M)


def _float32_variants():
    from batchrun.kernels.kv_layout import new_kv_cache
    from batchrun.kernels.qkv_heads import QKVHeads
    from batchrun.kernels.triton_elementwise import add_rms_norm, qkv_norm_rope_write, rms_norm

    n, heads, kv_heads, dim = 4, 4, 1, 32
    w = torch.randn(dim)
    cos, sin = torch.randn(n, dim), torch.randn(n, dim)
    with triton_aot.compile_only(90) as log:
        for gemma in (False, True):
            qkv = torch.randn(n, (heads + 2 * kv_heads) * dim)
            caches = [new_kv_cache(4, 16, kv_heads, dim, torch.float32, "cpu") for _ in range(2)]
            layout = QKVHeads(heads, kv_heads, dim, w, w, 1e-6, gemma)
            qkv_norm_rope_write(qkv, layout, cos, sin, *caches, torch.arange(n))
            qkv_norm_rope_write(qkv, layout, cos, sin, *caches, torch.arange(n), torch.arange(n))  # tables
            rms_norm(torch.randn(n, 48), torch.randn(48), 1e-6, gemma)
        add_rms_norm(torch.randn(n, 48), torch.randn(n, 48), torch.randn(48), 1e-6)
    return log


def test_float32_elementwise_kernels_round_each_op_as_torch_does():
    log = _float32_variants()
    assert {v.name for v in log.variants} == {"_qkv_kernel", "_rms_norm_kernel"}
    for v in log.variants:
        assert v.ok, v.error
        assert v.ptx is not None
        found = sorted(set(_INEXACT.findall(v.ptx)))
        assert not found, f"{v.name} {v.constexprs}: {found}"


def test_float32_attention_dots_are_ieee_not_tf32():
    """A float32 tl.dot defaults to TF32 on sm_80+ (10-bit mantissa operands); HF's float32 attention
    does not. Every float32 attention variant (decode with one split and several, with a window,
    soft-capped, and prefill) must multiply in full float32: no tf32 operand in its PTX."""
    from batchrun.kernels.binding import bind_kernels
    from benchmarks.cases import attention_case

    with triton_aot.compile_only(90) as log:
        attend = bind_kernels(log.target, torch.float32).paged_attention
        for window, softcap in ((None, None), (16, None), (None, 30.0)):
            for batch in ([(5, 1), (0, 9), (600, 1), (6, 70)], [(3, 1), (40, 1)]):
                c = attention_case(batch, 4, 1, 32, 16, torch.float32)
                attend(c.q, c.k_cache, c.v_cache, c.meta, 32**-0.5, window, softcap)
    names = {v.name for v in log.variants}
    assert {"_decode_kernel", "_prefill_kernel"} <= names, names
    for v in log.variants:
        assert v.ok, v.error
        if v.name in ("_decode_kernel", "_prefill_kernel"):
            assert v.constexprs["IEEE"], v.constexprs
            assert "tf32" not in v.ptx, f"{v.name} {v.constexprs}: a tf32 dot"
