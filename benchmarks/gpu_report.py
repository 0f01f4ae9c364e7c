"""What the GPU check records: the printed table, the JSON document beside it, the versions of what
ran it, and the time budget its phases are planned against.

A library module (no `__main__`): benchmarks.gpu writes through it. The JSON file is rewritten after
every phase, so a run stopped by a time limit still leaves everything it measured so far.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Optional, TypeVar

import torch

T = TypeVar("T")
JSON_NAME = "bench-gpu.json"
NO_CUDA = "n/a (no CUDA)"  # what a GPU-only measurement reads in --smoke


def default_json_path() -> str:
    """$OUT/bench-gpu.json where $OUT is a directory (the device machine's folder that comes back),
    else bench-gpu.json in the working directory."""
    out = os.environ.get("OUT")
    return os.path.join(out if out and os.path.isdir(out) else ".", JSON_NAME)


def json_safe(value: Any) -> Any:
    """`value` as strict JSON data: NaN and infinities become null, tuples and sets lists, dict keys
    strings, anything else unknown its str()."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(json_safe(v) for v in value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:  # numpy/torch scalars
        return json_safe(value.item())
    return str(value)


@dataclass
class Report:
    """The table rows as printed, the JSON document by section, and what failed."""

    json_path: Optional[str] = None
    rows: list[tuple[str, str]] = field(default_factory=list)
    kernel_rows: list[tuple[str, float, float, bool]] = field(default_factory=list)  # (name, max abs, rel, ok)
    data: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # table rows that failed their check

    def add(self, name: str, value: str, ok: bool = True) -> None:
        self.rows.append((name, value))
        if not ok:
            self.failures.append(name)
        print(f"  {name}: {value}", flush=True)

    def model(self, name: str) -> dict[str, Any]:
        """The JSON section of one model's engine measurements."""
        return self.data.setdefault("models", {}).setdefault(name, {})

    def write_json(self) -> None:
        if not self.json_path:
            return
        self.data["table"] = [list(r) for r in self.rows]
        self.data["failures"] = list(self.failures)
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(json_safe(self.data), f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, self.json_path)  # a reader never sees half a file


@dataclass
class Phase:
    name: str
    estimate_s: float  # planned seconds; a phase starts only when this much time is left
    status: str = "planned"  # planned | ran | failed | skipped
    elapsed_s: Optional[float] = None
    note: str = ""


class Budget:
    """A deadline and the phases planned against it: a phase whose estimate no longer fits in the
    time left is skipped (and says so in the table), so the run ends in time and always prints.
    Estimates are rough; each phase's elapsed time goes into the JSON beside its estimate."""

    def __init__(self, budget_s: float, estimates: dict[str, float], start: Optional[float] = None) -> None:
        self.budget_s = budget_s
        self.start = time.perf_counter() if start is None else start
        self.deadline = self.start + budget_s
        self.phases = {name: Phase(name, est) for name, est in estimates.items()}

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    @property
    def planned_s(self) -> float:
        return sum(p.estimate_s for p in self.phases.values())

    def plan_line(self) -> str:
        over = self.planned_s - self.budget_s
        fits = "fits" if over <= 0 else f"does NOT fit (over by ~{over:.0f} s: the last phases will be skipped)"
        planned = f"~{self.planned_s:.0f} s estimated of a {self.budget_s:.0f} s budget"
        return f"plan: {len(self.phases)} phases, {planned}: {fits}"

    def run(self, name: str, fn: Callable[[], T], report: Report) -> Optional[T]:
        """fn() if its estimate fits in the time left; None when skipped or failed (reported either way).
        One failing phase must not hide the others, so its exception is printed and recorded."""
        phase = self.phases[name]
        left = self.left()
        if left < phase.estimate_s:
            phase.status = "skipped"
            phase.note = f"out of time: needs ~{phase.estimate_s:.0f} s, {max(left, 0):.0f} s left"
            report.add(name, f"skipped ({phase.note})")
            self._record(report)
            return None
        print(f"\n== {name} (~{phase.estimate_s:.0f} s planned, {left:.0f} s left) ==", flush=True)
        t = time.perf_counter()
        try:
            out = fn()
            phase.status = "ran"
            return out
        except Exception as exc:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            phase.status, phase.note = "failed", repr(exc)
            report.add(name, f"FAILED: {exc!r}", ok=False)
            return None
        finally:
            phase.elapsed_s = time.perf_counter() - t
            self._record(report)

    def _record(self, report: Report) -> None:
        report.data["budget"] = {
            "budget_s": self.budget_s,
            "planned_s": self.planned_s,
            "elapsed_s": time.perf_counter() - self.start,
            "phases": [asdict(p) for p in self.phases.values()],
        }
        report.write_json()


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> Optional[str]:
    """The NVIDIA driver's version from nvidia-smi (torch reports only the CUDA API it supports)."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def versions(device: torch.device) -> dict[str, Any]:
    """What ran the check: library versions, CUDA and the driver, the device."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "transformers": _dist_version("transformers"),
        "numpy": _dist_version("numpy"),
        "cuda": torch.version.cuda,
        "driver": None,
        "device": str(device),
        "device_name": f"{os.cpu_count()} CPU cores ({platform.machine()})",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            driver=_nvidia_driver(),
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            total_memory_bytes=props.total_memory,
            num_sms=props.multi_processor_count,
        )
    return info
