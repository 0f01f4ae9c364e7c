"""The benchmark job's workloads: summarize over data.uri, shared_prefix and random. The benchmark
scripts' own workloads (the bundled summarize prompts, nano-vllm's) are benchmarks/workloads.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from batchrun.benchmark.config import BenchmarkConfig
from batchrun.engine import Engine, SamplingParams
from batchrun.job.config import DataConfig, JobConfig
from batchrun.job.errors import JobError
from batchrun.job.formats.prompts import PromptBuilder
from batchrun.job.formats.reader import InputRow, ShardReader
from batchrun.job.shards import discover_shards, open_filesystem

if TYPE_CHECKING:
    from batchrun.job.config import RunConfig

SHARED_INSTRUCTION = (
    "You answer questions about the documentation below. Answer in one or two sentences, "
    "quote the documentation where you can, and say so when it does not answer the question.\n\n"
)
QUESTIONS = (
    "What is the main topic of the documentation above?",
    "Which Python keyword or built-in is discussed first?",
    "Summarize the first paragraph in one sentence.",
    "List three technical terms the text uses.",
    "What would a beginner find most confusing here?",
    "Give one short code example of what the text describes.",
    "Which rule does the text state most clearly?",
    "What does the text say about errors or exceptions?",
)


@dataclass
class BenchmarkWorkload:
    """The prompts every system runs, with what the report says about them."""

    prompts: list[list[int]]
    params: SamplingParams
    notes: dict[str, Any]  # e.g. the tokens all prompts share
    # The input rows the prompts were built from, one per prompt (summarize only): the job path
    # (jobpath.py) runs these rows themselves.
    rows: Optional[list[InputRow]] = None


def build_workload(config: RunConfig, bench: BenchmarkConfig, engine: Engine) -> BenchmarkWorkload:
    max_prompt_tokens = engine.max_model_len - bench.max_tokens
    if max_prompt_tokens <= 0:
        raise JobError(
            f"benchmark.max_tokens={bench.max_tokens} leaves no room for a prompt within the engine's "
            f"max_model_len={engine.max_model_len}"
        )
    params = SamplingParams(temperature=0.0, max_tokens=bench.max_tokens, ignore_eos=bench.workload == "random")
    if bench.workload == "random":
        prompts = _random_prompts(bench, engine, max_prompt_tokens)
        return BenchmarkWorkload(prompts, params, {"prompt_tokens": "uniform", "ignore_eos": True})
    builder = PromptBuilder(config.job, config.data, engine.tokenizer, max_prompt_tokens)
    rows = _data_rows(config.data, config.job)
    if bench.workload == "summarize":
        built = [(row, builder.build(row).token_ids) for row in rows]
        usable = [(row, p) for row, p in built if p is not None][: bench.num_prompts]
        prompts = [p for _, p in usable]
        if len(prompts) < bench.num_prompts:
            raise JobError(
                f"benchmark.num_prompts={bench.num_prompts}, but data.uri={config.data.uri} holds only "
                f"{len(prompts)} usable rows; lower it or point data.uri at more rows"
            )
        return BenchmarkWorkload(prompts, params, {"source": config.data.uri}, [row for row, _ in usable])
    return _shared_prefix_workload(config, bench, engine, rows, params, max_prompt_tokens)


def _data_rows(data: DataConfig, job: JobConfig) -> list[InputRow]:
    assert data.uri is not None
    fs, path = open_filesystem(data.uri, data.storage_options)
    rows: list[InputRow] = []
    for shard in discover_shards(fs, path, data.uri):
        reader = ShardReader(shard, fs, data, job.input_columns(data))
        try:
            rows.extend(reader.rows())
        finally:
            reader.close()
    return rows


def _shared_prefix_workload(
    config: RunConfig,
    bench: BenchmarkConfig,
    engine: Engine,
    rows: list[InputRow],
    params: SamplingParams,
    max_prompt_tokens: int,
) -> BenchmarkWorkload:
    """One system message (instruction + documentation, about shared_prefix_tokens tokens with the
    chat template) shared by every prompt, then a short distinct question per prompt."""
    tokenizer = engine.tokenizer
    texts = [t for t in (row.values.get(config.data.text_column) for row in rows) if isinstance(t, str)]
    document_ids = tokenizer.encode("\n\n".join(texts), add_special_tokens=False)

    def build(document_tokens: int, question: str) -> Optional[list[int]]:
        system = SHARED_INSTRUCTION + str(tokenizer.decode(document_ids[:document_tokens]))
        job = JobConfig(name="benchmark", system_prompt=system, chat_template=config.job.chat_template)
        return (
            PromptBuilder(job, config.data, tokenizer, max_prompt_tokens)
            .build(InputRow(0, "q", {config.data.text_column: question}))
            .token_ids
        )

    questions = [f"Question {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(bench.num_prompts)]
    overhead = _common_prefix_length([build(0, q) or [] for q in questions[:2]])
    document_tokens = max(0, min(bench.shared_prefix_tokens - overhead, len(document_ids)))
    prompts = [build(document_tokens, q) for q in questions]
    if any(p is None for p in prompts):
        raise JobError(
            f"benchmark.shared_prefix_tokens={bench.shared_prefix_tokens} does not fit the engine's "
            f"max_model_len={engine.max_model_len} with max_tokens={bench.max_tokens}"
        )
    token_prompts = [p for p in prompts if p is not None]
    return BenchmarkWorkload(
        token_prompts, params, {"source": config.data.uri, "shared_prefix_tokens": _common_prefix_length(token_prompts)}
    )


def _common_prefix_length(prompts: list[list[int]]) -> int:
    if not prompts:
        return 0
    first = prompts[0]
    n = min(map(len, prompts))
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return n


def _random_prompts(bench: BenchmarkConfig, engine: Engine, max_prompt_tokens: int) -> list[list[int]]:
    rng = random.Random(bench.seed)
    vocab_size = min(len(engine.tokenizer), int(getattr(engine.hf_config, "vocab_size", len(engine.tokenizer))))
    special = set(engine.tokenizer.all_special_ids)
    token_pool = [t for t in range(vocab_size) if t not in special]
    high = min(bench.random_max_tokens, max_prompt_tokens)
    low = min(bench.random_min_tokens, high)
    return [[rng.choice(token_pool) for _ in range(rng.randint(low, high))] for _ in range(bench.num_prompts)]
