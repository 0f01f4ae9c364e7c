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

from batchrun.kernels.quant.kv import QuantizedKVCache
from batchrun.kernels.quant.triton_codes import kv_quantize, kv_scale

__all__ = ["KVCacheArgs", "kv_cache_args", "kv_quantize", "kv_scale", "write_kv_cache"]


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
