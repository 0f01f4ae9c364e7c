"""benchmarks.gpu's GEMM phase: each weight mode's linear against cuBLAS bf16, per projection shape and
token count, as time and as a fraction of the bytes-moved floor.

Each mode's projection is the engine's layer (model/quant/layers.py: make_linear, int8 and int4 in
groups of 32 as engine.quantization builds them), so what is timed is the GPU dispatch path: the
fused Triton dequantize-GEMMs for int8/int4, the per-token quantization kernel + torch._scaled_mm
for fp8, quantization + torch._int_mm + epilogue for W8A8, and engine.batch_invariant's float
linear (the batch-invariant Triton matmul over the bf16 weight). The baseline is
torch.nn.functional.linear over the bf16 weight (cuBLAS), timed in the same run on the same shapes.

The layers' kernel set is bound with the static tables' tiles (what engine.tune_kernels=false
runs; start-up tuning may pick faster ones), so nothing is tuned here. Per shape every (mode, M)
is called once first, which compiles its kernels and checks its output against the float product
(relative error at most MAX_REL_ERR, on the GPU too); then the calls are timed, with Triton's
compile counts (benchmarks.compile_counts) taken before and after: a variant compiled while timing
fails the phase. Each mode's layer and each call is tried on its own: one that raises is that
row's error (in the JSON and named in the table, a failed check: exit status 1) and the other
modes go on.

The floor: the bytes a call must move (the weight as stored, scales and mins included, x and y in
bf16) over the device copy bandwidth measured here; "% of floor" = floor time / measured time. At
few rows a GEMM is bound by the weight's bytes, which is where a 4- or 8-bit weight can beat bf16.

Shapes: Llama-3-8B's projections (qkv 6144x4096, o 4096x4096, gate/up 28672x4096, down 4096x14336,
as (N, K)) and Qwen3-0.6B's, at M = 1, 16, 64 and 256 rows. In --smoke the same code runs on the
CPU at tiny shapes over the kernel set of a simulated sm_90 (kernels/target.py: the layers take the
GPU's kernels, the Triton kernels run in the interpreter) and times nothing.

On a GPU torch's own int4 kernel (tinygemm, `TorchInt4`) is measured beside ours on the same int4
weights, so docs/quantization.md's choice of kernel rests on a side-by-side figure; a torch build
without it is said in its rows, not failed.

A library module (`python -m benchmarks.gpu --only gemm` runs it).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch

from benchmarks import compile_counts
from benchmarks.gpu_report import NO_CUDA, Report

# (model, projection, N, K): the weight (N, K) of y = x @ W.T
SHAPES: list[tuple[str, str, int, int]] = [
    ("Llama-3-8B", "qkv", 6144, 4096),
    ("Llama-3-8B", "o", 4096, 4096),
    ("Llama-3-8B", "gate_up", 28672, 4096),
    ("Llama-3-8B", "down", 4096, 14336),
    ("Qwen3-0.6B", "qkv", 4096, 1024),
    ("Qwen3-0.6B", "o", 1024, 2048),
    ("Qwen3-0.6B", "gate_up", 6144, 1024),
    ("Qwen3-0.6B", "down", 1024, 3072),
]
SMOKE_SHAPES: list[tuple[str, str, int, int]] = [("tiny", "qkv", 96, 64), ("tiny", "down", 64, 128)]
ROWS = (1, 16, 64, 256)
SMOKE_ROWS = (1, 20)
MODES = ("int8", "int4", "fp8", "w8a8", "batch-invariant")
GPU_ONLY_MODES = ("torch-int4",)  # torch's tinygemm int4 kernel beside ours (TorchInt4)
# A mode's output against the float product: far above each format's rounding error (int4 in
# groups of 32 on random weights: ~0.1), far below what a wrong kernel or layout gives.
MAX_REL_ERR = 0.2


def _layer(mode: str, w: torch.Tensor, kernels: Any) -> torch.nn.Module:
    """The engine's projection for `mode` over the float weight w (N, K), over `kernels`."""
    from batchrun.model.quant.layers import make_linear

    if mode == "batch-invariant":  # engine.batch_invariant's float linear (kernels/triton_invariant.py)
        from batchrun.model.invariant import InvariantLinear

        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        linear.weight.data = w
        return InvariantLinear(linear, kernels.invariant_matmul)
    from batchrun.model.quant.weights import quantize_weight

    fmt = {"int8": "int8", "int4": "int4", "fp8": "fp8", "w8a8": "int8"}[mode]
    qw = quantize_weight(w, fmt, 32 if mode in ("int8", "int4") else None)
    return make_linear(qw, mode, None, w.dtype, kernels=kernels)


