"""Running Triton kernel checks in Triton's interpreter, in a child process.

TRITON_INTERPRET must be set before triton is first imported, and the rest of the suite imports it
normally, so each Triton test file re-runs itself (`python tests/kernels/test_x.py`) with the
interpreter on and reads what the child printed: one JSON line per case (`report_cases`), or
whatever the file's `__main__` prints. The child has the repository on its path, so it imports
`tests.support` and `benchmarks` as the suite does.

A file whose checks are a table of cases takes its two tests from `interpreted_and_on_gpu`: every
case in one interpreted child on the CPU, and the same case compiled on a CUDA GPU where there is
one. Its `__main__` is `report_cases(CASES, run_case)`. A file whose child prints something else
(a whole engine run, launch counts) reads the child's JSON lines with `interpreted_rows`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional

import pytest

from tests.support import REPO


def run_interpreted(test_file: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python test_file *args` with TRITON_INTERPRET=1, no visible GPU and the repository importable."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, test_file, *args], env=env, capture_output=True, text=True, timeout=timeout)


def interpreted_output(test_file: str, *args: str, timeout: float = 300) -> str:
    """What an interpreted child printed, once it has exited 0."""
    proc = run_interpreted(test_file, *args, timeout=timeout)
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def interpreted_rows(test_file: str, *args: str, timeout: float = 300) -> list[dict[str, Any]]:
    """The JSON lines an interpreted child printed, in order, once it has exited 0."""
    lines = interpreted_output(test_file, *args, timeout=timeout).splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def interpreted_cases(test_file: str) -> dict[str, dict[str, Any]]:
    """case id -> {"ok": bool, "msg": str}, from one interpreted child that ran `report_cases`."""
    proc = run_interpreted(test_file)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["id"]] = row
    assert results, f"the interpreted child reported nothing:\n{proc.stdout}\n{proc.stderr}"
    return results


def report_cases(cases: Mapping[str, Any], run_case: Callable[[Any], None]) -> None:
    """The child's side: run every case and print one JSON line each, whatever breaks."""
    for case_id, spec in cases.items():
        try:
            run_case(spec)
            print(json.dumps({"id": case_id, "ok": True, "msg": ""}), flush=True)
        except Exception as exc:  # noqa: BLE001 - every case reports
            print(json.dumps({"id": case_id, "ok": False, "msg": f"{type(exc).__name__}: {exc}"}), flush=True)


def interpreted_and_on_gpu(
    cases: Mapping[str, Any], run_on_gpu: Callable[[Any], None], gpu_cases: Optional[Mapping[str, Any]] = None
) -> tuple[Callable[..., None], Callable[..., None]]:
    """(interpreted test, GPU test) over a Triton test file's table of cases, for the file to bind
    to its own test names. The interpreted test reads case `case_id` from the one child the
    module-scoped `interpreted_child` fixture (tests/conftest.py) runs for every case of the file;
    the GPU test (marked `gpu`: skipped without CUDA) runs `run_on_gpu(spec)` for each case of
    `gpu_cases` (default: the same cases), at the sizes the file picks for a GPU."""
    gpu_cases = cases if gpu_cases is None else gpu_cases

    @pytest.mark.parametrize("case_id", list(cases))
    def interpreted(interpreted_child: dict[str, dict[str, Any]], case_id: str) -> None:
        assert case_id in interpreted_child, f"the child never reached {case_id}"
        assert interpreted_child[case_id]["ok"], interpreted_child[case_id]["msg"]

    @pytest.mark.gpu
    @pytest.mark.parametrize("case_id", list(gpu_cases))
    def on_gpu(case_id: str) -> None:
        pytest.importorskip("triton")
        run_on_gpu(gpu_cases[case_id])

    return interpreted, on_gpu


@contextlib.contextmanager
def unary_minus_as_subtraction() -> Iterator[None]:
    """Triton's `-x` on floats as `0 - x`, which is how Triton compiles it up to 3.6 (and so on the
    GPUs the project runs on): `-(+0.0)` is then +0.0, not -0.0. A kernel that must keep the sign
    of zero is checked under this in the interpreter, whatever Triton version runs the tests."""
    from triton.language import core
    from triton.language.semantic import TritonSemantic

    def minus(self, input):  # noqa: A002 - Triton's own parameter name
        zero = core.tensor(self.builder.get_null_value(input.type.scalar.to_ir(self.builder)), input.type.scalar)
        return self.sub(zero, input, True)

    real = TritonSemantic.minus
    TritonSemantic.minus = minus
    try:
        yield
    finally:
        TritonSemantic.minus = real
