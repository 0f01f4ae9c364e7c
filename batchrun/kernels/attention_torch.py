"""Attention over the paged KV cache in plain torch: the reference every kernel is checked against,
and the pieces the CPU path (kernels/cpu_attention.py) runs for what its native kernels do not serve.

Decodes (one query row per sequence) gather their contexts with `gather_blocks` and run as grouped
batched matmuls (`decode_attend`); decodes that share their leading cache blocks attend to that
prefix once (`decode_attend_shared`, cascade attention); prefills run one SDPA call per sequence
(`attend_prefills`). Visibility: a key at position j is visible to the query at position i when
j <= i and, with a sliding window W, j > i - W (the convention of HF transformers' masks).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from batchrun.kernels import elementwise as ew
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.kv_layout import slots_by_head
from batchrun.kernels.qkv_heads import QKVHeads
from batchrun.kernels.quant.kv import QuantizedKVCache


def gather_blocks(cache, tables: torch.Tensor) -> torch.Tensor:
    """(num_kv_heads, num_seqs, num_blocks * block_size, head_dim): the cache blocks listed in each
    row of `tables` (num_seqs, num_blocks), in the order the batched matmuls read them."""
    if isinstance(cache, QuantizedKVCache):
        return cache.gather_blocks(tables)
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    by_block = slots_by_head(cache).reshape(num_kv_heads, num_blocks, block_size * head_dim)  # a view if head-major
    return by_block.index_select(1, tables.flatten()).view(num_kv_heads, tables.shape[0], -1, head_dim)


def gather_slots(cache, slots: torch.Tensor) -> torch.Tensor:
    """(num_kv_heads, len(slots), head_dim): the entries at flat slots (block * block_size + offset)."""
    if isinstance(cache, QuantizedKVCache):
        return cache.gather_slots(slots)
    return slots_by_head(cache).index_select(1, slots)


def write_kv_cache_reference(
    k_cache: Union[torch.Tensor, QuantizedKVCache],  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: Union[torch.Tensor, QuantizedKVCache],  # (num_blocks, block_size, num_kv_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> None:
    """The plain-torch cache write, and what triton_kv.write_kv_cache is checked against. Any cache
    layout (flattening the two leading dims is a view of every layout used); an int8/fp8
    QuantizedKVCache quantizes on its own write."""
    if isinstance(k_cache, QuantizedKVCache):
        assert isinstance(v_cache, QuantizedKVCache), "K and V caches share one dtype"
        k_cache.write(k, slot_mapping)
        v_cache.write(v, slot_mapping)
        return
    assert isinstance(v_cache, torch.Tensor)
    k_cache.flatten(0, 1).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.flatten(0, 1).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _attend(
    q: torch.Tensor,  # (batch, num_heads, q_len, head_dim)
    k: torch.Tensor,  # (batch, num_kv_heads, kv_len, head_dim)
    v: torch.Tensor,  # (batch, num_kv_heads, kv_len, head_dim)
    mask: Optional[torch.Tensor],  # (batch, 1, q_len, kv_len) bool, True where allowed; None = causal
    scale: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """Attention for one or more sequences of equal shape (SDPA's fused CPU kernel when it can)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    # Logit soft-capping (Gemma 2 style) has no SDPA flag, so it takes the explicit path.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _scores(
    q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor], scale: float, softcap: Optional[float]
) -> torch.Tensor:
    """float32 logits q @ k.T * scale, soft-capped if asked, -inf where `mask` (broadcast) is False."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def decode_attend(
    q: torch.Tensor,  # (batch, num_heads, head_dim): one query per sequence
    k: torch.Tensor,  # (num_kv_heads, batch, kv_len, head_dim) padded contexts (gather_blocks)
    v: torch.Tensor,  # (num_kv_heads, batch, kv_len, head_dim)
    mask: torch.Tensor,  # (batch, kv_len) bool, True where allowed
    scale: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """Single-query attention as grouped batched matmuls: the query heads that share a KV head are
    one matrix, so KV is never repeated, and the masked softmax runs in float32. K and V are read in
    the layout they were gathered in (K through a transposed view). (SDPA's CPU kernel with a mask
    is several times slower than this for one query in bf16.)"""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = _scores(qg, k, mask[None, :, None, :], scale, softcap)  # (num_kv_heads, batch, group, kv_len)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, v)  # (num_kv_heads, batch, group, head_dim)
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)


def _partial_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    softcap: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalized attention of q (..., rows, dim) over k, v (..., keys, dim): (out float32
    (..., rows, dim), row max (..., rows, 1), row sum of exp (..., rows, 1)), to be merged."""
    scores = _scores(q, k, mask, scale, softcap)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)  # rows with no key
    weights = torch.exp(scores - row_max)
    out = torch.matmul(weights.to(v.dtype), v).float()
    return out, row_max, weights.sum(dim=-1, keepdim=True)


