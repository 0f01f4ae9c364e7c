"""The layer arrows of DESIGN.md hold: import-linter's contracts, plus what it cannot express."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

PACKAGE = REPO / "batchrun"


def _imports(path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """(module, line) of every import in a file, relative imports resolved against its package."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            # `from batchrun.engine import engine` reaches a submodule too.
            if module == "batchrun.engine":
                found += [
                    (f"{module}.{a.name}", node.lineno)
                    for a in node.names
                    if (PACKAGE / "engine" / f"{a.name}.py").exists() or (PACKAGE / "engine" / a.name).is_dir()
                ]
    return found


def test_import_linter_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    # --no-cache: its cache can miss edits and report contracts for code that is no longer there.
    proc = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_job_layer_uses_only_the_engines_public_package():
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in sorted((PACKAGE / "job").rglob("*.py"))
        for module, line in _imports(path)
        if module.startswith("batchrun.engine.")
    ]
    assert offenders == []


def test_only_the_cli_imports_hydra_or_omegaconf():
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "cli.py"
        for module, line in _imports(path)
        if module.split(".")[0] in ("hydra", "omegaconf")
    ]
    assert offenders == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from batchrun.engine import Engine\n", []),
        ("from batchrun.engine.engine import Engine\n", ["batchrun.engine.engine"]),
        ("import batchrun.engine.scheduler\n", ["batchrun.engine.scheduler"]),
        ("from batchrun.engine import scheduler\n", ["batchrun.engine.scheduler"]),
        ("from ..engine import outputs\n", ["batchrun.engine.outputs"]),
    ],
)
def test_the_ast_check_itself_catches_submodule_imports(source, expected):
    probe = PACKAGE / "job" / "probe.py"  # never written: the source is passed in
    assert [m for m, _ in _imports(probe, source) if m.startswith("batchrun.engine.")] == expected


def test_tests_import_no_benchmark_script():
    """Case builders and metrics that tests share with benchmarks live in benchmarks/' library modules
    (cases.py, quality.py, workloads.py, ...), not in a script run with `python -m`."""
    scripts = {
        f"benchmarks.{path.stem}"
        for path in (REPO / "benchmarks").glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    }
    assert {"benchmarks.gpu", "benchmarks.quant"} <= scripts
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} imports {m}" for m in modules if m in scripts]
    assert offenders == []
