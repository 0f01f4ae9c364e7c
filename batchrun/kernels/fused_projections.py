"""A decoder layer's projections with the kernel that follows each, and the token embedding with
layer 0's norm: one Triton launch for the two where a Triton kernel set fuses them (fewer launches
per decode step), the two one after the other elsewhere.

- `qkv_project`: the qkv projection, then q/k-norm + rotary + KV write
  (kernels/triton_fused_gemm.py: `gemm_qkv_norm_rope_write`, one launch for the two).
- `gate_up_act`: the gate/up projection, then silu(gate) * up (`gemm_silu_mul`).
- `lm_head_logits`: the LM head, then the float32 cast of the logits (`gemm_logits`).
- `embed_norm`: the embedding gather and RMSNorm of its rows (`triton_embed_norm`), bitwise the
  two separate kernels.

Each op has a `*_separate` function (the projection module, then the kernel set's next kernel) and,
for the GPU, a `*_fused` one. A fused GEMM replaces a cuBLAS GEMM, so it is taken only where it is
known not to be slower: start-up tuning (kernels/tuning.py) times both per (kind, row bucket, shape,
dtype) on a real GPU and the bound `*_fused` function reads its choice (`Tuning.is_fused`); on the
CPU, in Triton's interpreter and under a simulated GPU the tables prefer the fused path, so a launch
count there is what the fused path launches. A kernel set bound with `fuse=False` binds the
separate functions everywhere.

Only bf16/fp16 models and plain nn.Linear projections fuse (the fused functions check it per call,
a precondition on the module and dtype): a float32 model keeps cuBLAS's GEMMs, the ones HF's
float32 run (the greedy-identity oracle) uses, and quantized or packed projections keep their own
kernels. Float KV caches only for qkv (an int8/fp8 cache quantizes in the unfused qkv kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, TypeGuard

import torch
from torch import nn

from batchrun.kernels.qkv_heads import QKVHeads
from batchrun.kernels.target import GpuTarget
from batchrun.kernels.tuning import Tuning

_HALF = (torch.bfloat16, torch.float16)


def _fusable(proj: Any, x: torch.Tensor) -> TypeGuard[nn.Linear]:
    return (
        isinstance(proj, nn.Linear)
        and type(proj) is nn.Linear
        and x.dtype in _HALF
        and x.dim() == 2
        and x.shape[0] > 0
        and x.stride(1) == 1
        and proj.weight.dtype == x.dtype
        and proj.weight.stride(1) == 1
    )


def qkv_project_separate(
    x: torch.Tensor,  # (num_tokens, hidden)
    qkv_proj: nn.Module,
    heads: QKVHeads,
    cos: torch.Tensor,  # (num_tokens, head_dim); with positions (num_positions, head_dim)
    sin: torch.Tensor,
    k_cache: Any,  # (num_blocks, block_size, num_kv_heads, head_dim) tensor, or a QuantizedKVCache
    v_cache: Any,
    slot_mapping: torch.Tensor,  # (num_tokens,); negative: write nothing
    positions: Optional[torch.Tensor] = None,  # (num_tokens,): cos/sin are tables
    *,
    qkv_norm_rope_write: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_norm_rope_write(qkv_proj(x), ...)`: (q, k, v) per head, q and k normed and rotated, K
    and V stored at their slots."""
    return qkv_norm_rope_write(qkv_proj(x), heads, cos, sin, k_cache, v_cache, slot_mapping, positions)


