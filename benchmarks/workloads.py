"""The benchmark scripts' workloads: the bundled summarize prompts of the quantization, speculative
and sampling benchmarks, and nano-vllm's random workload of the GPU check. The job=benchmark
workloads are batchrun/benchmark/workloads.py.

A library module (no `__main__`): the scripts and the tests import from here.
"""

from __future__ import annotations

import glob
import os
import random
import time

import batchrun
from batchrun.engine import Engine, SamplingParams

# The summarize job's prompt (conf/job/summarize.yaml), for summarize_prompts.
SUMMARIZE_SYSTEM = "You are a concise technical writer."
SUMMARIZE_TEMPLATE = "Summarize the following documentation in two sentences.\n\n{text}"
COPY_TEMPLATE = "Repeat the following text exactly, word for word, and nothing else.\n\n{text}"

# ---- the bundled summarize prompts (benchmarks.quant, benchmarks.speculative) --------------------


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def bundled_texts() -> list[str]:
    """The bundled sample shards' texts (32 CPython doc topics), in shard order."""
    import pyarrow.parquet as pq

    root = os.path.join(os.path.dirname(batchrun.__file__), "data", "sample")
    return [
        t
        for f in sorted(glob.glob(os.path.join(root, "*.parquet")))
        for t in pq.read_table(f).column("text").to_pylist()
    ]


def summarize_prompts(tokenizer) -> list[list[int]]:
    """The bundled sample through the summarize job's prompt, chat template applied: the
    quantization and speculative benchmarks' workload."""
    return [
        chat_ids(
            tokenizer,
            [
                {"role": "system", "content": SUMMARIZE_SYSTEM},
                {"role": "user", "content": SUMMARIZE_TEMPLATE.format(text=t)},
            ],
        )
        for t in bundled_texts()
    ]


def copy_prompts(tokenizer) -> list[list[int]]:
    """The bundled sample's texts with a request to repeat them word for word: a copy-heavy
    workload, where prompt-lookup (n-gram) speculation finds its drafts."""
    return [
        chat_ids(tokenizer, [{"role": "user", "content": COPY_TEMPLATE.format(text=t[:1200])}]) for t in bundled_texts()
    ]


def summarize_tokens_per_s(engine: Engine, prompts: list[list[int]]) -> float:
    """Output tokens per wall second over the whole workload (prefill included, as a job sees it),
    from an empty prefix cache: what an earlier round left there would skip prefill, and more of it
    survives in a mode with more KV blocks (an int8 cache), which once read as a 3.3x speed-up."""
    engine.reset_prefix_cache()
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


# ---- nano-vllm's workload (benchmarks.gpu) ----------------------------------------------------


def nano_vllm_workload(
    num_seqs: int, lo: int, hi: int, vocab_size: int = 10001, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's benchmarks.py: prompt ids uniform in [0, 10000], lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    top = min(10000, vocab_size - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(lo, hi) for _ in range(num_seqs)]
    return prompts, max_tokens
