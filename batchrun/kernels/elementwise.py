"""The elementwise ops between a decoder layer's GEMMs: RMSNorm (optionally fused with the residual
add before it), rotary position embedding and silu(gate) * up.

Each function has one signature and up to three paths: CUDA tensors take one fused Triton kernel
(kernels/triton_elementwise.py) where triton is installed; bf16 CPU tensors go through one native
pass (csrc/elementwise.cpp, built by cpu_native) when the kernels are built; everything else
(float32 on the CPU, BATCHRUN_CPU_KERNELS=0) takes the plain-torch reference path, which is also
what the other two are tested against. The native path keeps torch's bf16 roundings (each op's result is
rounded to bf16 before the next reads it), so rotary and the residual add are bitwise equal to the
reference, and RMSNorm and silu differ only where a float32 sum order or exp's last bit tips a
bf16 rounding. float32 stays on torch ops on purpose: that path is the one held token-identical to
HF transformers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from batchrun.kernels import cpu_native
from batchrun.kernels.backend import triton_usable
from batchrun.kernels.quant.act import ActQuant, QuantizedRows


def _native(*tensors: torch.Tensor) -> bool:
    # Called several times per layer and step: the cheap dtype test first.
    return all(t.dtype == torch.bfloat16 for t in tensors) and cpu_native.usable(*tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as HF does; Gemma scales by (1 + w) in float32,
    the others multiply w by the normalized value rounded to x's dtype (HF's rounding order)."""
    if triton_usable(x) and x.dim() >= 2:
        from batchrun.kernels.triton_elementwise import rms_norm as rms_norm_triton

        return rms_norm_triton(x, weight, eps, is_gemma)
    if _native(x, weight) and x.stride(-1) == 1 and x.dim() >= 2:
        return _rms_norm_native(x, weight, eps, is_gemma, residual=None)
    return rms_norm_reference(x, weight, eps, is_gemma)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool = False) -> torch.Tensor:
    # One fused kernel for the normalization (the unfused pow/mean/rsqrt/mul chain costs ~5 passes).
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if is_gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + h), residual + h): the residual add and the next sublayer's norm in one
    pass. The native and Triton paths update `residual` in place (the decoder owns its residual stream)."""
    if (
        triton_usable(h)
        and h.dim() == 2
        and h.stride(-1) == 1
        and residual.stride(-1) == 1
        and residual.shape == h.shape
    ):
        from batchrun.kernels.triton_elementwise import add_rms_norm as add_rms_norm_triton

        return add_rms_norm_triton(h, residual, weight, eps)
    if (
        _native(h, residual, weight)
        and h.dim() == 2
        and h.stride(-1) == 1
        and residual.is_contiguous()
        and residual.shape == h.shape
    ):
        return _rms_norm_native(h, weight, eps, False, residual=residual), residual
    return add_rms_norm_reference(h, residual, weight, eps)


def rms_norm_quant(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, quant: ActQuant
) -> tuple[QuantizedRows, torch.Tensor]:
    """add_rms_norm (rms_norm without a residual) whose normed rows also come quantized per token as
    `quant` asks, in the same pass: the GPU's fp8 / W8A8 linears ask for it (their `input_quant`)
    and then skip their own quantization kernel. The Triton kernel only: x 2-D with unit last
    stride on a GPU (triton_usable), `residual` updated in place."""
    from batchrun.kernels.triton_elementwise import rms_norm_quant as rms_norm_quant_triton

    return rms_norm_quant_triton(x, residual, weight, eps, quant)


def add_rms_norm_reference(
    h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + h
    return rms_norm_reference(residual, weight, eps), residual


def _rms_norm_native(
    x: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool, residual: Optional[torch.Tensor]
) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (num_rows, k); a copy only for strided head views
    out = torch.empty(x2.shape, dtype=x.dtype)  # (num_rows, k)
    assert weight.is_contiguous()
    cpu_native.loaded().batchrun_rms_norm_bf16(
        x2.data_ptr(),
        x2.shape[0],
        k,
        x2.stride(0),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        eps,
        is_gemma,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out if x.dim() == 2 else out.view(x.shape)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin per head. x: (num_tokens, num_heads, head_dim), rows any
    stride (a view of the fused qkv output); cos, sin: (num_tokens, head_dim) in x's dtype. The
    native path rotates x in place and returns it; the reference returns a new tensor."""
    t, num_heads, head_dim = x.shape
    if (
        _native(x, cos, sin)
        and x.stride(2) == 1
        and x.stride(1) == head_dim
        and cos.is_contiguous()
        and sin.is_contiguous()
        and head_dim % 2 == 0
        and head_dim <= 512
    ):
        cpu_native.loaded().batchrun_rotary_bf16(
            x.data_ptr(), t, num_heads, head_dim, x.stride(0), cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
        )
        return x
    return apply_rotary_reference(x, cos, sin)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def activation(name: str):
    """The MLP activation by HF's name."""
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"activation {name!r} is not supported")


def act_mul(gate_up: torch.Tensor, name: str) -> torch.Tensor:
    """act(gate) * up for the fused gate/up projection's output (num_tokens, 2 * n), gate first."""
    if name in ("silu", "swish") and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        if triton_usable(gate_up):
            from batchrun.kernels.triton_elementwise import silu_mul

            return silu_mul(gate_up)
        if _native(gate_up):
            return _silu_mul_native(gate_up)
    return act_mul_reference(gate_up, name)


def _silu_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    out = torch.empty((gate_up.shape[0], n), dtype=gate_up.dtype)  # (num_tokens, n)
    cpu_native.loaded().batchrun_silu_mul_bf16(
        gate_up.data_ptr(), gate_up.shape[0], n, gate_up.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out


def act_mul_reference(gate_up: torch.Tensor, name: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(name)(gate) * up
