"""LoRA adapters per row: one run over rows spread across 4 adapters against the same rows on each
adapter's merged model one after another, and against the base model alone, in one process.

    python -m benchmarks.lora                       # SmolLM2-135M, 64 rows, 32 tokens, 3 rounds
    python -m benchmarks.lora --tiny --rounds 1     # a small random Llama: a minute's smoke run
    python -m benchmarks.lora --rows 64 --rounds 3 --write-docs
    python -m benchmarks.lora --dry-run             # the rows and systems; nothing loaded or timed

The base model is SmolLM2-135M-Instruct (the registry's `smollm2-135m`: the installed GGUF, converted
once into the model cache), or with `--tiny` a random Llama (hidden 256, 4 layers). Four random PEFT
adapters (r=16, lora_alpha=32, target_modules="all-linear", lora_B drawn non-zero: PEFT starts it at
zero) are saved to a temporary directory, and each is merged into a copy of the base
(`merge_and_unload`). The rows are CPython's pydoc topics cut to a few hundred characters, greedy,
`ignore_eos`, `--max-tokens` each (every system generates the same number of tokens); row i names
adapter i mod 4.

Systems (engine start-up is never timed; each is warmed up on a few rows first):
- `mixed`: one Engine with `lora_adapters` (4 adapters, `max_loras=4`) runs every row, each naming
  its adapter: the base GEMM once per step for all rows, each row's low-rank update beside it;
- `merged sequence`: 4 Engines, one per merged model, each running its quarter of the rows, one
  after another (what serving adapters without LoRA support costs): the time is their sum;
- `base`: one Engine on the base model runs every row without an adapter (the ceiling).

Each round times every system once, the order rotating from round to round; seconds are the median
over rounds, each ratio the median of per-round ratios. The issue's bars: `mixed` at least as fast as
`merged sequence`, and within 20% of `base`. Correctness: a mixed row's tokens equal its merged
model's (float32: exactly; bf16 may differ on near ties).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

MODEL = "smollm2-135m"  # batchrun's registry name
NUM_ADAPTERS = 4
RANK = 16
SYSTEMS = ("mixed", "merged sequence", "base")
WARMUP_ROWS = NUM_ADAPTERS  # one row per adapter
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def pick_texts(n: int, max_chars: int = 300) -> list[str]:
    """`n` texts: the pydoc topics in name order, each cut at a word boundary to about `max_chars`."""
    from pydoc_data.topics import topics

    every = []
    for key in sorted(topics):
        body = " ".join(topics[key].split())
        if len(body) >= 80:
            every.append(body[:max_chars].rsplit(" ", 1)[0])
    return [every[i % len(every)] for i in range(n)]


def base_model_dir(tiny: bool, root: Path) -> str:
    """An HF directory of the base model (what PEFT and merged copies start from)."""
    if tiny:
        from batchrun.testing import make_tiny_model

        overrides = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8)
        return str(make_tiny_model(root / "base", "llama", num_key_value_heads=4, **overrides))
    from batchrun.model.loader import default_cache_dir, load_model

    loaded = load_model(MODEL)  # converts the GGUF into the model cache once
    return str(default_cache_dir() / "converted" / loaded.fingerprint[:16])


def make_adapter(base_dir: str, out_dir: Path, seed: int, rank: int = RANK, std: float = 0.02) -> str:
    """A random PEFT LoRA adapter of the model at `base_dir` (every linear but the head), saved as
    PEFT saves it; lora_B drawn from N(0, std) so that the adapter changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def merged_model(base_dir: str, adapter_dir: str, out_dir: Path) -> str:
    """The base with the adapter merged into its weights (PEFT's merge_and_unload), as an HF directory."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(str(out_dir))
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(base_dir, name)):
            shutil.copy(os.path.join(base_dir, name), out_dir / name)
    return str(out_dir)


def cpu_name() -> str:
    """The CPU's model name (Linux), for the docs' stamp."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split()[:3])
    except OSError:
        pass
    return "CPU"


@dataclass
class System:
    name: str
    run: Callable[[], list[list[int]]]  # every row's output tokens, in row order
    seconds: list[float] = field(default_factory=list)
    tokens: Optional[list[list[int]]] = None