class TorchInt4(torch.nn.Module):
    """torch's own W4A16 CUDA kernel (tinygemm: torch._weight_int4pack_mm) over the int4 weight of
    `int4` mode, measured beside ours (GPU only). Its zero point: w = (q - 8) * scale + zero, so
    zero = min + 8 * scale; its packed input holds even k in the high nibble."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, w: torch.Tensor, group_size: int = 32) -> None:
        from batchrun.kernels.quant import quantize_int4, unpack_int4

        super().__init__()
        packed, scales, mins = quantize_int4(w, group_size)
        q = unpack_int4(packed)  # (N, K) uint8 in [0, 15]
        high_even = (q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()  # (N, K // 2)
        self.register_buffer("packed", torch._convert_weight_to_int4pack(high_even, 8))
        zeros = mins.float() + 8.0 * scales.float()
        scales_zeros = torch.stack((scales.float().t(), zeros.t()), dim=-1)  # (K // group_size, N, 2)
        self.register_buffer("scales_zeros", scales_zeros.to(w.dtype).contiguous())
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_zeros)


def _weight_bytes(layer: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in (*layer.buffers(), *layer.parameters()))


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device copy moves (read + write), over 1 GiB: the HBM ceiling."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=20))
    return 2 * src.numel() / (ms * 1e-3)


def _time_us(fn: Callable[[], Any]) -> float:
    import triton.testing

    return 1e3 * float(triton.testing.do_bench(fn, warmup=5, rep=20))


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def check_gemms(device: torch.device, smoke: bool, report: Report, deadline_s: Optional[float] = None) -> None:
    """Fill report.data["gemm"] and the summary rows. `deadline_s`: seconds this phase may take; shapes
    not started by then are left out (and said so). Each mode's layer, and each of its calls, is
    tried on its own: a failure is that row's error (and a failed check), the rest go on."""
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import SM90, find_target

    start = time.perf_counter()
    shapes, rows = (SMOKE_SHAPES, SMOKE_ROWS) if smoke else (SHAPES, ROWS)
    # The interpreter gets bf16 tl.dot wrong: fp16 there, bf16 (what runs) on the GPU.
    dtype = torch.float16 if smoke else torch.bfloat16
    # The static tables' tiles (engine.tune_kernels=false): nothing is tuned, so nothing but the
    # calls below compiles or times anything
    kernels = bind_kernels(find_target("cpu", simulate=SM90) if smoke else find_target(device), dtype)
    section: dict[str, Any] = {
        "note": NO_CUDA if smoke else "",
        "dtype": str(dtype).split(".")[-1],
        "tuning": kernels.tuning.source,
        "rows": [],
        "compiles_during_timing": {},
    }
    report.data["gemm"] = section
    bandwidth = None if smoke else _copy_bandwidth(device)
    section["copy_bytes_per_s"] = bandwidth
    gen = torch.Generator().manual_seed(0)
    cut = 0
    with torch.inference_mode():
        for model, proj, n, k in shapes:
            if deadline_s is not None and time.perf_counter() - start > deadline_s:
                cut += 1
                continue
            w = (torch.randn(n, k, generator=gen) * 0.02).to(device, dtype)  # (N, K)
            x_all = torch.randn(max(rows), k, generator=gen).to(device, dtype)
            layers = _layers(w, kernels, smoke, section, (model, proj, n, k), rows)
            calls = _check_calls(layers, w, x_all, rows, section, (model, proj, n, k))
            if not smoke:
                assert bandwidth is not None
                _time_calls(calls, bandwidth, section, f"{model} {proj}")
            del layers, calls, w, x_all
            if device.type == "cuda":
                torch.cuda.empty_cache()
    section["cut_shapes"] = cut
    _summarize(section, smoke, report, cut)


Shape = tuple[str, str, int, int]  # (model, projection, N, K)


def _row(shape: Shape, m: int, mode: str, **fields: Any) -> dict[str, Any]:
    model, proj, n, k = shape
    return {"model": model, "proj": proj, "n": n, "k": k, "m": m, "mode": mode, **fields}


def _failed(row: dict[str, Any], exc: BaseException, section: dict[str, Any]) -> None:
    """Record `exc` as the row's error; a failure of ours (not of an optional torch kernel) fails
    the check."""
    traceback.print_exc()
    row["error"] = repr(exc)
    if row["mode"] not in GPU_ONLY_MODES:
        print(f"  GEMM {row['mode']} {row['model']} {row['proj']} M={row['m']}: FAILED: {exc!r}", flush=True)


def _layers(
    w: torch.Tensor, kernels: Any, smoke: bool, section: dict[str, Any], shape: Shape, rows: tuple[int, ...]
) -> dict[str, Optional[torch.nn.Module]]:
    """mode -> the engine's layer over w (None: the cuBLAS baseline); a mode whose layer cannot be
    made gets an error row per M and no layer."""
    layers: dict[str, Optional[torch.nn.Module]] = {"bf16": None}
    for mode in MODES + (() if smoke else GPU_ONLY_MODES):
        try:
            layers[mode] = TorchInt4(w) if mode == "torch-int4" else _layer(mode, w, kernels)
        except Exception as exc:  # noqa: BLE001 - one mode's failure must not end the phase
            for m in rows:
                row = _row(shape, m, mode)
                _failed(row, exc, section)
                section["rows"].append(row)
    return layers


Call = tuple[dict[str, Any], Callable[[], Any]]  # (its row, the call)


