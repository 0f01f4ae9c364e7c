"""docs/benchmarks.md is regenerated, not hand-kept: each benchmark given `--write-docs` (job=benchmark:
`benchmark.write_docs=true`) replaces its own marked section with what it just measured,

    <!-- bench:NAME -->
    2026-12-03, commit cb59fff, 2 CPU cores: `python -m benchmarks.quant`

    | mode | ... |
    <!-- /bench:NAME -->

and leaves the rest of the file (headings, prose, other sections) as it is. A section not yet in the
file is appended under a heading of its own.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

# The repository's page; a wheel has no docs/, so write_section then fails naming the path.
DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def write_section(
    name: str,
    command: str,
    date: str,
    table: str,
    notes: str = "",
    title: Optional[str] = None,
    path: Optional[os.PathLike | str] = None,
) -> Path:
    """Replace the `<!-- bench:name -->` ... `<!-- /bench:name -->` section of `path` with `date`,
    `command`, the markdown `table` and `notes`; append it (under `## title`, default the name) when
    the file has no such section. `path` defaults to the repository's docs/benchmarks.md. Returns the
    path written."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"section name {name!r}: letters, digits, '_', '.' and '-' only")
    path = Path(DOCS_PATH if path is None else path)
    text = path.read_text()
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    parts = [f"{date}: `{command}`", table.strip(), notes.strip()]
    section = start + "\n" + "\n\n".join(p for p in parts if p) + "\n" + end
    counts = text.count(start), text.count(end)
    if counts == (0, 0):
        text = text.rstrip("\n") + f"\n\n## {title or name}\n\n{section}\n"
    elif counts == (1, 1) and text.index(start) < text.index(end):
        head, rest = text.split(start)
        text = head + section + rest.split(end, 1)[1]
    else:
        raise ValueError(f"{path}: expected one {start} before one {end}, found {counts[0]} and {counts[1]}")
    path.write_text(text)
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; cells are str()-ed and '|' in them escaped."""

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(r) for r in rows)])


def stamp(machine: Optional[str] = None) -> str:
    """Today's UTC date, the commit measured (marked when files other than the benchmarks page differ
    from it) and the machine: the `date` of write_section."""
    parts = [datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")]
    commit = _git("rev-parse", "--short", "HEAD")
    if commit:
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/benchmarks.md")
        parts.append(f"commit {commit}" + (" plus local changes" if dirty else ""))
    parts.append(machine or f"{os.cpu_count()} CPU cores")
    return ", ".join(parts)


WRITE_DOCS_HELP = "also replace this benchmark's section of docs/benchmarks.md with what it measured"


def script_command(module: str, argv: Optional[Sequence[str]]) -> str:
    """`python -m module` with the script's arguments (sys.argv's when `argv` is None), less --write-docs."""
    return command_line(f"python -m {module}", sys.argv[1:] if argv is None else argv)


def command_line(prefix: str, argv: Sequence[str], drop: Sequence[str] = ("--write-docs",)) -> str:
    """The command that reproduces a run: `prefix` and its arguments, less those that only write docs."""
    kept = [a for a in argv if a not in drop and a.split("=", 1)[0] not in drop]
    return " ".join([prefix, *(shlex.quote(a) for a in kept)])


def _git(*args: str) -> str:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=DOCS_PATH.parents[1], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""
