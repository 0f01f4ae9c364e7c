"""The elementwise ops between a decoder layer's GEMMs: RMSNorm (optionally fused with the residual
add before it), rotary position embedding and silu(gate) * up.

Each op has one signature and up to three functions, one per kernel family, which a kernel set binds
once for its target (kernels/bind_cpu.py, kernels/bind_triton.py): `*_triton` runs one fused Triton
kernel (kernels/triton_elementwise.py); `*_native` one native bf16 pass (csrc/elementwise.cpp, built
by cpu_native; bound where the kernels are built and on); `*_reference` the plain-torch ops, which
the others are tested against. The first two take their reference where a tensor is not in a form
their kernel takes (a dtype, a dim, a stride). The native path keeps torch's bf16 roundings (each
op's result is rounded to bf16 before the next reads it), so rotary and the residual add are bitwise
equal to the reference, and RMSNorm and silu differ only where a float32 sum order or exp's last bit
tips a bf16 rounding. float32 stays on torch ops on purpose: that path is the one held
token-identical to HF transformers. The norm that also quantizes its rows for the linear after it
is Triton's alone (triton_elementwise.rms_norm_quant).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from batchrun.kernels import cpu_native

BF16 = torch.bfloat16


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as HF does; Gemma scales by (1 + w) in float32,
    the others multiply w by the normalized value rounded to x's dtype (HF's rounding order)."""
    # One fused kernel for the normalization (the unfused pow/mean/rsqrt/mul chain costs ~5 passes).
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if is_gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool = False) -> torch.Tensor:
    """`rms_norm_reference` in one native pass over bf16 rows with unit last stride."""
    if x.dtype == BF16 and weight.dtype == BF16 and x.stride(-1) == 1 and x.dim() >= 2:
        return _rms_norm_native(x, weight, eps, is_gemma, residual=None)
    return rms_norm_reference(x, weight, eps, is_gemma)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool = False) -> torch.Tensor:
    """`rms_norm_reference` in one Triton kernel (rows of any dim from 2)."""
    if x.dim() >= 2:
        from batchrun.kernels.triton_elementwise import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, weight, eps, is_gemma)
    return rms_norm_reference(x, weight, eps, is_gemma)


def add_rms_norm_reference(
    h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + h), residual + h): the residual add and the next sublayer's norm. The
    native and Triton functions do both in one pass and update `residual` in place (the decoder
    owns its residual stream)."""
    residual = residual + h
    return rms_norm_reference(residual, weight, eps), residual


def add_rms_norm_native(
    h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` in one native pass over bf16 (rows, n) matrices."""
    if (
        h.dtype == BF16
        and residual.dtype == BF16
        and weight.dtype == BF16
        and h.dim() == 2
        and h.stride(-1) == 1
        and residual.is_contiguous()
        and residual.shape == h.shape
    ):
        return _rms_norm_native(h, weight, eps, False, residual=residual), residual
    return add_rms_norm_reference(h, residual, weight, eps)


def add_rms_norm_triton(
    h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` in one Triton kernel."""
    if h.dim() == 2 and h.stride(-1) == 1 and residual.stride(-1) == 1 and residual.shape == h.shape:
        from batchrun.kernels.triton_elementwise import add_rms_norm as add_rms_norm_kernel

        return add_rms_norm_kernel(h, residual, weight, eps)
    return add_rms_norm_reference(h, residual, weight, eps)


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


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin per head. x: (num_tokens, num_heads, head_dim), rows any
    stride (a view of the fused qkv output); cos, sin: (num_tokens, head_dim) in x's dtype. A new
    tensor (the native function rotates x in place and returns it)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def apply_rotary_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_reference` in one native bf16 pass, in place, where x's heads have unit strides."""
    t, num_heads, head_dim = x.shape
    if (
        x.dtype == BF16
        and cos.dtype == BF16
        and sin.dtype == BF16
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


def activation(name: str):
    """The MLP activation by HF's name."""
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"activation {name!r} is not supported")


def act_mul_reference(gate_up: torch.Tensor, name: str) -> torch.Tensor:
    """act(gate) * up for the fused gate/up projection's output (num_tokens, 2 * n), gate first."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(name)(gate) * up


def _is_silu_rows(gate_up: torch.Tensor, name: str) -> bool:
    return name in ("silu", "swish") and gate_up.dim() == 2 and gate_up.stride(-1) == 1


def act_mul_native(gate_up: torch.Tensor, name: str) -> torch.Tensor:
    """`act_mul_reference` in one native pass for silu over bf16 rows."""
    if _is_silu_rows(gate_up, name) and gate_up.dtype == BF16:
        return _silu_mul_native(gate_up)
    return act_mul_reference(gate_up, name)


def act_mul_triton(gate_up: torch.Tensor, name: str) -> torch.Tensor:
    """`act_mul_reference` in one Triton kernel for silu (gelu keeps the torch activation)."""
    if _is_silu_rows(gate_up, name):
        from batchrun.kernels.triton_elementwise import silu_mul

        return silu_mul(gate_up)
    return act_mul_reference(gate_up, name)


def _silu_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    out = torch.empty((gate_up.shape[0], n), dtype=gate_up.dtype)  # (num_tokens, n)
    cpu_native.loaded().batchrun_silu_mul_bf16(
        gate_up.data_ptr(), gate_up.shape[0], n, gate_up.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out
