"""Host time per engine step: what the engine spends outside the model on a decode step.

    python -m benchmarks.host                 # 64 and 256 sequences x 512 and 4096-token contexts
    python -m benchmarks.host --rounds 5 --write-docs

The real engine (scheduler, KV cache manager with the prefix cache on, runner packing, sampler)
runs a real tiny model whose forward and LM head are replaced by stand-ins that cost nothing: the
forward returns zeros of the hidden shape and the head a fixed logits tensor whose argmax is one
ordinary token. So a step's time is the host's work alone: the part a GPU would wait on.

Each point admits N distinct random prompts of `context` tokens (ignore_eos, greedy), lets them
prefill, and times every following `Engine.step` that decodes all N at once: wall milliseconds
and this thread's CPU milliseconds (the model stand-in runs in one torch thread, so on a shared
machine the CPU figure moves less with other jobs' load). Per round the median step; reported,
the median over rounds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.benchmark.timing import round_order
from batchrun.engine import Engine, EngineConfig, SamplingParams
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.testing import make_tiny_model

NUM_SEQS = (64, 256)
CONTEXTS = (512, 4096)
BLOCK_SIZE = 16
HIDDEN_SIZE = 64
# The token every step "generates": an ordinary one (not a special token), so nothing stops early.
FIXED_TOKEN = 100
PREFILL_BUDGET = 32768  # tokens per step: prompts prefill in few steps, the stand-in costs nothing


def build_engine(model_dir: str, max_num_seqs: int, max_tokens_per_seq: int) -> Engine:
    """An engine over the tiny model with a KV cache that holds every sequence at full length."""
    num_blocks = max_num_seqs * (-(-max_tokens_per_seq // BLOCK_SIZE) + 1)
    # One layer, one KV head of 16 dims, float32: 2 (K and V) * 16 * 4 bytes per token.
    kv_bytes = num_blocks * BLOCK_SIZE * 2 * (HIDDEN_SIZE // 4) * 4
    engine = Engine(
        EngineConfig(
            model=model_dir,
            dtype="float32",
            device="cpu",
            block_size=BLOCK_SIZE,
            kv_cache_memory=kv_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=PREFILL_BUDGET,
            num_threads=1,
        )
    )
    install_stand_in(engine)
    return engine


def install_stand_in(engine: Engine) -> None:
    """Replace the model's forward and LM head with constant-time stand-ins (same shapes, dtypes)."""
    model = engine.model
    vocab = model.spec.vocab_size
    assert FIXED_TOKEN < vocab
    # (rows, vocab_size) float32: the most rows one step can sample is one per running sequence
    logits = torch.zeros(engine.max_num_seqs, vocab, dtype=torch.float32)
    logits[:, FIXED_TOKEN] = 1.0

    def forward(input_ids, positions, kv_caches, meta, num_layers=None):  # noqa: ARG001 - the real signature
        return torch.zeros(input_ids.shape[0], model.spec.hidden_size, dtype=engine.dtype)  # (num_tokens, hidden)

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        return logits[: hidden.shape[0]]

    # Replaced on this instance only: the benchmark times the host around a model that costs nothing.
    model.forward = forward  # type: ignore[method-assign]
    model.compute_logits = compute_logits  # type: ignore[method-assign]


def time_decode_steps(
    engine: Engine, num_seqs: int, context: int, num_steps: int, seed: int
) -> list[tuple[float, float]]:
    """(wall s, thread CPU s) of every step that decoded all `num_seqs` sequences at once."""
    rng = np.random.default_rng(seed)
    vocab = engine.model.spec.vocab_size
    # distinct prompts, so no two share a cached block: (num_seqs, context)
    prompts = rng.integers(FIXED_TOKEN + 1, vocab, size=(num_seqs, context)).tolist()
    # Chunked prefill lets the first sequences decode while the last are prefilled: room for those
    # steps too, so every sequence is still running for `num_steps` steps once all of them decode.
    max_tokens = num_steps + 2 + num_seqs * context // PREFILL_BUDGET
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batches: list[ScheduledBatch] = []
    inner_schedule, inner_step = engine.scheduler.schedule, engine.step
    times: list[tuple[float, float]] = []

    def schedule(*args, **kwargs) -> ScheduledBatch:
        batches.append(inner_schedule(*args, **kwargs))
        return batches[-1]

    def step():
        wall, cpu = time.perf_counter(), time.thread_time()
        finished = inner_step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        batch = batches[-1]
        is_full_decode = len(batch.requests) == num_seqs and all(n == 1 for n in batch.num_new_tokens)
        if is_full_decode and len(times) < num_steps:
            times.append((wall, cpu))
        return finished

    engine.scheduler.schedule, engine.step = schedule, step  # type: ignore[method-assign]
    try:
        engine.reset_prefix_cache()  # every round starts cold
        outs = engine.generate(prompts, params)
    finally:
        del engine.scheduler.schedule, engine.step  # back to the class's methods
    assert all(o.token_ids == [FIXED_TOKEN] * max_tokens for o in outs), "stand-in output changed"
    assert len(times) == num_steps, f"only {len(times)} full decode steps"
    return times


