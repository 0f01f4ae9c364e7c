"""Linear layers whose weights are held in a kernel's own layout, and the float ones among them.

`PackedWeightLinear` is the base of every such layer (these float ones and the quantized ones in
model/quant/layers.py). A kernel often reads side copies of a layer's buffers (a float32 bias,
per-channel scales) and relies on their dtype and device; `_refresh` rebuilds those copies and
checks, and the base calls it after `.to()`/`.half()` (`_apply`) and after `load_state_dict`, so a
subclass only says what its kernel needs.

The float layers, chosen per layer by `pack_linear` where the kernel set packs the float linears
(bf16 on the CPU: KernelSet.linear_float, kernels/cpu_linear.py):

- NativeLinear: csrc/linear.cpp over the weight in its tiles, where the kernel is built and the
  shape fits; it prefetches the weight stream, which matters at a decode step's row counts, where
  each weight byte comes from memory once per step. Within a bf16 rounding of F.linear.
- PackedLinear elsewhere: oneDNN over its packed layout, bitwise F.linear.
- NativeSiluMulLinear (`pack_silu_mul`): a silu MLP's gate/up projection with silu(gate) * up
  applied in the kernel's tile store, so the (rows, 2 * intermediate) output is never written and
  read back by a separate activation pass.
- NativeEmbedding: a tied embedding that reads its rows out of the NativeLinear LM head's tiles.

Either way the packed weight replaces the plain one (no second copy). bf16 only: the float32 path
stays on F.linear, the one held token-identical to HF transformers.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels import cpu_linear as ck
from batchrun.kernels.cpu_native import on_host
from batchrun.kernels.elementwise import act_mul_native, act_mul_reference

log = logging.getLogger(__name__)


class PackedWeightLinear(nn.Module):
    """Base of the linears that hold their weight for a kernel: y = x @ W.T (+ bias).

    Subclasses register their buffers, then call `self._refresh()`; the base calls it again after
    every `.to()` and `load_state_dict`, so copies made for a kernel never go stale."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh())

    def _refresh(self) -> None:
        """Rebuild what a kernel reads besides the buffers, and whether the buffers are still the
        dtypes and device it reads (if not, the layer takes its reference path)."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._refresh()
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class PackedLinear(PackedWeightLinear):
    """y = x @ W.T + b with W held in oneDNN's packed layout (an opaque mkldnn tensor buffer)."""

    packed_weight: torch.Tensor
    bias: Optional[torch.Tensor]

    def __init__(
        self, packed_weight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int, out_features: int
    ) -> None:
        super().__init__(in_features, out_features)
        self.register_buffer("packed_weight", packed_weight)  # (out_features, in_features), mkldnn layout
        self.register_buffer("bias", bias)  # (out_features,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ck.mkldnn_linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", packed=oneDNN"


class NativeLinear(PackedWeightLinear):
    """y = x @ W.T + b through csrc/linear.cpp, W held in its tile layout (pack_native_weight).

    The kernel also reads a float32 copy of the bias. A module whose weight is no longer bf16 on the
    CPU takes F.linear over the unpacked weight."""

    silu_mul = False  # the subclass below applies silu(gate) * up in the kernel
    packed_weight: torch.Tensor
    bias: Optional[torch.Tensor]

    def __init__(self, packed_weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__(packed_weight.shape[1], packed_weight.shape[0])
        self.register_buffer("packed_weight", packed_weight)  # (out_features, in_features) bf16, tiled
        self.register_buffer("bias", bias)  # (out_features,) or None, in the model dtype
        self._refresh()

    def _refresh(self) -> None:
        w, b = self.packed_weight, self.bias
        # The kernel adds the bias in float32 before its one rounding, as F.linear does.
        self._bias_f32 = None if b is None else b.detach().float().contiguous()
        self._kernel_ok = w.dtype == torch.bfloat16 and on_host(w, b) and w.is_contiguous()

    def weight(self) -> torch.Tensor:
        """The plain (out_features, in_features) weight (a copy)."""
        return ck.unpack_native_weight(self.packed_weight)

    def plain_bias(self) -> Optional[torch.Tensor]:
        """The bias in the plain weight's row order, or None."""
        return self.bias

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.plain_bias())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called for every projection of every step: a few cheap checks, the rest was settled at load.
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features or not self._kernel_ok:
            return self._fallback(x)  # an odd input (F.linear's errors), or buffers moved since load
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = ck.native_linear(x2, self.packed_weight, self._bias_f32, self.silu_mul)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return super().extra_repr() + ", packed=native"


