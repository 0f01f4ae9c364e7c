"""`prepare_linears`: the one pass that gives every linear layer of a loaded decoder its backend.

Per layer: a quantized layer for `mode` (the decoder's projections, model/quant/), over the kernel
set's kernel for its format, which also decides the layout it holds; else, where the kernel set
packs float linears (bf16 on the CPU), a packed float twin (model/linear.py: NativeLinear where the
native kernels are on and take the shape, else oneDNN's PackedLinear), else the plain nn.Linear.
Per silu MLP, in one place
(`_fuse_mlp`): whether its gate/up projection applies silu(gate) * up itself (`MLP.fused_act`):
NativeSiluMulLinear for a float bf16 one, W4A8SiluMulLinear where both W4A8 projections run the
native kernel. A tied LM head is packed only where the native kernel serves it, so the embedding
can read its rows from the same tiles (NativeEmbedding); oneDNN's opaque layout cannot be read that
way, and packing it there would keep a second copy of the vocabulary matrix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Optional, TypeGuard, Union

import torch
from torch import nn

from batchrun.kernels import cpu_linear as ck
from batchrun.kernels.binding import default_kernels
from batchrun.kernels.cpu_choices import UNPACKED
from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.quant import w4a8 as w4
from batchrun.model.decoder import MLP, DecoderLM
from batchrun.model.gemm_shapes import linear_kind
from batchrun.model.linear import (
    NativeEmbedding,
    NativeLinear,
    NativeSiluMulLinear,
    PackedLinear,
    RowSplitLinear,
    SiluMulAfter,
    UnpackedTilesLinear,
    pack_linear,
    pack_silu_mul,
)
from batchrun.model.quant.layers import W4A8Linear, W4A8SiluMulLinear
from batchrun.model.quant.smoothquant import PROJECTION_NAMES
from batchrun.model.quant.surgery import QUANT_MODES, ProjectionQuantizer, QuantizationSummary
from batchrun.model.quant.weights import QuantizedWeight
from batchrun.model.tensor_parallel import is_replicated

log = logging.getLogger(__name__)


def _is_silu_mlp(module: nn.Module) -> TypeGuard[MLP]:
    """A decoder MLP (it has the `fused_act` switch) with a silu activation."""
    return isinstance(module, MLP) and module.activation in ("silu", "swish")


def prepare_linears(
    model: nn.Module,
    mode: str = "none",
    device: Union[torch.device, str, None] = None,
    dtype: Optional[torch.dtype] = None,
    *,
    group_size: int = 32,
    include_embeddings: bool = False,
    prequantized: Optional[dict[str, QuantizedWeight]] = None,
    input_absmax: Optional[dict[str, torch.Tensor]] = None,
    outlier_channels: int = 0,
    batch_hint: int = 32,
    kernels: Optional[KernelSet] = None,
) -> QuantizationSummary:
    """Swap the linear layers of a loaded decoder for their backends, in place (see the module doc).

    Call after the float weights are loaded and the model is on its device and dtype. `kernels`: the
    kernel set the layers take their kernels from (None: the one bound for `device` and `dtype`;
    without a device, each quantized layer's own default and no float packing). `prequantized`,
    `input_absmax` and `outlier_channels`: see ProjectionQuantizer. `include_embeddings` also
    quantizes the token embedding and LM head (one per-row 8-bit matrix, shared when tied).
    `batch_hint`: the row count oneDNN packs for.
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization mode must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    if kernels is None and device is not None and dtype is not None:
        kernels = default_kernels(device, dtype)
    summary = QuantizationSummary(mode, group_size)
    quantizer = None
    if mode != "none":
        quantizer = ProjectionQuantizer(
            model, mode, group_size, summary, prequantized, input_absmax, outlier_channels, kernels
        )
    packing = kernels.linear_float.packing if kernels is not None else "none"
    pack, native = packing != "none", packing == "native"
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    quantize_embeddings = quantizer is not None and include_embeddings and isinstance(embed, nn.Embedding)
    tied = isinstance(head, nn.Linear) and isinstance(embed, nn.Embedding) and head.weight is embed.weight

    def backend(name: str, linear: nn.Linear) -> Optional[nn.Module]:
        if quantizer is not None and name.rsplit(".", 1)[-1] in PROJECTION_NAMES:
            return quantizer.quantize(name, linear)
        packed = pack_linear(linear, batch_hint, native) if pack else None
        summary.num_packed += packed is not None
        return packed

    # The parents only: a list holding the float linears themselves would keep every one alive until
    # the loop ends, beside its packed or quantized replacement (a second copy of the weights).
    parents = [(prefix, m) for prefix, m in model.named_modules() if not isinstance(m, nn.Linear)]
    for prefix, parent in parents:
        deferred = None  # a float silu MLP's gate/up: packed fused or plain by _fuse_mlp
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or (child is head and (tied or quantize_embeddings)):
                continue
            if native and quantizer is None and _is_silu_mlp(parent) and name == "gate_up_proj":
                deferred = child
                continue
            module = backend(f"{prefix}.{name}" if prefix else name, child)
            if module is not None:
                setattr(parent, name, module)
        if _is_silu_mlp(parent):
            _fuse_mlp(parent, deferred, batch_hint, summary, kernels)

    if mode == "w4a8":
        slow = [m for m in model.modules() if isinstance(m, W4A8Linear) and not m.is_native]
        if slow and (kernels is None or kernels.binder == "cpu"):
            summary.notes.append(
                f"w4a8: {len(slow)} projections run the reference path (a float32 matmul over "
                "the weight dequantized on every call, slower than int4): the native kernel "
                "needs a bf16 model and a CPU with AVX512-VNNI and AVX512-BF16"
            )
            log.warning(summary.notes[-1])
    if quantize_embeddings:
        assert quantizer is not None
        quantizer.quantize_embeddings(model)
    elif native and tied:
        assert isinstance(head, nn.Linear)
        packed_head = pack_linear(head, batch_hint)
        if isinstance(packed_head, NativeLinear):
            model.lm_head, model.embed_tokens = packed_head, NativeEmbedding(packed_head)
            summary.num_packed += 1
    if quantizer is not None:
        log.info(
            "quantized %d modules (%s)%s",
            summary.num_quantized,
            mode,
            f"; {len(summary.notes)} notes" if summary.notes else "",
        )
    log.debug("packed %d float linears", summary.num_packed)
    if kernels is not None:
        apply_linear_choices(model, kernels, batch_hint)
    return summary


def apply_linear_choices(model: nn.Module, kernels: KernelSet, batch_hint: int = 32) -> None:
    """Lay out the linears held in the native tiles for the kernels start-up tuning chose
    (KernelSet.linear_float.choices; kernels/cpu_choices.py), in place; a layer of a kind the native
    kernel won at every row count keeps its tiles. Torch's kernel throughout: oneDNN's packed weight
    (PackedLinear; a silu gate/up projection unfused again, its MLP applying the activation; a tied
    LM head the plain weight the embedding shares again). Both, by row count: a RowSplitLinear over
    the tiles and torch's side, oneDNN's copy ("packed") or the tiles unpacked per call into one
    buffer the model's layers share, as large as the largest of them ("unpacked")."""
    float_linears = kernels.linear_float
    if not float_linears.choices:
        return
    todo = []
    for _, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) in (NativeLinear, NativeSiluMulLinear) and not isinstance(parent, RowSplitLinear):
                assert isinstance(child, NativeLinear)
                n, k = child.packed_weight.shape
                choice = float_linears.choice(linear_kind(name, child), n, k)
                if choice is not None and not choice.is_native:
                    todo.append((parent, name, child, choice))
    unpacked = [c.packed_weight.numel() for _, _, c, choice in todo if choice.torch_form == UNPACKED]
    buffer = torch.empty(max(unpacked), dtype=torch.bfloat16) if unpacked else None
    for parent, name, child, choice in todo:
        embedding = getattr(model, "embed_tokens", None)
        tied = child is getattr(model, "lm_head", None) and isinstance(embedding, NativeEmbedding)
        if choice.split_rows is None:  # torch's kernel at every row count
            bias = child.plain_bias()
            plain = nn.Linear(child.in_features, child.out_features, bias=bias is not None)
            plain.weight = nn.Parameter(child.weight(), requires_grad=False)
            if bias is not None:
                plain.bias = nn.Parameter(bias.clone(), requires_grad=False)
            if tied:
                embed = nn.Embedding(plain.out_features, plain.in_features)
                embed.weight = plain.weight
                model.embed_tokens = embed
                setattr(parent, name, plain)
                continue
            packed = pack_linear(plain, batch_hint, native=False)
            setattr(parent, name, packed if packed is not None else plain)
            if child.silu_mul and isinstance(parent, MLP):
                parent.fused_act = False  # the MLP applies silu(gate) * up after it again
            continue
        large: nn.Module
        if choice.torch_form == UNPACKED:
            assert buffer is not None
            large = UnpackedTilesLinear(child, buffer)
        else:
            weight = ck.mkldnn_pack(child.weight(), batch_hint)
            packed = PackedLinear(weight, child.plain_bias(), child.in_features, child.out_features)
            large = SiluMulAfter(packed) if child.silu_mul else packed
        setattr(parent, name, RowSplitLinear(child, large, choice.split_rows))
    log.info("%d linears laid out for the kernels start-up tuning chose", len(todo))


