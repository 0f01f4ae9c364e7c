"""Triton GEMMs that finish what the next small kernel of a decoder layer would do, so a decode
step launches one kernel where it launched two.

- `gemm_silu_mul`: the gate/up projection with silu(gate) * up in its epilogue. One program computes
  a (BLOCK_M, BLOCK_N) tile of the gate columns and the matching tile of the up columns (two dots
  per K step over two weight tiles), rounds each to the dtype as the projection's output is
  rounded, and stores silu(g) * up rounded as `triton_elementwise.silu_mul` rounds it.
- `gemm_logits`: the LM head with the float32 cast of its output in its epilogue (each logit rounded
  to the dtype first, as the projection's output is, then widened).
- `gemm_qkv_norm_rope_write`: the qkv projection with q/k-norm, rotary and the KV write in its
  epilogue. One program computes a (BLOCK_M, head_dim) tile: one head of BLOCK_M tokens, its two
  halves as two dots (rotary pairs column d with d + head_dim / 2, so each half is a tile of its
  own and no register shuffles are needed), then does what `triton_elementwise._qkv_kernel` does for
  that head, in the same order and with the same roundings: the bias, the round to the dtype, the
  q/k-norm over the whole head, the rotation by each token's cos/sin row (tables indexed by
  position, or rows given per token), the stores of q, k and v, and K/V at each token's slot (a
  negative slot writes nothing: the CUDA-graph padding convention). Float caches only.

So each differs from the unfused pair (a GEMM, then the elementwise kernel) only in the GEMM's sum
order, which is cuBLAS's own choice there; everything after the sum is the same float32 op
sequence (`enable_fp_fusion=False`, as in triton_elementwise). Half-precision activations only:
a float32 model keeps cuBLAS's GEMMs (kernels/fused_projections.py says why).

Tiles come from the caller (kernels/fused_projections.py: the start-up tuning's choice, or
kernels/gemm_tiles.py's table), with no split-K: at few rows the unfused pair may be faster, and
start-up tuning times both on the GPU and keeps the faster per row bucket. `gpu`: the GPU a
launch is sized for (pipeline stages by its shared memory; None: Triton's interpreter). Offsets
are int64 (rows times strides pass 2**31 on long batches).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import triton
import triton.language as tl

from batchrun.kernels.gemm_tiles import GemmConfig, default_config
from batchrun.kernels.qkv_heads import QKVHeads
from batchrun.kernels.target import GpuTarget
from batchrun.kernels.triton_attention import _dot_f32
from batchrun.kernels.triton_elementwise import _inverse


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b; with DOT_F32 the operands upcast first (`triton_attention._dot_f32`: the
    interpreter multiplies bf16 tiles as raw integers). float32 operands (tests only: the dispatch
    fuses half-precision models) multiply in IEEE float32, not TF32."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])  # the step's token count: one compiled variant for all
def _gemm_silu_mul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,  # columns of the output: the intermediate size (the weight has 2 N rows, gate then up)
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gate = w_ptr + offs_n[None, :] * stride_wn
    up = w_ptr + (offs_n + N)[None, :] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[None, :] & k_ok[:, None]
        acc_g = _dot(x, tl.load(gate + k[:, None], mask=w_mask, other=0.0), acc_g, DOT_F32)  # (BLOCK_K, BLOCK_N)
        acc_u = _dot(x, tl.load(up + k[:, None], mask=w_mask, other=0.0), acc_u, DOT_F32)
    dtype = y_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)  # the projection's output, rounded
    u = acc_u.to(dtype).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)  # silu rounded, then the product (silu_mul's order)
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], (s * u).to(dtype), mask=m_ok[:, None] & n_ok[None, :]
    )


def gemm_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, config: Optional[GemmConfig] = None, gpu: Optional[GpuTarget] = None
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) of x (M, K) and weight (2 N, K) (gate rows, then up rows), in
    x's dtype: `silu_mul(F.linear(x, weight))` in one launch. `config`: the tiling (None: the
    table's for the weight's shape), without split-K."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[0] % 2 == 0
    m, k = x.shape
    n = weight.shape[0] // 2
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # (M, N)
    if m == 0:
        return y

    def run(c: GemmConfig) -> None:
        c = _fit(c, x, 2 * c.block_n, gpu)
        grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n))
        _gemm_silu_mul_kernel[grid](
            x,
            weight,
            y,
            m,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            BLOCK_M=c.block_m,
            BLOCK_N=c.block_n,
            BLOCK_K=c.block_k,
            DOT_F32=_dot_f32(x.dtype),
            num_warps=c.num_warps,
            num_stages=c.num_stages,
            enable_fp_fusion=False,
        )

    run(config or default_config(m, 2 * n, k, 0, None))
    return y


@triton.jit(do_not_specialize=["M"])
def _gemm_logits_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w_ptr + offs_n[None, :] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(x, tl.load(w + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0), acc, DOT_F32)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # the projection's output in x's dtype, then float32
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], logits, mask=m_ok[:, None] & n_ok[None, :])


def gemm_logits(
    x: torch.Tensor, weight: torch.Tensor, config: Optional[GemmConfig] = None, gpu: Optional[GpuTarget] = None
) -> torch.Tensor:
    """`F.linear(x, weight).float()` of x (M, K) and weight (N, K) in one launch: (M, N) float32, each
    value the projection's output rounded to x's dtype (the LM head's logits, cast as the unfused
    path casts them)."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)  # (M, N)
    if m == 0:
        return y

    def run(c: GemmConfig) -> None:
        c = _fit(c, x, c.block_n, gpu)
        grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n))
        _gemm_logits_kernel[grid](
            x,
            weight,
            y,
            m,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            BLOCK_M=c.block_m,
            BLOCK_N=c.block_n,
            BLOCK_K=c.block_k,
            DOT_F32=_dot_f32(x.dtype),
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )

    run(config or default_config(m, n, k, 0, None))
    return y


