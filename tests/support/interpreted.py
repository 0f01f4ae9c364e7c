"""Running Triton kernel checks in Triton's interpreter, in a child process.

TRITON_INTERPRET must be set before triton is first imported, and the rest of the suite imports it
normally, so each Triton test file re-runs itself (`python tests/kernels/test_x.py`) with the
interpreter on and reads what the child printed: one JSON line per case (`report_cases`), or
whatever the file's `__main__` prints. The child has the repository on its path, so it imports
`tests.support` and `benchmarks` as the suite does.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tests.support import REPO


def run_interpreted(test_file: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python test_file *args` with TRITON_INTERPRET=1, no visible GPU and the repository importable."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, test_file, *args], env=env, capture_output=True, text=True, timeout=timeout)


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
