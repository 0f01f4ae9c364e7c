"""Attention over packed variable-length rows (no KV cache, no padding): the torch reference.

Rows lie back to back in the token dimension; each row attends only to itself (bidirectionally for
an encoder, causally when asked). This is the plain-torch reference the Triton kernel
(kernels/triton_varlen_attention.py) is compared with, and what the CPU path runs: rows of equal
length are grouped and each group is one `scaled_dot_product_attention` call over a (rows, heads,
length, head_dim) batch, so a batch sorted by length, the usual case, costs a few calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _row_groups(seq_lens: list[int]) -> list[tuple[int, list[int]]]:
    """(length, row indices) per distinct length, in first-seen order."""
    groups: dict[int, list[int]] = {}
    for row, length in enumerate(seq_lens):
        groups.setdefault(length, []).append(row)
    return list(groups.items())


def varlen_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    seq_lens: list[int],
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """(num_tokens, num_heads, head_dim): softmax(q k^T * scale) v within each row of `seq_lens`
    (lengths of the packed rows, in order, summing to num_tokens); with `causal`, a token sees only
    itself and the tokens before it in its row. Any strides on the token dimension (views of a fused
    qkv projection are fine); the output is contiguous, in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    assert k.shape == q.shape and v.shape == q.shape, "one KV head per query head"
    assert sum(seq_lens) == num_tokens, "seq_lens must cover the packed tokens exactly"
    starts: list[int] = []
    offset = 0
    for length in seq_lens:
        starts.append(offset)
        offset += length
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)  # (num_tokens, heads, dim)
    for length, rows in _row_groups(seq_lens):
        if length == 0:
            continue
        first = starts[rows[0]]
        is_run = starts[rows[-1]] - first == (len(rows) - 1) * length  # equal lengths: consecutive rows
        if is_run:
            span = slice(first, first + len(rows) * length)
            qg, kg, vg = q[span], k[span], v[span]  # (rows * length, heads, dim) views
        else:
            token_ids = torch.cat([torch.arange(starts[r], starts[r] + length) for r in rows]).to(q.device)
            qg, kg, vg = q.index_select(0, token_ids), k.index_select(0, token_ids), v.index_select(0, token_ids)
        # (rows, heads, length, dim)
        qb, kb, vb = (t.reshape(len(rows), length, num_heads, head_dim).transpose(1, 2) for t in (qg, kg, vg))
        attended = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=scale)
        attended = attended.transpose(1, 2).reshape(len(rows) * length, num_heads, head_dim)
        if is_run:
            out[span] = attended
        else:
            out.index_copy_(0, token_ids, attended)
    return out
