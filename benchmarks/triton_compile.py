"""Compile every Triton kernel variant a run uses for a CUDA GPU, on any machine (no GPU needed).

    python -m benchmarks.triton_compile [--arch 90] [--arch 80] [--fast] [--only SUBSTRING]

Drives every launcher through the cases of benchmarks/compile_cases.py (all of them; --fast: the test's
set) inside kernels/triton_aot.py's `compile_only(arch)`, and prints one row per compiled variant:
the kernel, the case that first launched it and its boolean constexprs that are on, whether it
compiled and loads within the GPU's limits, registers per thread, local memory per thread (spills
and stack: 0 unless registers ran out), shared memory per block, warps and pipeline stages. Below
sm_89 the dispatches refuse float8 caches, so those cases take the CPU path and compile nothing.
Exits 1 when any variant fails. Compile time is mostly ptxas: the first run for an architecture
takes minutes on two cores; Triton's on-disk cache makes a rerun quick.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Optional

from batchrun.kernels.triton_aot import ARCHS, CompiledVariant, triton_supported
from benchmarks.compile_cases import compile_cases, launch_cases


def _flags(v: CompiledVariant) -> str:
    return " ".join(name for name, value in v.constexprs.items() if value is True)


def _row(v: CompiledVariant) -> list[str]:
    def num(x: Optional[int]) -> str:
        return "?" if x is None else str(x)

    return [
        v.name,
        v.label + (f" [{_flags(v)}]" if _flags(v) else ""),
        f"sm_{v.arch}",
        "ok" if v.ok else "FAIL",
        num(v.n_regs),
        num(v.n_spills),
        num(v.shared),
        f"{v.num_warps}/{v.num_stages}",
    ]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--arch", type=int, action="append", help=f"compute capability, e.g. 90 (known: {sorted(ARCHS)})"
    )
    parser.add_argument("--fast", action="store_true", help="only the test's cases")
    parser.add_argument("--only", help="only cases whose name contains this")
    args = parser.parse_args(argv)
    why = triton_supported()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    cases = [c for c in launch_cases(full=not args.fast) if args.only is None or args.only in c.name]
    header = ["kernel", "variant (first case) [flags]", "arch", "ok", "regs", "local B", "shared B", "warps/stages"]
    failed = False
    for arch in args.arch or [90]:
        t = time.perf_counter()
        compile_log = compile_cases(arch, cases)
        rows = [_row(v) for v in compile_log.variants]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        print(f"\n== sm_{arch}: {len(cases)} cases, {len(rows)} variants, {time.perf_counter() - t:.0f}s ==")
        for r in [header, *rows]:
            print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        for v in compile_log.failures:
            print(f"FAIL {v.name} sm_{v.arch} ({v.label}): {v.error}")
        failed |= bool(compile_log.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
