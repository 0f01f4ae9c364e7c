"""bf16 linear layers on the CPU with their weights packed once for oneDNN.

`F.linear` hands oneDNN a plain (N, K) weight on every call, and oneDNN reorders it into its
blocked layout each time; at the row counts of a decode step that reorder is a large part of the
call (measured here for SmolLM2's shapes at 32 rows: 83 -> 61 us for qkv, 232 -> 184 us for
gate/up, 4.6 -> 3.6 ms for the LM head; at 512 rows within noise). Packing once at load
(torch.ops.mkldnn._reorder_linear_weight, the op torch.compile's CPU backend uses) removes it.
The product is the same oneDNN kernel, so outputs are bitwise those of F.linear; `pack_linear`
checks that on a probe input and leaves a layer alone when the build lacks the ops or they disagree.

bf16 only: the float32 path stays on F.linear, the one held token-identical to HF transformers.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

log = logging.getLogger(__name__)


def packing_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's packed layout (an opaque mkldnn tensor buffer)."""

    def __init__(self, packed_weight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed_weight", packed_weight)  # (out_features, in_features), mkldnn layout
        self.register_buffer("bias", bias)  # (out_features,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linear(linear: nn.Linear, batch_hint: int = 32) -> Optional[PackedLinear]:
    """The packed twin of a bf16 CPU nn.Linear, or None when it does not apply or does not match
    F.linear bitwise on a probe. `batch_hint`: the row count oneDNN picks its layout for."""
    w = linear.weight
    if not (type(linear) is nn.Linear and w.dtype == torch.bfloat16 and w.device.type == "cpu"
            and packing_available()):
        return None
    bias = None if linear.bias is None else linear.bias.detach()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(w.dtype)
        module = PackedLinear(packed, bias, linear.in_features, linear.out_features)
        with torch.inference_mode():
            same = torch.equal(module(probe), nn.functional.linear(probe, w, bias))
    except RuntimeError as exc:  # a build whose mkldnn ops refuse this shape or dtype
        log.debug("not packing a %s linear: %s", tuple(w.shape), exc)
        return None
    return module if same else None
