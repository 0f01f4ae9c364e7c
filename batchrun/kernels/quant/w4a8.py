"""W4A8: int4 weights and int8 activations, both in groups of 32 along K (llama.cpp's Q4_1 x Q8_1
scheme; model/quant/layers.py: W4A8Linear). The activations are quantized per group on the fly
(`quantize_groups_int8`), each group's int8 x int4 dot product is exact in int32, then scaled and
summed in float32. `w4a8_matmul` is the plain-torch reference; in bf16 on a CPU with AVX512-VNNI
and AVX512-BF16 the native kernel (csrc/linear.cpp: w4a8_micro) runs instead, over the weight in
its nibble tiles (`pack_w4a8_weight`), and a silu MLP's gate/up projection hands its down
projection the activations already quantized (`w4a8_silu_quant_native`, `GroupQuantized`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from batchrun.kernels import cpu_native
from batchrun.kernels.cpu_linear import pack_tiles, unpack_tiles
from batchrun.kernels.cpu_native import DTYPE_CODES
from batchrun.kernels.quant.formats import INT8_MAX, MIN_SCALE, dequantize_int4, pack_int4, unpack_int4
from batchrun.kernels.quant.w8a8 import native_rows

W4A8_GROUP = 32


def quantize_groups_int8(
    x: torch.Tensor, group: int = W4A8_GROUP, native: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_q int8 (M, K), scales float32 (M, K // group), sums float32 (M, K // group)) with
    x ~= x_q * scale per group of `group` consecutive columns, and sums = scale * sum(x_q) over the
    group (W4A8's min term). `native` (the kernels built and on): in one native pass where it takes
    x, bitwise equal to this code."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"{k} features are not a whole number of groups of {group}")
    if native and native_rows(x) and group <= 512:
        xq = torch.empty((m, k), dtype=torch.int8)
        scales = torch.empty((m, k // group), dtype=torch.float32)
        sums = torch.empty((m, k // group), dtype=torch.float32)
        cpu_native.loaded().batchrun_quantize_groups_int8(
            x.data_ptr(),
            DTYPE_CODES[x.dtype],
            m,
            k,
            x.stride(0),
            group,
            xq.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
            torch.get_num_threads(),
        )
        return xq, scales, sums
    xg = x.float().reshape(m, k // group, group)
    scales = xg.abs().amax(dim=-1).div_(INT8_MAX).clamp_(min=MIN_SCALE)  # (M, G)
    q = (xg / scales[..., None]).round_()
    sums = q.sum(dim=-1) * scales  # integer sums (exact in float32: |sum| <= 127 * 512) times the scale
    return q.to(torch.int8).reshape(m, k), scales, sums


def w4a8_matmul(
    x: Union[torch.Tensor, GroupQuantized],
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    native: bool = False,
) -> torch.Tensor:
    """Reference W4A8: x quantized in groups of 32 (quantize_groups_int8, `native` as there; or
    already quantized), times the int4 weight (our layout: packed (N, K // 2), scales and mins
    (N, K // 32)), in float32, then x's dtype. The same sum as the native kernel's, in a different
    float32 order."""
    if not isinstance(x, GroupQuantized):
        xq = quantize_groups_int8(x.reshape(-1, x.shape[-1]), W4A8_GROUP, native)
        x = GroupQuantized(*xq, tuple(x.shape[:-1]), x.dtype)
    y = x.dequantize() @ dequantize_int4(qweight, scales, mins, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.lead_shape, qweight.shape[0])


def w4a8_native_supported(out_features: int, in_features: int) -> bool:
    """Whether batchrun_w4a8_linear takes this weight (built with AVX512-VNNI and BF16; out_features
    a multiple of 32, in_features of 32). Asked where the kernels are built and on."""
    return bool(cpu_native.loaded().batchrun_w4a8_linear_supported(out_features, in_features))


def pack_w4a8_weight(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our int4 layout (packed (N, K // 2), scales and mins (N, K // 32) float16) -> the native
    kernel's: nibble tiles (N, K // 2) uint8 ([N / 32][K / 4][64]: byte b of a k-quad step holds
    column b // 4's (low nibble) and column 16 + b // 4's (high nibble) k = b % 4), and scales
    (columns 16-31 divided by 16) and mins as float32 [N / 32][K / 32][32]."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    tiles = pack_tiles(unpack_int4(qweight), 4).reshape(n // 32, k // 4, 2, 64)
    packed = (tiles[:, :, 0] | (tiles[:, :, 1] << 4)).reshape(n, k // 2)
    groups = scales.shape[1]

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return t.float().reshape(n // 32, 32, groups).permute(0, 2, 1).contiguous().reshape(n, groups)

    # The kernel reads the high nibbles as 16 q (one AND, no shift), so their scales are stored / 16
    # (exact: a power of two).
    w_scales = per_tile(scales).reshape(n // 32, groups, 2, 16)
    w_scales[:, :, 1] /= 16
    return packed, w_scales.reshape(n, groups), per_tile(mins)


def unpack_w4a8_weight(
    packed: torch.Tensor, w_scales: torch.Tensor, w_mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_w4a8_weight (scales and mins come back as float16, exact: they were)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    steps = packed.reshape(n // 32, k // 4, 64)
    tiles = torch.stack((steps & 0xF, steps >> 4), dim=2).reshape(n, k)
    groups = w_scales.shape[1]

    def plain(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n // 32, groups, 32).permute(0, 2, 1).reshape(n, groups).to(torch.float16)

    scales = w_scales.reshape(n // 32, groups, 2, 16).clone()
    scales[:, :, 1] *= 16
    return pack_int4(unpack_tiles(tiles, 4)), plain(scales.reshape(n, groups)), plain(w_mins)


class GroupQuantized(NamedTuple):
    """Activations already quantized in groups of 32 (quantize_groups_int8's three tensors), as the
    fused W4A8 gate/up projection hands them to the down projection; `lead_shape`: the leading
    dims of the activations they stand for."""

    q: torch.Tensor  # (M, K) int8
    scales: torch.Tensor  # (M, K // 32) float32
    sums: torch.Tensor  # (M, K // 32) float32
    lead_shape: tuple[int, ...]
    dtype: torch.dtype  # of the activations they stand for: the dtype a projection returns

    def dequantize(self) -> torch.Tensor:
        """(M, K) float32: q * scale."""
        m, k = self.q.shape
        return (self.q.float().reshape(m, k // W4A8_GROUP, W4A8_GROUP) * self.scales[..., None]).reshape(m, k)


def _kernel_input(x: Union[torch.Tensor, GroupQuantized], k: int) -> tuple[tuple, int, tuple[int, ...], object]:
    """The kernels' activation arguments (xq, ldq, x_scales, x_sums, x, ldx), the row count, the
    leading shape, and the tensors those pointers point into (the caller holds them until the kernel
    returns: x.reshape may have made a copy). bf16 rows with unit column stride go as they are and
    the kernel quantizes them itself (one call instead of two, no intermediate tensors: what a
    decode step's small projections need); other inputs are quantized here first."""
    if not isinstance(x, GroupQuantized):
        if x.shape[-1] != k:
            raise ValueError(f"input has {x.shape[-1]} features, the weight {k}")
        x2 = x.reshape(-1, k)
        if x2.dtype == torch.bfloat16 and x2.stride(1) == 1:
            return (None, 0, None, None, x2.data_ptr(), x2.stride(0)), x2.shape[0], tuple(x.shape[:-1]), x2
        x = GroupQuantized(*quantize_groups_int8(x2.contiguous(), W4A8_GROUP, True), tuple(x.shape[:-1]), x.dtype)
    if x.q.shape[1] != k:  # the kernel takes K from the weight: a wrong width would read past x
        raise ValueError(f"input has {x.q.shape[1]} features, the weight {k}")
    return (
        (x.q.data_ptr(), x.q.stride(0), x.scales.data_ptr(), x.sums.data_ptr(), None, 0),
        x.q.shape[0],
        x.lead_shape,
        x,
    )


def w4a8_matmul_native(
    x: Union[torch.Tensor, GroupQuantized],
    packed: torch.Tensor,
    w_scales: torch.Tensor,
    w_mins: torch.Tensor,
    bias_f32: Optional[torch.Tensor],
) -> torch.Tensor:
    """w4a8_matmul for a bf16 CPU x (quantized by the kernel, as quantize_groups_int8 does it) or x
    already quantized, through the native kernel (pack_w4a8_weight's tensors; bias float32 or
    None): the same integer group sums, scaled and summed in float32 in registers, one rounding to
    bf16."""
    k = packed.shape[1] * 2
    (xq, ldq, xs, xsum, xb, ldx), m, lead_shape, _held = _kernel_input(x, k)
    n = packed.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    if m:
        rc = cpu_native.loaded().batchrun_w4a8_linear(
            xq,
            m,
            k,
            ldq,
            xs,
            xsum,
            xb,
            ldx,
            packed.data_ptr(),
            w_scales.data_ptr(),
            w_mins.data_ptr(),
            n,
            None if bias_f32 is None else bias_f32.data_ptr(),
            y.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"batchrun_w4a8_linear failed ({rc}) for weight {tuple(packed.shape)}")
    return y.reshape(*lead_shape, n)


def w4a8_silu_quant_native(
    x: torch.Tensor,
    packed: torch.Tensor,
    w_scales: torch.Tensor,
    w_mins: torch.Tensor,
    bias_f32: Optional[torch.Tensor],
) -> GroupQuantized:
    """silu(gate) * up of a W4A8 gate/up projection, quantized in groups of 32 for the down
    projection, in one native pass (csrc/linear.cpp: w4a8_silu_quant_pair): `packed` etc. are
    pack_w4a8_weight's tensors of the (2N, K) weight with its rows in silu pair order
    (kernels/cpu_linear.py: silu_pair_order). Bitwise: the projection, batchrun_silu_mul_bf16's
    product and quantize_groups_int8."""
    k = packed.shape[1] * 2
    (xq, ldq, xs, xsum, xb, ldx), m, lead_shape, _held = _kernel_input(x, k)
    n = packed.shape[0] // 2
    q = torch.empty((m, n), dtype=torch.int8)
    scales = torch.empty((m, n // W4A8_GROUP), dtype=torch.float32)
    sums = torch.empty((m, n // W4A8_GROUP), dtype=torch.float32)
    if m:
        rc = cpu_native.loaded().batchrun_w4a8_silu_quant(
            xq,
            m,
            k,
            ldq,
            xs,
            xsum,
            xb,
            ldx,
            packed.data_ptr(),
            w_scales.data_ptr(),
            w_mins.data_ptr(),
            n,
            None if bias_f32 is None else bias_f32.data_ptr(),
            q.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"batchrun_w4a8_silu_quant failed ({rc}) for weight {tuple(packed.shape)}")
    return GroupQuantized(q, scales, sums, lead_shape, x.dtype)