def _check_calls(
    layers: dict[str, Optional[torch.nn.Module]],
    w: torch.Tensor,
    x_all: torch.Tensor,
    rows: tuple[int, ...],
    section: dict[str, Any],
    shape: Shape,
) -> list[Call]:
    """Every (M, mode) called once (compiling its kernels) and checked against the float product;
    returns the calls that ran, for timing."""
    _, _, n, k = shape
    calls: list[Call] = []
    for m in rows:
        x = x_all[:m]
        want = torch.nn.functional.linear(x.float(), w.float())
        io_bytes = (m * k + m * n) * 2
        for mode, layer in layers.items():

            def call(layer=layer, x=x, w=w):
                return torch.nn.functional.linear(x, w) if layer is None else layer(x)

            row = _row(shape, m, mode, bytes=(n * k * 2 if layer is None else _weight_bytes(layer)) + io_bytes)
            section["rows"].append(row)
            try:
                y = call()
                row["rel_err_vs_float"] = float((y.float() - want).norm() / want.norm())
            except Exception as exc:  # noqa: BLE001 - recorded in the row, the other modes go on
                _failed(row, exc, section)
                continue
            calls.append((row, call))
    return calls


def _time_calls(calls: list[Call], bandwidth: float, section: dict[str, Any], label: str) -> None:
    """Time every checked call of one shape, with Triton's compile counts before and after (the
    checks compiled everything; a variant compiled while timing is a failure)."""
    before = compile_counts.snapshot()
    base_us: dict[int, float] = {}
    for row, call in calls:
        try:
            us = _time_us(call)
        except Exception as exc:  # noqa: BLE001 - recorded in the row
            _failed(row, exc, section)
            continue
        floor_us = 1e6 * row["bytes"] / bandwidth
        row.update(us=us, floor_us=floor_us, pct_of_floor=100 * floor_us / us)
        if row["mode"] == "bf16":
            base_us[row["m"]] = us
        if row["m"] in base_us:
            row["speedup_vs_bf16"] = base_us[row["m"]] / us
    after = compile_counts.snapshot()
    if before is not None and after is not None:
        section["compiles_during_timing"][label] = compile_counts.compiled_between(before, after)


def _summarize(section: dict[str, Any], smoke: bool, report: Report, cut: int) -> None:
    rows = section["rows"]
    ran = [r for r in rows if "rel_err_vs_float" in r]
    worst = max((r["rel_err_vs_float"] for r in ran), default=math.nan)
    bad = [
        f"{r['mode']} {r['model']} {r['proj']} M={r['m']}: rel err {r['rel_err_vs_float']:.3g}"
        for r in ran
        if not r["rel_err_vs_float"] <= MAX_REL_ERR
    ]
    where = " (interpreter, tiny shapes)" if smoke else ""
    report.add(
        f"GEMM modes vs the float product{where}",
        f"{len(ran)} calls, worst rel err {worst:.3g}" + (f"; {'; '.join(bad[:4])}" if bad else ""),
        ok=not bad,
    )
    errors = [r for r in rows if "error" in r]
    if errors:
        ours = [r for r in errors if r["mode"] not in GPU_ONLY_MODES]
        report.add(
            "GEMM calls that failed",
            f"{len(errors)} of {len(rows)}: "
            + "; ".join(f"{r['mode']} {r['model']} {r['proj']} M={r['m']}: {r['error']}" for r in errors[:6])
            + (f"; and {len(errors) - 6} more (JSON: gemm.rows)" if len(errors) > 6 else ""),
            ok=not ours,  # torch's own int4 kernel missing from a torch build is said, not failed
        )
    if smoke:
        report.add("GEMM microbenchmark vs cuBLAS bf16", NO_CUDA)
        report.add("GEMM phase: Triton compiles during the timed calls", "n/a (interpreter: nothing compiles)")
        return
    for model in dict.fromkeys(r["model"] for r in rows):
        for mode in MODES + GPU_ONLY_MODES:
            mine = [r for r in rows if r["model"] == model and r["mode"] == mode and "speedup_vs_bf16" in r]
            small = [r["speedup_vs_bf16"] for r in mine if r["m"] <= 16]
            large = [r["speedup_vs_bf16"] for r in mine if r["m"] == 256]
            pct = [r["pct_of_floor"] for r in mine if r["m"] == 1]
            if not mine:
                continue
            report.add(
                f"GEMM {mode} vs cuBLAS bf16, {model} shapes",
                f"M<=16: min {min(small, default=math.nan):.2f}x geomean {_geomean(small):.2f}x; "
                f"M=256: min {min(large, default=math.nan):.2f}x; M=1: {_geomean(pct):.0f}% of the bytes floor",
            )
    new = {label: kernels for label, kernels in section["compiles_during_timing"].items() if kernels}
    report.add(
        "GEMM phase: Triton compiles during the timed calls",
        f"{sum(len(keys) for kernels in new.values() for keys in kernels.values())} new"
        + (f"; RECOMPILED in {', '.join(new)}" if new else ""),
        ok=not new,
    )
    if cut:
        report.add("GEMM shapes left out", f"{cut} (out of the phase's time)")
