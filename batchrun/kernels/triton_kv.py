"""Triton kernels that write this step's K/V into the paged cache, alone or fused with rotary embedding.

- `write_kv_cache`: same signature and result as `batchrun.kernels.attention.write_kv_cache` (the
  torch reference). One program per token copies all its KV heads; a negative slot is skipped (the
  convention CUDA-graph padding uses: a padded row writes nothing).
- `rotary_write_kv_cache`: rotary embedding of q and k (HF's rotate-half form, cos/sin per token)
  plus the cache write, in one launch instead of about a dozen elementwise ones per layer. Its torch
  reference is `rotary_write_kv_cache_reference`, the decoder's own three lines. Whether the fusion
  pays is measured by `python -m batchrun.bench.gpu`; the decoder does not call it yet.

The kernels compute in float32 and round once, so bf16 results may differ from the reference (which
rounds after each elementwise op) by an ulp.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from batchrun.kernels.attention import write_kv_cache_reference
from batchrun.kernels.elementwise import apply_rotary_reference


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    slot = tl.load(slot_ptr + t).to(tl.int64) + tl.zeros((HEADS_PAD, DIM_PAD), tl.int64)  # the token's slot, tiled
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    slot = tl.maximum(slot, 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int; negative = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, t, stride_xt, stride_xh, stride_cos, h, d, half, mask, HEAD_DIM: tl.constexpr):
    """(HEADS_PAD, DIM_PAD) float32: x * cos + rotate_half(x) * sin for token t."""
    base = x_ptr + t.to(tl.int64) * stride_xt + h[:, None] * stride_xh
    x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x)[j] = -x[j + half] for j < half, x[j - half] otherwise
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    xr = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32) * sign[None, :]
    cos = tl.load(cos_ptr + t.to(tl.int64) * stride_cos + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t.to(tl.int64) * stride_cos + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    return x * cos[None, :] + xr * sin[None, :]


@triton.jit
def _rotary_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cb, stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    d = tl.arange(0, DIM_PAD)
    half = HEAD_DIM // 2
    hq = tl.arange(0, HEADS_PAD)
    q_mask = (hq[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    q = _rotate(q_ptr, cos_ptr, sin_ptr, t, stride_qt, stride_qh, stride_cos, hq, d, half, q_mask, HEAD_DIM)
    tl.store(q_out_ptr + t.to(tl.int64) * stride_qot + hq[:, None] * stride_qoh + d[None, :],
             q.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    hk = tl.arange(0, KV_HEADS_PAD)
    kv_mask = (hk[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = _rotate(k_ptr, cos_ptr, sin_ptr, t, stride_kt, stride_kh, stride_cos, hk, d, half, kv_mask, HEAD_DIM)
    k = k.to(k_out_ptr.dtype.element_ty)  # round to the model dtype first, as the reference's cache write sees it
    tl.store(k_out_ptr + t.to(tl.int64) * stride_kot + hk[:, None] * stride_koh + d[None, :], k, mask=kv_mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + hk[:, None] * stride_vh + d[None, :], mask=kv_mask)
    slot = tl.load(slot_ptr + t).to(tl.int64) + tl.zeros((KV_HEADS_PAD, DIM_PAD), tl.int64)
    c_mask = kv_mask & (slot >= 0)
    slot = tl.maximum(slot, 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + hk[:, None] * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=c_mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=c_mask)


def rotary_write_kv_cache_reference(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos: torch.Tensor,  # (num_tokens, head_dim)
    sin: torch.Tensor,  # (num_tokens, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, rotated k), with rotated k and v written to the cache: what the decoder does."""
    q, k = apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)
    write_kv_cache_reference(k_cache, v_cache, k, v, slot_mapping)
    return q, k


def rotary_write_kv_cache(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim), any strides with unit last stride
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos: torch.Tensor,  # (num_tokens, head_dim)
    sin: torch.Tensor,  # (num_tokens, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int; negative = skip the cache write
    q_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert cos.stride() == sin.stride() and cos.stride(1) == 1 and k_cache.stride() == v_cache.stride()
    q_out = q_out if q_out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _rotary_write_kernel[(num_tokens,)](
        q, k, v, cos, sin, q_out, k_out, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )
    return q_out, k_out
