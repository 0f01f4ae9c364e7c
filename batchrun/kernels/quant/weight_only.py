"""Weight-only quantized matmuls: W8A16 (int8), W4A16 (int4) and fp8 weights, activations in the
model dtype. The `*_weight_matmul` functions are the plain-torch references (the CPU path for float32
activations, and what the Triton kernels in kernels/quant/triton_gemm.py are checked against);
`int8_weight_matmul_cpu` and `int4_matmul_cpu` are torch's own packed CPU kernels, which need bf16
activations; `fp8_scaled_matmul` is W8A8-FP8 for GPUs with fp8 tensor cores.
"""

from __future__ import annotations

from typing import Optional

import torch

from batchrun.kernels.quant.formats import FP8_E4M3_MAX, activation_scale, dequantize_int4, unpack_int4


def int8_weight_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Reference W8A16: y = x @ dequant(W).T in x's dtype."""
    if scales.shape[1] == 1:
        # A per-channel scale factors out of the sum over k, so the weight is only cast, not scaled.
        y = torch.nn.functional.linear(x, qweight.to(x.dtype)) * scales[:, 0].to(x.dtype)
    else:
        # Dequantized straight into x's dtype (|q| <= 127 is exact in bf16): two passes over the
        # weight instead of four through float32; the same float32 numbers when x is float32.
        n, k = qweight.shape
        num_groups = scales.shape[1]
        w = qweight.to(x.dtype).view(n, num_groups, k // num_groups) * scales.to(x.dtype)[..., None]
        y = torch.nn.functional.linear(x, w.view(n, k))
    return y if bias is None else y + bias


def int8_weight_matmul_cpu(x: torch.Tensor, qweight: torch.Tensor, scales_bf16: torch.Tensor) -> torch.Tensor:
    """torch's packed W8A16 CPU kernel (bf16 x, per-channel scales (N,) in bf16): fastest at a few rows."""
    return torch._weight_int8pack_mm(x, qweight, scales_bf16)


def int4_weight_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference W4A16: y = x @ dequant(W).T in x's dtype."""
    y = torch.nn.functional.linear(x, dequantize_int4(qweight, scales, mins, x.dtype))
    return y if bias is None else y + bias


def int4_pack_for_cpu(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 layout -> torch's CPU int4 kernel layout: (packed weight, scales_and_zeros bf16 (G, N, 2)).

    torch's kernel computes w = (q - 8) * scale + zero, so zero = min + 8 * scale. Scales and zeros
    become bf16 there (a relative error of 2^-9, small against the half-step of rounding to int4).
    """
    q = unpack_int4(qweight).to(torch.int32)  # (N, K)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    zeros = mins.float() + 8.0 * scales.float()
    scales_zeros = torch.stack((scales.float().t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros


def int4_matmul_cpu(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """torch's packed W4A16 CPU kernel; x is bf16 (M, K)."""
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)


def fp8_weight_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Reference fp8 weight-only matmul (runs anywhere; the CPU has no fast fp8 GEMM)."""
    y = torch.nn.functional.linear(x, qweight.to(x.dtype)) * scales[:, 0].to(x.dtype)
    return y if bias is None else y + bias


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn (M, K), scale float32 (M, 1)) with x ~= x_q * scale row by row: fp8's
    activations (the torch reference of kernels/quant/triton_act.py: quantize_rows)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).float()
    sx = activation_scale(amax, FP8_E4M3_MAX)  # (M, 1)
    return (x.float() / sx).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), sx


def fp8_scaled_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """W8A8-FP8 for Hopper-class GPUs: per-token e4m3 activations, torch._scaled_mm (row-wise scales)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, sx = quantize_per_token_fp8(x2)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    y = torch._scaled_mm(xq, qweight.t(), scale_a=sx, scale_b=scales.t().contiguous(), out_dtype=out_dtype).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], y.shape[-1])