def qkv_project_fused(
    x: torch.Tensor,
    qkv_proj: nn.Module,
    heads: QKVHeads,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: Any,
    v_cache: Any,
    slot_mapping: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    *,
    separate: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    tuning: Tuning,
    gpu: Optional[GpuTarget],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_project_separate` in one Triton launch (gemm_qkv_norm_rope_write) where the projection
    fuses, the cache is a float one and `tuning` chose the fused GEMM for this row bucket and shape."""
    if (
        _fusable(qkv_proj, x)
        and isinstance(k_cache, torch.Tensor)
        and isinstance(v_cache, torch.Tensor)
        and k_cache.stride() == v_cache.stride()
        and cos.stride(-1) == 1
        and sin.stride() == cos.stride()
    ):
        weight = qkv_proj.weight
        (n, k), m = weight.shape, x.shape[0]
        if tuning.is_fused("qkv", m, n, k, x.dtype):
            from batchrun.kernels.triton_fused_gemm import gemm_qkv_norm_rope_write

            config = tuning.tile("qkv_rope", m, n, k, 0, x.dtype, gpu)
            return gemm_qkv_norm_rope_write(
                x, weight, qkv_proj.bias, heads, cos, sin, k_cache, v_cache, slot_mapping, positions, config, gpu
            )
    return separate(x, qkv_proj, heads, cos, sin, k_cache, v_cache, slot_mapping, positions)


def gate_up_act_separate(
    x: torch.Tensor, gate_up_proj: nn.Module, activation: str, *, act_mul: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """act(gate) * up of the gate/up projection (gate rows, then up rows) of x (num_tokens, hidden):
    (num_tokens, intermediate)."""
    return act_mul(gate_up_proj(x), activation)


def gate_up_act_fused(
    x: torch.Tensor,
    gate_up_proj: nn.Module,
    activation: str,
    *,
    separate: Callable[..., torch.Tensor],
    tuning: Tuning,
    gpu: Optional[GpuTarget],
) -> torch.Tensor:
    """`gate_up_act_separate` in one Triton launch (gemm_silu_mul) for a silu MLP whose projection
    fuses, where `tuning` chose it."""
    if activation in ("silu", "swish") and _fusable(gate_up_proj, x) and gate_up_proj.bias is None:
        weight = gate_up_proj.weight
        (n, k), m = weight.shape, x.shape[0]
        if tuning.is_fused("silu_mul", m, n, k, x.dtype):
            from batchrun.kernels.triton_fused_gemm import gemm_silu_mul

            return gemm_silu_mul(x, weight, tuning.tile("silu_mul", m, n, k, 0, x.dtype, gpu), gpu)
    return separate(x, gate_up_proj, activation)


def lm_head_logits_separate(hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    """`lm_head(hidden).float()`: (num_rows, vocab_size) float32 logits of hidden (num_rows, hidden)."""
    return lm_head(hidden).float()


def lm_head_logits_fused(
    hidden: torch.Tensor, lm_head: nn.Module, *, tuning: Tuning, gpu: Optional[GpuTarget]
) -> torch.Tensor:
    """`lm_head_logits_separate` in one Triton launch (gemm_logits) where the head fuses and
    `tuning` chose it."""
    if _fusable(lm_head, hidden) and lm_head.bias is None:
        weight = lm_head.weight
        (n, k), m = weight.shape, hidden.shape[0]
        if tuning.is_fused("logits", m, n, k, hidden.dtype):
            from batchrun.kernels.triton_fused_gemm import gemm_logits

            return gemm_logits(hidden, weight, tuning.tile("logits", m, n, k, 0, hidden.dtype, gpu), gpu)
    return lm_head_logits_separate(hidden, lm_head)


def embed_norm_triton(
    input_ids: torch.Tensor, embedding: nn.Module, norm_weight: torch.Tensor, eps: float
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(rms_norm(embedding(input_ids)), embedding(input_ids)) in one launch where the embedding is a
    plain nn.Embedding (non-Gemma norm); None elsewhere: the caller runs the two."""
    if not (
        type(embedding) is nn.Embedding
        and input_ids.dim() == 1
        and input_ids.shape[0] > 0
        and embedding.weight.stride(1) == 1
    ):
        return None
    from batchrun.kernels.triton_embed_norm import embed_rms_norm

    return embed_rms_norm(input_ids, embedding.weight, norm_weight, eps)