class NativeSiluMulLinear(NativeLinear):
    """silu(gate) * up of a fused gate/up projection in one kernel call (csrc/linear.cpp:
    silu_mul_pair): the activation is applied in the GEMM's tile store. Bitwise the result of
    NativeLinear followed by the native silu-mul pass (the same roundings, tested). The weight and
    bias are held with their rows in `silu_pair_order`; `weight()` and the fallback restore HF's order."""

    silu_mul = True

    def __init__(self, packed_weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__(packed_weight, bias)
        self.act_features = self.out_features // 2
        self._plain_order = torch.argsort(ck.silu_pair_order(self.act_features))

    @staticmethod
    def from_linear(linear: nn.Linear) -> NativeSiluMulLinear:
        order = ck.silu_pair_order(linear.out_features // 2)
        bias = None if linear.bias is None else linear.bias.detach()[order]
        return NativeSiluMulLinear(ck.pack_native_weight(linear.weight.detach()[order]), bias)

    def weight(self) -> torch.Tensor:
        """The plain (2n, in_features) gate/up weight, gate rows first (a copy)."""
        return ck.unpack_native_weight(self.packed_weight)[self._plain_order]

    def plain_bias(self) -> Optional[torch.Tensor]:
        return None if self.bias is None else self.bias[self._plain_order]

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return act_mul_native(F.linear(x, self.weight(), self.plain_bias()), "silu")

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fused=silu_mul"


class RowSplitLinear(PackedWeightLinear):
    """A float linear held for two kernels, each serving the row counts start-up tuning measured it
    faster at (kernels/cpu_choices.py): `small` below `split_rows` rows (decode steps), `large` from
    there (prefill chunks). `small` is the NativeLinear (or NativeSiluMulLinear) over the tiles;
    `large` runs torch's kernel over oneDNN's packed copy (PackedLinear, the weight held twice) or
    over the tiles unpacked per call (UnpackedTilesLinear, no second copy). Both give the same
    result up to the kernels' float32 sum order: silu(gate) * up already applied where `small` does."""

    def __init__(self, small: NativeLinear, large: nn.Module, split_rows: int) -> None:
        super().__init__(small.in_features, small.out_features)
        self.small = small
        self.large = large
        self.split_rows = split_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return self.large(x) if rows >= self.split_rows else self.small(x)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", split_rows={self.split_rows}"


class SiluMulAfter(nn.Module):
    """silu(gate) * up after a gate/up projection that does not apply it itself (the torch side of
    a split NativeSiluMulLinear): the native elementwise pass, as the unfused pair runs it."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_mul_native(self.linear(x), "silu")


class UnpackedTilesLinear(nn.Module):
    """torch's kernel (F.linear: oneDNN, AMX where the CPU has it) over a NativeLinear's weight,
    unpacked from its tiles into `buffer` on every call: the large-row side of a RowSplitLinear
    without a second copy of the weight. `buffer` (flat bf16, at least the weight's size) is one
    tensor shared by every such layer of a model; the tiles' layer is referenced, not registered
    (the RowSplitLinear holds it). A NativeSiluMulLinear's tiles unpack into HF's gate/up order and
    silu(gate) * up follows (the native elementwise pass)."""

    buffer: torch.Tensor

    def __init__(self, tiles: NativeLinear, buffer: torch.Tensor) -> None:
        super().__init__()
        self._tiles: NativeLinear
        object.__setattr__(self, "_tiles", tiles)
        self.register_buffer("buffer", buffer, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self._tiles
        n, k = t.packed_weight.shape
        weight = ck.unpack_native_weight_into(t.packed_weight, self.buffer[: n * k].view(n, k), t.silu_mul)
        y = F.linear(x, weight, t.plain_bias())
        return act_mul_native(y, "silu") if t.silu_mul else y


def count_native_linears(model: nn.Module) -> int:
    """Linears csrc/linear.cpp runs, at least at some row counts (a RowSplitLinear's small side)."""
    return sum(isinstance(m, NativeLinear) for m in model.modules())


class NativeEmbedding(nn.Module):
    """A token embedding tied to a NativeLinear LM head: rows are read out of the head's tiled
    weight, so the vocabulary matrix is held once (the values are the same bf16 numbers). The head
    is referenced, not registered: its buffer belongs to the head alone, so .to() converts it once
    and the two stay one tensor."""

    def __init__(self, head: NativeLinear) -> None:
        super().__init__()
        self._head: NativeLinear
        object.__setattr__(self, "_head", head)  # not a submodule (see above)
        self.num_embeddings, self.embedding_dim = (int(n) for n in head.packed_weight.shape)

    @property
    def packed_weight(self) -> torch.Tensor:
        return self._head.packed_weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = ck.tiled_rows(self._head.packed_weight, input_ids.reshape(-1))  # (num_ids, embedding_dim)
        return rows.reshape(*input_ids.shape, self.embedding_dim)


def _within_bf16_rounding(got: torch.Tensor, want: torch.Tensor, half_steps: float, atol: float = 1e-5) -> bool:
    """Every output within `half_steps` halves of a bf16 step (2^-8 relative at most, each) of the
    float32 reference, plus `atol` times the largest reference value (float32 summation noise)."""
    return bool(((got - want).abs() <= want.abs() * half_steps * 2.0**-8 + atol * want.abs().amax()).all())


def _probe(linear: nn.Linear) -> torch.Tensor:
    """The fixed input a packed twin is checked on before it replaces `linear`: (3, in_features)."""
    return torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)


def pack_silu_mul(linear: nn.Linear) -> Optional[NativeSiluMulLinear]:
    """The fused silu(gate) * up twin of a bf16 CPU gate/up projection (gate rows first), or None
    where the native kernel does not serve its shape (n = out_features / 2 a multiple of 32) or
    disagrees on a probe with the float32 reference beyond the roundings it makes. For a kernel set
    with the native kernels (KernelSet.linear_float.packing "native")."""
    w = linear.weight
    n = linear.out_features // 2
    if not (
        type(linear) is nn.Linear
        and w.dtype == torch.bfloat16
        and on_host(w)
        and linear.out_features == 2 * n
        and n % ck.TILE_N == 0
        and ck.native_supported(2 * n, linear.in_features)
    ):
        return None
    fused = NativeSiluMulLinear.from_linear(linear)
    probe = _probe(linear)
    with torch.inference_mode():
        gate_up = nn.functional.linear(probe.float(), w.float(), None if linear.bias is None else linear.bias.float())
        want = act_mul_reference(gate_up, "silu")
        got = fused(probe).float()
    # gate, up, silu(gate) and the product are each rounded to bf16 once (silu's slope is at most
    # 1.1); far below zero silu's relative error grows with |gate| but its value vanishes.
    if _within_bf16_rounding(got, want, 5, atol=2.0**-8):
        return fused
    log.warning("fused native silu-mul disagrees with its float32 reference for %s; not fusing", tuple(w.shape))
    return None


def pack_linear(linear: nn.Linear, batch_hint: int = 32, native: bool = True) -> Optional[nn.Module]:
    """The packed twin of a bf16 CPU nn.Linear: with `native` (the kernel set's packing "native": the
    kernels built and on) a NativeLinear where the native kernel serves it, else a PackedLinear;
    None when neither applies or the result disagrees with F.linear on a probe (bitwise for
    oneDNN's, within bf16 rounding for the native kernel). `batch_hint`: the row count oneDNN
    picks its layout for."""
    w = linear.weight
    if not (type(linear) is nn.Linear and w.dtype == torch.bfloat16 and on_host(w)):
        return None
    bias = None if linear.bias is None else linear.bias.detach()
    probe = _probe(linear)
    if native and ck.native_supported(linear.out_features, linear.in_features):
        native_twin = NativeLinear(ck.pack_native_weight(w.detach()), bias)
        with torch.inference_mode():
            want = nn.functional.linear(probe.float(), w.float(), None if bias is None else bias.float())
            got = native_twin(probe).float()
        # One bf16 rounding of a float32 sum: within half a bf16 step of the exact product.
        if _within_bf16_rounding(got, want, 1):
            return native_twin
        log.warning("native bf16 linear disagrees with F.linear for %s; using oneDNN", tuple(w.shape))
    if not ck.packing_available():
        return None
    try:
        module = PackedLinear(ck.mkldnn_pack(w.detach(), batch_hint), bias, linear.in_features, linear.out_features)
        with torch.inference_mode():
            same = torch.equal(module(probe), nn.functional.linear(probe, w, bias))
    except RuntimeError as exc:  # a build whose mkldnn ops refuse this shape or dtype
        log.debug("not packing a %s linear: %s", tuple(w.shape), exc)
        return None
    return module if same else None
