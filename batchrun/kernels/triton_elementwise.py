"""Triton kernels for the small ops between a decoder layer's GEMMs, fused so each is one pass.

- `rms_norm` / `add_rms_norm`: (the residual add and) RMSNorm, one program per row.
- `rms_norm_quant`: the same, and the normed row quantized per token (int8 or fp8 e4m3 codes and a
  float32 scale) for the fp8 / W8A8 linear it feeds, which then skips its own quantization kernel
  (the constexpr QUANT variant of the same kernel; the quantization is triton_act's quantize_row).
- `silu_mul`: silu(gate) * up over the fused gate/up projection's output.
- `qkv_norm_rope_write`: from the fused qkv projection's output, q/k-norm (Qwen3, Gemma 3), rotary
  on q and k (each token's cos/sin row read from per-position tables by its position, or given per
  token), and the K/V write into the paged cache, in one launch: one program per (token, head),
  the KV heads' programs also storing K and V at the token's slot (a negative slot writes nothing,
  the CUDA-graph padding convention); into an int8/fp8 cache quantized on the way, each program
  holding its whole head for the scale (kernels/triton_kv.py's quantization).

Every launch turns Triton's fusion of a product and a sum into one multiply-add off
(`enable_fp_fusion=False`), so float32 rounds each op as torch's separate kernels do (HF's float32
greedy tokens are the oracle); these kernels are memory-bound, the extra instructions cost nothing.

Each has the signature and result of its plain-torch reference (`batchrun.kernels.elementwise`'s
`*_reference` and `batchrun.kernels.attention_torch.qkv_norm_rope_write_reference`), which the tests
compare it with in Triton's interpreter. The kernels round to the tensor dtype where the references
do (after the residual add, after the normalization, after each rotary product and sum, after silu),
so in bf16 they differ from the references only where a float32 sum order or rsqrt/exp's last bit
tips a rounding. Offsets are int64: rows times strides pass 2**31 on long batches.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from batchrun.kernels.qkv_heads import QKVHeads
from batchrun.kernels.quant.act import ActQuant, QuantizedRows
from batchrun.kernels.quant.triton_act import quantize_row
from batchrun.kernels.triton_kv import kv_cache_args, kv_quantize, kv_scale


@triton.jit
def _norm(x, w, inv_n, eps, IS_GEMMA: tl.constexpr):
    """RMSNorm of float32 x (padded with zeros past n) by weight w, rounded as the reference rounds:
    w * normed.to(dtype), or (normed * (1 + w)).to(dtype) for Gemma; returned in float32. The mean
    is the sum times inv_n = fl32(1 / n), as torch's CUDA mean computes it (`/` would lower to an
    approximate division)."""
    normed = x * tl.rsqrt(tl.sum(x * x, 0) * inv_n + eps)
    if IS_GEMMA:
        return (normed * (1.0 + w.to(tl.float32))).to(w.dtype).to(tl.float32)
    return (w.to(tl.float32) * normed.to(w.dtype).to(tl.float32)).to(w.dtype).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    skip_ptr,
    M,
    n,
    inv_n,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_q,
    HAS_RESIDUAL: tl.constexpr,
    IS_GEMMA: tl.constexpr,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row. With QUANT the normed row (as stored, in out's dtype) is also quantized
    per token into q / s by kernels/quant/triton_act.py's quantize_row, the unfused kernel's own
    code; the grid then covers max(M, min_rows) rows, and the rows past M (zero input) write only
    their zero codes (torch._int_mm's padding) and scale."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < n
    live = ok
    if QUANT:
        live = ok & ((tl.zeros_like(d) + row) < M)  # a vector: the interpreter takes no scalar in a mask
    x = tl.load(x_ptr + row * stride_x + d, mask=live, other=0.0)
    if HAS_RESIDUAL:
        # residual + h rounded to the dtype first, as the reference's add is; stored as the new residual
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + d, mask=live, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + d, x, mask=live)
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    out = _norm(x.to(tl.float32), w, inv_n, eps, IS_GEMMA).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + d, out, mask=live)
    if QUANT:
        q, scale = quantize_row(out.to(tl.float32), skip_ptr, d, ok, IS_INT8, HAS_SKIP)
        tl.store(q_ptr + row * stride_q + d, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row, scale)


@functools.cache
def _inverse(n: int) -> float:
    """fl32(1 / n) as a Python float (exact in float32): the factor torch's CUDA mean multiplies by.
    Cached: launched per layer and step, and each computation is a few host-side torch ops."""
    return float(torch.tensor(1.0, dtype=torch.float32) / n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (num_rows, n) with unit last stride; a copy only for views that do not flatten."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool = False) -> torch.Tensor:
    """`elementwise.rms_norm_reference` in one pass; weight in x's dtype."""
    x2 = _rows(x)  # (num_rows, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # (num_rows, n)
    if x2.shape[0] == 0:
        return out.view(x.shape)
    n = x2.shape[1]
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        x2,
        weight,
        out,
        out,
        out,
        out,
        x2.shape[0],
        n,
        _inverse(n),
        float(eps),
        x2.stride(0),
        x2.stride(0),
        out.stride(0),
        0,
        HAS_RESIDUAL=False,
        IS_GEMMA=is_gemma,
        QUANT=False,
        IS_INT8=False,
        HAS_SKIP=False,
        BLOCK=triton.next_power_of_2(n),
        enable_fp_fusion=False,
    )
    return out.view(x.shape)


