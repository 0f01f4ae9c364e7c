"""Where Triton runs, a decoder layer's projections fused with the kernel that follows each, and the
token embedding fused with layer 0's norm: fewer launches per decode step.

- `qkv_project`: the qkv projection, then q/k-norm + rotary + KV write
  (kernels/triton_fused_gemm.py: `gemm_qkv_norm_rope_write`, one launch for the two).
- `gate_up_act`: the gate/up projection, then silu(gate) * up (`gemm_silu_mul`).
- `lm_head_logits`: the LM head, then the float32 cast of the logits (`gemm_logits`).
- `embed_norm`: the embedding gather and RMSNorm of its rows (`triton_embed_norm`), bitwise the
  two separate kernels.

Each fused GEMM replaces a cuBLAS GEMM, so it is taken only where it is known not to be slower:
on a real GPU the first call of a (kind, row bucket, shape, dtype) outside a graph capture times
both paths (Triton's do_bench) and keeps the faster for the process, as the quantized GEMMs pick
their tiles (kernels/quant/triton_gemm.py: select_config); the CUDA-graph warm-up call before each
capture makes that first call. A capture with nothing measured takes the unfused pair. In Triton's
interpreter and under a simulated GPU (bench/gpu_launches.py's count, triton_aot's compile-only
checks) the fused path is taken, so the count is what the fused path launches.

Only bf16/fp16 models and plain nn.Linear projections fuse: a float32 model keeps cuBLAS's GEMMs,
the ones HF's float32 run (the greedy-identity oracle) uses, and quantized or packed projections
keep their own kernels. Float KV caches only for qkv (an int8/fp8 cache quantizes in the unfused
qkv kernel). Everything else, the CPU engine path included, takes the unfused calls unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional, TypeGuard

import torch
from torch import nn

from batchrun.kernels import elementwise as ew
from batchrun.kernels.attention import qkv_norm_rope_write
from batchrun.kernels.backend import triton_usable
from batchrun.kernels.qkv_heads import QKVHeads

log = logging.getLogger(__name__)

FUSE = True  # the fused paths at all (tests and benchmarks set it False for the unfused pair)
MEASURE_ON_GPU = True  # on a real GPU, fused vs unfused timed per bucket (False: fused wherever it serves)
_HALF = (torch.bfloat16, torch.float16)
# (kind, device index, row bucket, N, K, dtype) -> whether the fused path was the faster; row buckets
# are the tile table's (16, 32, 64, 128, 256) and powers of two above
_CHOICE: dict[tuple, bool] = {}
_TIMES: dict[tuple, tuple[float, float]] = {}  # the same keys -> (fused ms, unfused ms) as measured


def _fusable(proj: Any, x: torch.Tensor) -> TypeGuard[nn.Linear]:
    return (
        FUSE
        and isinstance(proj, nn.Linear)
        and type(proj) is nn.Linear
        and x.dtype in _HALF
        and x.dim() == 2
        and x.shape[0] > 0
        and x.stride(1) == 1
        and proj.weight.dtype == x.dtype
        and proj.weight.stride(1) == 1
        and triton_usable(x)
    )


def _choose(
    kind: str, x: torch.Tensor, weight: torch.Tensor, fused: Callable[[], Any], unfused: Callable[[], Any]
) -> bool:
    """Whether this call takes the fused path (module docstring). Timing runs both paths on the
    call's real inputs; the KV write in both is idempotent (the same rows to the same slots, the
    chosen path's values written last by the call itself)."""
    if not (x.is_cuda and MEASURE_ON_GPU):
        return True
    from batchrun.kernels.quant.triton_gemm import M_BUCKETS, m_bucket

    m = x.shape[0]
    # decode sizes by the tile table's buckets; prefill sizes apart (where cuBLAS may win instead)
    bucket = m_bucket(m) if m <= M_BUCKETS[-1] else 1 << (m - 1).bit_length()
    key = (kind, x.device.index, bucket, *weight.shape, x.dtype)
    hit = _CHOICE.get(key)
    if hit is not None:
        return hit
    if torch.cuda.is_current_stream_capturing():  # nothing can be timed inside a capture
        return False
    import triton.testing

    try:
        fused_ms = float(triton.testing.do_bench(fused, warmup=5, rep=20))
    except Exception as exc:  # noqa: BLE001 - a fused kernel that cannot run here is just not chosen
        log.warning("fused %s GEMM failed at %s (%r); cuBLAS and the separate kernel from now on", kind, key[2:], exc)
        _CHOICE[key] = False
        return False
    try:
        unfused_ms = float(triton.testing.do_bench(unfused, warmup=5, rep=20))
    except Exception as exc:  # noqa: BLE001 - e.g. no memory left for the timing's cache-flush buffer
        log.warning("timing the unfused %s path failed at %s (%r); it stays the path here", kind, key[2:], exc)
        _CHOICE[key] = False
        return False
    _CHOICE[key] = fused_ms <= unfused_ms
    _TIMES[key] = (fused_ms, unfused_ms)
    log.debug("%s %s: fused %.4f ms, unfused %.4f ms", kind, key[2:], fused_ms, unfused_ms)
    return _CHOICE[key]


