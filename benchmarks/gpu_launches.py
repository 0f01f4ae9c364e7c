"""What one decode step launches on the GPU, counted on a CPU: Triton kernels and torch ops.

A decode step's cost on a GPU is partly its number of kernels: each launch costs host time (eager)
and a gap on the device (a graph replay still pays a few microseconds per kernel). This count needs
no GPU. A model built over the Triton kernel set of a simulated GPU (kernels/target.py: find_target's
`simulate`) runs on CPU tensors what a CUDA model runs, and the launchers size tiles and split
counts for the simulated GPU; with TRITON_INTERPRET=1 every
Triton launch then runs in Triton's interpreter (the results are real, the step is the engine's),
and each is counted once. Torch ops are counted by a TorchDispatchMode: every aten op that would
issue a CUDA kernel counts one (views, allocations and metadata ops issue none); the interpreter's
own torch calls, made inside a launch, are not counted. A copy from one of the host buffers the
step stages its inputs in is a host-to-device memcpy on a GPU, counted apart from kernels.

The step counted is the engine's graphed decode step (engine/runners/cuda_graphs.py, what every pure
decode step replays on a GPU): the unpacking of the uploaded rows, the captured forward, and the
LM head over the sampled rows (`compute_logits`). Sampling is not counted. The model is built as
the engine builds it for a GPU (plain nn.Linear projections: one cuBLAS GEMM each, counted as one;
cuBLAS may add a split-K reduction kernel at some shapes, which only the profiler sees), and the
step takes the fused projections (kernels/fused_projections.py) unless the model's kernel set is
bound with `fuse=False`: on a GPU those run where start-up tuning measured them faster.

A library module: `python -m benchmarks.gpu --smoke` prints the figures (`format_figures`), and
tests/model/test_gpu_launches.py pins them.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchrun.kernels.binding import bind_kernels
from batchrun.kernels.target import SM90, GpuTarget, find_target  # SM90: the GPU the figures are sized for

# benchmarks.gpu's phase that prints these counts in --smoke (a library constant: tests import it from here).
LAUNCHES = "decode step launches (CPU count)"

# aten ops that issue no kernel: allocations without a fill, and metadata-only ops; views are read
# from the op's schema (`is_view`).
_NO_KERNEL = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "_unsafe_view",
        "lift_fresh",
        "detach",
        "alias",
        "resize_",
        "set_",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_local_scalar_dense",  # a device-to-host copy and a sync: counted apart (`syncs`)
    }
)


@dataclass
class StepLaunches:
    """What one step issued: kernels by name ("triton:<kernel>" or "aten:<op>"), host-to-device
    copies, and host syncs (`.item()`, `.tolist()` of device values: a graph cannot hold them)."""

    kernels: Counter = field(default_factory=Counter)
    copies: int = 0
    syncs: int = 0
    logits: Optional[torch.Tensor] = None  # the step's (num_seqs, vocab) float32 logits, where a step was run

    @property
    def total(self) -> int:
        return sum(self.kernels.values())


def _copied(args: tuple, out: Any) -> bool:
    """Whether an op that may return a view of its input (`to`, `reshape`, `contiguous`) made a new
    tensor instead, which is one kernel."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()


