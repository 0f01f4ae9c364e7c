"""Quantization benchmark: quality against the unquantized model, weight bytes and speed, one process.

    python -m benchmarks.quant                    # everything (several minutes on 2 cores)
    python -m benchmarks.quant --only quality     # teacher-forced agreement and perplexity
    python -m benchmarks.quant --only speed --threads 1 --rounds 3

Quality is teacher-forced over real text (CPython's pydoc topics): every position's top-1 next
token and the log-probability of the actual next token, through the engine's own model and paged
KV cache, against an unquantized engine of the same compute dtype. The text runs in two steps per
sequence (its first token, then the rest) so every attention read goes through the KV cache, which
is what an int8/fp8 KV cache changes.

Speed: all engines are built first and then measured in rounds in this process, each workload run
on every engine back to back (the machine's other load drifts; adjacent runs keep the ratios fair),
and the ratio to bf16 is taken per round, then the median over rounds. Decode tokens/s at batch 1, 16
and 64 is batch size / mean inter-token latency; the
summarization workload is the bundled sample shards (32 CPython doc topics) through the summarize
job's prompt (chat template, greedy, 64 tokens), output tokens / wall seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Optional

import torch

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.benchmark.timing import median_ratio
from batchrun.engine import Engine, SamplingParams
from batchrun.testing import sample_texts
from benchmarks.quality import agreement, engine_teacher_forced, make_engine, quality_sequences
from benchmarks.workloads import chat_ids, summarize_prompts, summarize_tokens_per_s

GREEDY_PROMPTS = (
    "The capital of France is",
    "Write a Python function that returns the factorial of n.",
    "Explain in one paragraph what a hash table is.",
)


def greedy(engine: Engine, prompts=GREEDY_PROMPTS, max_tokens: int = 40) -> list[str]:
    chats = [chat_ids(engine.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    return [o.text for o in engine.generate(chats, SamplingParams(temperature=0.0, max_tokens=max_tokens))]


def decode_tokens_per_s(engine: Engine, batch_size: int, prompt_tokens: int = 64, max_tokens: int = 24) -> float:
    """batch_size / mean inter-token latency, all requests decoding side by side."""
    texts = sample_texts()
    prompts = [engine.tokenizer.encode(texts[i % len(texts)])[:prompt_tokens] for i in range(batch_size)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    itl = statistics.mean(o.metrics.itl_s for o in outs if o.metrics.itl_s is not None)
    return batch_size / itl


# ---------------------------------------------------------------------------------------------


def _split_kv(mode: str) -> tuple[str, str]:
    """A mode spec -> (weight quantization, KV cache dtype): "kv-int8" is an int8 cache on float
    weights, "w4a8+kv-int8" both."""
    if mode.startswith("kv-"):
        return "none", mode[3:]
    quant, _, kv = mode.partition("+kv-")
    return quant, kv or "auto"


def run_quality(modes: list[str], dtype: str, cache_dir: Optional[str], threads: Optional[int]) -> dict:
    base = make_engine("none", dtype, cache_dir=cache_dir, threads=threads)
    seqs = quality_sequences(base.tokenizer)
    ref = engine_teacher_forced(base, seqs)
    rows: dict[str, dict[str, Any]] = {
        "none": {"ppl": ref.perplexity, "agree": 1.0, "weight_bytes": base.settings.weight_bytes}
    }
    outputs = {"none": greedy(base)}
    del base
    for mode in modes:
        quant, kv = _split_kv(mode)
        e = make_engine(quant, dtype, kv_cache_dtype=kv, cache_dir=cache_dir, threads=threads)
        tf = engine_teacher_forced(e, seqs)
        rows[mode] = {
            "ppl": tf.perplexity,
            "agree": agreement(ref, tf),
            "weight_bytes": e.settings.weight_bytes,
            "formats": dict(e.settings.quant_formats),
        }
        outputs[mode] = greedy(e)
        del e
    base_ppl = rows["none"]["ppl"]
    print(f"\nquality: {len(seqs)} x {len(seqs[0])} tokens teacher-forced, compute dtype {dtype}")
    print(f"{'mode':<10} {'top1 agree':>10} {'ppl':>8} {'ppl +%':>7} {'weight MB':>10}")
    for mode, r in rows.items():
        print(
            f"{mode:<10} {100 * r['agree']:>9.2f}% {r['ppl']:>8.3f} {100 * (r['ppl'] / base_ppl - 1):>6.2f}% "
            f"{r['weight_bytes'] / 1e6:>10.1f}"
        )
    print("\ngreedy, chat template, 40 tokens:")
    for i, p in enumerate(GREEDY_PROMPTS):
        print(f"\n### {p}")
        for mode, texts in outputs.items():
            print(f"  [{mode}] {texts[i]!r}")
    return {"rows": rows, "greedy": outputs}


def run_speed(
    modes: list[str],
    cache_dir: Optional[str],
    threads: Optional[int],
    rounds: int,
    batch_sizes: tuple[int, ...],
    summarize: bool,
    summarize_docs: int = 32,
) -> dict:
    engines = {}
    for mode in modes:
        dtype = mode if mode in ("float32", "bfloat16") else "bfloat16"
        quant, kv = ("none", "auto") if mode == dtype else _split_kv(mode)
        engines[mode] = make_engine(quant, dtype, kv_cache_dtype=kv, cache_dir=cache_dir, threads=threads)
    prompts = summarize_prompts(next(iter(engines.values())).tokenizer)[:summarize_docs] if summarize else []
    for e in engines.values():  # warm-up: first calls pay one-off setup
        decode_tokens_per_s(e, 2, max_tokens=4)
    results: dict[str, dict[str, list[float]]] = {m: {} for m in engines}
    for r in range(rounds):
        # Engines innermost: the measurements a ratio compares run back to back, so drift in the
        # machine's other load (other jobs on a shared box) hits both sides alike.
        for b in batch_sizes:
            for mode, e in engines.items():
                results[mode].setdefault(f"decode@{b}", []).append(decode_tokens_per_s(e, b))
        if summarize:
            for mode, e in engines.items():
                results[mode].setdefault("summarize", []).append(summarize_tokens_per_s(e, prompts))
        print(
            f"round {r + 1}/{rounds}: "
            + ", ".join(f"{m} " + "/".join(f"{v[-1]:.0f}" for v in res.values()) for m, res in results.items()),
            flush=True,
        )
    ref = "bfloat16" if "bfloat16" in engines else None
    keys = list(next(iter(results.values())).keys())
    print(
        f"\nspeed: tokens/s (median of {rounds} alternating rounds; x = median of per-round ratio to bf16), "
        f"threads={torch.get_num_threads()}"
    )
    print(f"{'mode':<10} {'weight MB':>9} " + " ".join(f"{k:>20}" for k in keys))
    table: dict[str, dict[str, Any]] = {}
    for mode, res in results.items():
        cells = []
        for k in keys:
            med = statistics.median(res[k])
            ratio = median_ratio(res[k], results[ref][k]) if ref else float("nan")
            cells.append(f"{med:>10.1f} ({ratio:>4.2f}x)")
            table.setdefault(mode, {})[k] = {"tok_s": med, "vs_bf16": ratio, "all": res[k]}
        table[mode]["weight_bytes"] = engines[mode].settings.weight_bytes
        print(f"{mode:<10} {engines[mode].settings.weight_bytes / 1e6:>9.1f} " + " ".join(f"{c:>20}" for c in cells))
    return table


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("quality", "speed"), default=None)
    ap.add_argument(
        "--quality-modes",
        default="int8,w8a8,w8a8@0,int4,int4@64,w4a8,fp8,gguf,kv-int8,kv-fp8",
        help="@N after a mode: int4/int8 group size N, or w8a8 with N float channels; "
        "+kv-int8 after a mode: with an int8 KV cache",
    )
    ap.add_argument("--quality-dtype", default="float32")
    ap.add_argument("--speed-modes", default="float32,bfloat16,int8,w8a8,w8a8@0,int4,w4a8")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--no-summarize", action="store_true")
    ap.add_argument("--summarize-docs", type=int, default=32, help="first N of the 32 bundled documents")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {}
    if args.only in (None, "quality"):
        out["quality"] = run_quality(args.quality_modes.split(","), args.quality_dtype, args.cache_dir, args.threads)
    if args.only in (None, "speed"):
        out["speed"] = run_speed(
            args.speed_modes.split(","),
            args.cache_dir,
            args.threads,
            args.rounds,
            tuple(int(b) for b in args.batch_sizes.split(",")),
            not args.no_summarize,
            args.summarize_docs,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if args.write_docs:
        tables, notes = _markdown(out, args)
        write_section("quant", script_command("benchmarks.quant", argv), stamp(), tables, notes, "Quantization")


def _markdown(out: dict, args: argparse.Namespace) -> tuple[str, str]:
    """docs/benchmarks.md's tables of what ran (quality, speed) and a note on how it was measured."""
    tables, notes = [], []
    if "quality" in out:
        rows = out["quality"]["rows"]
        base_ppl = rows["none"]["ppl"]
        tables.append(
            markdown_table(
                ["mode", "top-1 agreement", "perplexity", "perplexity +%", "weights MB"],
                [
                    [
                        mode,
                        f"{100 * r['agree']:.2f}%",
                        f"{r['ppl']:.3f}",
                        f"{100 * (r['ppl'] / base_ppl - 1):.2f}%",
                        f"{r['weight_bytes'] / 1e6:.1f}",
                    ]
                    for mode, r in rows.items()
                ],
            )
        )
        notes.append(
            f"Quality: teacher-forced on pydoc text against the unquantized model, compute dtype {args.quality_dtype}."
        )
    if "speed" in out:
        table = out["speed"]
        keys = [k for k in next(iter(table.values())) if k != "weight_bytes"]
        tables.append(
            markdown_table(
                ["mode", "weights MB", *keys],
                [
                    [mode, f"{res['weight_bytes'] / 1e6:.1f}", *(_speed_cell(res[k]) for k in keys)]
                    for mode, res in table.items()
                ],
            )
        )
        notes.append(
            f"Speed: tokens/s, median of {args.rounds} alternating rounds, and in brackets the median of the "
            f"per-round ratio to bfloat16; {torch.get_num_threads()} threads."
        )
    return "\n\n".join(tables), " ".join(notes)


def _speed_cell(cell: dict) -> str:
    return f"{cell['tok_s']:.1f} ({cell['vs_bf16']:.2f}x)"


if __name__ == "__main__":
    main()
