"""The quantized linears' functions as a kernel set binds them, one signature per weight format
(kernels/kernel_set.py: KernelSet.linear_*; model/quant/layers.py calls them):

- int8 (W8A16): (x2 (M, K), qweight (N, K) int8, scales (N, num_groups) float32, bias, scales_bf16)
  -> (M, N), scales_bf16 the per-channel scales' bf16 copy (None when grouped) that torch's packed
  CPU kernel takes;
- int4 (W4A16) over the canonical layout: weight_only.int4_weight_matmul's signature, and over
  torch's packed CPU layout `int4_linear_cpu`;
- W8A8: w8a8.w8a8_matmul's signature (x, qweight, scales (N, 1), bias, outliers), x also as
  QuantizedRows on the GPU;
- fp8: weight_only.fp8_weight_matmul's (x, qweight, scales (N, 1), bias), x also as QuantizedRows
  on the GPU.

The Triton ones import Triton where they run (a Triton kernel set binds them); the rest is torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Union

import torch

from batchrun.kernels.quant.act import QuantizedRows
from batchrun.kernels.quant.w8a8 import OutlierChannels
from batchrun.kernels.quant.weight_only import int4_matmul_cpu, int8_weight_matmul, int8_weight_matmul_cpu

# Up to this many rows torch's packed W8A16 CPU kernel beats dequantizing into a bf16 GEMM; past
# it the GEMM amortizes the dequantization (see docs/quantization.md).
CPU_INT8PACK_MAX_ROWS = 4
INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's packed int4 CPU kernel takes


def int8_linear_reference(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor],
    scales_bf16: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """W8A16 as plain torch ops (weight_only.int8_weight_matmul)."""
    return int8_weight_matmul(x2, qweight, scales, bias)


def int8_linear_cpu(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor],
    scales_bf16: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """W8A16 on the CPU: torch's packed kernel for up to CPU_INT8PACK_MAX_ROWS bf16 rows of a
    per-channel weight (a decode step's), the reference otherwise."""
    if scales_bf16 is not None and x2.dtype == torch.bfloat16 and x2.shape[0] <= CPU_INT8PACK_MAX_ROWS:
        y = int8_weight_matmul_cpu(x2, qweight, scales_bf16)
        return y + bias if bias is not None else y
    return int8_weight_matmul(x2, qweight, scales, bias)


def int4_linear_cpu(
    x2: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """W4A16 through torch's packed int4 CPU kernel (weight_only.int4_pack_for_cpu's layout), in x2's dtype."""
    y = int4_matmul_cpu(x2.to(torch.bfloat16), packed, group_size, scales_zeros).to(x2.dtype)
    return y + bias if bias is not None else y


def w8a8_linear_triton(
    x: Union[torch.Tensor, QuantizedRows],
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    outliers: Optional[OutlierChannels] = None,
) -> torch.Tensor:
    """W8A8 on the GPU (kernels/quant/triton_act.py: w8a8_linear): quantize, torch._int_mm, epilogue,
    3 kernels; 2 for x already quantized by the norm before it (QuantizedRows)."""
    from batchrun.kernels.quant.triton_act import w8a8_linear

    o = outliers
    args = (qweight, scales.reshape(-1), bias, *((None,) * 3 if o is None else (o.index, o.skip, o.weight_t)))
    if isinstance(x, QuantizedRows):
        return w8a8_linear(x, *args)
    shape = x.shape
    y = w8a8_linear(x.reshape(-1, shape[-1]), *args)
    return y.reshape(*shape[:-1], y.shape[-1])


def fp8_linear_triton(
    x: Union[torch.Tensor, QuantizedRows],
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    wide: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """fp8 on a GPU with e4m3 (compute capability 8.9+): bf16/fp16 activations quantized per token
    by one Triton kernel, then torch._scaled_mm (kernels/quant/triton_act.py: fp8_linear), or
    _scaled_mm alone on rows the norm before it quantized (QuantizedRows); other dtypes take `wide`
    (weight_only.fp8_scaled_matmul on a real GPU)."""
    from batchrun.kernels.quant.triton_act import fp8_linear

    if isinstance(x, QuantizedRows):
        return fp8_linear(x, qweight, scales.t(), bias)  # (N, 1) -> (1, N): a view, already contiguous
    if x.dtype not in (torch.bfloat16, torch.float16):
        return wide(x, qweight, scales, bias)
    shape = x.shape
    y = fp8_linear(x.reshape(-1, shape[-1]), qweight, scales.t(), bias)
    return y.reshape(*shape[:-1], y.shape[-1])