def run(rounds: int, num_steps: int) -> tuple[dict[tuple[int, int], dict[str, float]], int]:
    """({(num_seqs, context): {"wall_ms", "cpu_ms"}}, the stand-in's vocabulary size)."""
    longest = max(CONTEXTS) + num_steps + 4 + max(NUM_SEQS) * max(CONTEXTS) // PREFILL_BUDGET
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(
            make_tiny_model(
                Path(tmp) / "model",
                "llama",
                hidden_size=HIDDEN_SIZE,
                num_hidden_layers=1,
                num_key_value_heads=1,
                max_position_embeddings=longest + BLOCK_SIZE,
            )
        )
        engine = build_engine(model_dir, max(NUM_SEQS), longest)
        vocab = engine.model.spec.vocab_size
        time_decode_steps(engine, 8, 64, 4, seed=0)  # warm-up
        print(
            f"host time per decode step (ms): {num_steps} decode steps per point, vocab "
            f"{vocab}, block size {BLOCK_SIZE}, prefix cache on"
        )
        samples: dict[tuple[int, int], list[tuple[float, float]]] = {(n, c): [] for n in NUM_SEQS for c in CONTEXTS}
        for r in range(rounds):
            for n, c in round_order(list(samples), r):  # no point always runs first while the load moves
                per_round = samples[(n, c)]
                times = time_decode_steps(engine, n, c, num_steps, seed=r)
                per_round.append((statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)))
            print(
                f"  round {r + 1}/{rounds} (wall / CPU): "
                + ", ".join(f"{n}x{c} {v[-1][0] * 1e3:.2f} / {v[-1][1] * 1e3:.2f}" for (n, c), v in samples.items()),
                flush=True,
            )
    table = {
        key: {
            "wall_ms": statistics.median(v[0] for v in vals) * 1e3,
            "cpu_ms": statistics.median(v[1] for v in vals) * 1e3,
        }
        for key, vals in samples.items()
    }
    print(f"  median of {rounds} rounds")
    for (n, c), row in table.items():
        print(f"  {n:>4} seqs, {c:>5}-token context: wall {row['wall_ms']:.3f} ms  CPU {row['cpu_ms']:.3f} ms")
    for n in NUM_SEQS:
        lo, hi = table[(n, min(CONTEXTS))], table[(n, max(CONTEXTS))]
        print(
            f"  {n} seqs, {min(CONTEXTS)} -> {max(CONTEXTS)} tokens: wall {hi['wall_ms'] / lo['wall_ms'] - 1:+.0%}, "
            f"CPU {hi['cpu_ms'] / lo['cpu_ms'] - 1:+.0%}"
        )
    return table, vocab


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per point")
    ap.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    table, vocab = run(args.rounds, args.steps)
    if args.write_docs:
        rows = [[n, c, f"{row['wall_ms']:.2f}", f"{row['cpu_ms']:.2f}"] for (n, c), row in sorted(table.items())]
        notes = (
            "The engine with a stand-in model whose forward costs nothing (tiny llama config, vocab "
            f"{vocab}, block size {BLOCK_SIZE}, prefix cache on, greedy): milliseconds of one decode step of "
            f"all sequences at once, {args.steps} steps per point, median step per round, median of "
            f"{args.rounds} rounds, the points' order rotating each round. CPU: this thread's CPU time "
            "(torch runs one thread here). On a shared machine single rounds move a lot: compare the "
            "medians, and points within one run."
        )
        command = script_command("benchmarks.host", argv)
        write_section(
            "host",
            command,
            stamp(),
            markdown_table(["running sequences", "context tokens", "wall ms / step", "CPU ms / step"], rows),
            notes,
            "Host time per step",
        )


if __name__ == "__main__":
    main()
