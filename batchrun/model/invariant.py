"""engine.batch_invariant on the GPU path: every linear layer through the batch-invariant Triton matmul.

On a GPU the float linears are plain nn.Linear, which is cuBLAS, and cuBLAS picks its kernel and
split-K factor per call from the product's shape, the row count included: a row's logits then
depend on how many rows ran with it. `use_invariant_linears` swaps every nn.Linear of a decoder
(projections, the LM head, an MoE router and shared expert) for an `InvariantLinear` over the same
weight (no copy: a tied head keeps sharing the embedding's), which runs
kernels/triton_invariant.py where Triton serves its input and F.linear elsewhere. It also tells the
MoE blocks to sum each token's expert outputs in a fixed order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels.backend import triton_usable
from batchrun.model.moe import SparseMoeBlock


class InvariantLinear(nn.Module):
    """y = x @ W.T + b, each row's result independent of the other rows where Triton serves x."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # (out_features, in_features): the same Parameter, not a copy
        self.bias = linear.bias  # (out_features,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_usable(x) and x.dtype == self.weight.dtype and self.weight.stride(-1) == 1:
            from batchrun.kernels.triton_invariant import invariant_matmul

            return invariant_matmul(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, batch_invariant=True"


def use_invariant_linears(model: nn.Module) -> int:
    """Swap every nn.Linear in `model` for an InvariantLinear over its weight, in place, and set the
    MoE blocks' fixed-order sums; returns how many linears were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, InvariantLinear(child))
                swapped += 1
        if isinstance(parent, SparseMoeBlock):
            parent.batch_invariant = True
    return swapped