def _fit(c: GemmConfig, x: torch.Tensor, weight_cols: int, target: Optional[GpuTarget]) -> GemmConfig:
    """`c` without split-K and with as many pipeline stages as the GPU's shared memory per block
    holds: each stage keeps an x tile (block_m, block_k) and weight tiles of `weight_cols` columns
    (block_k, weight_cols) in x's dtype. The table's stages are sized for the single-weight-tile
    quantized GEMMs; two bf16 weight tiles at 4 stages pass an sm_89's 99 KB. `target`: the GPU
    (None: Triton's interpreter, no limit)."""
    stages = c.num_stages
    if target is not None:
        stage_bytes = (c.block_m + weight_cols) * c.block_k * x.element_size()
        stages = max(1, min(stages, target.max_shared // stage_bytes))
    if c.split_k == 1 and stages == c.num_stages:
        return c
    return replace(c, split_k=1, num_stages=stages)


@triton.jit(do_not_specialize=["M"])
def _gemm_qkv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_out_ptr,
    k_out_ptr,
    v_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    pos_ptr,
    M,
    K,
    inv_dim,
    eps,
    block_size,
    stride_xm,
    stride_wn,
    stride_cs,
    stride_qo,
    stride_ko,
    stride_vo,
    stride_cb,
    stride_ct,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    IS_GEMMA: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)  # query heads first, then K's, then V's
    half = HEAD_DIM // 2
    d = tl.arange(0, HALF_PAD)
    d_ok = d < half
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    col1 = head * HEAD_DIM + d  # (HALF_PAD,) the head's first half: qkv columns, weight rows
    col2 = col1 + half
    acc1 = tl.zeros((BLOCK_M, HALF_PAD), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, HALF_PAD), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = d_ok[None, :] & k_ok[:, None]
        acc1 = _dot(x, tl.load(w_ptr + col1[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0), acc1, DOT_F32)
        acc2 = _dot(x, tl.load(w_ptr + col2[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0), acc2, DOT_F32)
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + col1, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(b_ptr + col2, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    a = acc1.to(dtype)  # (BLOCK_M, HALF_PAD): the projection's output, rounded (zero past half)
    b = acc2.to(dtype)
    tile = m_ok[:, None] & d_ok[None, :]
    if head >= NUM_HEADS + NUM_KV_HEADS:  # a V head: stored as projected, and at the tokens' slots
        v_head = head - NUM_HEADS - NUM_KV_HEADS
        v_dst = v_out_ptr + offs_m[:, None] * stride_vo + v_head * HEAD_DIM + d[None, :]
        tl.store(v_dst, a, mask=tile)
        tl.store(v_dst + half, b, mask=tile)
        v_slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)  # (BLOCK_M,)
        v_ok = tile & (v_slot >= 0)[:, None]
        v_slot = tl.maximum(v_slot, 0)
        v_at = (v_slot // block_size) * stride_cb + (v_slot % block_size) * stride_ct + v_head * stride_ch
        tl.store(v_cache_ptr + v_at[:, None] + d[None, :], a.to(v_cache_ptr.dtype.element_ty), mask=v_ok)
        tl.store(v_cache_ptr + v_at[:, None] + half + d[None, :], b.to(v_cache_ptr.dtype.element_ty), mask=v_ok)
    else:
        is_q = head < NUM_HEADS
        a32 = a.to(tl.float32)
        b32 = b.to(tl.float32)
        if HAS_NORM:  # _qkv_kernel's q/k-norm, per token over the whole head
            if is_q:
                norm_ptr = q_norm_ptr
            else:
                norm_ptr = k_norm_ptr
            w1 = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(norm_ptr + half + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            inv = tl.rsqrt((tl.sum(a32 * a32, 1) + tl.sum(b32 * b32, 1)) * inv_dim + eps)[:, None]
            if IS_GEMMA:
                a32 = (a32 * inv * (1.0 + w1)).to(dtype).to(tl.float32)
                b32 = (b32 * inv * (1.0 + w2)).to(dtype).to(tl.float32)
            else:
                a32 = (w1 * (a32 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                b32 = (w2 * (b32 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if HAS_POSITIONS:
            rope_row = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)  # tables: each token's row
        else:
            rope_row = offs_m
        rope = rope_row[:, None] * stride_cs + d[None, :]
        c1 = tl.load(cos_ptr + rope, mask=tile, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + rope + half, mask=tile, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + rope, mask=tile, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + rope + half, mask=tile, other=0.0).to(tl.float32)
        # _qkv_kernel's rotation, each product and the sum rounded, p - x2 * s for p + (-x2 * s)
        r1 = ((a32 * c1).to(dtype).to(tl.float32) - (b32 * s1).to(dtype).to(tl.float32)).to(dtype)
        r2 = ((b32 * c2).to(dtype).to(tl.float32) + (a32 * s2).to(dtype).to(tl.float32)).to(dtype)
        if is_q:
            q_dst = q_out_ptr + offs_m[:, None] * stride_qo + head * HEAD_DIM + d[None, :]
            tl.store(q_dst, r1, mask=tile)
            tl.store(q_dst + half, r2, mask=tile)
        else:
            k_head = head - NUM_HEADS
            k_dst = k_out_ptr + offs_m[:, None] * stride_ko + k_head * HEAD_DIM + d[None, :]
            tl.store(k_dst, r1, mask=tile)
            tl.store(k_dst + half, r2, mask=tile)
            k_slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)
            k_write = tile & (k_slot >= 0)[:, None]
            k_slot = tl.maximum(k_slot, 0)
            k_at = (k_slot // block_size) * stride_cb + (k_slot % block_size) * stride_ct + k_head * stride_ch
            tl.store(k_cache_ptr + k_at[:, None] + d[None, :], r1.to(k_cache_ptr.dtype.element_ty), mask=k_write)
            tl.store(k_cache_ptr + k_at[:, None] + half + d[None, :], r2.to(k_cache_ptr.dtype.element_ty), mask=k_write)


def gemm_qkv_norm_rope_write(
    x: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # ((num_heads + 2 * num_kv_heads) * head_dim, hidden): q, k, v rows
    bias: Optional[torch.Tensor],  # (num_heads + 2 * num_kv_heads) * head_dim, or None
    heads: QKVHeads,
    cos: torch.Tensor,  # (num_tokens, head_dim) in x's dtype; with positions (num_positions, head_dim)
    sin: torch.Tensor,  # as cos
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), a float cache
    v_cache: torch.Tensor,  # laid out as k_cache
    slot_mapping: torch.Tensor,  # (num_tokens,) int; negative = write nothing
    positions: Optional[torch.Tensor] = None,  # (num_tokens,): cos/sin are tables, row p for position p
    config: Optional[GemmConfig] = None,  # the tiling; None: the table's
    gpu: Optional[GpuTarget] = None,  # the GPU the launch is sized for; None: the interpreter
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) as (num_tokens, heads, head_dim), q and k normed and rotated, K and V written at
    their slots: `qkv_norm_rope_write(F.linear(x, weight, bias), heads, ...)` in one launch."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1
    assert cos.stride(1) == 1 and sin.stride() == cos.stride() and k_cache.stride() == v_cache.stride()
    m, k = x.shape
    num_heads, num_kv_heads, head_dim = heads.num_heads, heads.num_kv_heads, heads.head_dim
    assert head_dim % 2 == 0 and weight.shape[0] == (num_heads + 2 * num_kv_heads) * head_dim
    q = torch.empty((m, num_heads, head_dim), dtype=x.dtype, device=x.device)
    k_out = torch.empty((m, num_kv_heads, head_dim), dtype=x.dtype, device=x.device)
    v = torch.empty((m, num_kv_heads, head_dim), dtype=x.dtype, device=x.device)
    if m == 0:
        return q, k_out, v

    half_pad = max(16, triton.next_power_of_2(head_dim // 2))  # tl.dot's smallest width

    def run(c: GemmConfig) -> None:
        c = _fit(c, x, 2 * half_pad, gpu)
        grid = (triton.cdiv(m, c.block_m), num_heads + 2 * num_kv_heads)
        _gemm_qkv_kernel[grid](
            x,
            weight,
            bias if bias is not None else weight,
            cos,
            sin,
            heads.q_norm if heads.q_norm is not None else cos,
            heads.k_norm if heads.k_norm is not None else cos,
            q,
            k_out,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            positions if positions is not None else slot_mapping,
            m,
            k,
            _inverse(head_dim),
            float(heads.eps),
            k_cache.shape[1],
            x.stride(0),
            weight.stride(0),
            cos.stride(0),
            q.stride(0),
            k_out.stride(0),
            v.stride(0),
            *k_cache.stride()[:3],
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HALF_PAD=half_pad,
            HAS_BIAS=bias is not None,
            HAS_NORM=heads.q_norm is not None,
            IS_GEMMA=heads.is_gemma,
            HAS_POSITIONS=positions is not None,
            BLOCK_M=c.block_m,
            BLOCK_K=c.block_k,
            DOT_F32=_dot_f32(x.dtype),
            num_warps=c.num_warps,
            num_stages=c.num_stages,
            enable_fp_fusion=False,
        )

    n = weight.shape[0]
    run(config or default_config(m, n, k, 0, None))
    return q, k_out, v
