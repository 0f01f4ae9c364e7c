"""Inputs and reference computations shared by the benchmarks and the tests: random attention
batches laid out as the runner builds them (also at the far end of a cache past int32 offsets),
the MoE definition, the error metric.

A library module (no `__main__`): tests import from here, never from a benchmark script.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.attention_torch import write_kv_cache_reference
from batchrun.kernels.kv_layout import from_head_major
from batchrun.kernels.quant.kv import QuantizedKVCache


@dataclass
class AttentionCase:
    q: torch.Tensor  # (num_tokens, num_heads, head_dim)
    # (num_blocks, block_size, num_kv_heads, head_dim) tensor or QuantizedKVCache, this step's keys written
    k_cache: Any
    v_cache: Any
    k_new: torch.Tensor  # (num_tokens, num_kv_heads, head_dim)
    v_new: torch.Tensor
    meta: AttentionMetadata


def attention_case(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    seed: int = 0,
    kv_cache_dtype: Optional[torch.dtype] = None,
) -> AttentionCase:
    """A flattened batch like the runner builds: per sequence (cached tokens, new tokens); one new
    token makes it a decode. Blocks are shuffled across sequences and the cache holds random K/V
    around them, so wrong block arithmetic reads wrong numbers. With `kv_cache_dtype` (int8 or
    float8_e4m3fn) the caches are QuantizedKVCaches holding the same entries quantized."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.long)  # (num_seqs, max_blocks)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = order[used : used + nb]
        used += nb
    query_start_loc = [0]
    for _, n in seqs:
        query_start_loc.append(query_start_loc[-1] + n)
    num_tokens = query_start_loc[-1]
    slots = [
        int(block_tables[i, p // block_size]) * block_size + p % block_size
        for i, (c, n) in enumerate(seqs)
        for p in range(c, c + n)
    ]
    # Drawn where they live: a GPU case holds hundreds of millions of cache entries.
    dev_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=dev_gen, device=device).to(dtype)

    # the engine's head-major layout (kernels/attention.py), seen through the logical shape
    k_cache: Union[torch.Tensor, QuantizedKVCache]
    v_cache: Union[torch.Tensor, QuantizedKVCache]
    k_cache, v_cache = (from_head_major(randn(num_kv_heads, num_blocks, block_size, head_dim)) for _ in range(2))
    if kv_cache_dtype is not None:
        k_cache, v_cache = quantized_copy(k_cache, kv_cache_dtype), quantized_copy(v_cache, kv_cache_dtype)
    q = randn(num_tokens, num_heads, head_dim)
    k_new, v_new = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    write_kv_cache_reference(k_cache, v_cache, k_new, v_new, slot_mapping)
    decode_ids = [i for i, (_, n) in enumerate(seqs) if n == 1]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=[c + n for c, n in seqs],
        block_tables=block_tables.to(device),
        block_size=block_size,
        decode_seq_ids=torch.tensor(decode_ids, dtype=torch.long, device=device),
        decode_seq_lens=torch.tensor([seqs[i][0] + 1 for i in decode_ids], dtype=torch.long, device=device),
        prefill_seq_ids=[i for i, (_, n) in enumerate(seqs) if n != 1],
    )
    return AttentionCase(q, k_cache, v_cache, k_new, v_new, meta)


@dataclass
class FarCase:
    """A batch whose blocks sit at the far end of a KV cache large enough that int32 offsets wrap."""

    small: AttentionCase  # the same batch on a small cache: what the far one must reproduce
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim), head-major storage
    v_cache: torch.Tensor
    meta: AttentionMetadata  # the small case's batch with every block id moved to the far end
    num_blocks: int


def far_blocks_case(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float16,
    device: Any = "cpu",
    seed: int = 0,
) -> FarCase:
    """`attention_case(seqs, ...)` again on a cache whose head stride (num_blocks * block_size *
    head_dim) is just over 2**30, so KV head 2 starts past 2**31 elements while every stride and
    index still fits in int32: exactly where an int32 product such as `kv_head * stride_kh` wraps.
    The small case's blocks are copied to the cache's last blocks; nothing else of it is written
    or read, so on a CPU `torch.empty` maps virtual memory only and the case costs the pages of
    those blocks (on a GPU it allocates 3 * 2**30 elements per cache)."""
    assert num_kv_heads >= 3, "head 2 is the first past 2**31"
    num_blocks = (1 << 30) // (block_size * head_dim) + 8
    small = attention_case(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed)
    shift = num_blocks - small.k_cache.shape[0]  # small block b is far block b + shift

    def far_like(cache: torch.Tensor) -> torch.Tensor:
        storage = torch.empty((num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device)
        far = from_head_major(storage)
        assert far.stride(2) * 2 >= 2**31 > far.stride(2)
        far[shift:] = cache
        return far

    m = small.meta
    meta = AttentionMetadata(
        slot_mapping=m.slot_mapping + shift * block_size,
        query_start_loc=m.query_start_loc,
        seq_lens=m.seq_lens,
        block_tables=m.block_tables + shift,
        block_size=block_size,
        decode_seq_ids=m.decode_seq_ids,
        decode_seq_lens=m.decode_seq_lens,
        prefill_seq_ids=m.prefill_seq_ids,
    )
    return FarCase(small, far_like(small.k_cache), far_like(small.v_cache), meta, num_blocks)


def quantized_copy(cache: torch.Tensor, kv_cache_dtype: torch.dtype) -> QuantizedKVCache:
    """An int8/fp8 cache holding a float cache's (num_blocks, block_size, num_kv_heads, head_dim)
    entries, quantized as the engine's cache write quantizes them."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    out = QuantizedKVCache.empty(tuple(cache.shape), kv_cache_dtype, cache.dtype, cache.device)
    num_slots = num_blocks * block_size
    out.write(cache.reshape(num_slots, num_kv_heads, head_dim), torch.arange(num_slots, device=cache.device))
    return out


def rel_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, ||got - want|| / ||want||) in float64."""
    diff = got.double() - want.double()
    return diff.abs().max().item(), (diff.norm() / want.double().norm().clamp_min(1e-30)).item()


def moe_per_token(x, gate_up, down, weights, ids):
    """The definition: a Python loop over tokens and their k experts."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += float(weights[t, j]) * (down[e] @ (F.silu(g) * u))
    return out
