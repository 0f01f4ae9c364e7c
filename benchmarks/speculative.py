"""Speculative decoding benchmark on the bundled summarization workload (greedy, real model).

    python -m benchmarks.speculative --prompts 8 --rounds 2

Batch 1 (max_num_seqs=1): decode tokens/s (output tokens / time after the first token) with
speculation off, n-gram (always on, and adaptive) and self, and their acceptance rates.
`--workload copy` asks the model to repeat each text word for word (where n-gram lookup finds
drafts) instead of summarizing it. Full batch: output tokens/s of the
whole workload, off against the adaptive policy (ngram). Engines are built first and measured in
alternating rounds, so drift on a shared machine hits every configuration alike; ratios are
per round, then averaged.

Greedy outputs are compared with speculation off and the agreement is printed, not asserted: the
engines run in bfloat16 (dtype auto), where verifying k+1 tokens in one forward rounds differently
from k+1 single-token decode steps (other matmul shapes, the chunk attention path), so a near-tie
can flip an argmax and the texts part from there on. In float32 the outputs are token-identical
(tests/engine/test_speculative.py, on tiny models and the real one).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.benchmark.timing import round_order
from batchrun.engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from benchmarks.workloads import copy_prompts, summarize_prompts


def _engine(
    method: str,
    max_num_seqs: Optional[int],
    cache_dir: Optional[str],
    adaptive: bool = True,
    self_layers: Optional[int] = None,
) -> Engine:
    return Engine(
        EngineConfig(
            model="smollm2-135m",
            dtype="auto",
            cache_dir=cache_dir,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=1024,
            kv_cache_memory=512 << 20,
            speculative=SpeculativeConfig(method=method, adaptive=adaptive, self_layers=self_layers),
        )
    )


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]], dict]:
    """(decode tok/s per request, whole-workload output tok/s, outputs, spec stats)."""
    engine.reset_prefix_cache()  # every round prefills afresh, as the first did
    before = engine.stats()
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    wall = time.perf_counter() - t
    decode = [
        (len(o.token_ids) - 1) / (o.metrics.latency_s - o.metrics.ttft_s)
        for o in outs
        if len(o.token_ids) > 1 and o.metrics.latency_s is not None and o.metrics.ttft_s is not None
    ]
    after = engine.stats()
    spec = {}
    if (
        after.num_spec_proposed is not None
        and after.num_spec_accepted is not None
        and before.num_spec_proposed is not None
        and before.num_spec_accepted is not None
    ):
        proposed = after.num_spec_proposed - before.num_spec_proposed
        accepted = after.num_spec_accepted - before.num_spec_accepted
        spec = {
            "proposed": proposed,
            "accepted": accepted,
            "acceptance": accepted / proposed if proposed else None,
            "steps_on": after.num_spec_steps,
            "switches": after.num_spec_switches,
            "probes": after.num_spec_probes,
            "step_s": after.spec_step_s,  # what the adaptive policy measured: "kind/width" -> s
        }
    return statistics.mean(decode), sum(len(o.token_ids) for o in outs) / wall, [o.token_ids for o in outs], spec


def _agreement(got: list[list[int]], want: list[list[int]]) -> str:
    """'k/n identical' plus the mean share of each output that matches before the first difference."""
    same = sum(g == w for g, w in zip(got, want))
    prefix = []
    for g, w in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        prefix.append(n / max(len(w), 1))
    return f"{same}/{len(want)} identical, {100 * statistics.mean(prefix):.0f}% of tokens before the first difference"


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="batch-1 prompts (full batch uses all 32)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--self-layers", type=int, default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--only", choices=("batch1", "full"), default=None)
    ap.add_argument("--workload", choices=("summarize", "copy"), default="summarize")
    ap.add_argument("--no-self", action="store_true", help="batch 1: skip self-speculation (slow on small models)")
    ap.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = ap.parse_args(argv)

    rows: list[list[str]] = []
    if args.only != "full":
        rows += _batch_one(args)
    if args.only != "batch1":
        rows += _full_batch(args)
    if args.write_docs:
        table = markdown_table(["measurement", "result"], rows)
        notes = (
            f"{args.workload.capitalize()} workload, greedy, {args.max_tokens} tokens, {args.rounds} alternating "
            f"rounds; batch 1 on the first {args.prompts} prompts. Ratios are the mean of per-round ratios to "
            "speculation off."
        )
        command = script_command("benchmarks.speculative", argv)
        name = "speculative" if args.workload == "summarize" else f"speculative-{args.workload}"
        write_section(name, command, stamp(), table, notes, f"Speculative decoding ({args.workload})")


def _prompts(args, tokenizer) -> list[list[int]]:
    return copy_prompts(tokenizer) if args.workload == "copy" else summarize_prompts(tokenizer)


def _batch_one(args) -> list[list[str]]:
    """Batch 1: each method's decode tok/s over speculation off's; the docs' rows."""
    single = {
        "off": _engine("none", 1, args.cache_dir),
        "ngram": _engine("ngram", 1, args.cache_dir, adaptive=False),
        "ngram_adaptive": _engine("ngram", 1, args.cache_dir),
    }
    if not args.no_self:
        single["self"] = _engine("self", 1, args.cache_dir, adaptive=False, self_layers=args.self_layers)
    methods = [m for m in ("ngram", "ngram_adaptive", "self") if m in single]
    prompts = _prompts(args, single["off"].tokenizer)
    few = prompts[: args.prompts]
    print(f"batch 1: {len(few)} prompts, {args.max_tokens} tokens, rounds {args.rounds}")
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(args.rounds):
        res = {name: _run(e, few, args.max_tokens) for name, e in single.items()}
        for name in methods:
            ratios[name].append(res[name][0] / res["off"][0])
        print(f"  round {r}: " + ", ".join(f"{n} {v[0]:.1f} decode tok/s {v[3] or ''}" for n, v in res.items()))
        print(
            "    bf16 agreement with off: "
            + ", ".join(f"{name} {_agreement(res[name][2], res['off'][2])}" for name in methods)
        )
    rows = []
    for method, vals in ratios.items():
        print(f"  {method} / off decode tok/s at batch 1: {statistics.mean(vals):.2f}x")
        acceptance = res[method][3].get("acceptance")
        accepted = "" if acceptance is None else f", {100 * acceptance:.0f}% of drafts accepted (last round)"
        rows.append([f"{method} / off, decode tok/s at batch 1", f"{statistics.mean(vals):.2f}x{accepted}"])
    return rows


