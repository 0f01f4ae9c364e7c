"""Quantization benchmark: quality against the unquantized model, weight bytes and speed, one process.

    python -m batchrun.bench.quant                    # everything (several minutes on 2 cores)
    python -m batchrun.bench.quant --only quality     # teacher-forced agreement and perplexity
    python -m batchrun.bench.quant --only speed --threads 1 --rounds 3

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
import glob
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch

from batchrun.engine import Engine, EngineConfig, SamplingParams
from batchrun.engine.request import Request
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.testing import sample_texts

log = logging.getLogger(__name__)

SUMMARIZE_SYSTEM = "You are a concise technical writer."
SUMMARIZE_TEMPLATE = "Summarize the following documentation in two sentences.\n\n{text}"
GREEDY_PROMPTS = (
    "The capital of France is",
    "Write a Python function that returns the factorial of n.",
    "Explain in one paragraph what a hash table is.",
)


@dataclass
class TeacherForced:
    """Per predicted position (every token but each sequence's last), concatenated over sequences."""

    argmax: torch.Tensor  # (num_predicted,) int64: the model's top-1 next token
    nll: torch.Tensor  # (num_predicted,) float64: -log p(actual next token)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())


def agreement(base: TeacherForced, other: TeacherForced) -> float:
    """Fraction of positions where both models pick the same top-1 token."""
    return (base.argmax == other.argmax).double().mean().item()


def quality_sequences(tokenizer, num_seqs: int = 8, seq_len: int = 512) -> list[list[int]]:
    """The first `seq_len` tokens of the first `num_seqs` pydoc topics at least that long."""
    out = []
    for text in sample_texts():
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= seq_len:
            out.append(ids[:seq_len])
        if len(out) == num_seqs:
            return out
    raise ValueError(f"only {len(out)} sample texts have {seq_len} tokens")


@torch.inference_mode()
def teacher_forced(model, runner, sequences: list[list[int]], logits_rows: int = 256) -> TeacherForced:
    """Run the sequences through a model and its runner's paged KV cache (the engine must be idle:
    this writes to the cache's first blocks)."""
    bs = runner.block_size
    reqs, next_block = [], 0
    for i, ids in enumerate(sequences):
        num_blocks = -(-len(ids) // bs)
        req = Request(i, i, list(ids), SamplingParams(temperature=0.0), 0.0, None)
        req.block_ids = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        reqs.append(req)
    assert next_block <= runner.kv_caches[0][0].shape[0], f"needs {next_block} KV blocks"
    hidden: list[list[torch.Tensor]] = [[] for _ in sequences]
    for lens in ([1] * len(sequences), [len(s) - 1 for s in sequences]):
        input_ids, positions, meta = runner.prepare(ScheduledBatch(reqs, lens))[:3]
        h = model(input_ids, positions, runner.kv_caches, meta)  # (num_tokens, hidden_size)
        for i, part in enumerate(h.split(lens)):
            hidden[i].append(part)
            reqs[i].num_computed_tokens += lens[i]
    argmax, nll = [], []
    for ids, parts in zip(sequences, hidden):
        h = torch.cat(parts)[:-1]
        targets = torch.tensor(ids[1:], device=h.device)
        for start in range(0, h.shape[0], logits_rows):
            logp = torch.log_softmax(model.compute_logits(h[start : start + logits_rows]), dim=-1)
            argmax.append(logp.argmax(dim=-1).cpu())
            nll.append(-logp.gather(1, targets[start : start + logits_rows, None])[:, 0].double().cpu())
    return TeacherForced(torch.cat(argmax), torch.cat(nll))


def engine_teacher_forced(engine: Engine, sequences: list[list[int]]) -> TeacherForced:
    return teacher_forced(engine.model, engine.runner, sequences)


def make_engine(
    quantization: str = "none",
    dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
    cache_dir: Optional[str] = None,
    threads: Optional[int] = None,
    kv_cache_memory: float = 256 << 20,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    group_size: int = 32,
) -> Engine:
    """An engine for one mode. `quantization` may carry a setting after "@": "int4@64" is int4 in
    groups of 64, "w8a8@0" is W8A8 with no input channels kept in float."""
    quantization, _, setting = quantization.partition("@")
    extra = {}
    if setting and quantization == "w8a8":
        extra["w8a8_outlier_channels"] = int(setting)
    elif setting:
        group_size = int(setting)
    # Fixed batch limits: the start-up profile would pick per mode and blur the comparison.
    return Engine(
        EngineConfig(
            model="smollm2-135m",
            dtype=dtype,
            device="cpu",
            quantization=quantization,
            quant_group_size=group_size,
            **extra,
            kv_cache_dtype=kv_cache_dtype,
            cache_dir=cache_dir,
            num_threads=threads,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )


def greedy(engine: Engine, prompts=GREEDY_PROMPTS, max_tokens: int = 40) -> list[str]:
    chats = [_chat(engine.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    return [o.text for o in engine.generate(chats, SamplingParams(temperature=0.0, max_tokens=max_tokens))]


def _chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def decode_tokens_per_s(engine: Engine, batch_size: int, prompt_tokens: int = 64, max_tokens: int = 24) -> float:
    """batch_size / mean inter-token latency, all requests decoding side by side."""
    texts = sample_texts()
    prompts = [engine.tokenizer.encode(texts[i % len(texts)])[:prompt_tokens] for i in range(batch_size)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    itl = statistics.mean(o.metrics.itl_s for o in outs)
    return batch_size / itl


def summarize_prompts(tokenizer) -> list[list[int]]:
    import pyarrow.parquet as pq

    root = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "sample")
    texts = [
        t
        for f in sorted(glob.glob(os.path.join(root, "*.parquet")))
        for t in pq.read_table(f).column("text").to_pylist()
    ]
    return [
        _chat(
            tokenizer,
            [
                {"role": "system", "content": SUMMARIZE_SYSTEM},
                {"role": "user", "content": SUMMARIZE_TEMPLATE.format(text=t)},
            ],
        )
        for t in texts
    ]


def summarize_tokens_per_s(engine: Engine, prompts: list[list[int]]) -> float:
    """Output tokens per wall second over the whole workload (prefill included, as a job sees it),
    from an empty prefix cache: what an earlier round left there would skip prefill, and more of it
    survives in a mode with more KV blocks (an int8 cache), which once read as a 3.3x speed-up."""
    engine.reset_prefix_cache()
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


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
    rows = {"none": {"ppl": ref.perplexity, "agree": 1.0, "weight_bytes": base.settings["weight_bytes"]}}
    outputs = {"none": greedy(base)}
    del base
    for mode in modes:
        quant, kv = _split_kv(mode)
        e = make_engine(quant, dtype, kv_cache_dtype=kv, cache_dir=cache_dir, threads=threads)
        tf = engine_teacher_forced(e, seqs)
        rows[mode] = {
            "ppl": tf.perplexity,
            "agree": agreement(ref, tf),
            "weight_bytes": e.settings["weight_bytes"],
            "formats": e.settings["quant_formats"],
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
    table = {}
    for mode, res in results.items():
        cells = []
        for k in keys:
            med = statistics.median(res[k])
            ratio = statistics.median(a / b for a, b in zip(res[k], results[ref][k])) if ref else float("nan")
            cells.append(f"{med:>10.1f} ({ratio:>4.2f}x)")
            table.setdefault(mode, {})[k] = {"tok_s": med, "vs_bf16": ratio, "all": res[k]}
        table[mode]["weight_bytes"] = engines[mode].settings["weight_bytes"]
        print(f"{mode:<10} {engines[mode].settings['weight_bytes'] / 1e6:>9.1f} " + " ".join(f"{c:>20}" for c in cells))
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


if __name__ == "__main__":
    main()
