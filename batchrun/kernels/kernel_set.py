"""The kernels an engine runs, bound once at start-up for its device target (`KernelSet`).

A binder (kernels/bind_cpu.py, kernels/bind_triton.py; kernels/binding.py picks) fills every field
with the function that serves it on that target; the model's modules receive their callables when
the model is prepared (model/decoder.py: DecoderLM.use_kernels, model/prepare.py), so no module
asks per call which device it is on. A bound function may still check a precondition of the
tensors it is given (a stride, a dim, a dtype the kernel takes) and take its reference path there.

`describe()` names, for every field, the function that serves it, with the start-up tuning's
choices: EngineSettings.kernels, which the run manifest, the dry run and the benchmark tables record.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from batchrun.kernels.cpu_choices import LinearChoice
from batchrun.kernels.target import DeviceTarget
from batchrun.kernels.tuning import Tuning

# GGUF block formats the loader keeps quantized, and the weight format (so the linear kernel) each
# becomes (model/gguf.py).
GGUF_FORMATS = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


@dataclass(frozen=True)
class BindOptions:
    """What a binder is told besides the target and the dtype."""

    kv_cache_dtype: str = "auto"  # engine.kv_cache_dtype: which cache the attention kernels read
    fuse: bool = True  # the fused projection GEMMs at all (False: the unfused pairs, as on the CPU)
    # From this many rows the W8A16/W4A16 layers run cuBLAS over a copy of the weight dequantized at
    # load instead of the Triton GEMM (GPU only; None: always the Triton GEMM, and no copy)
    dense_min_rows: Optional[int] = None


@dataclass(frozen=True)
class LinearKernel:
    """One weight format's linear on the target: the layout its layers hold and the functions over it.

    `matmul` runs over the format's canonical layout (model/quant/weights.py: QuantizedWeight);
    where `packed_matmul` is set, a layer whose shape the kernel takes holds its weight only in that
    kernel's layout (made by `pack`) and calls it instead (the CPU's packed int4, the native W8A8 and
    W4A8 tiles). The signatures are per format (model/quant/layers.py calls them)."""

    matmul: Callable[..., torch.Tensor]
    packed_matmul: Optional[Callable[..., Any]] = None
    pack: Optional[Callable[..., Any]] = None
    # W4A8's gate/up projection with silu(gate) * up and the down projection's quantization in its store
    fused_silu: Optional[Callable[..., Any]] = None
    # The layer's input may come quantized per token by the RMSNorm before it (KernelSet.rms_norm_quant)
    takes_quantized_rows: bool = False
    tile_kernel: Optional[str] = None  # a Triton GEMM whose tiles start-up tunes (kernels/tuning.py)
    dense_min_rows: Optional[int] = None  # BindOptions.dense_min_rows, where this kernel has the option

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"matmul": function_name(self.matmul)}
        if self.packed_matmul is not None:
            out["packed_matmul"] = function_name(self.packed_matmul)
        if self.fused_silu is not None:
            out["fused_silu"] = function_name(self.fused_silu)
        if self.takes_quantized_rows:
            out["takes_quantized_rows"] = True
        if self.dense_min_rows is not None:
            out["dense_min_rows"] = self.dense_min_rows
        return out


@dataclass(frozen=True)
class FloatLinears:
    """How the float (unquantized) projections are held and run: plain nn.Linear (F.linear: cuBLAS,
    oneDNN), or on a bf16 CPU packed once at load (model/linear.py: pack_linear). With "native"
    packing, start-up tuning may have measured torch's kernel faster for some kinds and row counts
    (`choices`): those layers are held for it, or for both kernels split by row count
    (model/prepare.py: apply_linear_choices)."""

    packing: (
        str  # "none" | "onednn" (PackedLinear) | "native" (NativeLinear where the kernel takes the shape, else oneDNN)
    )
    choices: tuple[LinearChoice, ...] = ()  # the measured ones that are not native throughout

    def choice(self, kind: str, n: int, k: int) -> Optional[LinearChoice]:
        """What serves a native-packed layer of `kind` over an (n, k) weight; None: the native kernel."""
        return next((c for c in self.choices if (c.kind, c.n, c.k) == (kind, n, k)), None)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"packing": self.packing}
        if self.choices:
            out["torch_kernels"] = [_layout(c) for c in self.choices]
        return out


_TORCH_FORMS = {"unpacked": "over the tiles unpacked per call", "packed": "over oneDNN's copy beside the tiles"}


def _layout(c: LinearChoice) -> dict[str, Any]:
    """One kind's kernels by row count, e.g. {"kind": "down", "weight": [576, 1536], "kernels":
    "native below 97 rows, torch from 97 (over the tiles unpacked per call)"}."""
    if c.split_rows is None:
        kernels = c.small
    else:
        kernels = f"{c.small} below {c.split_rows} rows, {c.large} from {c.split_rows}"
        if c.torch_form is not None:
            kernels += f" (torch {_TORCH_FORMS[c.torch_form]})"
    return {"kind": c.kind, "weight": [c.n, c.k], "kernels": kernels}


@dataclass(frozen=True)
class KernelSet:
    """Every kernel a decoder step or an encoder forward runs on one target, and what start-up tuning
    chose for them."""

    target: DeviceTarget
    dtype: torch.dtype  # the model's compute dtype the set was bound for
    binder: str  # "cpu" | "triton"
    options: BindOptions
    tuning: Tuning
    # elementwise (kernels/elementwise.py's signatures)
    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps, is_gemma=False) -> normed
    # (h, residual, weight, eps) -> (normed, residual + h)
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (x, residual or None, weight, eps, ActQuant) -> (QuantizedRows, residual); None where no
    # linear takes quantized rows
    rms_norm_quant: Optional[Callable[..., Any]]
    act_mul: Callable[..., torch.Tensor]  # (gate_up, activation name) -> act(gate) * up
    # attention (kernels/attention.py's signatures)
    write_kv_cache: Callable[..., None]
    qkv_norm_rope_write: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    paged_attention: Callable[..., torch.Tensor]
    # the encoder's attention over packed rows (kernels/varlen_attention.py's signature): (q, k, v,
    # seq_lens, scale, causal) -> out
    varlen_attention: Callable[..., torch.Tensor]
    rope_reads_tables: bool  # qkv_norm_rope_write reads cos/sin rows by position itself (no per-step gather)
    decode_num_splits: Callable[[int, int, int], int]  # (num_decodes, num_kv_heads, max_context) -> split count
    # projections (kernels/fused_projections.py's signatures)
    qkv_project: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    gate_up_act: Callable[..., torch.Tensor]
    lm_head_logits: Callable[..., torch.Tensor]
    embed_norm: Optional[Callable[..., Optional[tuple[torch.Tensor, torch.Tensor]]]]  # None: embedding, then norm
    # sampling (kernels/sampling.py's signatures)
    sample: Callable[..., torch.Tensor]  # the Gumbel race: (logits (B, V), rows (3, B), threshold) -> (B,) int64
    spill: Callable[..., torch.Tensor]  # top-p thresholds of the rows past the candidates (sampling.SpillFn)
    gather_in_place: Callable[[torch.Tensor, torch.Tensor], None]  # ids[i] = src[ids[i]]
    # mixture of experts and engine.batch_invariant
    moe_grouped_gemm: Callable[..., torch.Tensor]  # kernels/moe.py: grouped_gemm_reference's signature
    # (x, weight, bias) -> y, each row independent of the others; None where the float linears need no swap
    invariant_matmul: Optional[Callable[..., torch.Tensor]]
    # LoRA: a step's per-token updates where its adapter tokens are spread over slots, in place
    # (kernels/lora.py: lora_rows_native's signature; returns False where it does not take the
    # tensors); None: model/lora.py's torch path
    lora_rows: Optional[Callable[..., bool]]
    # linears, one per weight format
    linear_float: FloatLinears
    linear_int8: LinearKernel  # W8A16 (and GGUF Q8_0): (x2, qweight, scales, bias, scales_bf16) -> y
    linear_int4: LinearKernel  # W4A16 (and GGUF Q4_0/Q4_1): (x2, qweight, scales, mins, bias) -> y
    linear_w8a8: LinearKernel  # int8 weights and per-token int8 activations
    linear_w4a8: LinearKernel  # int4 weights and int8 activations in groups of 32
    linear_fp8: LinearKernel  # e4m3 weights per channel

    @property
    def name(self) -> str:
        return f"{self.binder} kernels for {self.target.name} ({str(self.dtype).removeprefix('torch.')})"

    def describe(self) -> dict[str, Any]:
        """For every field the function that serves it (module.qualname, "batchrun." left off; a bound
        argument in parentheses), the target, and the tuning's choices: JSON-able."""
        kernels: dict[str, Any] = {}
        linears: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("linear_"):
                linears[f.name.removeprefix("linear_")] = value.describe()
            elif f.name == "rope_reads_tables":
                kernels[f.name] = value
            elif callable(value) or (value is None and f.name in _OPTIONAL_KERNELS):
                kernels[f.name] = None if value is None else function_name(value)
        return {
            "target": self.target.describe(),
            "binder": self.binder,
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": self.options.kv_cache_dtype,
            "fuse": self.options.fuse,
            "kernels": kernels,
            "linears": linears,
            "gguf": dict(GGUF_FORMATS),
            "tuning": self.tuning.describe(),
        }


_OPTIONAL_KERNELS = ("rms_norm_quant", "embed_norm", "invariant_matmul", "lora_rows")


def function_name(fn: Any) -> str:
    """ "module.qualname" of a function ("batchrun." left off), with a functools.partial's bound plain
    arguments and functions (by name) in parentheses: e.g.
    "kernels.cpu_attention.paged_attention_cpu(native=True)"."""
    if isinstance(fn, functools.partial):
        args = [f"{k}={_argument(v)}" for k, v in fn.keywords.items() if _argument(v) is not None]
        return function_name(fn.func) + (f"({', '.join(args)})" if args else "")
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module.removeprefix('batchrun.')}.{name}"


def _argument(value: Any) -> Optional[str]:
    if isinstance(value, (bool, int, float, str)):
        return repr(value) if isinstance(value, str) else str(value)
    if isinstance(value, functools.partial):  # a bound kernel: its name (its own arguments are its field's)
        return _argument(value.func)
    if callable(value) and not isinstance(value, type):
        return function_name(value)
    return None  # a target or a tuning: described once, at the top
