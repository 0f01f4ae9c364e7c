"""MoE expert dispatch on the CPU: grouped (tokens sorted by expert, one matmul per expert) against
a per-token loop and against running every expert on every token, in float32.

    python -m benchmarks.moe [--tokens 256] [--hidden 256] [--inter 512] [--experts 8] [--top-k 2]

Prints the best of --repeats timings of each, and the largest difference from the per-token loop.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.kernels.moe import fused_experts
from batchrun.model.moe import route
from benchmarks.cases import moe_per_token


def every_expert(x, gate_up, down, weights, ids):
    """Each expert on all tokens, then weighted by a dense (tokens, experts) routing matrix."""
    dense = torch.zeros(x.shape[0], gate_up.shape[0]).scatter_add_(1, ids, weights.float())
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        g, u = (x @ gate_up[e].T).chunk(2, dim=-1)
        out += dense[:, e : e + 1] * ((F.silu(g) * u) @ down[e].T)
    return out


def _best(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (
        ("tokens", 256),
        ("hidden", 256),
        ("inter", 512),
        ("experts", 8),
        ("top-k", 2),
        ("repeats", 5),
        ("threads", 0),
    ):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    gate_up = torch.randn(args.experts, 2 * args.inter, args.hidden, generator=gen) * 0.05
    down = torch.randn(args.experts, args.hidden, args.inter, generator=gen) * 0.05
    weights, ids = route(
        torch.randn(args.tokens, args.experts, generator=gen), args.top_k, renormalize=True, weights_fp32=True
    )
    want = moe_per_token(x, gate_up, down, weights, ids)
    runs = {
        "grouped": lambda: fused_experts(x, gate_up, down, weights, ids, F.silu),
        "per-token loop": lambda: moe_per_token(x, gate_up, down, weights, ids),
        "every expert on every token": lambda: every_expert(x, gate_up, down, weights, ids),
    }
    setting = (
        f"{args.tokens} tokens, hidden {args.hidden}, expert width {args.inter}, {args.experts} experts "
        f"top-{args.top_k}, float32, {torch.get_num_threads()} threads, best of {args.repeats}"
    )
    print(setting)
    base = None
    rows = []
    for name, fn in runs.items():
        s = _best(fn, args.repeats)
        base = base or s
        diff = (fn() - want).abs().max().item()
        print(f"  {name:28s} {s * 1e3:8.2f} ms  ({s / base:5.2f}x grouped's time, max |diff| {diff:.1e})")
        rows.append([name, f"{s * 1e3:.2f}", f"{s / base:.2f}x", f"{diff:.1e}"])
    if args.write_docs:
        table = markdown_table(["dispatch", "ms (best)", "x grouped's time", "max |diff| from the loop"], rows)
        title = "MoE expert dispatch (CPU)"
        write_section("moe", script_command("benchmarks.moe", argv), stamp(), table, setting + ".", title)


if __name__ == "__main__":
    main()
