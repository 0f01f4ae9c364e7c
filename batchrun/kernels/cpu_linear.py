"""bf16 linear kernels on the CPU over weights packed once at load (the modules that hold them:
batchrun/model/linear.py).

- The native kernels (csrc/linear.cpp), where they are built with AVX512-BF16 and the shape fits
  (out_features a multiple of 32, in_features even and at most NATIVE_MAX_IN_FEATURES), read the
  weight in their own tiles (`pack_native_weight`) and prefetch the next tile while they compute.
  `native_linear` runs y = x @ W.T + b, or silu(gate) * up of a gate/up projection whose rows are
  in `silu_pair_order`, applied in the tile store. Their float32 sums run in a different order from
  oneDNN's, so outputs can differ from F.linear in the last bf16 bit.
- oneDNN's packed weights (`mkldnn_pack`, `mkldnn_linear`): F.linear hands oneDNN a plain weight
  on every call, which it reorders into its blocked layout each time; packing once at load removes
  that reorder, and the product is the same oneDNN kernel, bitwise F.linear's.
"""

from __future__ import annotations

from typing import Optional

import torch

from batchrun.kernels import cpu_native

# A weight tile (32 output columns x in_features bf16) is reused from L2 by every 12-row block of a
# large batch; past this width the tile outgrows L2 and oneDNN's K-blocked GEMM is the safer choice.
NATIVE_MAX_IN_FEATURES = 8192
TILE_N = 32  # csrc/linear.cpp's output columns per weight tile


def packing_available() -> bool:
    """Whether this torch build has the oneDNN ops that pack a linear weight once (mkldnn_pack)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def mkldnn_pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """(N, K) bf16 -> oneDNN's packed layout (an opaque mkldnn tensor) for about `batch_hint` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def mkldnn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x @ W.T + b over mkldnn_pack's weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def native_supported(out_features: int, in_features: int) -> bool:
    """Whether the native bf16 kernel takes an (out_features, in_features) weight: built with
    AVX512-BF16, out_features a multiple of 32, in_features even and not too wide. Asked where the
    kernels are built and on (a CPU kernel set that packs for them: model/linear.py)."""
    if in_features > NATIVE_MAX_IN_FEATURES:
        return False
    return bool(cpu_native.loaded().batchrun_linear_bf16_supported(out_features, in_features))


def pack_tiles(w: torch.Tensor, group: int) -> torch.Tensor:
    """(N, K) -> csrc/linear.cpp's tile layout [N / 32][K / group][32][group] (groups of `group`
    consecutive k per column: bf16 pairs, int8 quads), as an (N, K)-shaped tensor."""
    n, k = w.shape
    return w.reshape(n // TILE_N, TILE_N, k // group, group).permute(0, 2, 1, 3).contiguous().reshape(n, k)


def unpack_tiles(packed: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of pack_tiles: the plain (N, K) matrix."""
    n, k = packed.shape
    return packed.reshape(n // TILE_N, k // group, TILE_N, group).permute(0, 2, 1, 3).reshape(n, k)


def pack_native_weight(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> batchrun_linear_bf16's tiles [N / 32][K / 2][32][2] (vdpbf16ps pairs)."""
    return pack_tiles(w, 2)


def unpack_native_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_native_weight: the plain (N, K) weight."""
    return unpack_tiles(packed, 2)


def unpack_native_weight_into(packed: torch.Tensor, out: torch.Tensor, silu_pairs: bool = False) -> torch.Tensor:
    """pack_native_weight's tiles (N, K) unpacked into `out` (N, K), the plain weight, and returned.
    `silu_pairs`: the tiles hold a gate/up weight in silu_pair_order, and `out` gets HF's order
    (gate rows, then up rows). One pass that moves each k pair as one 32-bit word (the tiles'
    unit), several times faster than permuting bf16 elements."""
    n, k = packed.shape
    assert out.shape == packed.shape and out.dtype == packed.dtype == torch.bfloat16 and out.is_contiguous()
    words = packed.view(torch.int32).view(n // TILE_N, k // 2, TILE_N)  # [tile][k pair][column]
    if silu_pairs:  # tile 2j holds gate rows 32j.., tile 2j + 1 the same up rows
        src = words.view(n // (2 * TILE_N), 2, k // 2, TILE_N).permute(1, 0, 3, 2)  # [gate|up][j][column][k pair]
        out.view(torch.int32).view(2, n // (2 * TILE_N), TILE_N, k // 2).copy_(src)
    else:
        out.view(torch.int32).view(n // TILE_N, TILE_N, k // 2).copy_(words.transpose(1, 2))
    return out


def tiled_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (flat int64) of a pack_native_weight matrix (N, K): (num_ids, K), the same values."""
    n, k = packed.shape
    tiles = packed.view(n // TILE_N, k // 2, TILE_N, 2)
    if ids.numel() and int(ids.min()) < 0:  # floor division would wrap a negative id to a real row
        raise IndexError(f"token id {int(ids.min())} out of range for an embedding of {n} rows")
    return tiles[ids // TILE_N, :, ids % TILE_N, :].reshape(-1, k)  # ids >= n raise IndexError


def silu_pair_order(n: int) -> torch.Tensor:
    """Row order of a (2n, K) gate/up weight (gate rows first) for batchrun_linear_silu_mul_bf16:
    32 gate rows, the same 32 up rows, the next 32 gate rows, ... (n a multiple of 32)."""
    return torch.arange(2 * n).view(2, n // TILE_N, TILE_N).permute(1, 0, 2).reshape(-1)


def native_linear(
    x2: torch.Tensor, packed_weight: torch.Tensor, bias_f32: Optional[torch.Tensor], silu_mul: bool = False
) -> torch.Tensor:
    """x2 (M, K) bf16 with unit column stride, through csrc/linear.cpp over pack_native_weight's
    tiles; the bias in float32 (added before the one rounding, as F.linear does) or None. With
    `silu_mul` the weight is a (2n, K) gate/up projection in silu_pair_order and the result is
    silu(gate) * up, (M, n); otherwise (M, N)."""
    kernel = "batchrun_linear_silu_mul_bf16" if silu_mul else "batchrun_linear_bf16"
    m, k = x2.shape
    n = packed_weight.shape[0] // 2 if silu_mul else packed_weight.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    if m:
        rc = getattr(cpu_native.library(), kernel)(
            x2.data_ptr(),
            m,
            k,
            x2.stride(0),
            packed_weight.data_ptr(),
            n,
            None if bias_f32 is None else bias_f32.data_ptr(),
            y.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"{kernel} failed ({rc}) for weight {tuple(packed_weight.shape)}")
    return y