class _LaunchCounter(TorchDispatchMode):
    def __init__(self, host_buffers: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.launches = StepLaunches()
        self.in_triton = 0
        self._host = {t.untyped_storage().data_ptr() for t in host_buffers}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.in_triton:  # the interpreter moving a launch's arguments: not a GPU op
            return out
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.launches.syncs += 1
        elif name == "copy_" and args[1].untyped_storage().data_ptr() in self._host:
            self.launches.copies += 1
        elif name not in _NO_KERNEL and (not func.is_view or _copied(args, out)):
            self.launches.kernels[f"aten:{name}"] += 1
        return out


@contextlib.contextmanager
def count_launches(host_buffers: tuple[torch.Tensor, ...] = ()) -> Iterator[StepLaunches]:
    """Count what the block issues (module docstring). Needs TRITON_INTERPRET=1 and CPU tensors;
    `host_buffers`: tensors standing for pinned host memory, copies from which are uploads."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before triton is imported"
    from triton.runtime.interpreter import InterpretedFunction

    counter = _LaunchCounter(host_buffers)
    run = InterpretedFunction.run

    def counted_run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            counter.launches.kernels[f"triton:{self.fn.__name__}"] += 1
        counter.in_triton += 1
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counter.in_triton -= 1

    InterpretedFunction.run = counted_run
    try:
        with counter:
            yield counter.launches
    finally:
        InterpretedFunction.run = run


def tiny_decoder(
    family: str,
    num_layers: int,
    dtype: torch.dtype,
    seed: int = 0,
    quantization: str = "none",
    target: GpuTarget = SM90,
    fuse: bool = True,
) -> Any:
    """A random-weight DecoderLM of `family` (batchrun.testing's tiny shapes) with `num_layers`
    layers, on the CPU in `dtype`, over the Triton kernel set of `target` simulated (`fuse`: the
    fused projection GEMMs, as that set binds them), its projections plain nn.Linear as on a GPU,
    or quantized as the engine quantizes them for `target` (`quantization`: a weight mode, or
    "w8a8/float": W8A8 after SmoothQuant over random input ranges, with 4 float channels per
    projection)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from batchrun.model.decoder import build_decoder
    from batchrun.testing import _BASE, FAMILIES

    kw = {**_BASE, **FAMILIES[family], "num_hidden_layers": num_layers, "vocab_size": 512}
    if "layer_types" in kw:  # Gemma 3: sliding and global layers alternating, as the tiny model has them
        kw["layer_types"] = [kw["layer_types"][i % len(kw["layer_types"])] for i in range(num_layers)]
    model_type = kw.pop("model_type")
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    kernels = bind_kernels(find_target("cpu", simulate=target), dtype, fuse=fuse)
    model = build_decoder(config, state, dtype, torch.device("cpu"), kernels).eval()
    if quantization != "none":
        from batchrun.model.prepare import prepare_linears
        from batchrun.model.quant.smoothquant import projections

        mode = quantization.split("/")[0]
        gen = torch.Generator().manual_seed(seed)
        absmax = None
        if quantization == "w8a8/float":
            absmax = {name: torch.rand(m.in_features, generator=gen) + 0.1 for name, m in projections(model)}
        # the layers hold their weights as the simulated GPU's kernels take them (no CPU packing)
        prepare_linears(
            model, mode, None, dtype, input_absmax=absmax, outlier_channels=4 if absmax else 0, kernels=kernels
        )
    return model


def decode_step_launches(model: Any, num_seqs: int = 4, context: int = 20, block_size: int = 16) -> StepLaunches:
    """Launches of one graphed decode step of `num_seqs` sequences `context` tokens long (this
    step's token included) on `model` (a DecoderLM on the CPU, over its kernel set: a simulated
    GPU's for the GPU's count, `tiny_decoder`). The step runs once uncounted first (a graph's
    warm-up), then once counted."""
    from batchrun.engine import SamplingParams
    from batchrun.engine.request import Request
    from batchrun.engine.runners.cuda_graphs import DecodeGraphs, EagerReplay
    from batchrun.engine.scheduler import ScheduledBatch

    spec = model.spec
    dtype = model.embed_tokens.weight.dtype
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(spec.num_layers)]
    graphs = DecodeGraphs(
        model, kv_caches, block_size, blocks_per_seq, torch.device("cpu"), dtype, max(num_seqs, 1), EagerReplay
    )
    requests = []
    for i in range(num_seqs):
        r = Request(i, i, [(7 * i + j) % spec.vocab_size for j in range(context)], SamplingParams(), 0.0)
        r.num_computed_tokens = context - 1
        r.block_ids = [1 + i * blocks_per_seq + b for b in range(blocks_per_seq)]
        requests.append(r)
    batch = ScheduledBatch(requests, [1] * num_seqs)
    with torch.inference_mode():
        assert graphs.can_run(batch)
        graphs.execute(batch)  # the warm-up run a capture makes
        with count_launches((graphs.host,)) as launches:
            out = graphs.execute(batch)
    if out is None:
        raise RuntimeError("the graphed decode step fell back to eager (a capture failed; see the log)")
    logits, _ = out
    assert logits.shape == (num_seqs, spec.vocab_size) and bool(torch.isfinite(logits).all())
    launches.logits = logits
    return launches


@dataclass
class LaunchFigures:
    """Per-step and per-layer kernel counts by name, and the figure for `num_layers` layers."""

    per_step: Counter
    per_layer: Counter
    num_layers: int

    @property
    def total(self) -> int:
        return sum(self.per_step.values()) + self.num_layers * sum(self.per_layer.values())

    def rows(self) -> list[tuple[str, int, int, int]]:
        """(kernel, per step, per layer, in `num_layers` layers' step), most launched first."""
        names = set(self.per_step) | set(self.per_layer)
        rows = [
            (n, self.per_step[n], self.per_layer[n], self.per_step[n] + self.num_layers * self.per_layer[n])
            for n in names
        ]
        return sorted(rows, key=lambda r: (-r[3], r[0]))


def launch_figures(
    family: str = "qwen3",
    num_layers: int = 28,
    dtype: torch.dtype = torch.bfloat16,
    quantization: str = "none",
    fuse: bool = True,
    **step: Any,
) -> LaunchFigures:
    """Kernels of one decode step split into what every layer adds and what the step adds once, from
    models of 2 and 3 layers (layer 0 and the last differ from the rest only in which kernel their
    norm takes, never in how many), extrapolated to `num_layers`; `quantization`, `fuse`: see tiny_decoder."""
    two = decode_step_launches(tiny_decoder(family, 2, dtype, quantization=quantization, fuse=fuse), **step).kernels
    three = decode_step_launches(tiny_decoder(family, 3, dtype, quantization=quantization, fuse=fuse), **step).kernels
    per_layer = Counter({n: three[n] - two[n] for n in set(two) | set(three) if three[n] != two[n]})
    assert all(v > 0 for v in per_layer.values()), f"a layer removed kernels: {per_layer}"
    per_step = Counter({n: two[n] - 2 * per_layer[n] for n in two if two[n] - 2 * per_layer[n]})
    assert all(v > 0 for v in per_step.values()), f"per-step counts below zero: {per_step}"
    return LaunchFigures(per_step, per_layer, num_layers)


def format_figures(figures: LaunchFigures, label: str) -> str:
    lines = [
        f"{label}: {figures.total} kernels per decode step for {figures.num_layers} layers "
        f"({sum(figures.per_layer.values())} per layer, {sum(figures.per_step.values())} per step)"
    ]
    width = max((len(r[0]) for r in figures.rows()), default=10)
    lines.append(f"  {'kernel':<{width}}  per step  per layer  step of {figures.num_layers}")
    for name, s, layer, total in figures.rows():
        lines.append(f"  {name:<{width}}  {s:>8}  {layer:>9}  {total:>10}")
    return "\n".join(lines)


# Weight modes whose linear `launches_per_linear` counts: engine.quantization's modes on the GPU, and
# W8A8 with float (outlier) channels, which the engine's default calibration keeps.
LINEAR_MODES = ("none", "int8", "int4", "fp8", "w8a8", "w8a8/float")


def launches_per_linear(
    mode: str,
    num_tokens: int = 4,
    in_features: int = 512,
    out_features: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    bias: bool = False,
    target: GpuTarget = SM90,
    dense_min_rows: Optional[int] = None,
) -> StepLaunches:
    """What one quantized projection of `mode` (LINEAR_MODES) launches on `target`, its layer built as
    the engine builds it (model/quant/layers.py: make_linear, int8/int4 in groups of 32, W8A8 with 8
    float channels for "w8a8/float") and called once uncounted, then once counted. The default
    shape has a single column tile of the weight-only GEMMs, which split K on an sm_90 (split-K is
    part of the one launch). `dense_min_rows`: the kernel set's option (kernels/kernel_set.py:
    BindOptions) of cuBLAS over a dequantized copy from that many rows."""
    from batchrun.model.quant.layers import make_linear
    from batchrun.model.quant.smoothquant import split_outlier_channels
    from batchrun.model.quant.weights import quantize_weight

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    kernels = bind_kernels(find_target("cpu", simulate=target), dtype, dense_min_rows=dense_min_rows)
    with torch.inference_mode():
        if mode == "none":
            layer: Any = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
        else:
            base = mode.split("/")[0]
            outliers = None
            if mode == "w8a8/float":
                absmax = torch.rand(in_features, generator=gen)
                w, outliers = split_outlier_channels(w, absmax, 8)
                outliers.weight_t = outliers.weight_t.to(dtype)
            fmt = {"int8": "int8", "int4": "int4", "fp8": "fp8", "w8a8": "int8"}[base]
            qw = quantize_weight(w, fmt, 32 if base in ("int8", "int4") else None)
            layer = make_linear(qw, base, b, dtype, outliers, kernels=kernels)
        y = layer(x)  # warm-up (a graph capture's)
        with count_launches() as launches:
            y = layer(x)
    assert y.shape == (num_tokens, out_features) and y.dtype == dtype
    return launches