def engine_config(model: str, dtype: str, threads: Optional[int], **extra: Any) -> Any:
    from batchrun.engine import EngineConfig

    return EngineConfig(
        model=model,
        dtype=dtype,
        device="cpu",
        num_threads=threads,
        kv_cache_memory=256 << 20,
        # fixed rather than profiled at start-up: every engine runs with the same batch limits
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,  # every round runs the same prompts: no system may reuse its last round's KV
        **extra,
    )


def build_systems(
    names: Sequence[str],
    base: str,
    adapters: dict[str, str],
    merged: dict[str, str],
    prompts: list[str],
    row_adapters: list[str],
    params: Any,
    dtype: str,
    threads: Optional[int],
) -> tuple[list[System], list[Any]]:
    from batchrun.engine import Engine

    systems, engines = [], []
    if "mixed" in names:
        mixed = Engine(engine_config(base, dtype, threads, lora_adapters=adapters, max_loras=len(adapters)))
        engines.append(mixed)

        def run_mixed() -> list[list[int]]:
            return [o.token_ids for o in mixed.generate(prompts, params, adapters=row_adapters)]

        systems.append(System("mixed", run_mixed))
    if "merged sequence" in names:
        per_adapter = []
        for name, directory in merged.items():
            rows = [i for i, a in enumerate(row_adapters) if a == name]
            engine = Engine(engine_config(directory, dtype, threads))
            engines.append(engine)
            per_adapter.append((engine, rows))

        def run_merged() -> list[list[int]]:
            tokens: list[list[int]] = [[] for _ in prompts]
            for engine, rows in per_adapter:
                for i, out in zip(rows, engine.generate([prompts[i] for i in rows], params)):
                    tokens[i] = out.token_ids
            return tokens

        systems.append(System("merged sequence", run_merged))
    if "base" in names:
        plain = Engine(engine_config(base, dtype, threads))
        engines.append(plain)

        def run_base() -> list[list[int]]:
            return [o.token_ids for o in plain.generate(prompts, params)]

        systems.append(System("base", run_base))
    return systems, engines


def run_rounds(systems: list[System], rounds: int, num_tokens: int) -> None:
    from batchrun.benchmark.timing import round_order

    for r in range(rounds):
        for s in round_order(systems, r):
            t0 = time.perf_counter()
            s.tokens = s.run()
            s.seconds.append(time.perf_counter() - t0)
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{s.name} {num_tokens / s.seconds[-1]:.0f} tok/s" for s in systems),
            flush=True,
        )


def table(systems: list[System], num_rows: int) -> tuple[list[str], list[list[str]], dict[str, Any]]:
    from batchrun.benchmark.timing import median_ratio

    by_name = {s.name: s for s in systems}
    mixed, merged, base = (by_name.get(n) for n in SYSTEMS)
    header = ["system", "seconds", "output tok/s", "x merged sequence", "x base", "tokens = merged"]
    body, figures = [], {}
    for s in systems:
        assert s.tokens is not None
        num_tokens = sum(len(t) for t in s.tokens)
        seconds = statistics.median(s.seconds)
        vs_merged = median_ratio(merged.seconds, s.seconds) if merged is not None else None
        vs_base = median_ratio(base.seconds, s.seconds) if base is not None else None
        same = "-"
        if s is mixed and merged is not None and merged.tokens is not None:
            same = f"{sum(a == b for a, b in zip(s.tokens, merged.tokens))}/{num_rows} rows"
        figures[s.name] = {"seconds": seconds, "vs_merged": vs_merged, "vs_base": vs_base}
        body.append(
            [
                s.name,
                f"{seconds:.2f}",
                f"{num_tokens / seconds:.0f}",
                "-" if vs_merged is None else f"{vs_merged:.2f}x",
                "-" if vs_base is None else f"{vs_base:.2f}x",
                same,
            ]
        )
    return header, body, figures


