"""The library modules of the GPU check (`python -m batchrun.bench.gpu`): its report and budget,
the Triton compile counts, and the decode step's launch counting."""

from __future__ import annotations

import json
import math

import pytest

from batchrun.bench import compile_counts
from batchrun.bench.decode_step import count_launches
from batchrun.bench.gpu_report import Budget, Report, json_safe

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