def _full_batch(args) -> list[list[str]]:
    """Full batch: the adaptive policy's output tok/s over speculation off's; the docs' rows."""
    off = _engine("none", None, args.cache_dir)
    # the same batch limit for both (each engine's start-up profile alone could pick another)
    full = {"off": off, "adaptive": _engine("ngram", off.max_num_seqs, args.cache_dir)}
    prompts = _prompts(args, off.tokenizer)
    print(f"full batch: {len(prompts)} prompts, max_num_seqs {off.max_num_seqs} for both")
    full_ratios = []
    for r in range(args.rounds):
        # who runs first alternates
        res = {name: _run(full[name], prompts, args.max_tokens) for name in round_order(list(full), r)}
        full_ratios.append(res["adaptive"][1] / res["off"][1])
        print(f"  round {r}: " + ", ".join(f"{n} {v[1]:.1f} out tok/s {v[3] or ''}" for n, v in res.items()))
        print(f"    bf16 agreement with off: {_agreement(res['adaptive'][2], res['off'][2])}")
    print(f"  adaptive ngram / off at full batch: {statistics.mean(full_ratios):.3f}x")
    return [["adaptive ngram / off, output tok/s at full batch", f"{statistics.mean(full_ratios):.3f}x"]]


if __name__ == "__main__":
    main()