def bars(vs_merged: float, vs_base: float) -> str:
    """The issue's two bars as a sentence: mixed at least as fast as the merged sequence, and within
    20% of the base (its rate at least 0.8x the base's; read as time, at most 1.2x)."""
    met = "met" if vs_merged >= 1 else "not met"
    rate = "met" if vs_base >= 0.8 else "not met"
    time_read = "met" if 1 / vs_base <= 1.2 else "not met"
    return (
        f"mixed vs merged sequence {vs_merged:.2f}x (at least as fast: {met}); mixed vs base {vs_base:.2f}x "
        f"the rate, {1 / vs_base:.2f}x the time (within 20%: {rate} as a rate, {time_read} as a time)"
    )


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    """The arguments; nothing of batchrun imported yet, so a dry run stays quick."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="rows, spread over the adapters (default 64)")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per row (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="timed passes per system (default 3)")
    ap.add_argument("--dtype", default="float32", help="engine dtype: float32 (default) or auto / bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for every engine (default: torch's)")
    ap.add_argument("--tiny", action="store_true", help="a small random Llama instead of SmolLM2-135M")
    ap.add_argument("--only", action="append", choices=SYSTEMS, help="run these systems only")
    ap.add_argument("--dry-run", action="store_true", help="print the rows and systems; load and time nothing")
    ap.add_argument(
        "--write-docs", action="store_true", help="also replace this benchmark's section of docs/benchmarks.md"
    )
    args = ap.parse_args(argv)
    if args.rows < NUM_ADAPTERS or args.rounds < 1 or args.max_tokens < 1:
        ap.error(f"--rows must be at least {NUM_ADAPTERS}, --rounds and --max-tokens at least 1")
    args.systems = [s for s in SYSTEMS if s in set(args.only or SYSTEMS)]
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    texts = pick_texts(args.rows)
    names = [f"adapter{i}" for i in range(NUM_ADAPTERS)]
    row_adapters = [names[i % NUM_ADAPTERS] for i in range(args.rows)]
    model = "a random Llama (--tiny)" if args.tiny else MODEL
    print(
        f"{args.rows} rows of pydoc topics over {NUM_ADAPTERS} adapters (r={RANK}, all linear) on {model}, "
        f"{args.max_tokens} tokens each, {args.dtype}; systems: {', '.join(args.systems)}; {args.rounds} round(s)",
        flush=True,
    )
    if args.dry_run:
        return
    import torch

    from batchrun.engine import SamplingParams

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        base = base_model_dir(args.tiny, root)
        adapters = {n: make_adapter(base, root / n, seed=i) for i, n in enumerate(names)}
        merged = {}
        if "merged sequence" in args.systems:
            merged = {n: merged_model(base, d, root / f"{n}-merged") for n, d in adapters.items()}
        systems, engines = build_systems(
            args.systems, base, adapters, merged, texts, row_adapters, params, args.dtype, args.threads
        )
        print(
            f"adapters, merged models and {len(engines)} engines ready in {time.perf_counter() - t0:.0f}s", flush=True
        )
        try:
            warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            for e in engines:  # first calls (oneDNN primitives, LoRA slots loaded) before any timing
                named = row_adapters[:WARMUP_ROWS] if e.config.lora_adapters else None
                e.generate(texts[:WARMUP_ROWS], warm, adapters=named)
            run_rounds(systems, args.rounds, args.rows * args.max_tokens)
        finally:
            for e in engines:
                e.close()
    header, body, figures = table(systems, args.rows)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body, strict=True)]
    for line in (header, *body):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)))
    mixed = figures.get("mixed", {})
    if mixed.get("vs_merged") is not None and mixed.get("vs_base") is not None:
        print(f"bars: {bars(mixed['vs_merged'], mixed['vs_base'])}")
    if args.write_docs:
        from batchrun.benchmark.doc import markdown_table, script_command, stamp, write_section

        notes = (
            f"{model}, {args.dtype}, on the CPU with {threads} torch threads for every engine, in one process: "
            f"{args.rows} greedy rows of {args.max_tokens} tokens (ignore_eos), row i naming adapter i mod "
            f"{NUM_ADAPTERS}; {NUM_ADAPTERS} random PEFT adapters r={RANK}, all linear. `mixed`: one engine, "
            "max_loras=4, every row with its adapter; `merged sequence`: 4 engines on the PEFT-merged models, "
            "each running its quarter of the rows, one after another (their seconds summed); `base`: the base "
            f"model alone on every row. Median of {args.rounds} rounds (start-up never timed, prefix caching off); "
            "ratios are per-round medians, above 1 is faster than that system. `tokens = merged`: mixed rows "
            "whose tokens equal their merged model's."
        )
        if mixed.get("vs_merged") is not None and mixed.get("vs_base") is not None:
            notes += f" The issue's bars: {bars(mixed['vs_merged'], mixed['vs_base'])}."
        write_section(
            "lora",
            script_command("benchmarks.lora", argv),
            stamp(f"{os.cpu_count()}-core {cpu_name()}, CPU"),
            markdown_table(header, body),
            notes,
            "LoRA adapters per row: one mixed run vs merged models one after another",
        )


if __name__ == "__main__":
    main()
