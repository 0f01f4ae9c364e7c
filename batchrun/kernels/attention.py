"""Paged attention and the KV-cache write, dispatched to a backend.

One call per layer and step, for a flattened batch of tokens (kernels/attention_metadata.py) over a
paged cache (kernels/kv_layout.py). Float caches and int8/fp8 QuantizedKVCaches (engine.kv_cache_dtype;
fp8 on GPUs of compute capability 8.9 and up) on a CUDA device with triton installed take the
Triton kernels (kernels/triton_attention.py, kernels/triton_kv.py, kernels/triton_elementwise.py),
which never sync with the host, so decode steps capture in CUDA graphs; everything else takes the
CPU path (kernels/cpu_attention.py: native kernels where they serve, plain torch for the rest). The
plain-torch reference both are checked against is kernels/attention_torch.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from batchrun.kernels import cpu_attention
from batchrun.kernels import elementwise as ew
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.attention_torch import write_kv_cache_reference
from batchrun.kernels.backend import triton_fp8_usable, triton_usable
from batchrun.kernels.qkv_heads import QKVHeads
from batchrun.kernels.quant.kv import QuantizedKVCache


def _triton_serves(x: torch.Tensor, k_cache) -> bool:
    """The Triton kernels serve float caches and int8/fp8 QuantizedKVCaches where Triton runs (fp8
    where the GPU converts it); the rest takes the torch path, which syncs with the host and so
    keeps decode steps out of CUDA graphs."""
    if not triton_usable(x):
        return False
    if isinstance(k_cache, QuantizedKVCache):
        return k_cache.dtype == torch.int8 or triton_fp8_usable(x.device)
    return isinstance(k_cache, torch.Tensor)


def write_kv_cache(
    k_cache,  # (num_blocks, block_size, num_kv_heads, head_dim) tensor, or a QuantizedKVCache
    v_cache,  # the same kind and layout as k_cache
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> None:
    """Store this step's K and V rows at their cache slots (a negative slot: nothing). An int8/fp8
    cache (engine.kv_cache_dtype) quantizes them on the way: in the Triton kernel, natively for
    int8 on the CPU, else in QuantizedKVCache.write."""
    if _triton_serves(k, k_cache):
        from batchrun.kernels.triton_kv import write_kv_cache as write_kv_cache_triton

        write_kv_cache_triton(k_cache, v_cache, k, v, slot_mapping)
        return
    if cpu_attention.write_kv_cache(k_cache, v_cache, k, v, slot_mapping):
        return
    write_kv_cache_reference(k_cache, v_cache, k, v, slot_mapping)


def qkv_norm_rope_write(
    qkv: torch.Tensor,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim): q, k, v heads
    heads: QKVHeads,
    cos: torch.Tensor,  # (num_tokens, head_dim) in qkv's dtype; with positions (num_positions, head_dim)
    sin: torch.Tensor,  # as cos
    k_cache,  # (num_blocks, block_size, num_kv_heads, head_dim), or a QuantizedKVCache
    v_cache,
    slot_mapping: torch.Tensor,  # (num_tokens,)
    positions: Optional[torch.Tensor] = None,  # (num_tokens,): cos/sin are tables, row p for position p
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the fused qkv projection: (q, k, v) per head, q and k normed and rotated, K and V stored
    at their cache slots. One Triton launch where Triton serves the cache (instead of the norms',
    rotary's and the write's separate kernels; it reads each token's cos/sin row from the tables
    itself); elsewhere those ops one by one, each on its own fastest path. Both equal
    `attention_torch.qkv_norm_rope_write_reference`."""
    if _triton_serves(qkv, k_cache) and qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride():
        from batchrun.kernels.triton_elementwise import qkv_norm_rope_write as fused

        return fused(qkv, heads, cos, sin, k_cache, v_cache, slot_mapping, positions)
    if positions is not None:
        cos, sin = cos[positions], sin[positions]  # (num_tokens, head_dim)
    q, k, v = heads.split(qkv)
    if heads.norms is not None:
        (q_norm, k_norm), eps, gemma = heads.norms, heads.eps, heads.is_gemma
        q, k = ew.rms_norm(q, q_norm, eps, gemma), ew.rms_norm(k, k_norm, eps, gemma)
    q, k = ew.apply_rotary(q, cos, sin), ew.apply_rotary(k, cos, sin)
    write_kv_cache(k_cache, v_cache, k, v, slot_mapping)
    return q, k, v


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache,  # (num_blocks, block_size, num_kv_heads, head_dim) or a QuantizedKVCache, this step's keys written
    v_cache,  # the same kind and layout as k_cache
    meta: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    k_new: Optional[torch.Tensor] = None,  # (num_tokens, num_kv_heads, head_dim): this step's keys, if at hand
    v_new: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached context.

    A key at position j is visible to the query at position i when j <= i and, with a sliding
    window W, j > i - W (the convention of HF transformers' masks).

    meta.batch_invariant (engine.batch_invariant): every sequence is a prefill and each backend
    computes a row's attention in an order fixed by the row alone (its position, window and the
    kernel's tile size), never by the number of rows, the query length or where the chunk began.
    """
    if _triton_serves(q, k_cache):
        from batchrun.kernels.triton_attention import paged_attention as paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_new, v_new)
    return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_new, v_new)
