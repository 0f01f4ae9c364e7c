"""What passes between an RMSNorm and the 8-bit linear after it when the norm quantizes the rows
itself (kernels/triton_elementwise.py: rms_norm_quant): the linear says how it wants its input
quantized (`ActQuant`), the norm hands back the rows with their codes (`QuantizedRows`), and the
linear skips its own quantization kernel. No Triton here: the layers import these types on every
backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# cuBLAS's int8 GEMM (torch._int_mm) takes more than this many rows: fewer are padded with zero rows,
# written by the quantizing kernel itself rather than by a separate pad.
INT_MM_MIN_ROWS = 17


@dataclass(frozen=True)
class ActQuant:
    """Per-token quantization a linear wants of its input: codes in `dtype` (int8 or
    float8_e4m3fn), `skip` (K,) bool columns counted as 0 (W8A8's float channels) or None, and at
    least `min_rows` rows of codes (zero rows past the input's)."""

    dtype: torch.dtype
    skip: Optional[torch.Tensor] = None
    min_rows: int = 0


@dataclass(frozen=True)
class QuantizedRows:
    """Rows x (M, K) in the model dtype with their per-token codes q (max(M, min_rows), K) and
    scales (M, 1) float32, bitwise what kernels/quant/triton_act.py: quantize_rows(x, ...) returns."""

    x: torch.Tensor
    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.x.shape
