"""`QuantizedWeight`: one weight matrix in a format of kernels/quant/formats.py, and quantizing to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from batchrun.kernels import quant as qk


@dataclass
class QuantizedWeight:
    """One weight matrix (N, K) in a canonical format of `batchrun.kernels.quant`."""

    format: str  # "int8" | "int4" | "fp8"
    qweight: torch.Tensor  # int8 (N, K) | uint8 (N, K // 2) | float8_e4m3fn (N, K)
    scales: torch.Tensor  # (N, num_groups): float32 for int8 and fp8, float16 for int4
    mins: Optional[torch.Tensor] = None  # int4 only: (N, num_groups) float16
    in_features: int = 0

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.format == "int8":
            return qk.dequantize_int8(self.qweight, self.scales, dtype)
        if self.format == "int4":
            assert self.mins is not None
            return qk.dequantize_int4(self.qweight, self.scales, self.mins, dtype)
        return qk.dequantize_fp8(self.qweight, self.scales, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack along the output dim (fusing q/k/v or gate/up); formats and groups must agree."""
        first = parts[0]
        assert all(
            p.format == first.format
            and p.in_features == first.in_features
            and p.scales.shape[1] == first.scales.shape[1]
            for p in parts
        ), "cannot fuse mixed formats"
        mins = torch.cat([p.mins for p in parts if p.mins is not None]) if first.mins is not None else None
        return QuantizedWeight(
            first.format,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            first.in_features,
        )


def effective_group_size(in_features: int, group_size: int) -> int:
    """`group_size`, halved until it divides in_features (SmolLM2's 576 takes 64 for 128)."""
    g = group_size
    while g > 2 and in_features % g:
        g //= 2
    return g if in_features % g == 0 else in_features


def quantize_weight(
    w: torch.Tensor, fmt: str, group_size: Optional[int] = None, row_absmax: Optional[torch.Tensor] = None
) -> QuantizedWeight:
    """Float (N, K) -> QuantizedWeight; int8 is per channel unless `group_size` is given. `row_absmax`
    (fp8): the rows' magnitudes over more columns than `w` holds (formats.quantize_fp8)."""
    k = w.shape[1]
    if fmt == "int8":
        qw, s = qk.quantize_int8(w, effective_group_size(k, group_size) if group_size else None)
        return QuantizedWeight("int8", qw, s, None, k)
    if fmt == "int4":
        qw, s, m = qk.quantize_int4(w, effective_group_size(k, group_size or 32))
        return QuantizedWeight("int4", qw, s, m, k)
    if fmt == "fp8":
        qw, s = qk.quantize_fp8(w, row_absmax)
        return QuantizedWeight("fp8", qw, s, None, k)
    raise ValueError(f"unknown weight format {fmt!r}")


def to_device(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    """The same weight with its tensors on `device`."""
    return QuantizedWeight(
        w.format,
        w.qweight.to(device),
        w.scales.to(device),
        None if w.mins is None else w.mins.to(device),
        w.in_features,
    )