def add_rms_norm(
    h: torch.Tensor,  # (num_tokens, n)
    residual: torch.Tensor,  # (num_tokens, n), updated in place to residual + h
    weight: torch.Tensor,  # (n,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`elementwise.add_rms_norm_reference` in one pass: (rms_norm(residual + h), residual + h)."""
    assert h.dim() == 2 and h.stride(1) == 1 and residual.stride(1) == 1 and residual.shape == h.shape
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # (num_tokens, n)
    if h.shape[0] == 0:
        return out, residual
    n = h.shape[1]
    _rms_norm_kernel[(h.shape[0],)](
        h,
        residual,
        weight,
        out,
        out,
        out,
        out,
        h.shape[0],
        n,
        _inverse(n),
        float(eps),
        h.stride(0),
        residual.stride(0),
        out.stride(0),
        0,
        HAS_RESIDUAL=True,
        IS_GEMMA=False,
        QUANT=False,
        IS_INT8=False,
        HAS_SKIP=False,
        BLOCK=triton.next_power_of_2(n),
        enable_fp_fusion=False,
    )
    return out, residual


def rms_norm_quant(
    x: torch.Tensor,  # (num_tokens, n)
    residual: Optional[torch.Tensor],  # (num_tokens, n), updated in place to residual + x; or None
    weight: torch.Tensor,  # (n,)
    eps: float,
    quant: ActQuant,
) -> tuple[QuantizedRows, torch.Tensor]:
    """(rows, residual + x) where rows holds rms_norm(residual + x) (`add_rms_norm`; without a
    residual `rms_norm(x)` and x) and its per-token codes and scales as `quant` asks, bitwise
    `quantize_rows(rows.x, quant.dtype, quant.skip, quant.min_rows)`: one launch for what the norm
    and the linear's quantization kernel did in two."""
    assert x.dim() == 2 and x.stride(1) == 1
    if residual is not None:
        assert residual.stride(1) == 1 and residual.shape == x.shape
    assert quant.dtype in (torch.int8, torch.float8_e4m3fn)
    m, n = x.shape
    rows = max(m, quant.min_rows)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # (num_tokens, n)
    q = torch.empty((rows, n), dtype=quant.dtype, device=x.device)  # (rows, n), zero past num_tokens
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows > 0:
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            q,
            scale,
            quant.skip if quant.skip is not None else x,
            m,
            n,
            _inverse(n),
            float(eps),
            x.stride(0),
            residual.stride(0) if residual is not None else x.stride(0),
            out.stride(0),
            q.stride(0),
            HAS_RESIDUAL=residual is not None,
            IS_GEMMA=False,
            QUANT=True,
            IS_INT8=quant.dtype == torch.int8,
            HAS_SKIP=quant.skip is not None,
            BLOCK=triton.next_power_of_2(n),
            enable_fp_fusion=False,
        )
    return QuantizedRows(out, q, scale[:m]), residual if residual is not None else x


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(gu_ptr + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * stride_g + n + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    s = (gf * tl.sigmoid(gf)).to(g.dtype)  # silu rounded to the dtype, then the product (torch's order)
    tl.store(
        out_ptr + row * stride_o + cols, (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of (num_tokens, 2 * n), gate first: `elementwise.act_mul_reference(x, "silu")`."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1
    num_tokens, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, n), dtype=gate_up.dtype, device=gate_up.device)  # (num_tokens, n)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(num_tokens, triton.cdiv(n, block))](
        gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, enable_fp_fusion=False
    )
    return out


