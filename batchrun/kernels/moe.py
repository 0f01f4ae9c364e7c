"""Mixture-of-experts dispatch: sort token-expert pairs by expert, one GEMM per expert segment.

A router picks `top_k` experts per token. Instead of looping over tokens, the `num_tokens * top_k`
(token, expert) pairs are sorted by expert so that each expert's rows are contiguous (a segment);
each expert then runs its whole segment as one matmul (a segment, or grouped, GEMM). The results
are scaled by the routing weights, put back in (token, k) order and summed over k, which is
deterministic (no atomics) and independent of the order experts run in.

`grouped_gemm_reference` is the plain-torch segment GEMM (the CPU path, and the reference the
Triton kernel in `batchrun.kernels.triton_moe` is checked against); `fused_experts` runs the one
it is given, the kernel set's `moe_grouped_gemm` (model/moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

import torch


@dataclass
class ExpertDispatch:
    """Where each (token, k) pair goes once the pairs are sorted by expert."""

    sorted_pair_ids: torch.Tensor  # (num_pairs,) int64: flat (token * top_k + k) index of each sorted row
    sorted_token_ids: torch.Tensor  # (num_pairs,) int64: token each sorted row reads its input from
    expert_offsets: torch.Tensor  # (num_experts + 1,) int64: rows [off[e], off[e+1]) belong to expert e
    tokens_per_expert: torch.Tensor  # (num_experts,) int64: segment lengths (the expert load of this batch)


def count_tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert; a scatter-add, so no host sync on CUDA (bincount needs one)."""
    flat = topk_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)  # (num_experts,)
    return counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertDispatch:
    """Group the (token, k) pairs of `topk_ids` (num_tokens, top_k) into per-expert segments."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    # Stable, so within a segment rows stay in token order (reproducible GEMM row order).
    _, order = torch.sort(flat, stable=True)  # (num_pairs,)
    counts = count_tokens_per_expert(topk_ids, num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return ExpertDispatch(
        sorted_pair_ids=order, sorted_token_ids=order // top_k, expert_offsets=offsets, tokens_per_expert=counts
    )


def grouped_gemm_reference(
    a: torch.Tensor,  # (num_rows_a, K): input rows
    b: torch.Tensor,  # (num_experts, N, K): one weight matrix per expert, nn.Linear layout
    expert_offsets: torch.Tensor,  # (num_experts + 1,) int64: output row segments per expert
    row_ids: Optional[torch.Tensor] = None,  # (num_rows,) int64: input row of each output row; None = identity
) -> torch.Tensor:
    """out[i] = a[row_ids[i]] @ b[e].T for the expert e whose segment holds row i.

    One matmul per non-empty expert segment; the segment bounds are read on the host once.
    """
    rows = a if row_ids is None else a.index_select(0, row_ids)  # (num_rows, K)
    num_rows = rows.shape[0]
    out = rows.new_empty((num_rows, b.shape[1]))  # (num_rows, N)
    bounds = expert_offsets.tolist()
    assert bounds[-1] == num_rows, f"segments cover {bounds[-1]} rows, input has {num_rows}"
    for e in range(b.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = torch.nn.functional.linear(rows[lo:hi], b[e])
    return out


class GroupedGemm(Protocol):
    """`grouped_gemm_reference`'s signature, which the Triton `grouped_gemm` takes too (its tile
    sizes have defaults)."""

    def __call__(
        self, a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, row_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor: ...


def fused_experts(
    x: torch.Tensor,  # (num_tokens, hidden_size)
    gate_up_proj: torch.Tensor,  # (num_experts, 2 * intermediate_size, hidden_size): [gate; up] per expert
    down_proj: torch.Tensor,  # (num_experts, hidden_size, intermediate_size)
    topk_weights: torch.Tensor,  # (num_tokens, top_k) routing weights (float32 or the model dtype)
    topk_ids: torch.Tensor,  # (num_tokens, top_k) int64 expert of each pair
    activation: Callable[[torch.Tensor], torch.Tensor],
    dispatch: Optional[ExpertDispatch] = None,
    grouped_gemm: GroupedGemm = grouped_gemm_reference,
    fixed_order_sum: bool = False,
) -> torch.Tensor:
    """sum_k w[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, k], for every token t.
    `grouped_gemm`: the segment GEMM (the reference, or the Triton kernel a kernel set binds).
    `fixed_order_sum`: the sum over k adds left to right in float32 (`sum_over_k`), so a token's
    result does not depend on the batch a reduction kernel is sized for (engine.batch_invariant)."""
    num_tokens, top_k = topk_ids.shape
    num_experts = gate_up_proj.shape[0]
    if num_tokens == 0:
        return x.new_zeros(x.shape)
    d = dispatch if dispatch is not None else sort_by_expert(topk_ids, num_experts)
    h = grouped_gemm(x, gate_up_proj, d.expert_offsets, d.sorted_token_ids)  # (num_pairs, 2 * intermediate)
    gate, up = h.chunk(2, dim=-1)
    h = activation(gate) * up  # (num_pairs, intermediate)
    y = grouped_gemm(h, down_proj, d.expert_offsets)  # (num_pairs, hidden_size), sorted by expert
    # HF multiplies by the routing weight in its dtype (float32 for Mixtral) and then casts back.
    w = topk_weights.reshape(-1).index_select(0, d.sorted_pair_ids)  # (num_pairs,)
    y = (y * w[:, None]).to(x.dtype)
    unsorted = torch.empty_like(y)
    unsorted[d.sorted_pair_ids] = y  # back to (token, k) order
    per_k = unsorted.view(num_tokens, top_k, -1)  # (num_tokens, top_k, hidden_size)
    if fixed_order_sum:
        return sum_over_k(per_k.float()).to(per_k.dtype)
    return per_k.sum(dim=1)  # (num_tokens, hidden_size)


def sum_over_k(x: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, top_k, ...) summed over dim 1 as x[:, 0] + x[:, 1] + ..., in that order: elementwise
    adds, whose result per element depends on nothing else in the batch -> (num_tokens, ...)."""
    total = x[:, 0]
    for k in range(1, x.shape[1]):
        total = total + x[:, k]
    return total
