"""Tensor parallelism in the model: which slice of every weight a rank holds, and where it sums.

A group of N ranks runs one model. Each rank holds
- attention: its `num_heads / N` query heads (q rows and o columns), and its KV heads: `num_kv_heads / N`
  of them, or, with fewer KV heads than ranks, the one KV head its query heads read (replicated on
  `N / num_kv_heads` ranks; Gemma 3 has one);
- MLP: its `intermediate / N` rows of gate/up and columns of down; a mixture of experts the same
  slice of every expert (and of the shared expert), the router replicated;
- embedding and LM head: `ceil(vocab / N)` rows of the vocabulary, the last rank's padded with
  zeros (their logits are cut off after the gather);
- norms and q/k norms whole.
Column-parallel projections need no communication; o_proj and down_proj (and the MoE block) end with
one all-reduce, the embedding with one (each rank fills its own vocabulary rows), and the LM head's
logits are gathered on rank 0, which samples.

The model layer knows only the `Collectives` it is handed (engine/group.py implements them over
torch.distributed; a one-rank model has none) and the `StepLink` rank 0 uses to ship each forward
and each logits computation to the followers before it runs its own part.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from batchrun.model.quant.weights import QuantizedWeight


@dataclass(frozen=True)
class TPShard:
    """One rank of a tensor-parallel group."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} outside a group of {self.size}"


def head_split_error(num_heads: int, num_kv_heads: int, size: int) -> Optional[str]:
    """Why `size` ranks cannot split these heads (None: they can). Query heads divide evenly; KV
    heads divide evenly, or each rank's query heads read one KV head that several ranks replicate."""
    if num_heads % size:
        return f"{num_heads} attention heads do not divide by {size}"
    if num_kv_heads % size and size % num_kv_heads:
        return f"{num_kv_heads} KV heads neither divide by {size} nor divide it"
    return None


def size_split_error(spec: Any, size: int) -> Optional[str]:
    """Why the MLP (or experts) cannot be split in `size` slices (None: they can)."""
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        value = getattr(spec, name)
        if value and value % size:
            return f"{name} {value} does not divide by {size}"
    return None


