"""engine.batch_invariant on the GPU path: every linear layer through the batch-invariant Triton matmul.

On a GPU the float linears are plain nn.Linear, which is cuBLAS, and cuBLAS picks its kernel and
split-K factor per call from the product's shape, the row count included: a row's logits then
depend on how many rows ran with it. `use_invariant_linears` swaps every nn.Linear of a decoder
(projections, the LM head, an MoE router and shared expert) for an `InvariantLinear` over the same
weight (no copy: a tied head keeps sharing the embedding's), which runs the matmul it is given: the
kernel set's `invariant_matmul` (kernels/bind_triton.py: the batch-invariant Triton matmul where it
takes the input, F.linear elsewhere). It also tells the MoE blocks to sum each token's expert
outputs in a fixed order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.model.moe import SparseMoeBlock

Matmul = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]  # (x, weight, bias) -> y


class InvariantLinear(nn.Module):
    """y = x @ W.T + b through `matmul` (KernelSet.invariant_matmul: each row's result independent
    of the other rows; F.linear by default)."""

    def __init__(self, linear: nn.Linear, matmul: Matmul = F.linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # (out_features, in_features): the same Parameter, not a copy
        self.bias = linear.bias  # (out_features,) or None
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, batch_invariant=True"


def use_invariant_linears(model: nn.Module, matmul: Matmul = F.linear) -> int:
    """Swap every nn.Linear in `model` for an InvariantLinear over its weight running `matmul`, in
    place, and set the MoE blocks' fixed-order sums; returns how many linears were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, InvariantLinear(child, matmul))
                swapped += 1
        if isinstance(parent, SparseMoeBlock):
            parent.batch_invariant = True
    return swapped
