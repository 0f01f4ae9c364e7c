"""The paged KV cache's memory layout, in one place.

Every kernel indexes one layer's K (or V) cache through the logical shape (num_blocks, block_size,
num_kv_heads, head_dim) and its strides; the storage underneath is head-major, (num_kv_heads,
num_blocks, block_size, head_dim), and the engine hands out the permuted view (`new_kv_cache`).
Then one block of one head is a contiguous block_size x head_dim tile, so the torch decode path
gathers a batch's contexts with one `index_select` straight into the (kv_head, sequence, position,
head_dim) order its batched matmuls read, with no second transposing copy. Per-entry side tensors,
like the int8 cache's scales (num_blocks, block_size, num_kv_heads), use the same layout without
the trailing dim.
"""

from __future__ import annotations

import torch


def from_head_major(storage: torch.Tensor) -> torch.Tensor:
    """Head-major storage (num_kv_heads, num_blocks, block_size, ...) seen through the logical
    (num_blocks, block_size, num_kv_heads, ...) shape; a view."""
    return storage.movedim(0, 2)


def slots_by_head(cache: torch.Tensor) -> torch.Tensor:
    """(num_kv_heads, num_blocks * block_size, ...): a view of a head-major cache (a copy of any other)."""
    return cache.movedim(2, 0).flatten(1, 2)


def new_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """One layer's zeroed K (or V) cache in the engine's layout."""
    return from_head_major(torch.zeros((num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device))


def as_kv_cache_layout(cache: torch.Tensor) -> torch.Tensor:
    """A copy of a (num_blocks, block_size, num_kv_heads, head_dim) cache in the engine's layout."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    out = new_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache.dtype, device=cache.device)
    out.copy_(cache)
    return out