def _fuse_mlp(
    mlp: MLP,
    float_gate_up: Optional[nn.Linear],
    batch_hint: int,
    summary: QuantizationSummary,
    kernels: Optional[KernelSet],
) -> None:
    """Whether a silu MLP's gate/up projection applies silu(gate) * up itself, and which layer does it.

    `float_gate_up`: its float bf16 gate/up projection when that was left to this choice (packed
    fused where the native kernel serves it, else packed plain), or None."""
    if float_gate_up is not None:
        fused = pack_silu_mul(float_gate_up)
        module = fused if fused is not None else pack_linear(float_gate_up, batch_hint)
        if module is not None:
            mlp.gate_up_proj = module
            mlp.fused_act = fused is not None
            summary.num_packed += 1
        return
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    if (
        type(gate_up) is W4A8Linear
        and type(down) is W4A8Linear
        and gate_up.is_native
        and down.is_native
        and gate_up.out_features == 2 * down.in_features
        and down.in_features % w4.W4A8_GROUP == 0
    ):
        qweight, scales, mins = gate_up.int4_weight()
        weight = QuantizedWeight("int4", qweight, scales, mins, gate_up.in_features)
        mlp.gate_up_proj = W4A8SiluMulLinear(weight, gate_up.bias, kernels=kernels)
        mlp.fused_act = True


