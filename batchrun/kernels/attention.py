"""The KV-cache write and the attention block's front end (q/k-norm, rotary, KV write) as the kernel
set composes them; paged attention itself is one function per family.

One call per layer and step, for a flattened batch of tokens (kernels/attention_metadata.py) over a
paged cache (kernels/kv_layout.py). A Triton kernel set (kernels/bind_triton.py) binds the Triton
kernels for float caches and int8/fp8 QuantizedKVCaches (engine.kv_cache_dtype; fp8 on GPUs of
compute capability 8.9 and up): kernels/triton_attention.py, kernels/triton_kv.py,
kernels/triton_elementwise.py, which never sync with the host, so decode steps capture in CUDA
graphs. A CPU kernel set binds kernels/cpu_attention.py (native kernels where they are built and
serve the cache, plain torch for the rest). The plain-torch reference both are checked against is
kernels/attention_torch.py.

`paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_new, v_new)`: causal
attention of every query token over its sequence's cached context. A key at position j is visible
to the query at position i when j <= i and, with a sliding window W, j > i - W (the convention of HF
transformers' masks). meta.batch_invariant (engine.batch_invariant): every sequence is a prefill
and each kernel computes a row's attention in an order fixed by the row alone (its position, window
and the kernel's tile size), never by the number of rows, the query length or where the chunk began.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from batchrun.kernels import cpu_attention
from batchrun.kernels.attention_torch import write_kv_cache_reference
from batchrun.kernels.qkv_heads import QKVHeads


def write_kv_cache_native(
    k_cache: Any,  # (num_blocks, block_size, num_kv_heads, head_dim) tensor, or a QuantizedKVCache
    v_cache: Any,  # the same kind and layout as k_cache
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,); negative: write nothing
) -> None:
    """Store this step's K and V rows at their cache slots: one native pass (quantizing into an int8
    cache) where the kernel takes these tensors, else `write_kv_cache_reference` (QuantizedKVCache.write
    for an int8/fp8 cache)."""
    if not cpu_attention.write_kv_cache(k_cache, v_cache, k, v, slot_mapping):
        write_kv_cache_reference(k_cache, v_cache, k, v, slot_mapping)


def qkv_norm_rope_write_separate(
    qkv: torch.Tensor,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim): q, k, v heads
    heads: QKVHeads,
    cos: torch.Tensor,  # (num_tokens, head_dim) in qkv's dtype; with positions (num_positions, head_dim)
    sin: torch.Tensor,  # as cos
    k_cache: Any,  # (num_blocks, block_size, num_kv_heads, head_dim), or a QuantizedKVCache
    v_cache: Any,
    slot_mapping: torch.Tensor,  # (num_tokens,)
    positions: Optional[torch.Tensor] = None,  # (num_tokens,): cos/sin are tables, row p for position p
    *,
    rms_norm: Callable[..., torch.Tensor],
    apply_rotary: Callable[..., torch.Tensor],
    write_kv_cache: Callable[..., None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the fused qkv projection: (q, k, v) per head, q and k normed and rotated, K and V stored
    at their cache slots, by the kernel set's own norm, rotary and write, one after the other. Equals
    `attention_torch.qkv_norm_rope_write_reference`, of the same signature."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]  # (num_tokens, head_dim)
    q, k, v = heads.split(qkv)
    if heads.norms is not None:
        (q_norm, k_norm), eps, gemma = heads.norms, heads.eps, heads.is_gemma
        q, k = rms_norm(q, q_norm, eps, gemma), rms_norm(k, k_norm, eps, gemma)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    write_kv_cache(k_cache, v_cache, k, v, slot_mapping)
    return q, k, v


def qkv_norm_rope_write_triton(
    qkv: torch.Tensor,
    heads: QKVHeads,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: Any,
    v_cache: Any,
    slot_mapping: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    *,
    separate: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_norm_rope_write_separate` in one Triton launch (it reads each token's cos/sin row from
    the tables itself), where the rows and tables have unit last strides; `separate` elsewhere."""
    if qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride():
        from batchrun.kernels.triton_elementwise import qkv_norm_rope_write as fused

        return fused(qkv, heads, cos, sin, k_cache, v_cache, slot_mapping, positions)
    return separate(qkv, heads, cos, sin, k_cache, v_cache, slot_mapping, positions)
