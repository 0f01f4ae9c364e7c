"""bf16 linear layers on the CPU with their weights packed once at load.

Two packed forms, both chosen per layer by `pack_linear`:

- NativeLinear (csrc/linear.cpp), where the native kernels are built with AVX512-BF16 and the
  shape fits (out_features a multiple of 32, in_features even and at most NATIVE_MAX_IN_FEATURES).
  At a decode step's row counts each weight byte comes from DRAM once per step, and the kernel
  prefetches the next weight tile while it computes the current one, which oneDNN's GEMM does not:
  SmolLM2's 120 projections, run one after another as in a step, took 9.7 ms at 32 rows against
  13.7 ms through oneDNN's packed weights (5.1 vs 6.8 ms at 1 row, 17.4 vs 22.5 at 64; at 512
  rows 125 vs 128 ms). Its float32 sums run in a different order from oneDNN's, so outputs can
  differ from F.linear in the last bf16 bit (tested against a float32 reference).
- PackedLinear, elsewhere: `F.linear` hands oneDNN a plain (N, K) weight on every call, and
  oneDNN reorders it into its blocked layout each time; at the row counts of a decode step that
  reorder is a large part of the call (measured here for SmolLM2's shapes at 32 rows: 83 -> 61 us
  for qkv, 232 -> 184 us for gate/up, 4.6 -> 3.6 ms for the LM head; at 512 rows within noise).
  Packing once at load (torch.ops.mkldnn._reorder_linear_weight, the op torch.compile's CPU
  backend uses) removes it. The product is the same oneDNN kernel, so outputs are bitwise those
  of F.linear; `pack_linear` checks that on a probe input and leaves a layer alone when the build
  lacks the ops or they disagree.

A silu MLP's gate/up projection is packed as a NativeSiluMulLinear (`pack_silu_mul`): the same
kernel with silu(gate) * up applied in its tile store, so the (rows, 2 * intermediate) projection
output is never written and read back by a separate activation pass (bitwise the two passes'
result; summarize in-process A/B 1.05x).

Either way the packed weight replaces the plain one (no second copy). bf16 only: the float32 path
stays on F.linear, the one held token-identical to HF transformers.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels import cpu_native
from batchrun.kernels.elementwise import act_mul, act_mul_reference

log = logging.getLogger(__name__)


def packing_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's packed layout (an opaque mkldnn tensor buffer)."""

    def __init__(self, packed_weight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed_weight", packed_weight)  # (out_features, in_features), mkldnn layout
        self.register_buffer("bias", bias)  # (out_features,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


# A weight tile (32 output columns x in_features bf16) is reused from L2 by every 12-row block of a
# large batch; past this width the tile outgrows L2 and oneDNN's K-blocked GEMM is the safer choice.
NATIVE_MAX_IN_FEATURES = 8192
_TILE_N = 32  # csrc/linear.cpp's output columns per weight tile


def native_supported(out_features: int, in_features: int) -> bool:
    """Whether NativeLinear serves an (out_features, in_features) weight here: kernels on and built
    with AVX512-BF16, out_features a multiple of 32, in_features even and not too wide."""
    if not (cpu_native.enabled() and cpu_native.available()) or in_features > NATIVE_MAX_IN_FEATURES:
        return False
    return bool(cpu_native.library().batchrun_linear_bf16_supported(out_features, in_features))


def pack_tiles(w: torch.Tensor, group: int) -> torch.Tensor:
    """(N, K) -> csrc/linear.cpp's tile layout [N / 32][K / group][32][group] (groups of `group`
    consecutive k per column: bf16 pairs, int8 quads), as an (N, K)-shaped tensor."""
    n, k = w.shape
    return w.reshape(n // _TILE_N, _TILE_N, k // group, group).permute(0, 2, 1, 3).contiguous().reshape(n, k)


def unpack_tiles(packed: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of pack_tiles: the plain (N, K) matrix."""
    n, k = packed.shape
    return packed.reshape(n // _TILE_N, k // group, _TILE_N, group).permute(0, 2, 1, 3).reshape(n, k)


def pack_native_weight(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> batchrun_linear_bf16's tiles [N / 32][K / 2][32][2] (vdpbf16ps pairs)."""
    return pack_tiles(w, 2)


def unpack_native_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_native_weight: the plain (N, K) weight."""
    return unpack_tiles(packed, 2)


class NativeLinear(nn.Module):
    """y = x @ W.T + b through csrc/linear.cpp, W held in its tile layout (pack_native_weight).

    The kernel also reads a float32 copy of the bias; that copy and the check that the buffers are
    still what the kernel reads are rebuilt after .to() and load_state_dict (`_refresh`). A module
    whose weight is no longer bf16 on the CPU takes F.linear over the unpacked weight."""

    def __init__(self, packed_weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = packed_weight.shape
        self.register_buffer("packed_weight", packed_weight)  # (out_features, in_features) bf16, tiled
        self.register_buffer("bias", bias)  # (out_features,) or None, in the model dtype
        self._refresh()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh())

    def _refresh(self) -> None:
        w, b = self.packed_weight, self.bias
        # The kernel adds the bias in float32 before its one rounding, as F.linear does.
        self._bias_f32 = None if b is None else b.detach().float().contiguous()
        self._kernel_ok = (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous()
                           and (b is None or b.device.type == "cpu"))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._refresh()
        return self

    def weight(self) -> torch.Tensor:
        """The plain (out_features, in_features) weight (a copy)."""
        return unpack_native_weight(self.packed_weight)

    def plain_bias(self) -> Optional[torch.Tensor]:
        """The bias in the plain weight's row order, or None."""
        return self.bias

    # The C entry point and the width of its output; the subclass below fuses an activation.
    _kernel = "batchrun_linear_bf16"

    @property
    def _kernel_out(self) -> int:
        return self.out_features

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.plain_bias())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called for every projection of every step: a few cheap checks, the rest was settled at load.
        if (x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features or x.is_cuda or not self._kernel_ok
                or not cpu_native.enabled()):
            return self._fallback(x)  # an odd input (F.linear's errors), or kernels off
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m, n = x2.shape[0], self._kernel_out
        y = torch.empty((m, n), dtype=torch.bfloat16)
        if m:
            bias = self._bias_f32
            rc = getattr(cpu_native.library(), self._kernel)(
                x2.data_ptr(), m, self.in_features, x2.stride(0), self.packed_weight.data_ptr(), n,
                None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
            if rc != 0:
                raise RuntimeError(f"{self._kernel} failed ({rc}) for weight {tuple(self.packed_weight.shape)}")
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=native"


def silu_pair_order(n: int) -> torch.Tensor:
    """Row order of a (2n, K) gate/up weight (gate rows first) for batchrun_linear_silu_mul_bf16:
    32 gate rows, the same 32 up rows, the next 32 gate rows, ... (n a multiple of 32)."""
    return torch.arange(2 * n).view(2, n // _TILE_N, _TILE_N).permute(1, 0, 2).reshape(-1)


class NativeSiluMulLinear(NativeLinear):
    """silu(gate) * up of a fused gate/up projection in one kernel call (csrc/linear.cpp:
    silu_mul_pair): the activation is applied in the GEMM's tile store, so the (rows, 2n)
    projection output is never written and read back. Bitwise the result of NativeLinear followed
    by the native silu-mul pass (the same roundings, tested). The weight and bias are held with
    their rows in `silu_pair_order`; `weight()` and the fallback path restore HF's order."""

    _kernel = "batchrun_linear_silu_mul_bf16"

    def __init__(self, packed_weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__(packed_weight, bias)
        self.act_features = self.out_features // 2
        self._plain_order = torch.argsort(silu_pair_order(self.act_features))

    @staticmethod
    def from_linear(linear: nn.Linear) -> "NativeSiluMulLinear":
        order = silu_pair_order(linear.out_features // 2)
        bias = None if linear.bias is None else linear.bias.detach()[order]
        return NativeSiluMulLinear(pack_native_weight(linear.weight.detach()[order]), bias)

    @property
    def _kernel_out(self) -> int:
        return self.act_features

    def weight(self) -> torch.Tensor:
        """The plain (2n, in_features) gate/up weight, gate rows first (a copy)."""
        return unpack_native_weight(self.packed_weight)[self._plain_order]

    def plain_bias(self) -> Optional[torch.Tensor]:
        return None if self.bias is None else self.bias[self._plain_order]

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return act_mul(F.linear(x, self.weight(), self.plain_bias()), "silu")

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fused=silu_mul"


class NativeEmbedding(nn.Module):
    """A token embedding tied to a NativeLinear LM head: rows are read out of the head's tiled
    weight, so the vocabulary matrix is held once (the values are the same bf16 numbers). The head
    is referenced, not registered: its buffer belongs to the head alone, so .to() converts it once
    and the two stay one tensor."""

    def __init__(self, head: NativeLinear) -> None:
        super().__init__()
        object.__setattr__(self, "_head", head)  # not a submodule (see above)
        self.num_embeddings, self.embedding_dim = head.packed_weight.shape

    @property
    def packed_weight(self) -> torch.Tensor:
        return self._head.packed_weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        packed = self._head.packed_weight
        n, k = packed.shape
        tiles = packed.view(n // _TILE_N, k // 2, _TILE_N, 2)
        ids = input_ids.reshape(-1)
        if ids.numel() and int(ids.min()) < 0:  # floor division would wrap a negative id to a real row
            raise IndexError(f"token id {int(ids.min())} out of range for an embedding of {n} rows")
        rows = tiles[ids // _TILE_N, :, ids % _TILE_N, :]  # (num_ids, k / 2, 2); ids >= n raise IndexError
        return rows.reshape(*input_ids.shape, k)


def _within_bf16_rounding(got: torch.Tensor, want: torch.Tensor, half_steps: float, atol: float = 1e-5) -> bool:
    """Every output within `half_steps` halves of a bf16 step (2^-8 relative at most, each) of the
    float32 reference, plus `atol` times the largest reference value (float32 summation noise)."""
    return bool(((got - want).abs() <= want.abs() * half_steps * 2.0 ** -8 + atol * want.abs().amax()).all())


def pack_silu_mul(linear: nn.Linear) -> Optional[NativeSiluMulLinear]:
    """The fused silu(gate) * up twin of a bf16 CPU gate/up projection (gate rows first), or None
    where the native kernel does not serve its shape (n = out_features / 2 a multiple of 32) or
    disagrees on a probe with the float32 reference beyond the roundings it makes."""
    w = linear.weight
    n = linear.out_features // 2
    if not (type(linear) is nn.Linear and w.dtype == torch.bfloat16 and w.device.type == "cpu"
            and linear.out_features == 2 * n and n % _TILE_N == 0 and native_supported(2 * n, linear.in_features)):
        return None
    fused = NativeSiluMulLinear.from_linear(linear)
    probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(w.dtype)
    with torch.inference_mode():
        gate_up = nn.functional.linear(probe.float(), w.float(), None if linear.bias is None else linear.bias.float())
        want = act_mul_reference(gate_up, "silu")
        got = fused(probe).float()
    # gate, up, silu(gate) and the product are each rounded to bf16 once (silu's slope is at most
    # 1.1); far below zero silu's relative error grows with |gate| but its value vanishes.
    if _within_bf16_rounding(got, want, 5, atol=2.0 ** -8):
        return fused
    log.warning("fused native silu-mul disagrees with its float32 reference for %s; not fusing", tuple(w.shape))
    return None


def pack_linear(linear: nn.Linear, batch_hint: int = 32) -> Optional[nn.Module]:
    """The packed twin of a bf16 CPU nn.Linear: a NativeLinear where native_supported, else a
    PackedLinear; None when neither applies or the result disagrees with F.linear on a probe
    (bitwise for oneDNN's, within bf16 rounding for the native kernel). `batch_hint`: the row count
    oneDNN picks its layout for."""
    w = linear.weight
    if not (type(linear) is nn.Linear and w.dtype == torch.bfloat16 and w.device.type == "cpu"):
        return None
    bias = None if linear.bias is None else linear.bias.detach()
    probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(w.dtype)
    if native_supported(linear.out_features, linear.in_features):
        native = NativeLinear(pack_native_weight(w.detach()), bias)
        with torch.inference_mode():
            want = nn.functional.linear(probe.float(), w.float(), None if bias is None else bias.float())
            got = native(probe).float()
        # One bf16 rounding of a float32 sum: within half a bf16 step of the exact product.
        if _within_bf16_rounding(got, want, 1):
            return native
        log.warning("native bf16 linear disagrees with F.linear for %s; using oneDNN", tuple(w.shape))
    if not packing_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        module = PackedLinear(packed, bias, linear.in_features, linear.out_features)
        with torch.inference_mode():
            same = torch.equal(module(probe), nn.functional.linear(probe, w, bias))
    except RuntimeError as exc:  # a build whose mkldnn ops refuse this shape or dtype
        log.debug("not packing a %s linear: %s", tuple(w.shape), exc)
        return None
    return module if same else None
