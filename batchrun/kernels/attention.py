"""Attention over a paged KV cache for a flattened batch of tokens, in plain torch.

This is the CPU path and the reference that GPU kernels are checked against. The batch holds
sequences back to back with no padding: sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, which are the last `query_len` positions of its
`seq_len` tokens of context; its keys and values live in the cache blocks listed in its row of
`block_tables`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: list[int]  # (num_seqs + 1,) where each sequence's query rows start
    seq_lens: list[int]  # (num_seqs,) context length after this step, new tokens included
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int64, padded with 0
    block_size: int
    decode_seq_ids: torch.Tensor  # (num_decode,) indices of sequences with exactly one query token
    decode_seq_lens: torch.Tensor  # (num_decode,) int64 context lengths of those sequences
    prefill_seq_ids: list[int]  # sequences with more than one query token, attended one by one


def write_kv_cache(
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _attend(
    q: torch.Tensor,  # (batch, num_heads, q_len, head_dim)
    k: torch.Tensor,  # (batch, num_kv_heads, kv_len, head_dim)
    v: torch.Tensor,  # (batch, num_kv_heads, kv_len, head_dim)
    mask: torch.Tensor,  # (batch, 1, q_len, kv_len) bool, True where attention is allowed
    scale: float,
    softcap: Optional[float],
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # Logit soft-capping (Gemma 2 style) has no SDPA flag, so it takes the explicit path.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), this step's keys already written
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    meta: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached context.

    A key at position j is visible to the query at position i when j <= i and, with a sliding
    window W, j > i - W (the convention of HF transformers' masks).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    block_size = meta.block_size

    if meta.decode_seq_ids.numel() > 0:
        # Decodes are batched: gather each sequence's context, padded to the longest, and mask.
        seq_ids = meta.decode_seq_ids
        seq_lens = meta.decode_seq_lens
        max_len = int(seq_lens.max())
        num_blocks = (max_len + block_size - 1) // block_size
        tables = meta.block_tables[seq_ids, :num_blocks]  # (num_decode, num_blocks)
        k = k_cache[tables].flatten(1, 2)[:, :max_len]  # (num_decode, max_len, num_kv_heads, head_dim)
        v = v_cache[tables].flatten(1, 2)[:, :max_len]
        key_pos = torch.arange(max_len)
        mask = key_pos[None, :] < seq_lens[:, None]  # (num_decode, max_len)
        if sliding_window is not None:
            mask &= key_pos[None, :] > (seq_lens[:, None] - 1 - sliding_window)
        rows = torch.tensor([meta.query_start_loc[i] for i in seq_ids.tolist()], dtype=torch.long)
        qd = q[rows].unsqueeze(2)  # (num_decode, num_heads, 1, head_dim)
        o = _attend(qd, k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], scale, softcap)
        out[rows] = o.squeeze(2)

    for i in meta.prefill_seq_ids:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        q_len, seq_len = end - start, meta.seq_lens[i]
        num_blocks = (seq_len + block_size - 1) // block_size
        table = meta.block_tables[i, :num_blocks]
        slots = (table[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:seq_len]
        k = flat_k[slots].transpose(0, 1).unsqueeze(0)  # (1, num_kv_heads, seq_len, head_dim)
        v = flat_v[slots].transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(seq_len - q_len, seq_len)
        key_pos = torch.arange(seq_len)
        mask = key_pos[None, :] <= q_pos[:, None]  # (q_len, seq_len)
        if sliding_window is not None:
            mask &= key_pos[None, :] > (q_pos[:, None] - sliding_window)
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # (1, num_heads, q_len, head_dim)
        o = _attend(qp, k, v, mask[None, None], scale, softcap)
        out[start:end] = o[0].transpose(0, 1)
    return out
