"""Sampling benchmark: what temperature, top-p and top-k cost against greedy decoding, one process.

    python -m benchmarks.sampling                  # engine workload, then the sampler alone
    python -m benchmarks.sampling --only engine --rounds 3
    python -m benchmarks.sampling --only samples   # n=4 samples per prompt against n=1

Engine: the bundled summarization workload (32 CPython doc topics through the summarize prompt,
64 tokens each, ignore_eos so every configuration produces the same number of tokens) on one
engine (SmolLM2-135M, bf16 on CPU), output tokens per wall second and per CPU second of the
process, and the share of wall time spent in the sampler, for greedy, temperature 0.7, + top_p
0.9, + top_k 50. Each round runs every configuration once, back to back; the ratio to greedy is
taken within a round, then the median over rounds.

Samples (--only samples): the same workload at temperature 0.8, n=1 against n=4 samples per
prompt (SamplingParams.n: one shared prefill, four decodes), wall and CPU seconds per pass and
their ratio within each round; the target is n=4 at most 2.5x the time of n=1.

Sampler alone: (rows, vocab) random logits in float32 and bfloat16, the batched sampler against
a per-row reference that sorts the vocabulary for top-p (kept here only for this comparison).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Optional, TypedDict

import torch

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.benchmark.timing import median_ratio, patched, round_order
from batchrun.engine import Engine, SamplingParams
from batchrun.engine.sampler import Sampler
from batchrun.kernels.sampling import cpu_race
from benchmarks.quality import make_engine
from benchmarks.workloads import summarize_prompts


class _Knobs(TypedDict, total=False):
    """The SamplingParams fields a configuration sets."""

    temperature: float
    top_p: float
    top_k: int


CONFIGS: dict[str, _Knobs] = {
    "greedy": dict(temperature=0.0),
    "temp0.7": dict(temperature=0.7),
    "temp0.7+top_p0.9": dict(temperature=0.7, top_p=0.9),
    "temp0.7+top_p0.9+top_k50": dict(temperature=0.7, top_p=0.9, top_k=50),
}


def _timed(inner: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """`inner`, adding the seconds spent in it up in the cell `spent`."""

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    return timed


def _measure(engine: Engine, prompts: list[list[int]], params: SamplingParams, spent: list[float]) -> dict:
    """Output tokens per wall second and per CPU second of this process (on a shared machine the
    second moves less with other jobs' load), and the share of wall time spent in the sampler."""
    engine.reset_prefix_cache()  # every run prefills afresh
    t, c, s = time.perf_counter(), time.process_time(), spent[0]
    outs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    n = sum(len(o.token_ids) for o in outs)
    return {"wall": n / wall, "cpu": n / cpu, "sampler": (spent[0] - s) / wall}


def run_engine(rounds: int, max_tokens: int, cache_dir: Optional[str], threads: Optional[int]) -> dict:
    engine = make_engine("none", "bfloat16", cache_dir=cache_dir, threads=threads)
    spent = [0.0]  # seconds in the sampler, summed
    prompts = summarize_prompts(engine.tokenizer)
    params = {name: SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw) for name, kw in CONFIGS.items()}
    results: dict[str, list[dict]] = {name: [] for name in params}
    with patched(engine.sampler, "sample", _timed(engine.sampler.sample, spent)):
        engine.generate(prompts[:2], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4))  # warm-up
        print(f"engine: {len(prompts)} prompts, {max_tokens} tokens, threads={torch.get_num_threads()}")
        for r in range(rounds):
            for name, p in params.items():
                results[name].append(_measure(engine, prompts, p, spent))
            print(
                f"  round {r + 1}/{rounds} (wall tok/s / CPU tok/s / sampler share): "
                + ", ".join(
                    f"{n} {v[-1]['wall']:.1f} / {v[-1]['cpu']:.1f} / {v[-1]['sampler']:.1%}" for n, v in results.items()
                ),
                flush=True,
            )
    print(f"  median of {rounds} rounds; x: median per-round ratio to greedy")
    table = {}
    for name, vals in results.items():
        row = {
            clock: {
                "tok_s": statistics.median(v[clock] for v in vals),
                "vs_greedy": median_ratio([v[clock] for v in vals], [g[clock] for g in results["greedy"]]),
            }
            for clock in ("wall", "cpu")
        }
        row["sampler_share"] = statistics.median(v["sampler"] for v in vals)
        table[name] = row
        print(
            f"  {name:<26} wall {row['wall']['tok_s']:>7.1f} tok/s ({row['wall']['vs_greedy']:.2f}x)"
            f"  CPU {row['cpu']['tok_s']:>7.1f} tok/s ({row['cpu']['vs_greedy']:.2f}x)"
            f"  in sampler {row['sampler_share']:.1%} of wall time"
        )
    return table


