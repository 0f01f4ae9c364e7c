"""Triton helpers that turn float32 values into int8 and float8_e4m3fn codes exactly as the torch
code does, shared by every kernel that quantizes: the KV cache's writes (kernels/triton_kv.py, the
fused qkv kernel in kernels/triton_elementwise.py) and the per-token activation quantization of
the fp8 and W8A8 linears (kernels/quant/triton_act.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchrun.kernels.quant.formats import FP8_E4M3_MAX, INT8_MAX, INV_FP8_E4M3_MAX, INV_INT8_MAX, MIN_SCALE

_INT8_MAX = tl.constexpr(INT8_MAX)
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_INV_INT8_MAX = tl.constexpr(INV_INT8_MAX)  # exact in float32, so the constant is the same float everywhere
_INV_FP8_MAX = tl.constexpr(INV_FP8_E4M3_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _round_half_even(x):
    """float32 x (|x| < 2**22) rounded to an integer, ties to even, like torch.round: adding 1.5 * 2**23
    leaves no fraction bits, so the float unit's round-to-nearest-even does the rounding, and
    subtracting it back is exact. (libdevice's rint does not run in Triton's interpreter.)"""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _round_to_e4m3(x):
    """float32 x (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, as a float32
    (so the cast to float8 after it is exact). Done by hand because Triton's interpreter casts to
    float8 without rounding correctly; compiled, this is the hardware cast's result. e4m3 keeps 3
    mantissa bits: within x's binade [2**e, 2**(e+1)) its values are multiples of 2**(e-3), and
    below the smallest normal 2**-6 multiples of 2**-9 (the subnormals)."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # biased float32 exponent of x's binade
    inv_step = ((254 + 3 - e) << 23).to(tl.float32, bitcast=True)  # 2**-(e-127-3), exact
    step = ((e - 3) << 23).to(tl.float32, bitcast=True)
    r = _round_half_even(tl.abs(x) * inv_step) * step
    # x's sign bit onto |r| by bits, so an entry that rounds to zero keeps its sign as torch's cast
    # does: a negation would not, where Triton compiles -r as 0 - r (-(+0.0) = +0.0).
    sign = bits & -2147483648  # the int32 with only the sign bit set
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def kv_scale(amax, IS_INT8: tl.constexpr):
    """quantize_kv's scale of a row whose largest |entry| is amax (float32): one float32 product
    with the reciprocal, not a division (see formats.INV_INT8_MAX)."""
    inv_qmax = _INV_INT8_MAX if IS_INT8 else _INV_FP8_MAX
    return tl.maximum(amax * inv_qmax, _MIN_SCALE)


@triton.jit
def kv_quantize(x, scale, IS_INT8: tl.constexpr):
    """float32 x / scale clamped to +-qmax and rounded as quantize_kv does, still float32 but exact
    in the cache's int8 or float8_e4m3fn."""
    qmax = _INT8_MAX if IS_INT8 else _FP8_MAX
    xs = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -qmax), qmax)
    if IS_INT8:
        return _round_half_even(xs)
    return _round_to_e4m3(xs)