def quantize_model(
    model: nn.Module,
    mode: str,
    group_size: int = 32,
    include_embeddings: bool = False,
    prequantized: Optional[dict[str, QuantizedWeight]] = None,
    input_absmax: Optional[dict[str, torch.Tensor]] = None,
    outlier_channels: int = 0,
) -> QuantizationSummary:
    """prepare_linears without packing the float layers: the quantized layers (and their MLP fusion) alone."""
    return prepare_linears(
        model,
        mode,
        group_size=group_size,
        include_embeddings=include_embeddings,
        prequantized=prequantized,
        input_absmax=input_absmax,
        outlier_channels=outlier_channels,
    )


def _stored_tensors(model: nn.Module) -> Iterator[tuple[str, int]]:
    """(name, bytes) of each parameter and buffer, shared storage once (tied embeddings)."""
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_mkldnn:  # oneDNN-packed weights (model/linear.py: PackedLinear): opaque, never shared
            yield name, t.numel() * t.element_size()
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        yield name, t.untyped_storage().nbytes()


def module_weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers, counting shared storage once (tied embeddings)."""
    return sum(nbytes for _, nbytes in _stored_tensors(model))


def owned_weight_bytes(model: DecoderLM) -> float:
    """A tensor-parallel rank's share of the whole model's weight bytes (model/tensor_parallel.py):
    what it holds, a tensor every rank holds counted 1/N, the KV rows of qkv_proj that `tp_kv_copies`
    ranks hold counted 1/copies. Summed over the ranks of a group: one process's `module_weight_bytes`."""
    spec = model.spec
    q, kv = spec.num_heads * spec.head_dim, 2 * spec.num_kv_heads * spec.head_dim
    qkv_share = (q + kv / spec.tp_kv_copies) / (q + kv)
    total = 0.0
    for name, nbytes in _stored_tensors(model):
        if is_replicated(name):
            total += nbytes / spec.tp_size
        elif "qkv_proj" in name:
            total += nbytes * qkv_share
        else:
            total += nbytes
    return total
