"""The README stays a user's page and true to CI; the repository stands on its own."""

from __future__ import annotations

import re
import subprocess

from tests.support import REPO


def test_readme_is_short_and_its_test_command_is_the_one_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    ci = (REPO / ".ci" / "run").read_text()
    pytest_line = next(line for line in ci.splitlines() if line.startswith("python -m pytest"))
    assert pytest_line in readme
    assert "pip install torch==2.13.0" in ci and "pip install torch==2.13.0" in readme


def test_relative_links_in_docs_point_at_files():
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_nothing_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    offenders = [
        p
        for p in tracked
        if p.endswith((".py", ".md", ".yaml", ".toml", ".sh", ".ipynb", ".sbatch"))
        and "../shared" in (REPO / p).read_text(errors="replace")
        and p != "tests/test_docs.py"
    ]
    assert offenders == []
