"""The GPU check (`python -m benchmarks.gpu`) and the library modules it measures through.

The check itself runs here as `--smoke`: every phase on the CPU at tiny sizes, in a fresh process
(--smoke sets TRITON_INTERPRET before triton is imported; tests never import a benchmark script).
The test reads the JSON document it writes: every section present, with sane types, and the
GPU-only values null. No figure is asserted: a test never times anything.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import compile_counts
from benchmarks.decode_step import capture_buckets, count_launches, top_kernels
from benchmarks.gpu_decode import DECODE_8B
from benchmarks.gpu_launches import LAUNCHES
from benchmarks.gpu_report import Budget, Report, json_safe
from tests.support import REPO

QWEN3, SMOLLM2 = "Qwen3-0.6B-shaped", "SmolLM2-135M-shaped"


def _run_gpu_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path / "gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRITON_INTERPRET", None)  # --smoke sets it itself, before triton's first import
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--smoke", "--json", str(path), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc, json.loads(path.read_text())


def _is_ms(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value >= 0


def test_smoke_run_writes_every_section(tmp_path):
    proc, data = _run_gpu_check(tmp_path)
    assert data["smoke"] is True and data["ok"] is True and data["failures"] == []
    assert "== summary" in proc.stdout

    versions = data["versions"]
    assert {"torch", "triton", "transformers", "cuda", "driver", "device_name"} <= set(versions)
    assert isinstance(versions["torch"], str) and isinstance(versions["triton"], str)
    assert versions["cuda"] is None and versions["driver"] is None  # no CUDA in --smoke

    budget = data["budget"]
    assert budget["budget_s"] == 480 and budget["planned_s"] > 0
    assert [p["status"] for p in budget["phases"]] == ["ran"] * len(budget["phases"])
    assert all(p["elapsed_s"] >= 0 for p in budget["phases"])

    kernels = {row["name"]: row for row in data["kernels"]}
    assert len(kernels) >= 14
    assert all(row["ok"] or row.get("skipped") for row in kernels.values())
    offsets = [row for name, row in kernels.items() if "int32" in name]
    assert len(offsets) == 2 and all("2**31" in row["note"] for row in offsets)

    bandwidth = data["bandwidth"]
    assert bandwidth["copy_bytes_per_s"] is None and bandwidth["note"] == "n/a (no CUDA)"
    assert bandwidth["decode"] and all("bytes_per_s" not in p for p in bandwidth["decode"])

    gemm = data["gemm"]  # every mode's linear on the GPU dispatch path, in the interpreter
    assert gemm["note"] == "n/a (no CUDA)" and gemm["copy_bytes_per_s"] is None and gemm["cut_shapes"] == 0
    assert {r["mode"] for r in gemm["rows"]} == {"bf16", "int8", "int4", "fp8", "w8a8", "batch-invariant"}
    assert {r["m"] for r in gemm["rows"]} == {1, 20} and len(gemm["rows"]) == 2 * 2 * 6
    assert all(r["rel_err_vs_float"] <= 0.2 and r["bytes"] > 0 and "us" not in r for r in gemm["rows"])
    int4 = next(r for r in gemm["rows"] if r["mode"] == "int4")
    bf16 = next(r for r in gemm["rows"] if r["mode"] == "bf16")
    assert int4["bytes"] < bf16["bytes"]  # the floor counts the weight as stored

    assert set(data["models"]) == {QWEN3, SMOLLM2}
    qwen = data["models"][QWEN3]
    memory = qwen["memory"]
    assert memory["weight_bytes"] > 0 and memory["kv_cache_bytes"] > 0 and memory["num_kv_blocks"] > 0
    assert "n/a (no CUDA)" in memory["note"]

    graphs = qwen["cuda_graphs"]
    assert graphs["capture"] is None  # capture needs CUDA; the stand-in replays lazily
    sizes = [row["num_seqs"] for row in graphs["graph_vs_eager"]]
    assert sizes == [1, 2, 4, 8, 7]  # every bucket up to 8 sequences, then 7 padded to bucket 8
    assert all(row["ok"] and row["argmax_agreement"] == 1.0 for row in graphs["graph_vs_eager"])

    step = qwen["decode_step"]
    assert step["num_seqs"] == 8 and step["mean_context"] > 0
    for path in ("graphed", "eager"):
        timed = step[path]["timed"]
        for part in ("schedule_ms", "pack_ms", "launch_ms", "sample_ms", "update_ms", "host_ms", "step_ms"):
            assert _is_ms(timed[part]), (path, part, timed[part])
        assert timed["gpu_ms"] is None and timed["gpu_forward_ms"] is None
        assert step[path]["kernels"] is None  # torch.profiler's kernel count needs CUDA
        assert _is_ms(step[path]["wall_ms"])
    ahead = step["async"]  # steps back to back with engine.async_scheduling on the stand-in graphs
    assert _is_ms(ahead["wall_ms"]) and ahead["num_ahead"] >= 8

    runs = {(run["temperature"], run["async_scheduling"]): run for run in qwen["throughput"]}
    assert set(runs) == {(0.0, False), (0.0, True), (0.6, False)}
    for run in runs.values():
        assert run["num_finished"] == 8 and run["is_cut"] is False
        assert run["num_output_tokens"] == qwen["workload"]["num_output_tokens"] and run["output_tok_s"] > 0
    # engine.async_scheduling on the stand-in graphs: steps ran ahead (the row fails otherwise)
    assert runs[0.0, True]["num_async_steps"] > 0 and runs[0.0, False]["num_async_steps"] is None
    # the turnover workload: 3 x 8 requests through 8 slots, admitting at every end, in batches, and
    # in batches with async scheduling; batches take fewer steps with a prefill (so fewer steps)
    turnover = qwen["turnover"]
    assert [(r["admission_min_slots"], r["async_scheduling"]) for r in turnover] == [
        (1, False),
        (16, False),
        (16, True),
    ]
    assert all(r["num_finished"] == 24 and not r["is_cut"] for r in turnover)
    assert len({r["num_output_tokens"] for r in turnover}) == 1 and turnover[2]["num_async_steps"] > 0
    assert qwen["compile_counts"]["note"].startswith("n/a (interpreter")
    assert qwen["hf_baseline"]["ratio"] > 0 and qwen["hf_baseline"]["num_seqs"] == 4

    smol = data["models"][SMOLLM2]
    assert [run["temperature"] for run in smol["throughput"]] == [0.0]
    assert "decode_step" not in smol and smol["hf_baseline"]["ratio"] > 0

    assert all(isinstance(name, str) and isinstance(value, str) for name, value in data["table"])


def test_smoke_decode_8b_runs_every_mode_through_the_engine(tmp_path):
    """The 8B decode phase at a tiny shape on the CPU: each weight mode's engine built over random
    weights (quantized by the engine's own pass) decodes at every batch size; nothing timed."""
    _, data = _run_gpu_check(tmp_path, "--only", "decode8b")
    assert [p["status"] for p in data["budget"]["phases"]] == ["ran"]
    section = data["decode_8b"]
    assert section["skipped"] is None and section["not_run"] == [] and section["note"] == "n/a (no CUDA)"
    assert "errors" not in section
    assert section["shape"]["model_type"] == "llama" and section["shape"]["hidden_size"] == 64  # smoke_shape
    rows = section["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        (mode, batch) for mode in ("none", "int8", "int4", "fp8", "w8a8") for batch in (1, 4)
    ]
    assert all(r["output_tok_s"] is None and r["ratio_vs_bf16"] is None and r["decode_tokens"] == 2 for r in rows)
    formats = {mode: engine["quant_formats"] for mode, engine in section["engines"].items()}
    assert formats["none"] == {} and all(k.startswith("linear:int4") for k in formats["int4"]), formats
    assert any(k.startswith("linear:w8a8") for k in formats["w8a8"]) and set(formats["fp8"]) == {"linear:fp8"}
    weights = {r["mode"]: r["weight_bytes"] for r in rows}
    assert weights["int4"] < weights["int8"] < weights["none"] and weights["fp8"] < weights["none"]  # quantized
    table = dict(data["table"])
    assert table[f"{DECODE_8B} w8a8"].startswith("n/a (no CUDA)")


def test_the_8b_decode_phase_says_why_it_skips_for_memory():
    from benchmarks.gpu_decode import memory_shortfall

    assert memory_shortfall(10 << 30, 40 << 30) is None
    assert (
        memory_shortfall(30 << 30, 20 << 30)
        == "needs ~30.0 GiB of GPU memory (bf16 weights, KV cache, headroom), 20.0 GiB free"
    )


def test_phases_that_do_not_fit_the_budget_are_skipped_and_said(tmp_path):
    proc, data = _run_gpu_check(
        tmp_path, "--only", "kernels", "--only", "decode8b", "--only", "engine", "--budget-s", "1"
    )
    phases = data["budget"]["phases"]
    # --smoke with the engine selected adds the CPU launch count, itself out of time at a 1 s budget
    assert [p["name"] for p in phases] == ["kernels", DECODE_8B, f"{QWEN3}: build", f"{QWEN3}: decode step", LAUNCHES]
    assert {p["status"] for p in phases} == {"skipped", "planned"}  # the build skipped: nothing after it
    assert phases[-1]["status"] == "skipped"
    assert phases[0]["status"] == "skipped" and "out of time" in phases[0]["note"]
    assert "does NOT fit" in proc.stdout
    assert any(name == "kernels" and value.startswith("skipped (out of time") for name, value in data["table"])


# ---- the library modules, without a subprocess ---------------------------------------------------


def test_json_safe_writes_strict_json():
    value = {"nan": math.nan, "inf": -math.inf, 3: (1, 2.5), "set": {"b", "a"}, "ok": True, "none": None}
    assert json_safe(value) == {"nan": None, "inf": None, "3": [1, 2.5], "set": ["a", "b"], "ok": True, "none": None}
    json.dumps(json_safe(value), allow_nan=False)


def test_budget_runs_what_fits_and_reports_a_failure_without_stopping(tmp_path):
    report = Report(json_path=str(tmp_path / "out.json"))
    budget = Budget(100.0, {"fits": 1.0, "fails": 1.0, "too long": 1000.0})
    assert budget.run("fits", lambda: 42, report) == 42

    def broken():
        raise ValueError("boom")

    assert budget.run("fails", broken, report) is None
    assert budget.run("too long", lambda: 1, report) is None
    statuses = {p.name: p.status for p in budget.phases.values()}
    assert statuses == {"fits": "ran", "fails": "failed", "too long": "skipped"}
    assert report.failures == ["fails"]
    written = json.loads((tmp_path / "out.json").read_text())
    assert [p["status"] for p in written["budget"]["phases"]] == ["ran", "failed", "skipped"]


class _FakeKernel:
    """The two layouts of a JITFunction's compile cache that compile_counts reads."""

    def __init__(self, keys: list[str], new_layout: bool) -> None:
        if new_layout:  # Triton >= 3.3: device -> (kernel cache, ...)
            self.device_caches = {0: ({k: object() for k in keys}, None, None)}
        else:
            self.cache = {0: {k: object() for k in keys}}


@pytest.mark.parametrize("new_layout", [True, False])
def test_compile_counts_finds_variants_compiled_between_snapshots(new_layout):
    before = {"a": compile_counts.variant_keys(_FakeKernel(["k1"], new_layout)), "b": set()}
    after = {
        "a": compile_counts.variant_keys(_FakeKernel(["k1", "k2"], new_layout)),
        "b": set(),
        "c": compile_counts.variant_keys(_FakeKernel(["k3"], new_layout)),
    }
    assert compile_counts.counts(after) == {"a": 2, "c": 1}  # never-launched kernels left out
    assert compile_counts.compiled_between(before, after) == {"a": ["0:k2"], "c": ["0:k3"]}
    assert compile_counts.compiled_between(after, after) == {}


def test_compile_counts_lists_the_triton_kernels_once_each():
    pytest.importorskip("triton")
    if compile_counts.interpreted():
        pytest.skip("under TRITON_INTERPRET the kernels are not JITFunctions")
    kernels = compile_counts.triton_kernels()
    assert {"triton_attention._decode_kernel", "triton_kv._write_kv_kernel", "quant.triton_gemm._w8a16_kernel"} <= set(
        kernels
    )
    assert len({id(fn) for fn in kernels.values()}) == len(kernels)


def test_count_launches_separates_device_kernels_copies_and_host_launch_calls():
    events = [
        ("_decode_kernel", True),
        ("ampere_bf16_gemm", True),
        ("Memcpy HtoD (Pinned -> Device)", True),
        ("Memset (Device)", True),
        ("cudaLaunchKernel", False),
        ("cuLaunchKernelEx", False),
        ("cudaLaunchKernelExC", False),
        ("cudaGraphLaunch", False),
        ("cudaMemcpyAsync", False),
        ("aten::mm", False),
    ]
    assert count_launches(events) == {
        "gpu_kernels": 2,
        "gpu_copies": 2,
        "host_kernel_launches": 3,
        "host_graph_launches": 1,
    }


class _FakeGraphs:
    """DecodeGraphs' capture_all (largest bucket first, already captured ones kept) over buckets whose
    capture fails, without CUDA."""

    def __init__(self, max_batch: int, failing: set[int]) -> None:
        from batchrun.engine.runners.cuda_graphs import bucket_sizes

        self.buckets = bucket_sizes(max_batch)
        self.max_batch = max_batch
        self.graphs: dict[int, object] = {}
        self.failing = failing

    def capture_all(self, max_batch: int) -> None:
        from batchrun.engine.runners.cuda_graphs import pick_bucket

        limit = pick_bucket(self.buckets, min(max_batch, self.max_batch))
        for bucket in reversed([b for b in self.buckets if b <= limit]):
            if bucket not in self.graphs:
                if bucket in self.failing:
                    raise RuntimeError(f"capture of {bucket} failed")
                self.graphs[bucket] = object()


def test_capture_names_every_failing_bucket_and_captures_the_rest():
    graphs = _FakeGraphs(64, failing={48, 4})
    cap = capture_buckets(graphs, 64)
    assert cap["buckets"] == [1, 2, 4, 8, 16, 32, 48, 64]
    assert cap["captured"] == [1, 2, 8, 16, 32, 64]
    assert sorted(cap["failed"]) == [4, 48] and "capture of 4 failed" in cap["failed"][4]
    assert capture_buckets(_FakeGraphs(64, failing=set()), 20)["captured"] == [1, 2, 4, 8, 16, 32]


def test_a_profiled_step_runs_the_step_once_and_counts_its_launches():
    """The profiler plumbing of benchmarks.decode_step on the CPU (no device events there, so all zero);
    the counts themselves are checked above, from names."""
    import types
    import warnings

    import torch

    from benchmarks.decode_step import _profiled_step

    engine = types.SimpleNamespace(runner=types.SimpleNamespace(graphs=None), device=torch.device("cpu"))
    calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without CUDA the profiler says it profiles the CPU only
        counts = _profiled_step(engine, lambda: calls.append(torch.ones(4) @ torch.ones(4)), graphed=False)
    assert len(calls) == 1
    assert counts == {
        "gpu_kernels": 0,
        "gpu_copies": 0,
        "host_kernel_launches": 0,
        "host_graph_launches": 0,
        "top_kernels": [],
    }


def test_top_kernels_sums_device_time_per_kernel_and_leaves_out_copies_and_host_calls():
    events = [
        ("_decode_kernel", True, 30.0),
        ("gemm", True, 10.0),
        ("_decode_kernel", True, 25.0),
        ("gemm", True, 12.0),
        ("_rms_norm_kernel", True, 2.0),
        ("Memcpy HtoD (Pinned -> Device)", True, 99.0),
        ("cudaLaunchKernel", False, 500.0),
    ]
    assert top_kernels(events) == [("_decode_kernel", 2, 55.0), ("gemm", 2, 22.0), ("_rms_norm_kernel", 1, 2.0)]
    assert top_kernels(events, limit=1) == [("_decode_kernel", 2, 55.0)]