def decode_attend_shared(
    q: torch.Tensor,  # (batch, num_heads, head_dim)
    k_cache,
    v_cache,
    shared_blocks: torch.Tensor,  # (num_shared,) block ids every sequence starts with
    tables: torch.Tensor,  # (batch, num_blocks) the rest of each sequence's blocks
    mask: torch.Tensor,  # (batch, num_blocks * block_size) for the rest
    scale: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """Decode attention split at a prefix every sequence shares (cascade attention): all queries
    attend to the shared blocks in one matmul, gathered once instead of once per sequence, each
    sequence attends to its own remaining blocks as in decode_attend, and the two partial softmaxes
    are merged exactly by their row maxima and sums."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)  # (num_kv_heads, batch, group, head_dim)
    k_shared = gather_blocks(k_cache, shared_blocks[None])[:, 0]  # (num_kv_heads, shared_len, head_dim)
    v_shared = gather_blocks(v_cache, shared_blocks[None])[:, 0]
    o1, m1, l1 = _partial_attend(
        qg.reshape(num_kv_heads, batch * group, head_dim), k_shared, v_shared, None, scale, softcap
    )
    o1, m1, l1 = (t.view(num_kv_heads, batch, group, -1) for t in (o1, m1, l1))
    if tables.shape[1] == 0:
        out = o1 / l1
    else:
        k, v = gather_blocks(k_cache, tables), gather_blocks(v_cache, tables)  # (num_kv_heads, batch, len, head_dim)
        o2, m2, l2 = _partial_attend(qg, k, v, mask[None, :, None, :], scale, softcap)
        m = torch.maximum(m1, m2)
        a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
        out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
    return out.to(q.dtype).transpose(0, 1).reshape(batch, num_heads, head_dim)


def attend_decodes(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int],
    softcap: Optional[float],
) -> None:
    """The decode rows of `out` (num_tokens, num_heads, head_dim), group by group (decode_groups)."""
    for rows, tables, mask, num_shared in meta.decode_groups(sliding_window):
        if num_shared:
            out[rows] = decode_attend_shared(
                q[rows],
                k_cache,
                v_cache,
                tables[0, :num_shared],
                tables[:, num_shared:],
                mask[:, num_shared * meta.block_size :],
                scale,
                softcap,
            )
        else:
            k, v = gather_blocks(k_cache, tables), gather_blocks(v_cache, tables)
            out[rows] = decode_attend(q[rows], k, v, mask, scale, softcap)


def attend_prefills(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    prefill_ids: list[int],
    scale: float,
    sliding_window: Optional[int],
    softcap: Optional[float],
    k_new: Optional[torch.Tensor],
    v_new: Optional[torch.Tensor],
) -> None:
    """The query rows of each listed prefilling sequence, one SDPA call each. A fresh prompt (no
    cached context, no window) attends to `k_new`/`v_new` when given instead of reading the cache."""
    for i in prefill_ids:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        slots, mask = meta.prefill_inputs(i, sliding_window)
        if slots is None and k_new is not None and v_new is not None:  # given together or not at all
            k, v = k_new[start:end].transpose(0, 1), v_new[start:end].transpose(0, 1)  # a fresh prompt: all new
        else:
            if slots is None:
                slots = meta.slot_mapping[start:end]
            k, v = gather_slots(k_cache, slots), gather_slots(v_cache, slots)  # (num_kv_heads, seq_len, head_dim)
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # (1, num_heads, q_len, head_dim)
        o = _attend(qp, k.unsqueeze(0), v.unsqueeze(0), None if mask is None else mask[None, None], scale, softcap)
        out[start:end] = o[0].transpose(0, 1)


def attend_rows_invariant(
    out: torch.Tensor,
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    seq_ids: list[int],
    scale: float,
    sliding_window: Optional[int],
    softcap: Optional[float],
) -> None:
    """The query rows of each listed sequence (any query length, a decode included), each row's
    result independent of how many rows run with it (engine.batch_invariant's torch path).

    Scores and the probability-weighted sum run in float64 over the row's keys read from the cache:
    a product of two bf16 (or float32) values is exact in float64 and a head_dim-long sum of them
    as good as exact, so the matmuls' blocking (which follows the number of query rows) cannot
    reach the float32 result; the softmax's float64 rounding is ~2^-29 of a float32 step. Slow
    (float64, one sequence at a time): for shapes the native kernels do not serve."""
    num_heads = q.shape[1]
    for i in seq_ids:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len, q_len = meta.seq_lens[i], end - start
        num_blocks = -(-seq_len // meta.block_size)
        device = meta.block_tables.device
        table = meta.block_tables[i, :num_blocks]
        offsets = torch.arange(meta.block_size, device=device)
        slots = (table[:, None] * meta.block_size + offsets[None, :]).flatten()[:seq_len]
        k = gather_slots(k_cache, slots).double()  # (num_kv_heads, seq_len, head_dim)
        v = gather_slots(v_cache, slots).double()
        group = num_heads // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # (num_heads, seq_len, head_dim)
        qh = q[start:end].transpose(0, 1).double()  # (num_heads, q_len, head_dim)
        s = torch.matmul(qh, k.transpose(1, 2)) * scale  # (num_heads, q_len, seq_len)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        key_pos = torch.arange(seq_len, device=device)
        visible = key_pos[None, :] <= q_pos[:, None]  # (q_len, seq_len)
        if sliding_window is not None:
            visible &= key_pos[None, :] > (q_pos[:, None] - sliding_window)
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:end] = torch.matmul(p, v).transpose(0, 1).to(out.dtype)


def qkv_norm_rope_write_reference(
    qkv: torch.Tensor,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim): q, k, v heads
    heads: QKVHeads,
    cos: torch.Tensor,  # (num_tokens, head_dim) in qkv's dtype; with positions (num_positions, head_dim)
    sin: torch.Tensor,  # as cos
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int, every slot >= 0
    positions: Optional[torch.Tensor] = None,  # (num_tokens,): cos/sin are tables, row p for position p
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) with q and k normed (Qwen3, Gemma 3) and rotated, and K and V written to the cache:
    what triton_elementwise.qkv_norm_rope_write is checked against."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]  # (num_tokens, head_dim)
    q, k, v = heads.split(qkv)
    if heads.norms is not None:
        (q_norm, k_norm), eps, gemma = heads.norms, heads.eps, heads.is_gemma
        q, k = ew.rms_norm_reference(q, q_norm, eps, gemma), ew.rms_norm_reference(k, k_norm, eps, gemma)
    q, k = ew.apply_rotary_reference(q, cos, sin), ew.apply_rotary_reference(k, cos, sin)
    write_kv_cache_reference(k_cache, v_cache, k, v, slot_mapping)
    return q, k, v


def paged_attention_reference(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), this step's keys already written
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    meta: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    k_new: Optional[torch.Tensor] = None,  # (num_tokens, num_kv_heads, head_dim): this step's keys, if at hand
    v_new: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached context, in plain torch:
    what triton_attention.paged_attention and cpu_attention.paged_attention_cpu are checked against."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (num_tokens, num_heads, head_dim)
    if meta.decode_seq_ids.numel() > 0:
        attend_decodes(out, q, k_cache, v_cache, meta, scale, sliding_window, softcap)
    attend_prefills(out, q, k_cache, v_cache, meta, meta.prefill_seq_ids, scale, sliding_window, softcap, k_new, v_new)
    return out
