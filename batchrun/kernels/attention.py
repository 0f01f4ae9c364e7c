"""Attention over a paged KV cache for a flattened batch of tokens, in plain torch.

This is the CPU path and the reference that GPU kernels are checked against. The batch holds
sequences back to back with no padding: sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, which are the last `query_len` positions of its
`seq_len` tokens of context; its keys and values live in the cache blocks listed in its row of
`block_tables`.

Cache layout (kernels/kv_layout.py). Every kernel indexes one layer's K (or V) cache as
(num_blocks, block_size, num_kv_heads, head_dim) through its strides, but the engine stores it
head-major, (num_kv_heads, num_blocks, block_size, head_dim), and hands out the permuted view
(`new_kv_cache`). Then one block of one head is a contiguous block_size x head_dim tile, so the CPU
decode path gathers a batch's contexts with one `index_select` straight into the
(kv_head, sequence, position, head_dim) order its batched matmuls read, with no second copy (the
token-major layout needed a gather and then a transposing copy of K and V in every layer).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from batchrun.kernels import cpu_attention
from batchrun.kernels.kv_layout import from_head_major, slots_by_head
from batchrun.kernels.quant import QuantizedKVCache


# Decodes that start with the same cached blocks (a shared system prompt or document) attend to
# that prefix once for all of them (AttentionMetadata.decode_groups, _decode_attend_shared).
MIN_SHARED_SEQS = 2
MIN_SHARED_TOKENS = 64


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
    # Built lazily by the first layer that needs them and shared by the rest of the step.
    _memo: dict = field(default_factory=dict, repr=False)

    def decode_inputs(self, sliding_window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query rows, block tables, key mask) of the batched decodes, for one window size."""
        key = ("decode", sliding_window)
        if key not in self._memo:
            seq_lens = self.decode_seq_lens
            max_len = int(seq_lens.max())
            num_blocks = -(-max_len // self.block_size)
            tables = self.block_tables[self.decode_seq_ids, :num_blocks]  # (num_decode, num_blocks)
            key_pos = torch.arange(num_blocks * self.block_size, device=seq_lens.device)
            mask = key_pos[None, :] < seq_lens[:, None]  # (num_decode, num_blocks * block_size)
            if sliding_window is not None:
                mask &= key_pos[None, :] > (seq_lens[:, None] - 1 - sliding_window)
            rows = torch.tensor([self.query_start_loc[i] for i in self.decode_seq_ids.tolist()],
                                dtype=torch.long, device=seq_lens.device)
            self._memo[key] = (rows, tables, mask)
        return self._memo[key]

    def decode_groups(self, sliding_window: Optional[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        """The batched decodes split for attention: [(query rows, block tables, key mask, num_shared)].

        Decodes whose block tables start with the same blocks (the same cached system prompt or
        document) form a group with num_shared > 0: the leading block columns all of its sequences
        share, with every position inside every context. The rest form one group with num_shared 0.
        Under a sliding window everything stays in one plain group."""
        key = ("groups", sliding_window)
        if key not in self._memo:
            rows, tables, mask = self.decode_inputs(sliding_window)
            groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
            plain = torch.ones(len(rows), dtype=torch.bool, device=rows.device)
            if sliding_window is None and len(rows) >= MIN_SHARED_SEQS:
                first = tables[:, 0]
                values, counts = torch.unique(first, return_counts=True)
                for value in values[counts >= MIN_SHARED_SEQS].tolist():
                    sel = torch.nonzero(first == value).flatten()
                    lens = self.decode_seq_lens[sel]
                    full = int(lens.min()) // self.block_size  # blocks inside every context of the group
                    t = tables[sel]
                    same = (t[:, :full] == t[:1, :full]).all(dim=0)
                    num_shared = int(same.long().cumprod(0).sum()) if full else 0
                    if num_shared * self.block_size < MIN_SHARED_TOKENS:
                        continue
                    width = -(-int(lens.max()) // self.block_size)
                    groups.append((rows[sel], t[:, :width], mask[sel, : width * self.block_size], num_shared))
                    plain[sel] = False
            if bool(plain.all()):
                groups = [(rows, tables, mask, 0)]
            elif bool(plain.any()):
                sel = torch.nonzero(plain).flatten()
                width = -(-int(self.decode_seq_lens[sel].max()) // self.block_size)
                groups.append((rows[sel], tables[sel, :width], mask[sel, : width * self.block_size], 0))
            self._memo[key] = groups
        return self._memo[key]

    def prefill_native_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block tables, first query rows, query lengths, context lengths) of the prefilling
        sequences, as int64 tensors for the native prefill kernel."""
        if "prefill_native" not in self._memo:
            ids = self.prefill_seq_ids
            starts = [self.query_start_loc[i] for i in ids]
            q_lens = [self.query_start_loc[i + 1] - self.query_start_loc[i] for i in ids]
            self._memo["prefill_native"] = (
                self.block_tables[torch.tensor(ids, dtype=torch.long, device=self.block_tables.device)],
                torch.tensor(starts, dtype=torch.long), torch.tensor(q_lens, dtype=torch.long),
                torch.tensor([self.seq_lens[i] for i in ids], dtype=torch.long))
        return self._memo["prefill_native"]

    def prefill_inputs(self, i: int, sliding_window: Optional[int]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(context slots, mask) of prefill sequence i; both None when it has no earlier context
        and no window, so its causal attention runs on the new keys alone."""
        key = ("prefill", i, sliding_window)
        if key not in self._memo:
            q_len = self.query_start_loc[i + 1] - self.query_start_loc[i]
            seq_len = self.seq_lens[i]
            if seq_len == q_len and sliding_window is None:
                self._memo[key] = (None, None)
            else:
                device = self.block_tables.device
                num_blocks = -(-seq_len // self.block_size)
                table = self.block_tables[i, :num_blocks]
                offsets = torch.arange(self.block_size, device=device)
                slots = (table[:, None] * self.block_size + offsets[None, :]).flatten()[:seq_len]
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                key_pos = torch.arange(seq_len, device=device)
                mask = key_pos[None, :] <= q_pos[:, None]  # (q_len, seq_len)
                if sliding_window is not None:
                    mask &= key_pos[None, :] > (q_pos[:, None] - sliding_window)
                self._memo[key] = (slots, mask)
        return self._memo[key]


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> torch.Tensor:
    """One layer's zeroed K (or V) cache in the engine's layout (kernels/kv_layout.py)."""
    return from_head_major(torch.zeros((num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device))


def as_kv_cache_layout(cache: torch.Tensor) -> torch.Tensor:
    """A copy of a (num_blocks, block_size, num_kv_heads, head_dim) cache in the engine's layout."""
    out = new_kv_cache(*cache.shape, dtype=cache.dtype, device=cache.device)
    out.copy_(cache)
    return out


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


def _use_triton(x: torch.Tensor, k_cache) -> bool:
    """The Triton kernels (batchrun.kernels.triton_attention, triton_kv) serve plain float caches on
    CUDA when triton is installed; the CPU path below is also their reference."""
    if not x.is_cuda or not isinstance(k_cache, torch.Tensor):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def write_kv_cache(
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> None:
    if isinstance(k_cache, QuantizedKVCache):
        # int8/fp8 cache (engine.kv_cache_dtype): quantized on write (natively for int8 on the CPU),
        # read by the native CPU kernels as it is or dequantized when gathered.
        if not k.is_cuda and cpu_attention.write_kv_cache(k_cache, v_cache, k, v, slot_mapping):
            return
        k_cache.write(k, slot_mapping)
        v_cache.write(v, slot_mapping)
        return
    if _use_triton(k, k_cache):
        from batchrun.kernels.triton_kv import write_kv_cache as write_kv_cache_triton

        write_kv_cache_triton(k_cache, v_cache, k, v, slot_mapping)
        return
    if cpu_attention.write_kv_cache(k_cache, v_cache, k, v, slot_mapping):
        return
    write_kv_cache_reference(k_cache, v_cache, k, v, slot_mapping)


def write_kv_cache_reference(
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> None:
    """The plain-torch cache write: the CPU path, and what triton_kv.write_kv_cache is checked against.
    Any cache layout (flattening the two leading dims is a view of every layout used)."""
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
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
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


def _scores(q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
            softcap: Optional[float]) -> torch.Tensor:
    """float32 logits q @ k.T * scale, soft-capped if asked, -inf where `mask` (broadcast) is False."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _decode_attend(
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


def _partial_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                    softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalized attention of q (..., rows, dim) over k, v (..., keys, dim): (out float32
    (..., rows, dim), row max (..., rows, 1), row sum of exp (..., rows, 1)), to be merged."""
    scores = _scores(q, k, mask, scale, softcap)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)  # rows with no key
    weights = torch.exp(scores - row_max)
    out = torch.matmul(weights.to(v.dtype), v).float()
    return out, row_max, weights.sum(dim=-1, keepdim=True)


def _decode_attend_shared(
    q: torch.Tensor,  # (batch, num_heads, head_dim)
    k_cache, v_cache,
    shared_blocks: torch.Tensor,  # (num_shared,) block ids every sequence starts with
    tables: torch.Tensor,  # (batch, num_blocks) the rest of each sequence's blocks
    mask: torch.Tensor,  # (batch, num_blocks * block_size) for the rest
    scale: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """Decode attention split at a prefix every sequence shares (cascade attention): all queries
    attend to the shared blocks in one matmul, gathered once instead of once per sequence, each
    sequence attends to its own remaining blocks as in _decode_attend, and the two partial softmaxes
    are merged exactly by their row maxima and sums."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)  # (num_kv_heads, batch, group, head_dim)
    k_shared = gather_blocks(k_cache, shared_blocks[None])[:, 0]  # (num_kv_heads, shared_len, head_dim)
    v_shared = gather_blocks(v_cache, shared_blocks[None])[:, 0]
    o1, m1, l1 = _partial_attend(qg.reshape(num_kv_heads, batch * group, head_dim), k_shared, v_shared, None,
                                 scale, softcap)
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


def paged_attention(
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
    """Causal attention of every query token over its sequence's cached context.

    A key at position j is visible to the query at position i when j <= i and, with a sliding
    window W, j > i - W (the convention of HF transformers' masks).
    """
    if _use_triton(q, k_cache):
        from batchrun.kernels.triton_attention import paged_attention as paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_new, v_new)
    return paged_attention_reference(q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_new, v_new,
                                     native=True)


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
    native: bool = False,
) -> torch.Tensor:
    """The plain-torch attention: the CPU path, and what triton_attention.paged_attention is checked
    against. With `native` (the CPU path), decodes and prefills run the native kernels
    (kernels/cpu_attention.py) when they are built and serve the cache's dtype and shape."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (num_tokens, num_heads, head_dim)

    if meta.prefill_seq_ids and native and cpu_attention.supports_prefill(q, k_cache):
        cpu_attention.paged_prefill_attention(q.contiguous(), k_cache, v_cache, *meta.prefill_native_inputs(), out, scale,
                                              sliding_window, softcap)
        prefill_ids: list[int] = []
    else:
        prefill_ids = meta.prefill_seq_ids

    if meta.decode_seq_ids.numel() > 0 and native and cpu_attention.supports(q, k_cache):
        rows, tables, _ = meta.decode_inputs(None)
        if not meta.prefill_seq_ids:  # a pure decode step: every row is a decode, in order
            return cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, meta.decode_seq_lens,
                                                        scale, sliding_window, softcap)
        out[rows] = cpu_attention.paged_decode_attention(q[rows], k_cache, v_cache, tables, meta.decode_seq_lens,
                                                         scale, sliding_window, softcap)
    elif meta.decode_seq_ids.numel() > 0:
        for rows, tables, mask, num_shared in meta.decode_groups(sliding_window):
            if num_shared:
                out[rows] = _decode_attend_shared(q[rows], k_cache, v_cache, tables[0, :num_shared],
                                                  tables[:, num_shared:], mask[:, num_shared * meta.block_size:],
                                                  scale, softcap)
            else:
                k, v = gather_blocks(k_cache, tables), gather_blocks(v_cache, tables)
                out[rows] = _decode_attend(q[rows], k, v, mask, scale, softcap)

    for i in prefill_ids:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        slots, mask = meta.prefill_inputs(i, sliding_window)
        if slots is None and k_new is not None:
            k, v = k_new[start:end].transpose(0, 1), v_new[start:end].transpose(0, 1)  # a fresh prompt: all new
        else:
            if slots is None:
                slots = meta.slot_mapping[start:end]
            k, v = gather_slots(k_cache, slots), gather_slots(v_cache, slots)  # (num_kv_heads, seq_len, head_dim)
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # (1, num_heads, q_len, head_dim)
        o = _attend(qp, k.unsqueeze(0), v.unsqueeze(0), None if mask is None else mask[None, None], scale, softcap)
        out[start:end] = o[0].transpose(0, 1)
    return out