@triton.jit
def _quantize_halves(x1, x2, IS_INT8: tl.constexpr):
    """A head given as its two halves (zero past the half's end), quantized as quantize_kv does:
    (q1, q2, scale), q1 and q2 as float32 values exact in int8 or float8_e4m3fn."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    scale = kv_scale(tl.maximum(tl.max(tl.abs(x1), 0), tl.max(tl.abs(x2), 0)), IS_INT8)
    return kv_quantize(x1, scale, IS_INT8), kv_quantize(x2, scale, IS_INT8), scale


@triton.jit
def _qkv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    pos_ptr,
    inv_dim,
    eps,
    block_size,
    stride_t,
    stride_cs,
    stride_qo,
    stride_ko,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    stride_sh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    IS_GEMMA: tl.constexpr,
    IS_QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:
        rope_row = tl.load(pos_ptr + t).to(tl.int64)  # cos/sin are tables: the token's position's row
    else:
        rope_row = t
    head = tl.program_id(1).to(tl.int64)  # query heads first, then KV heads
    half = HEAD_DIM // 2
    d = tl.arange(0, HALF_PAD)
    ok = d < half
    is_q = head < NUM_HEADS
    src = qkv_ptr + t * stride_t + head * HEAD_DIM  # q heads then k heads, back to back in a qkv row
    x1 = tl.load(src + d, mask=ok, other=0.0)  # (HALF_PAD,) first half of the head
    x2 = tl.load(src + half + d, mask=ok, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        if is_q:
            norm_ptr = q_norm_ptr
        else:
            norm_ptr = k_norm_ptr
        w1 = tl.load(norm_ptr + d, mask=ok, other=0.0)
        w2 = tl.load(norm_ptr + half + d, mask=ok, other=0.0)
        inv = tl.rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) * inv_dim + eps)  # inv_dim: see _norm
        if IS_GEMMA:
            a = (a * inv * (1.0 + w1.to(tl.float32))).to(dtype).to(tl.float32)
            b = (b * inv * (1.0 + w2.to(tl.float32))).to(dtype).to(tl.float32)
        else:
            a = (w1.to(tl.float32) * (a * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            b = (w2.to(tl.float32) * (b * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c1 = tl.load(cos_ptr + rope_row * stride_cs + d, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + rope_row * stride_cs + half + d, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + rope_row * stride_cs + d, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + rope_row * stride_cs + half + d, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), each product and the sum rounded;
    # p + (-x2 * s) written p - x2 * s, the same IEEE result (signed zeros included) without a
    # negation, which Triton may compile as 0 - x (-(+0.0) = +0.0)
    r1 = ((a * c1).to(dtype).to(tl.float32) - (b * s1).to(dtype).to(tl.float32)).to(dtype)
    r2 = ((b * c2).to(dtype).to(tl.float32) + (a * s2).to(dtype).to(tl.float32)).to(dtype)
    if is_q:
        dst = q_out_ptr + t * stride_qo + head * HEAD_DIM
        tl.store(dst + d, r1, mask=ok)
        tl.store(dst + half + d, r2, mask=ok)
    else:
        kv_head = head - NUM_HEADS
        dst = k_out_ptr + t * stride_ko + kv_head * HEAD_DIM
        tl.store(dst + d, r1, mask=ok)
        tl.store(dst + half + d, r2, mask=ok)
        slot = tl.load(slot_ptr + t).to(tl.int64) + tl.zeros((HALF_PAD,), tl.int64)  # the token's slot, tiled
        w_ok = ok & (slot >= 0)
        slot = tl.maximum(slot, 0)
        cache = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + kv_head * stride_ch
        v_src = qkv_ptr + t * stride_t + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
        v1 = tl.load(v_src + d, mask=w_ok, other=0.0)
        v2 = tl.load(v_src + half + d, mask=w_ok, other=0.0)
        k1 = r1
        k2 = r2
        if IS_QUANT:
            # quantize_kv of the rotated K (as rounded to the dtype) and of V: one scale per (token,
            # KV head) over both halves of the head
            k1, k2, k_scale = _quantize_halves(r1, r2, IS_INT8)
            v1, v2, v_scale = _quantize_halves(v1, v2, IS_INT8)
            scale_at = (slot // block_size) * stride_sb + (slot % block_size) * stride_st + kv_head * stride_sh
            one = w_ok & (d == 0)  # the head's scale, stored from one lane
            tl.store(k_scale_ptr + scale_at, k_scale + tl.zeros((HALF_PAD,), tl.float32), mask=one)
            tl.store(v_scale_ptr + scale_at, v_scale + tl.zeros((HALF_PAD,), tl.float32), mask=one)
        tl.store(k_cache_ptr + cache + d, k1.to(k_cache_ptr.dtype.element_ty), mask=w_ok)
        tl.store(k_cache_ptr + cache + half + d, k2.to(k_cache_ptr.dtype.element_ty), mask=w_ok)
        tl.store(v_cache_ptr + cache + d, v1.to(v_cache_ptr.dtype.element_ty), mask=w_ok)
        tl.store(v_cache_ptr + cache + half + d, v2.to(v_cache_ptr.dtype.element_ty), mask=w_ok)


def qkv_norm_rope_write(
    qkv: torch.Tensor,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim): q, k, v heads
    heads: QKVHeads,
    cos: torch.Tensor,  # (num_tokens, head_dim) in qkv's dtype; with positions (num_positions, head_dim)
    sin: torch.Tensor,  # as cos
    k_cache,  # (num_blocks, block_size, num_kv_heads, head_dim) tensor, or a QuantizedKVCache
    v_cache,  # the same kind and layout as k_cache
    slot_mapping: torch.Tensor,  # (num_tokens,) int; negative = write nothing
    positions: Optional[torch.Tensor] = None,  # (num_tokens,) int, each < num_positions: cos/sin are tables
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) as (num_tokens, heads, head_dim) with q and k normed and rotated, K and V written
    to the cache (quantized into an int8/fp8 one, bitwise as `QuantizedKVCache.write`):
    `attention_torch.qkv_norm_rope_write_reference` in one launch."""
    num_tokens = qkv.shape[0]
    num_heads, num_kv_heads, head_dim = heads.num_heads, heads.num_kv_heads, heads.head_dim
    c = kv_cache_args(k_cache, v_cache)
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert c.k.stride() == c.v.stride() and head_dim % 2 == 0
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)  # (num_tokens, num_kv_heads, head_dim)
    if num_tokens == 0:
        return q, k, v
    _qkv_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv,
        cos,
        sin,
        heads.q_norm if heads.q_norm is not None else cos,
        heads.k_norm if heads.k_norm is not None else cos,
        q,
        k,
        c.k,
        c.v,
        c.k_scale,
        c.v_scale,
        slot_mapping,
        positions if positions is not None else slot_mapping,
        _inverse(head_dim),
        float(heads.eps),
        c.k.shape[1],
        qkv.stride(0),
        cos.stride(0),
        q.stride(0),
        k.stride(0),
        *c.write_strides,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        HAS_NORM=heads.q_norm is not None,
        IS_GEMMA=heads.is_gemma,
        IS_QUANT=c.is_quant,
        IS_INT8=c.is_int8,
        HAS_POSITIONS=positions is not None,
        enable_fp_fusion=False,
    )
    return q, k, v