def measured_choices() -> list[dict[str, Any]]:
    """Every choice made by measurement in this process, for bench.gpu's report: kind, row bucket,
    weight shape, dtype, whether fused won, and both times in ms."""
    return [
        {
            "kind": k[0],
            "rows": k[2],
            "weight": [k[3], k[4]],
            "dtype": str(k[5]).removeprefix("torch."),
            "fused": fused,
            "fused_ms": _TIMES.get(k, (None, None))[0],
            "unfused_ms": _TIMES.get(k, (None, None))[1],
        }
        for k, fused in _CHOICE.items()
    ]


def gate_up_act(x: torch.Tensor, gate_up_proj: nn.Module, activation: str) -> torch.Tensor:
    """act(gate) * up of the gate/up projection (gate rows, then up rows) of x (num_tokens, hidden):
    (num_tokens, intermediate)."""
    if activation in ("silu", "swish") and _fusable(gate_up_proj, x) and gate_up_proj.bias is None:
        from batchrun.kernels.triton_fused_gemm import gemm_silu_mul

        weight = gate_up_proj.weight

        def fused() -> torch.Tensor:
            return gemm_silu_mul(x, weight)

        if _choose("silu_mul", x, weight, fused, lambda: ew.act_mul(gate_up_proj(x), activation)):
            return fused()
    return ew.act_mul(gate_up_proj(x), activation)


def qkv_project(
    x: torch.Tensor,  # (num_tokens, hidden)
    qkv_proj: nn.Module,
    heads: QKVHeads,
    cos: torch.Tensor,  # (num_tokens, head_dim); with positions (num_positions, head_dim)
    sin: torch.Tensor,
    k_cache: Any,  # (num_blocks, block_size, num_kv_heads, head_dim) tensor, or a QuantizedKVCache
    v_cache: Any,
    slot_mapping: torch.Tensor,  # (num_tokens,); negative: write nothing
    positions: Optional[torch.Tensor] = None,  # (num_tokens,): cos/sin are tables
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_norm_rope_write(qkv_proj(x), ...)`: (q, k, v) per head, q and k normed and rotated, K
    and V stored at their slots."""
    if (
        _fusable(qkv_proj, x)
        and isinstance(k_cache, torch.Tensor)
        and isinstance(v_cache, torch.Tensor)
        and k_cache.stride() == v_cache.stride()
        and cos.stride(-1) == 1
        and sin.stride() == cos.stride()
    ):
        from batchrun.kernels.triton_fused_gemm import gemm_qkv_norm_rope_write

        weight, bias = qkv_proj.weight, qkv_proj.bias

        def fused() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return gemm_qkv_norm_rope_write(x, weight, bias, heads, cos, sin, k_cache, v_cache, slot_mapping, positions)

        def unfused() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return qkv_norm_rope_write(qkv_proj(x), heads, cos, sin, k_cache, v_cache, slot_mapping, positions)

        if _choose("qkv", x, weight, fused, unfused):
            return fused()
    return qkv_norm_rope_write(qkv_proj(x), heads, cos, sin, k_cache, v_cache, slot_mapping, positions)


def lm_head_logits(hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    """`lm_head(hidden).float()`: (num_rows, vocab_size) float32 logits of hidden (num_rows, hidden)."""
    if _fusable(lm_head, hidden) and lm_head.bias is None:
        from batchrun.kernels.triton_fused_gemm import gemm_logits

        weight = lm_head.weight

        def fused() -> torch.Tensor:
            return gemm_logits(hidden, weight)

        if _choose("logits", hidden, weight, fused, lambda: lm_head(hidden).float()):
            return fused()
    return lm_head(hidden).float()


def embed_norm(
    input_ids: torch.Tensor, embedding: nn.Module, norm_weight: torch.Tensor, eps: float
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(rms_norm(embedding(input_ids)), embedding(input_ids)) in one launch where Triton runs and
    the embedding is a plain nn.Embedding (non-Gemma norm); None elsewhere: the caller runs the two."""
    if not (
        FUSE
        and type(embedding) is nn.Embedding
        and input_ids.dim() == 1
        and input_ids.shape[0] > 0
        and embedding.weight.stride(1) == 1
        and triton_usable(input_ids)
    ):
        return None
    from batchrun.kernels.triton_embed_norm import embed_rms_norm

    return embed_rms_norm(input_ids, embedding.weight, norm_weight, eps)
