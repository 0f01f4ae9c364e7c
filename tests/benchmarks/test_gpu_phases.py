"""The GPU check's GEMM and fused-GEMM phases (benchmarks.gpu_gemm, benchmarks.gpu_fused) when something
breaks: a weight mode whose layer cannot be made, a call that raises at one row count, a fused
kernel whose output is wrong, a kernel set that falls back to the unfused path where it should
fuse. Each is that row's failure, named in the table and the JSON, and the exit status is 1; every
other mode and kind still reports. The failures are injected into `--smoke`'s code path (the
kernels in Triton's interpreter, over a simulated sm_90's kernel set) in a child process, which
TRITON_INTERPRET needs; the unbroken `--smoke` run is tests/test_bench_gpu.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# Run as `python -c`: the injections, then the check's own main.
_CHILD = """
import sys

import torch

from batchrun.kernels import triton_fused_gemm, tuning
from benchmarks import gpu_gemm

real_layer = gpu_gemm._layer


class FailsAt20Rows(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        if x.shape[0] == 20:
            raise RuntimeError("injected: fp8 at 20 rows")
        return self.layer(x)


def layer(mode, w, kernels):
    if mode == "int4":
        raise RuntimeError("injected: no int4 layer")
    made = real_layer(mode, w, kernels)
    return FailsAt20Rows(made) if mode == "fp8" else made


gpu_gemm._layer = layer
real_logits = triton_fused_gemm.gemm_logits
triton_fused_gemm.gemm_logits = lambda *args, **kwargs: real_logits(*args, **kwargs) * 1.05  # a wrong epilogue
real_is_fused = tuning.Tuning.is_fused
# the kernel set runs the unfused pair where it should fuse gate/up
tuning.Tuning.is_fused = lambda self, kind, *args: kind != "silu_mul" and real_is_fused(self, kind, *args)

from benchmarks.gpu import main

sys.exit(main(sys.argv[1:]))
"""


def test_a_failing_mode_or_fused_kernel_fails_its_rows_and_the_rest_still_report(tmp_path):
    path = tmp_path / "gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    args = ["--smoke", "--only", "gemm", "--only", "fused", "--json", str(path)]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    data = json.loads(path.read_text())
    assert data["ok"] is False and [p["status"] for p in data["budget"]["phases"]] == ["ran", "ran"]
    table = dict(data["table"])

    # GEMM: every (shape, M, mode) has its row; int4's and fp8's at 20 rows are errors, the rest ran
    rows = data["gemm"]["rows"]
    assert len(rows) == 2 * 2 * 6
    by = {(r["proj"], r["m"], r["mode"]): r for r in rows}
    for (_, m, mode), row in by.items():
        if mode == "int4" or (mode == "fp8" and m == 20):
            assert "injected" in row["error"] and "rel_err_vs_float" not in row
        else:
            assert "error" not in row and row["rel_err_vs_float"] <= 0.2, row
    assert table["GEMM modes vs the float product (interpreter, tiny shapes)"].startswith("18 calls")
    failed = table["GEMM calls that failed"]
    assert failed.startswith("6 of 24") and "int4 tiny qkv M=1" in failed and "fp8 tiny qkv M=20" in failed
    assert "GEMM calls that failed" in data["failures"]

    # fused: qkv (untouched) passes; logits (5% off) and gate/up (not fused) fail, said why
    fused = data["fused"]["rows"]
    assert {(r["kind"], r["part"]) for r in fused} == {
        ("qkv", "q, k, v"),
        ("qkv", "KV cache slots"),
        ("silu_mul", "out"),
        ("logits", "logits"),
    }
    assert len(fused) == 2 * 3 * 4  # 2 models x 3 row counts x (2 qkv parts, gate/up, logits)
    tol = data["fused"]["tolerance"]
    for r in fused:
        if r["kind"] == "qkv":
            assert r["ok"] and r["rel_err"] <= tol and r["rel_err_vs_float32"] <= tol and "error" not in r, r
        elif r["kind"] == "logits":
            assert not r["ok"] and r["rel_err"] > 0.04 and r["rel_err_vs_float32"] > 0.04, r
        else:
            assert not r["ok"] and r["rel_err"] == 0.0 and "not the fused kernel's" in r["error"], r
        assert "fused_us" not in r  # --smoke times nothing
    names = [name for name in data["failures"] if name.startswith("fused ")]
    assert len(names) == 2 and any("gate/up" in n for n in names) and any("logits" in n for n in names)
    qkv = next(value for name, value in table.items() if name.startswith("fused qkv+norm+rope+KV write vs unfused ("))
    assert qkv.startswith("12/12 within")


def test_the_default_gpu_plan_fits_its_budget_with_the_fused_phase():
    """`--plan` prints what a GPU run plans (no device needed): the default run's phase estimates,
    the fused-GEMM phase among them, fit the default budget; a smaller budget does not fit."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")

    def plan(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "benchmarks.gpu", "--plan", *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    default = plan()
    assert default.returncode == 0, default.stdout + default.stderr
    lines = default.stdout.splitlines()
    assert lines[-1].startswith("plan: 16 phases") and lines[-1].endswith(": fits")
    phases = [line.split("~")[0].strip() for line in lines[:-1]]
    assert phases[:4] == ["kernels", "bandwidth", "gemm", "fused GEMMs"]
    planned = sum(int(line.split("~")[1].split()[0]) for line in lines[:-1])
    assert planned <= 480
    short = plan("--budget-s", str(planned - 1))
    assert short.returncode == 1 and "does NOT fit" in short.stdout
