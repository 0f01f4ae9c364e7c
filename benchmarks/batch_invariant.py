"""What engine.batch_invariant costs: output tokens/s with it on against off, in one process.

    python -m benchmarks.batch_invariant --prompts 32 --max-tokens 64 --rounds 3

The bundled summarization workload on the real SmolLM2 in bf16, greedy, every output run to
max_tokens (ignore_eos) so both engines produce the same number of tokens. Both engines are built
first with the same batch limits and measured in alternating rounds (who runs first alternates), so
drift on a shared machine hits both alike; the ratio is taken per round, then the median.

Also printed, not asserted: how many outputs each engine keeps when its prompts are chunked under a
64-token budget (the option's purpose; tests/engine/test_batch_invariant.py asserts it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.benchmark.timing import round_order
from batchrun.engine import Engine, EngineConfig, SamplingParams
from benchmarks.workloads import summarize_prompts


def _engine(batch_invariant: bool, args, max_num_batched_tokens: int = 512) -> Engine:
    return Engine(
        EngineConfig(
            model="smollm2-135m",
            dtype="bfloat16",
            cache_dir=args.cache_dir,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=512 << 20,
            batch_invariant=batch_invariant,
            num_threads=args.num_threads,
        )
    )


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(output tok/s of the whole batch, output tokens per CPU second of this process, outputs).

    The CPU-time rate is the steadier one on a shared machine: other processes stretch the wall
    time, not this process's CPU time (with one torch thread no thread spins waiting for another)."""
    engine.reset_prefix_cache()  # every round prefills afresh
    t, c = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / wall, tokens / cpu, [o.token_ids for o in outs]


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-chunked-check", action="store_true", help="skip the 64-token-budget agreement runs")
    ap.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = ap.parse_args(argv)

    engines = {"off": _engine(False, args), "on": _engine(True, args)}
    prompts = summarize_prompts(engines["off"].tokenizer)[: args.prompts]
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens, max_num_seqs {args.max_num_seqs}, bf16")
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    rates: dict[str, list[float]] = {"off": [], "on": [], "off_cpu": [], "on_cpu": []}
    outputs = {}
    for r in range(args.rounds):
        res = {name: _run(engines[name], prompts, args.max_tokens) for name in round_order(list(engines), r)}
        for name, (rate, cpu_rate, outs) in res.items():
            rates[name].append(rate)
            rates[f"{name}_cpu"].append(cpu_rate)
            outputs[name] = outs
        ratios["wall"].append(res["on"][0] / res["off"][0])
        ratios["cpu"].append(res["on"][1] / res["off"][1])
        print(
            f"  round {r}: off {res['off'][0]:.1f}, on {res['on'][0]:.1f} out tok/s (on/off {ratios['wall'][-1]:.3f});"
            f" per CPU second off {res['off'][1]:.1f}, on {res['on'][1]:.1f} (on/off {ratios['cpu'][-1]:.3f})"
        )
    wall, cpu = statistics.median(ratios["wall"]), statistics.median(ratios["cpu"])
    print(f"  on / off: {wall:.3f}x output tok/s, {cpu:.3f}x tokens per CPU second (medians of {args.rounds} rounds)")
    med = {k: statistics.median(v) for k, v in rates.items()}
    rows = [
        ["output tok/s, off / on (medians)", f"{med['off']:.1f} / {med['on']:.1f}"],
        ["on / off, output tok/s (median of per-round ratios)", f"{wall:.3f}x"],
        ["output tokens per CPU second, off / on (medians)", f"{med['off_cpu']:.1f} / {med['on_cpu']:.1f}"],
        ["on / off, tokens per CPU second (median of per-round ratios)", f"{cpu:.3f}x"],
    ]
    if not args.no_chunked_check:
        for name, on in (("off", False), ("on", True)):
            del engines[name]  # one engine at a time in memory
            _, _, chunked = _run(_engine(on, args, max_num_batched_tokens=64), prompts, args.max_tokens)
            same = sum(a == b for a, b in zip(chunked, outputs[name]))
            print(f"  {name}: {same}/{len(prompts)} outputs identical with prompts chunked (budget 64)")
            rows.append([f"{name}: outputs identical, budget 64 against 512", f"{same}/{len(prompts)}"])
    if args.write_docs:
        notes = (
            f"SmolLM2-135M, bf16, {len(prompts)} summarize prompts, greedy, {args.max_tokens} tokens each "
            f"(ignore_eos), max_num_seqs {args.max_num_seqs}, budget 512, {args.rounds} alternating rounds"
            + (f", {args.num_threads} torch thread(s)." if args.num_threads else ".")
        )
        command = script_command("benchmarks.batch_invariant", argv)
        write_section(
            "batch-invariant",
            command,
            stamp(),
            markdown_table(["measurement", "result"], rows),
            notes,
            "Batch-invariant numerics (engine.batch_invariant)",
        )


if __name__ == "__main__":
    main()
