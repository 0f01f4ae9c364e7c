"""The paged KV cache's memory layout, in one place.

Every kernel indexes one layer's K (or V) cache through the logical shape (num_blocks, block_size,
num_kv_heads, head_dim) and its strides; the storage underneath is head-major, (num_kv_heads,
num_blocks, block_size, head_dim), so one block of one head is a contiguous block_size x head_dim
tile (see kernels/attention.py for why). Per-entry side tensors, like the int8 cache's scales
(num_blocks, block_size, num_kv_heads), use the same layout without the trailing dim.
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