def run_samples(rounds: int, max_tokens: int, n: int, cache_dir: Optional[str], threads: Optional[int]) -> dict:
    """Seconds per pass for n=1 and n samples per prompt, and the median per-round ratio."""
    engine = make_engine("none", "bfloat16", cache_dir=cache_dir, threads=threads)
    prompts = summarize_prompts(engine.tokenizer)
    params = {k: SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True, seed=0, n=k) for k in (1, n)}
    engine.generate(prompts[:2], params[n])  # warm-up
    print(f"samples: {len(prompts)} prompts, {max_tokens} tokens, n=1 vs n={n}, threads={torch.get_num_threads()}")
    times: dict[int, list[dict]] = {k: [] for k in params}
    for r in range(rounds):
        for k in round_order(list(params), r):
            engine.reset_prefix_cache()  # every pass prefills afresh: only the n samples share
            before = engine.stats()
            t, c = time.perf_counter(), time.process_time()
            outs = engine.generate(prompts, params[k])
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            after = engine.stats()
            assert len(outs) == k * len(prompts) and all(len(o.token_ids) == max_tokens for o in outs)
            times[k].append({"wall": wall, "cpu": cpu, "cached": after.num_cached_tokens - before.num_cached_tokens})
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"n={k} {v[-1]['wall']:.1f}s wall / {v[-1]['cpu']:.1f}s CPU" for k, v in times.items()),
            flush=True,
        )
    table: dict[str, Any] = {
        clock: {
            "n1_s": statistics.median(v[clock] for v in times[1]),
            "n_s": statistics.median(v[clock] for v in times[n]),
            "ratio": median_ratio([v[clock] for v in times[n]], [v[clock] for v in times[1]]),
        }
        for clock in ("wall", "cpu")
    }
    table["shared_tokens"] = times[n][-1]["cached"]
    table["prompt_tokens"] = sum(map(len, prompts))
    print(
        f"  n={n} vs n=1: {table['wall']['ratio']:.2f}x wall, {table['cpu']['ratio']:.2f}x CPU time "
        f"(median of per-round ratios); {table['shared_tokens']} of {n * table['prompt_tokens']} "
        "prompt tokens shared, not recomputed"
    )
    return table


def _reference_sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One row at a time: temperature, top-k by torch.topk, top-p by sorting the whole vocabulary."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.is_greedy:
            continue
        x = logits[row].float() / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            drop = torch.ones_like(x, dtype=torch.bool).scatter(-1, torch.topk(x, p.top_k).indices, False)
            x = x.masked_fill(drop, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = torch.sort(x, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            drop = torch.zeros_like(x, dtype=torch.bool).scatter(-1, order, torch.cumsum(probs, -1) - probs >= p.top_p)
            x = x.masked_fill(drop, float("-inf"))
        tokens[row] = int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=gen))
    return tokens


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def run_sampler(rows: int, vocab: int, reps: int) -> dict:
    print(f"sampler alone: ({rows}, {vocab}) logits, ms per call (mean of {reps})")
    sampler = Sampler(race=cpu_race())
    table = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
        for name, kw in CONFIGS.items():
            params = [SamplingParams(**kw)] * rows
            seeds, positions = list(range(rows)), [0] * rows
            gens = [torch.Generator().manual_seed(i) for i in range(rows)]
            new = _time(partial(sampler.sample, logits, params, seeds, positions), reps)
            old = _time(partial(_reference_sample, logits, params, gens), reps)
            table[f"{name}/{str(dtype).removeprefix('torch.')}"] = {"batched_ms": new * 1e3, "per_row_ms": old * 1e3}
            print(f"  {str(dtype):<15} {name:<26} batched {new * 1e3:>8.2f}  per-row sort {old * 1e3:>8.2f}")
    return table


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("engine", "sampler", "samples"), default=None)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt for --only samples")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[list[str]] = []
    if args.only == "samples":
        table = run_samples(args.rounds, args.max_tokens, args.n, args.cache_dir, args.threads)
        rows = [
            [
                f"n={args.n} samples per prompt vs n=1, time",
                f"{table['wall']['ratio']:.2f}x wall ({table['wall']['n_s']:.1f} s vs {table['wall']['n1_s']:.1f} s), "
                f"{table['cpu']['ratio']:.2f}x CPU time",
            ],
            [
                "prompt tokens shared by the samples (not recomputed)",
                f"{table['shared_tokens']} of {args.n * table['prompt_tokens']}",
            ],
        ]
        if args.write_docs:
            notes = (
                f"Summarize workload, temperature 0.8, {args.max_tokens} tokens with ignore_eos, bf16; "
                f"{args.rounds} alternating rounds, median of per-round ratios in the same process."
            )
            command = script_command("benchmarks.sampling", argv)
            table_md = markdown_table(["measurement", "result"], rows)
            write_section("sampling_n", command, stamp(), table_md, notes, "Several samples per prompt")
        return
    if args.only != "sampler":
        for name, row in run_engine(args.rounds, args.max_tokens, args.cache_dir, args.threads).items():
            rows.append(
                [
                    f"{name}, output tok/s vs greedy",
                    f"{row['wall']['vs_greedy']:.2f}x wall ({row['cpu']['vs_greedy']:.2f}x per CPU second), "
                    f"{row['sampler_share']:.1%} of wall time in the sampler",
                ]
            )
    if args.only != "engine":
        for name, row in run_sampler(args.rows, args.vocab, args.reps).items():
            rows.append(
                [
                    f"sampler alone ({args.rows}, {args.vocab}) {name}",
                    f"{row['batched_ms']:.1f} ms batched vs {row['per_row_ms']:.1f} ms per-row sort",
                ]
            )
    if args.write_docs:
        notes = (
            f"Summarize workload, {args.max_tokens} tokens with ignore_eos, bf16; {args.rounds} alternating rounds, "
            "median of per-round ratios to greedy in the same process."
        )
        command = script_command("benchmarks.sampling", argv)
        write_section("sampling", command, stamp(), markdown_table(["measurement", "result"], rows), notes, "Sampling")


if __name__ == "__main__":
    main()
