"""benchmarks.gpu's GEMM phase: each weight mode's linear against cuBLAS bf16, per projection shape and
token count, as time and as a fraction of the bytes-moved floor.

Each mode's projection is the engine's layer (model/quant/layers.py: make_linear, int8 and int4 in
groups of 32 as engine.quantization builds them), so what is timed is the GPU dispatch path: the
fused Triton dequantize-GEMMs for int8/int4 (tiles tuned at their first call, before timing), the
per-token quantization kernel + torch._scaled_mm for fp8, quantization + torch._int_mm + epilogue
for W8A8, and engine.batch_invariant's float linear (the batch-invariant Triton matmul over the
bf16 weight). The baseline is torch.nn.functional.linear over the bf16 weight (cuBLAS), timed in the
same run on the same shapes.

The floor: the bytes a call must move (the weight as stored, scales and mins included, x and y in
bf16) over the device copy bandwidth measured here; "% of floor" = floor time / measured time. At
few rows a GEMM is bound by the weight's bytes, which is where a 4- or 8-bit weight can beat bf16.

Shapes: Llama-3-8B's projections (qkv 6144x4096, o 4096x4096, gate/up 28672x4096, down 4096x14336,
as (N, K)) and Qwen3-0.6B's, at M = 1, 16, 64 and 256 rows. In --smoke the same code runs on the
CPU at tiny shapes over the kernel set of a simulated sm_90 (kernels/target.py: the layers take the
GPU's kernels, the Triton kernels run in the interpreter) and times nothing. Every call's output is checked
against the float product (relative error at most MAX_REL_ERR), on the GPU too.

On a GPU torch's own int4 kernel (tinygemm, `TorchInt4`) is measured beside ours on the same int4
weights, so docs/quantization.md's choice of kernel rests on a side-by-side figure.

A library module (`python -m benchmarks.gpu --only gemm` runs it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

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
    not started by then are left out (and said so)."""
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import SM90, find_target

    start = time.perf_counter()
    shapes, rows = (SMOKE_SHAPES, SMOKE_ROWS) if smoke else (SHAPES, ROWS)
    # The interpreter gets bf16 tl.dot wrong: fp16 there, bf16 (what runs) on the GPU.
    dtype = torch.float16 if smoke else torch.bfloat16
    section: dict[str, Any] = {"note": NO_CUDA if smoke else "", "dtype": str(dtype).split(".")[-1], "rows": []}
    report.data["gemm"] = section
    bandwidth = None if smoke else _copy_bandwidth(device)
    section["copy_bytes_per_s"] = bandwidth
    gen = torch.Generator().manual_seed(0)
    bad = []
    cut = 0
    kernels = bind_kernels(find_target("cpu", simulate=SM90) if smoke else find_target(device), dtype)
    with torch.inference_mode():
        for model, proj, n, k in shapes:
            if deadline_s is not None and time.perf_counter() - start > deadline_s:
                cut += 1
                continue
            w = (torch.randn(n, k, generator=gen) * 0.02).to(device, dtype)  # (N, K)
            x_all = torch.randn(max(rows), k, generator=gen).to(device, dtype)
            layers: dict[str, Optional[torch.nn.Module]] = {
                "bf16": None,
                **{mode: _layer(mode, w, kernels) for mode in MODES},
            }
            if not smoke:
                try:
                    layers["torch-int4"] = TorchInt4(w)
                except Exception as exc:  # noqa: BLE001 - a torch build without it: said, not fatal
                    section.setdefault("errors", []).append(f"torch-int4 {model} {proj}: {exc!r}")
            for m in rows:
                x = x_all[:m]
                want = torch.nn.functional.linear(x.float(), w.float())
                io_bytes = (m * k + m * n) * 2
                base_us = None
                for mode, layer in layers.items():

                    def call(layer=layer, x=x, w=w):
                        return torch.nn.functional.linear(x, w) if layer is None else layer(x)

                    y = call()  # compiles, and tunes the tiles of this (M bucket, N, K)
                    nbytes = (n * k * 2 if layer is None else _weight_bytes(layer)) + io_bytes
                    row: dict[str, Any] = {"model": model, "proj": proj, "n": n, "k": k, "m": m, "mode": mode}
                    row["bytes"] = nbytes
                    rel = float((y.float() - want).norm() / want.norm())
                    row["rel_err_vs_float"] = rel
                    if not rel <= MAX_REL_ERR:
                        bad.append(f"{mode} {model} {proj} M={m}: rel err {rel:.3g}")
                    if not smoke:
                        assert bandwidth is not None
                        us = _time_us(call)
                        floor_us = 1e6 * nbytes / bandwidth
                        base_us = us if layer is None else base_us
                        row.update(us=us, floor_us=floor_us, pct_of_floor=100 * floor_us / us)
                        if base_us is not None:
                            row["speedup_vs_bf16"] = base_us / us
                    section["rows"].append(row)
            del layers, w, x_all
            if device.type == "cuda":
                torch.cuda.empty_cache()
    section["cut_shapes"] = cut
    _summarize(section, smoke, report, bad, cut)


def _summarize(section: dict[str, Any], smoke: bool, report: Report, bad: list[str], cut: int) -> None:
    rows = section["rows"]
    worst = max((r["rel_err_vs_float"] for r in rows), default=math.nan)
    where = " (interpreter, tiny shapes)" if smoke else ""
    report.add(
        f"GEMM modes vs the float product{where}",
        f"{len(rows)} calls, worst rel err {worst:.3g}" + (f"; {'; '.join(bad[:4])}" if bad else ""),
        ok=not bad,
    )
    if smoke:
        report.add("GEMM microbenchmark vs cuBLAS bf16", NO_CUDA)
        return
    for model in dict.fromkeys(r["model"] for r in rows):
        for mode in MODES + GPU_ONLY_MODES:
            mine = [r for r in rows if r["model"] == model and r["mode"] == mode]
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
    if cut:
        report.add("GEMM shapes left out", f"{cut} (out of the phase's time)")