def local_spec(spec: Any, shard: TPShard) -> Any:
    """The DecoderSpec one rank runs: its heads and slices; vocab_size stays the whole vocabulary."""
    n = shard.size
    assert head_split_error(spec.num_heads, spec.num_kv_heads, n) is None
    assert size_split_error(spec, n) is None
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // n,
        num_kv_heads=max(1, spec.num_kv_heads // n),
        intermediate_size=spec.intermediate_size // n,
        moe_intermediate_size=spec.moe_intermediate_size // n,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size // n,
        tp_rank=shard.rank,
        tp_size=n,
        tp_kv_copies=max(1, n // spec.num_kv_heads),
    )


def local_vocab_size(vocab_size: int, size: int) -> int:
    """Rows of the vocabulary each rank holds (the last rank's padded)."""
    return -(-vocab_size // size)


class ShardSlicer:
    """Cuts one rank's slice out of each HF-named checkpoint tensor (`__call__`), given the whole
    model's spec: the slices the model of `local_spec` is built to hold. A tensor no rule names is
    replicated. Slices along dim 0 are contiguous rows, so a reader can fetch only their bytes
    (`row_range`)."""

    def __init__(self, spec: Any, shard: TPShard) -> None:
        self.spec, self.shard = spec, shard
        n, r, d = shard.size, shard.rank, spec.head_dim
        heads = spec.num_heads // n
        self.q_rows = (r * heads * d, (r + 1) * heads * d)
        if spec.num_kv_heads >= n:
            kv = spec.num_kv_heads // n
            self.kv_rows = (r * kv * d, (r + 1) * kv * d)
        else:  # the KV head this rank's query heads read: head (r * num_kv_heads) // n
            kv_head = r * spec.num_kv_heads // n
            self.kv_rows = (kv_head * d, (kv_head + 1) * d)
        self.vocab = local_vocab_size(spec.vocab_size, n)
        self.vocab_rows = (min(r * self.vocab, spec.vocab_size), min((r + 1) * self.vocab, spec.vocab_size))

    def _part(self, size: int) -> tuple[int, int]:
        part = size // self.shard.size
        return self.shard.rank * part, (self.shard.rank + 1) * part

    def row_range(self, name: str) -> Optional[tuple[int, int]]:
        """The dim-0 rows [lo, hi) of `name` this rank holds, where its slice is rows; None otherwise."""
        rule = self._rule(name)
        return rule[1] if rule is not None and rule[0] == 0 else None

    def _rule(self, name: str) -> Optional[tuple[int, tuple[int, int]]]:
        """(dim, (lo, hi)) of the slice, or None for a replicated tensor (and the fused expert
        tensors, which `__call__` cuts itself)."""
        s = self.spec
        if re.search(r"self_attn\.q_proj\.(weight|bias)$", name):
            return 0, self.q_rows
        if re.search(r"self_attn\.[kv]_proj\.(weight|bias)$", name):
            return 0, self.kv_rows
        if name.endswith("self_attn.o_proj.weight"):
            return 1, self.q_rows
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.vocab_rows
        inter = None
        if ".shared_expert." in name:
            inter = s.shared_expert_intermediate_size
        elif re.search(r"experts\.\d+\.", name):
            inter = s.moe_intermediate_size
        elif ".mlp." in name:
            inter = s.intermediate_size
        if inter is not None:
            if re.search(r"\.(gate_proj|up_proj|w1|w3)\.weight$", name):
                return 0, self._part(inter)
            if re.search(r"\.(down_proj|w2)\.weight$", name):
                return 1, self._part(inter)
        return None

    def pad_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """`rows`, the `row_range` of `name` read alone, padded to this rank's vocabulary slice where
        it is the embedding or LM head of the last rank."""
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and rows.shape[0] < self.vocab:
            pad = torch.zeros((self.vocab - rows.shape[0],) + tuple(rows.shape[1:]), dtype=rows.dtype)
            return torch.cat([rows, pad], dim=0)
        return rows

    def slice_quantized(self, name: str, weight: QuantizedWeight) -> QuantizedWeight:
        """This rank's slice of a weight already quantized (a GGUF file's blocks), `name` its HF
        module name: output rows whole, or input columns at group boundaries (start-up checks the
        split aligns; engine/group_startup.py), so it is bitwise the blocks one process holds there."""
        rule = self._rule(name + ".weight")
        if self.shard.size == 1 or rule is None:
            return weight
        dim, (lo, hi) = rule
        if dim == 0:
            rows = slice(lo, hi)
            mins = weight.mins[rows].clone() if weight.mins is not None else None
            return QuantizedWeight(
                weight.format, weight.qweight[rows].clone(), weight.scales[rows].clone(), mins, weight.in_features
            )
        group = weight.group_size
        assert lo % group == 0 and hi % group == 0, f"{name}: columns {lo}:{hi} straddle groups of {group}"
        per_byte = 2 if weight.format == "int4" else 1  # int4: two columns a byte, even column low
        groups = slice(lo // group, hi // group)
        mins = weight.mins[:, groups].clone() if weight.mins is not None else None
        return QuantizedWeight(
            weight.format,
            weight.qweight[:, lo // per_byte : hi // per_byte].clone(),
            weight.scales[:, groups].clone(),
            mins,
            hi - lo,
        )

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `tensor`, contiguous, its own storage (the whole may be freed)."""
        if self.shard.size == 1:
            return tensor
        if name.endswith("experts.gate_up_proj"):  # (num_experts, 2 * inter, hidden): gate rows, then up
            inter = tensor.shape[1] // 2
            lo, hi = self._part(inter)
            return torch.cat([tensor[:, lo:hi], tensor[:, inter + lo : inter + hi]], dim=1).contiguous()
        if name.endswith("experts.down_proj"):  # (num_experts, hidden, inter)
            lo, hi = self._part(tensor.shape[2])
            return tensor[:, :, lo:hi].contiguous()
        rule = self._rule(name)
        if rule is None:
            return tensor
        dim, (lo, hi) = rule
        return self.pad_rows(name, tensor.narrow(dim, lo, hi - lo).clone(memory_format=torch.contiguous_format))


def is_replicated(name: str) -> bool:
    """Whether every rank holds the parameter or buffer `name` whole: norms, the MoE router and
    shared-expert gate, counters."""
    return "norm" in name or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "token_counts"))


class Collectives(Protocol):
    """The group's communication, as the model uses it (engine/group.py over torch.distributed)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place; every rank gets the same bits."""

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """The elementwise largest of `tensor` over the ranks, in place (load time only)."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's, in place."""

    def gather(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every rank's `tensor` (same shape), in rank order, on rank 0; None on the others."""


class StepLink(Protocol):
    """Rank 0's side of the group: tells the followers what to run before it runs its own part."""

    def ship_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, num_layers: Optional[int]
    ) -> None:
        """The followers run this forward (their own KV cache, the same batch)."""

    def ship_logits(self, num_rows: int) -> None:
        """The followers join a logits computation of `num_rows` hidden rows broadcast by rank 0."""


@dataclass(frozen=True)
class TensorParallel:
    """What a model of one rank of a group holds to take part: its shard, the collectives, and on
    rank 0 the link that ships each step to the followers (None on a follower)."""

    shard: TPShard
    comm: Collectives
    link: Optional[StepLink]
    vocab_size: int = 0  # the whole vocabulary (set by the model that takes this: DecoderLM)

    def vocab_parallel_embedding(self, embed: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens, hidden_size): `embed`'s rows (this rank's vocabulary slice, whatever module
        holds it: a plain, quantized or packed embedding) for the ids in the slice, zeros for the
        others, summed over the ranks."""
        vocab = local_vocab_size(self.vocab_size, self.shard.size)
        local = input_ids - self.shard.rank * vocab
        outside = (local < 0) | (local >= vocab)  # (num_tokens,)
        rows = embed(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)  # (num_tokens, hidden)
        self.comm.all_reduce(rows)
        return rows

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
        """(num_rows, vocab_size) on rank 0 from each rank's (num_rows, local vocab) slice, the
        padding cut off; None on a follower."""
        parts = self.comm.gather(local.contiguous())
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]
