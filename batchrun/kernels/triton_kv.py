"""The Triton kernel that writes this step's K/V into the paged cache, and the in-kernel KV
quantization it shares with the fused qkv kernel (kernels/triton_elementwise.py).

`write_kv_cache` has the signature and result of `batchrun.kernels.attention_torch.write_kv_cache_reference`
(which the tests compare it with) for a float cache, and of `QuantizedKVCache.write` for an int8/fp8
one: each (token, head) row quantized as `kernels/quant/kv.py: quantize_kv` does it, bitwise (scale
= amax * fl32(1 / qmax) at least MIN_SCALE, x / scale clamped to +-qmax, int8 rounded half to even,
fp8 rounded to the nearest e4m3 value keeping the sign of zero), data and scale stored at the
token's slot. One program per
token copies all its KV heads; a negative slot is skipped (the convention CUDA-graph padding uses:
a padded row writes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchrun.kernels.quant.formats import FP8_E4M3_MAX, INT8_MAX, INV_FP8_E4M3_MAX, INV_INT8_MAX, MIN_SCALE
from batchrun.kernels.quant.kv import QuantizedKVCache

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


@dataclass
class KVCacheArgs:
    """One layer's K/V cache as the kernels take it: the data, and for an int8/fp8 cache its scales
    (for a float cache the data again, with zero strides: never read)."""

    k: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    v: torch.Tensor  # same layout as k
    k_scale: torch.Tensor  # (num_blocks, block_size, num_kv_heads) float32
    v_scale: torch.Tensor  # same layout as k_scale
    scale_strides: tuple[int, int, int]
    is_quant: bool
    is_int8: bool

    @property
    def read_strides(self) -> tuple[int, ...]:
        """K's, V's and the scales' strides over (block, offset, head): what the attention kernels
        take, in their argument order."""
        return (*self.k.stride()[:3], *self.v.stride()[:3], *self.scale_strides)

    @property
    def write_strides(self) -> tuple[int, ...]:
        """The cache's and the scales' strides over (block, offset, head), V sharing K's: what the
        kernels that store K/V take, in their argument order."""
        return (*self.k.stride()[:3], *self.scale_strides)


def kv_cache_args(k_cache, v_cache) -> KVCacheArgs:
    """The kernels' view of a float cache pair or a QuantizedKVCache pair (K and V laid out alike)."""
    if isinstance(k_cache, QuantizedKVCache):
        block_stride, offset_stride, head_stride = k_cache.scale.stride()  # (num_blocks, block_size, num_kv_heads)
        args = KVCacheArgs(
            k_cache.data,
            v_cache.data,
            k_cache.scale,
            v_cache.scale,
            (block_stride, offset_stride, head_stride),
            True,
            k_cache.data.dtype == torch.int8,
        )
        assert args.v_scale.stride() == args.scale_strides
    else:
        args = KVCacheArgs(k_cache, v_cache, k_cache, v_cache, (0, 0, 0), False, False)
    assert args.k.stride(3) == 1 and args.v.stride(3) == 1
    return args


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IS_QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
):
    # Offsets in int64: a cache past 2**31 elements is an ordinary GPU size, and an int32 product
    # such as h * stride_ch wraps there.
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD).to(tl.int64)
    d = tl.arange(0, DIM_PAD)
    slot = tl.load(slot_ptr + t).to(tl.int64) + tl.zeros((HEADS_PAD,), tl.int64)  # the token's slot, per head
    h_ok = (h < NUM_KV_HEADS) & (slot >= 0)
    slot = tl.maximum(slot, 0)
    mask = h_ok[:, None] & (d[None, :] < HEAD_DIM)
    row = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + h * stride_ch  # (HEADS_PAD,)
    dst = row[:, None] + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    if IS_QUANT:
        # one scale per (token, head): the row maxima of the (HEADS_PAD, DIM_PAD) tile
        kf = k.to(tl.float32)
        vf = v.to(tl.float32)
        k_scale = kv_scale(tl.max(tl.abs(kf), 1), IS_INT8)  # (HEADS_PAD,)
        v_scale = kv_scale(tl.max(tl.abs(vf), 1), IS_INT8)
        k = kv_quantize(kf, k_scale[:, None], IS_INT8)
        v = kv_quantize(vf, v_scale[:, None], IS_INT8)
        s_dst = (slot // block_size) * stride_sb + (slot % block_size) * stride_st + h * stride_sh
        tl.store(k_scale_ptr + s_dst, k_scale, mask=h_ok)
        tl.store(v_scale_ptr + s_dst, v_scale, mask=h_ok)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k_cache,  # (num_blocks, block_size, num_kv_heads, head_dim) tensor, or a QuantizedKVCache
    v_cache,  # the same kind and layout as k_cache
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int; negative = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    c = kv_cache_args(k_cache, v_cache)
    assert k.stride(2) == 1 and v.stride(2) == 1 and c.k.stride() == c.v.stride()
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        c.k,
        c.v,
        c.k_scale,
        c.v_scale,
        slot_mapping,
        c.k.shape[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *c.write_strides,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        IS_QUANT=c.is_quant,
        IS_INT8=c.is_int8,
    )
