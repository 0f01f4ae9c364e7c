"""The quantized weight formats and their codecs (what GGUF blocks map onto, what every kernel reads).

- int8: `qweight` int8 (N, K), `scales` float32 (N, K // group_size); w = q * scale. A group size
  of K is per output channel; 32 is GGUF's Q8_0.
- int4: `qweight` uint8 (N, K // 2), byte j of a row holds k = 2j in its low nibble and k = 2j + 1
  in its high nibble; `scales` and `mins` float16 (N, K // group_size); w = q * scale + min with q
  in [0, 15]. Asymmetric like GGUF's Q4_1 (d, m); Q4_0 is the case min = -8 * scale.
- fp8: `qweight` float8_e4m3fn (N, K), `scales` float32 (N, 1); w = q * scale.
"""

from __future__ import annotations

from typing import Optional

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
# A group or row of all zeros gets this scale instead of 0, so dividing by it stays finite.
MIN_SCALE = 1e-10
# 1 / INT8_MAX and 1 / FP8_E4M3_MAX rounded to float32 (exact as Python floats): the KV cache's scale
# is amax times this, one float32 product, which every device computes alike. A quotient amax / qmax
# does not: CUDA torch evaluates a division by a Python float as a multiplication by its reciprocal,
# CPU torch and Triton's div_rn as a true division, an ulp apart on a few rows in a hundred.
INV_INT8_MAX = float(torch.tensor(1.0 / INT8_MAX, dtype=torch.float32))
INV_FP8_E4M3_MAX = float(torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32))


def activation_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The per-token activation scale of W8A8 and fp8 linears: max(amax / qmax, MIN_SCALE) from a float32
    amax, a true division (in place). The Triton quantization (kernels/quant/triton_act.py:
    activation_scale) divides the same way (div_rn), and the native CPU pass too, so all are bitwise."""
    return amax.div_(qmax).clamp_(min=MIN_SCALE)


def quantize_int8(w: torch.Tensor, group_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8, one scale per `group_size` inputs (None: per output channel)."""
    n, k = w.shape
    g = group_size or k
    assert k % g == 0, f"in_features {k} is not a multiple of group_size {g}"
    wg = w.float().reshape(n, k // g, g)  # (N, num_groups, group_size)
    scales = (wg.abs().amax(dim=-1) / INT8_MAX).clamp_(min=MIN_SCALE)  # (N, num_groups)
    q = torch.round(wg / scales[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(n, k), scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = qweight.shape
    num_groups = scales.shape[1]
    w = qweight.float().reshape(n, num_groups, k // num_groups) * scales.float()[..., None]
    return w.reshape(n, k).to(dtype)  # (N, K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 15] -> (N, K // 2) uint8, even k in the low nibble."""
    assert q.shape[-1] % 2 == 0
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K // 2) uint8 -> (N, K) uint8 values in [0, 15]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest int4 per group: (packed (N, K//2), scales, mins (N, K//g) float16)."""
    n, k = w.shape
    assert k % group_size == 0 and group_size % 2 == 0, f"in_features {k} vs group_size {group_size}"
    wg = w.float().reshape(n, k // group_size, group_size)
    lo = wg.amin(dim=-1)
    hi = wg.amax(dim=-1)
    # Quantize against the float16 values that are stored, so dequantization reproduces them.
    scales = ((hi - lo) / 15.0).clamp_(min=1e-7).to(torch.float16)
    mins = lo.to(torch.float16)
    q = torch.round((wg - mins.float()[..., None]) / scales.float()[..., None]).clamp_(0, 15)
    return pack_int4(q.reshape(n, k)), scales, mins


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    n = packed.shape[0]
    q = unpack_int4(packed).float()
    num_groups = scales.shape[1]
    w = q.reshape(n, num_groups, -1) * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(n, -1).to(dtype)  # (N, K)


def quantize_fp8(w: torch.Tensor, row_absmax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3: (qweight float8_e4m3fn (N, K), scales float32 (N, 1)). `row_absmax`
    (N, 1): each row's largest magnitude over the whole row, where `w` holds only some of its
    columns (a tensor-parallel rank's slice: its codes are then one process's, sliced)."""
    if row_absmax is None:
        row_absmax = w.float().abs().amax(dim=1, keepdim=True)
    scales = (row_absmax.float() / FP8_E4M3_MAX).clamp_(min=MIN_SCALE)
    return (w.float() / scales).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scales


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (qweight.float() * scales).to(dtype)
