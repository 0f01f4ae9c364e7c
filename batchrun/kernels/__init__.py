"""Compute kernels: plain-torch references (the CPU path) and, later, Triton versions for the GPU."""
from batchrun.kernels.attention import AttentionMetadata, paged_attention, write_kv_cache

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]
