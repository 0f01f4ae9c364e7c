"""`QKVHeads`: how the fused qkv projection's output splits into heads, and the q/k-norm applied to
q and k before rotary. What every `qkv_norm_rope_write` (the dispatch in kernels/attention.py, the
torch reference, the Triton kernel) takes besides the step's tensors; a module of its own so that
all three import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class QKVHeads:
    """One row of the fused qkv projection holds the q heads, then K's, then V's, head_dim each."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm: Optional[torch.Tensor] = None  # (head_dim,) or None: no q/k-norm (Qwen3, Gemma 3 have one)
    k_norm: Optional[torch.Tensor] = None  # (head_dim,), None exactly when q_norm is
    eps: float = 1e-6
    is_gemma: bool = False  # norm weights apply as (1 + w)

    def __post_init__(self) -> None:
        assert (self.q_norm is None) == (self.k_norm is None), "q/k-norm comes as a pair"

    @property
    def norms(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(q_norm, k_norm), or None without q/k-norm: the pair as one value, so a caller checks once."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return self.q_norm, self.k_norm

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (num_tokens, heads, head_dim) of q, k and v in qkv (num_tokens, (num_heads + 2 *
        num_kv_heads) * head_dim)."""
        dim, kv_size = self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([self.num_heads * dim, kv_size, kv_size], dim=-1)
        return q.view(-1, self.num_heads, dim), k.view(-1, self.num_kv_heads, dim), v.view(-1, self.num_kv_heads, dim)
