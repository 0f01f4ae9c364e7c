"""The LoRA benchmark (`python -m benchmarks.lora`) parses its arguments and picks its rows: its
`--dry-run`, in a fresh process (tests never import a benchmark script). Nothing is loaded or timed
here; the benchmark itself builds adapters, merged models and six engines over SmolLM2-135M.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import REPO


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.lora", "--dry-run", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_dry_run_names_the_rows_adapters_and_systems_and_refuses_too_few_rows():
    proc = _dry_run("--rows", "8", "--only", "mixed", "--only", "base")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("8 rows of pydoc topics over 4 adapters (r=16, all linear) on smollm2-135m"), first
    assert "32 tokens each, float32; systems: mixed, base; 3 round(s)" in first, first
    refused = _dry_run("--rows", "3")
    assert refused.returncode == 2 and "--rows must be at least 4" in refused.stderr
