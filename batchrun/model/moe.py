"""Sparse mixture-of-experts block for the decoder: router, top-k, gated experts, shared expert.

Families and their routing (matching transformers 5.x exactly):

- Mixtral: softmax over all router logits in float32, top-k, renormalize the k weights (the same
  as a softmax over the top-k logits); the weights stay float32.
- Qwen3-MoE / Qwen2-MoE: softmax in float32, top-k, renormalize only when `norm_topk_prob`, then
  cast the weights to the model dtype. Qwen2-MoE adds a dense shared expert scaled by
  `sigmoid(shared_expert_gate(x))`. Layers can be dense (`mlp_only_layers`, `decoder_sparse_step`).

Experts are stored fused as 3D tensors, `experts.gate_up_proj` (num_experts, 2 * inter, hidden)
and `experts.down_proj` (num_experts, hidden, inter): the layout transformers 5 keeps in memory,
so its in-memory state dicts load by name. `save_pretrained` writes per-expert tensors
(`experts.{e}.w1/w3/w2` under `block_sparse_moe.` for Mixtral, `experts.{e}.gate_proj/up_proj/
down_proj` for Qwen); `fused_moe_weights` stacks those at load time.

Each block counts the tokens routed to each of its experts in a device tensor (no host sync per
step); `DecoderLM.expert_token_counts()` reads them all at once.

Expert parallelism (design note; not built, there is no multi-GPU machine here)
------------------------------------------------------------------------------
Within one node of G GPUs, expert parallelism (EP) gives each rank `num_experts / G` whole experts
(rank r owns experts [r*E/G, (r+1)*E/G)), while attention, norms, embeddings and the router stay
replicated (or tensor-parallel) as for a dense model. One MoE layer then runs as:

1. Route locally: every rank computes `topk_ids`, `topk_weights` for its own tokens (its share of
   the flattened batch: data parallel attention, or the same tokens on all ranks after a TP
   all-reduce, in which case each rank dispatches only a 1/G slice of them).
2. Sort by destination: `sort_by_expert` already orders pairs by expert, and experts are
   contiguous per rank, so the pairs for rank r are one contiguous slice; `send_counts[r]` is the
   sum of `tokens_per_expert` over r's experts.
3. Exchange counts: `dist.all_to_all_single(recv_counts, send_counts)` (G int64s), then one host
   read of `recv_counts` to size the receive buffer (the only sync per layer; to avoid it, pad
   every send to a fixed capacity `capacity_factor * num_pairs / G` and drop/overflow-handle).
4. Dispatch: `dist.all_to_all_single(recv_x, x_sorted, output_split_sizes=recv_counts,
   input_split_sizes=send_counts)` moves the token rows (hidden-size vectors, bf16) and, in a
   second small all-to-all, their local expert ids. The received rows are re-sorted by local expert
   (they arrive grouped by source rank) and run through the same grouped GEMM as here.
5. Combine: the reverse all-to-all returns the expert outputs to the token's rank, where they are
   scaled by the routing weights and summed over k exactly as `fused_experts` does, so output is
   the same as single-GPU up to summation order (deterministic given fixed splits).

Costs and choices: each token crosses the interconnect twice per MoE layer (2 * top_k * hidden
bytes per token per layer before dedup; sending one copy per destination rank rather than per
expert cuts this when several of a token's experts share a rank). NVLink all-to-all at batch
inference sizes is bandwidth-bound, so overlap the dispatch of micro-batch i+1 with the expert
GEMMs of micro-batch i (two CUDA streams). Expert load imbalance shows up directly as stragglers:
the `expert_token_counts` metric is what tells whether hot experts need replicas (EPLB-style: a
hot expert gets copies on several ranks and its tokens are split among them). The engine would
own one process per GPU (torch.distributed, NCCL), with the scheduler on rank 0 broadcasting each
step's flattened batch; KV cache stays per rank for the attention heads it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.moe import fused_experts, sort_by_expert, sum_over_k
from batchrun.model.kernel_user import KernelUser

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def moe_config_fields(config: Any, num_layers: int) -> dict[str, Any]:
    """The DecoderSpec fields that describe the MoE blocks (all zero/empty for dense models)."""
    mt = config.model_type
    if mt not in MOE_MODEL_TYPES:
        return {}
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    if mt == "mixtral":
        is_moe = (True,) * num_layers
        inter = config.intermediate_size
    else:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        is_moe = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        inter = config.moe_intermediate_size
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=inter,
        moe_renormalize=mt == "mixtral" or bool(getattr(config, "norm_topk_prob", False)),
        moe_weights_fp32=mt == "mixtral",
        moe_layers=is_moe,
        shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0)
        if mt == "qwen2_moe"
        else 0,
    )


def route(
    router_logits: torch.Tensor,  # (num_tokens, num_experts)
    top_k: int,
    renormalize: bool,
    weights_fp32: bool,
    fixed_order_sum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids), each (num_tokens, top_k): softmax in float32, top-k, optional renorm.
    `fixed_order_sum`: the renormalizing sum adds the k weights left to right (engine.batch_invariant)
    instead of in the order a reduction kernel sized for the whole batch picks."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (num_tokens, num_experts)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        total = sum_over_k(topk_weights) if fixed_order_sum else topk_weights.sum(dim=-1)  # (num_tokens,)
        topk_weights = topk_weights / total[:, None]
    if not weights_fp32:
        topk_weights = topk_weights.to(router_logits.dtype)
    return topk_weights, topk_ids


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (the shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Experts(nn.Module):
    """All experts of one layer as two 3D weights, run by sorted segment GEMMs."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(KernelUser):
    """Replaces the MLP in MoE layers; parameter names follow transformers 5 (`gate`, `experts.*`).
    Its experts run the kernel set's grouped GEMM (`moe_grouped_gemm`)."""

    token_counts: torch.Tensor  # (num_experts,) int64, cumulative tokens routed to each expert
    # engine.batch_invariant (model/invariant.py sets it): sums over a token's k experts in a fixed order
    batch_invariant: bool = False
    # A rank of a tensor-parallel group (model/tensor_parallel.py): every expert's slice of the
    # intermediate size, the router whole; the block's partial sums are all-reduced.
    tp: Optional[Any] = None

    def __init__(
        self, spec: Any, act: Callable[[torch.Tensor], torch.Tensor], kernels: Optional[KernelSet] = None
    ) -> None:
        super().__init__(kernels)
        self.num_experts = spec.num_experts
        self.top_k = spec.num_experts_per_tok
        self.renormalize = spec.moe_renormalize
        self.weights_fp32 = spec.moe_weights_fp32
        self.act = act
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size)
        self.shared_expert: Optional[GatedMLP] = None
        if spec.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(spec.hidden_size, spec.shared_expert_intermediate_size, act)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        # Cumulative tokens routed to each expert; int64 so Module.to(dtype) leaves it alone.
        self.register_buffer("token_counts", torch.zeros(spec.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # (num_tokens, num_experts)
        topk_weights, topk_ids = route(logits, self.top_k, self.renormalize, self.weights_fp32, self.batch_invariant)
        dispatch = sort_by_expert(topk_ids, self.num_experts)
        # Every row of the flattened batch is a real token (the runner does not pad); a runner that
        # pads for CUDA graphs must route padding rows elsewhere or subtract them here.
        self.token_counts += dispatch.tokens_per_expert
        out = fused_experts(
            x,
            self.experts.gate_up_proj,
            self.experts.down_proj,
            topk_weights,
            topk_ids,
            self.act,
            dispatch=dispatch,
            grouped_gemm=self.kernels.moe_grouped_gemm,
            fixed_order_sum=self.batch_invariant,
        )
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp is not None:
            self.tp.comm.all_reduce(out)
        return out


def fused_moe_weights(
    sd: dict[str, torch.Tensor], prefix: str, num_experts: int, has_shared_expert: bool
) -> dict[str, torch.Tensor]:
    """Pop one MoE layer's tensors out of an HF state dict (prefix 'layers.{i}.'), in our names.

    Accepts the fused 3D names transformers 5 keeps in memory and the per-expert names
    `save_pretrained` writes (Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`, Qwen's
    `mlp.experts.{e}.gate_proj/up_proj/down_proj`).
    """
    for name in [k for k in sd if k.startswith(prefix + "block_sparse_moe.")]:
        sd[prefix + "mlp." + name[len(prefix + "block_sparse_moe.") :]] = sd.pop(name)
    p = prefix + "mlp."
    out = {p + "gate.weight": sd.pop(p + "gate.weight")}
    if p + "experts.gate_up_proj" in sd:
        out[p + "experts.gate_up_proj"] = sd.pop(p + "experts.gate_up_proj")
        out[p + "experts.down_proj"] = sd.pop(p + "experts.down_proj")
    else:
        ex = p + "experts."
        names = ("w1", "w3", "w2") if ex + "0.w1.weight" in sd else ("gate_proj", "up_proj", "down_proj")
        gate_up, down = [], []
        for e in range(num_experts):
            gate_up.append(
                torch.cat([sd.pop(f"{ex}{e}.{names[0]}.weight"), sd.pop(f"{ex}{e}.{names[1]}.weight")], dim=0)
            )
            down.append(sd.pop(f"{ex}{e}.{names[2]}.weight"))
        out[p + "experts.gate_up_proj"] = torch.stack(gate_up)  # (num_experts, 2 * inter, hidden)
        out[p + "experts.down_proj"] = torch.stack(down)  # (num_experts, hidden, inter)
    if has_shared_expert:
        s = p + "shared_expert."
        out[s + "gate_up_proj.weight"] = torch.cat(
            [sd.pop(s + "gate_proj.weight"), sd.pop(s + "up_proj.weight")], dim=0
        )
        out[s + "down_proj.weight"] = sd.pop(s + "down_proj.weight")
        out[p + "shared_expert_gate.weight"] = sd.pop(p + "shared_expert_gate.weight")
    return out


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def reset_expert_token_counts(model: nn.Module) -> None:
    for block in moe_blocks(model):
        block.token_counts.zero_()


def expert_token_counts(model: nn.Module) -> Optional[list[list[int]]]:
    """Per MoE layer, cumulative tokens routed to each expert; None for a dense model. One host read."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    return torch.stack([b.token_counts for b in blocks]).tolist()
