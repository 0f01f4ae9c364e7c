"""The embeddings benchmark (`python -m benchmarks.embeddings`) parses its arguments and picks its
texts: its `--dry-run`, in a fresh process (tests never import a benchmark script). Nothing is
loaded or timed here; the benchmark itself needs the real all-MiniLM-L6-v2 and minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import REPO


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.embeddings", "--dry-run", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_dry_run_names_the_texts_and_systems_and_refuses_zero_texts():
    proc = _dry_run("--quick", "--only", "batchrun")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    # --quick: 200 paragraphs of the pydoc topics; the baseline always runs beside what --only names
    assert first.startswith("200 texts from pydoc_data.topics"), first
    assert "systems: st fp32, batchrun; 1 round(s)" in first, first
    refused = _dry_run("--texts", "0")
    assert refused.returncode == 2 and "--texts and --rounds must be at least 1" in refused.stderr
