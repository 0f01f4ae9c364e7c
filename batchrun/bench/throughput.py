"""The benchmark job: batchrun against HF transformers `generate` on the same prompts, in one process.

    python -m batchrun job=benchmark [benchmark.workload=summarize|shared_prefix|random] [benchmark.*=...]

Every system runs the same token-id prompts with greedy decoding. Runs alternate (round 1: each
system once, round 2: each again, ...) so that all systems see the same drift of a shared machine,
and ratios are taken within a round, then the median over rounds; the order within a round rotates
by one system per round. Before every batchrun run the
engine's prefix cache is emptied: a repeat must not reuse the previous repeat's blocks.

Systems (benchmark.systems; null picks batchrun, hf_fp32 and hf_bf16, plus batchrun_no_prefix_cache
for the shared_prefix workload):
  batchrun                  the engine as configured (engine.*), fed through the planner (planner.*)
                            with the job's in-flight bound, exactly as a job shard is
  batchrun_no_prefix_cache  a second engine with enable_prefix_caching=false and the same batch limits
  batchrun_no_planner       the engine, prompts in input order
  batchrun_<order>          the engine with planner.order=<order> (longest_first, shortest_first, input)
  hf_fp32, hf_bf16          HF `generate` in static batches of benchmark.hf_batch_size (hf_baseline.py)

Workloads: summarize (the job's prompt over the rows at data.uri, by default the bundled 32 CPython
documentation topics, with the chat template), shared_prefix (one long instruction of about
benchmark.shared_prefix_tokens tokens, then short distinct questions) and random (random token ids
of random lengths, ignore_eos, as vLLM's and nano-vllm's throughput benchmarks do).

Results go to {output.uri}/benchmark/ (see report.py) and are printed as a table.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from batchrun.bench.hf_baseline import TimedRun, cast_model, count_parameters, hf_generate, load_hf_model, matmul_peak
from batchrun.bench.report import BenchmarkResult, build_result, write_result
from batchrun.engine import Engine, EngineRequest, RequestOutput, SamplingParams
from batchrun.job.config import BENCHMARK_SYSTEMS, BenchmarkConfig, DataConfig, JobConfig, PlannerConfig
from batchrun.job.errors import JobError
from batchrun.job.planner import plan_requests
from batchrun.job.prompts import PromptBuilder
from batchrun.job.reader import InputRow, ShardReader
from batchrun.job.runner import load_engine
from batchrun.job.shards import discover_shards, open_filesystem

if TYPE_CHECKING:
    from batchrun.job.config import RunConfig

log = logging.getLogger(__name__)

PLANNER_ORDERS = ("longest_first", "shortest_first", "input")
SYSTEMS = BENCHMARK_SYSTEMS
HF_DTYPES = {"hf_fp32": torch.float32, "hf_bf16": torch.bfloat16}

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


def run_benchmark(config: RunConfig, engine: Optional[Engine] = None) -> BenchmarkResult:
    """Run the benchmark job; `engine` may be passed in to reuse a loaded one (tests)."""
    bench = config.benchmark
    load_start = os.getloadavg()
    engine = engine or load_engine(config.engine)
    workload = build_workload(config, engine)
    systems = _build_systems(config, engine)
    log.info(
        "benchmark %s: %d prompts (%.0f prompt tokens on average), %d new tokens, systems %s, %d rounds",
        bench.workload,
        len(workload.prompts),
        sum(map(len, workload.prompts)) / len(workload.prompts),
        bench.max_tokens,
        ", ".join(systems),
        bench.repeats,
    )
    for run in systems.values():  # warm-up: first calls pay one-off setup, and it is not timed
        run(workload.prompts[: min(2, len(workload.prompts))], dataclasses.replace(workload.params, max_tokens=2))
    hidden, intermediate = _matmul_shape(engine)
    shape = (min(max(engine.max_num_batched_tokens, 256), 2048), hidden, intermediate)
    runs: dict[str, list[TimedRun]] = {name: [] for name in systems}
    peaks: dict[str, float] = {}
    names = list(systems)
    for round_index in range(bench.repeats):
        # Each round starts one system later, so no system always runs first (or last) while the
        # machine's load rises or falls through the round.
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            run = systems[name]
            gc.collect()
            timed = run(workload.prompts, workload.params)
            runs[name].append(timed)
            log.info(
                "round %d/%d %-26s %7.1f output tok/s (%.1f s)",
                round_index + 1,
                bench.repeats,
                name,
                timed.num_output_tokens / timed.wall_s,
                timed.wall_s,
            )
        for dtype in (torch.float32, torch.bfloat16):  # the ceiling, measured beside the runs
            key = str(dtype).replace("torch.", "")
            peaks[key] = max(peaks.get(key, 0.0), matmul_peak(dtype, *shape))
    settings = {
        "engine": engine.settings,
        "model": engine.model_path,
        "num_parameters": count_parameters(engine.hf_config),
        "matmul_shape": list(shape),
        "matmul_peak_flops_per_s": peaks,
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
        "num_cpus": os.cpu_count(),
        "planner": dataclasses.asdict(config.planner),
        "benchmark": dataclasses.asdict(bench),
        "workload": workload.notes,
    }
    result = build_result(bench, runs, settings)
    write_result(result, config.output.uri, dict(config.output.storage_options))
    return result


# ---- workloads ------------------------------------------------------------------------------------


def build_workload(config: RunConfig, engine: Engine) -> BenchmarkWorkload:
    bench = config.benchmark
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
        prompts = [p for p in (builder.build(row).token_ids for row in rows) if p is not None][: bench.num_prompts]
        if len(prompts) < bench.num_prompts:
            raise JobError(
                f"benchmark.num_prompts={bench.num_prompts}, but data.uri={config.data.uri} holds only "
                f"{len(prompts)} usable rows; lower it or point data.uri at more rows"
            )
        return BenchmarkWorkload(prompts, params, {"source": config.data.uri})
    return _shared_prefix_workload(config, engine, rows, params, max_prompt_tokens)


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
    config: RunConfig, engine: Engine, rows: list[InputRow], params: SamplingParams, max_prompt_tokens: int
) -> BenchmarkWorkload:
    """One system message (instruction + documentation, about shared_prefix_tokens tokens with the
    chat template) shared by every prompt, then a short distinct question per prompt."""
    bench, tokenizer = config.benchmark, engine.tokenizer
    texts = [t for t in (row.values.get(config.data.text_column) for row in rows) if isinstance(t, str)]
    document_ids = tokenizer.encode("\n\n".join(texts), add_special_tokens=False)

    def build(document_tokens: int, question: str) -> Optional[list[int]]:
        system = SHARED_INSTRUCTION + tokenizer.decode(document_ids[:document_tokens])
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


# ---- systems --------------------------------------------------------------------------------------

RunFn = Callable[[list[list[int]], SamplingParams], TimedRun]


def _build_systems(config: RunConfig, engine: Engine) -> dict[str, RunFn]:
    names = config.benchmark.system_names()
    systems: dict[str, RunFn] = {}
    hf_models: dict[str, Any] = {}
    if any(n in HF_DTYPES for n in names):
        fp32 = load_hf_model(engine.model_path)
        hf_models = {
            n: fp32 if HF_DTYPES[n] == torch.float32 else cast_model(fp32, HF_DTYPES[n])
            for n in names
            if n in HF_DTYPES
        }
    eos_token_ids = _eos_token_ids(engine)
    pad_token_id = engine.tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = eos_token_ids[0]
    block_size = engine.config.block_size
    for name in names:
        if name in HF_DTYPES:
            model = hf_models[name]
            systems[name] = lambda prompts, params, model=model: hf_generate(
                model,
                prompts,
                params.max_tokens,
                config.benchmark.hf_batch_size,
                pad_token_id,
                eos_token_ids,
                ignore_eos=params.ignore_eos,
            )
            continue
        planner = config.planner
        target = engine
        if name == "batchrun_no_prefix_cache":
            # Same batch limits as the main engine: only the prefix cache differs.
            target = load_engine(
                dataclasses.replace(
                    engine.config,
                    enable_prefix_caching=False,
                    max_num_seqs=engine.max_num_seqs,
                    max_num_batched_tokens=engine.max_num_batched_tokens,
                )
            )
        elif name == "batchrun_no_planner":
            planner = dataclasses.replace(planner, enabled=False)
        elif name != "batchrun":
            planner = dataclasses.replace(planner, enabled=True, order=name.removeprefix("batchrun_"))
        systems[name] = lambda prompts, params, target=target, planner=planner: batchrun_generate(
            target, prompts, params, planner, block_size
        )
    return systems


def _eos_token_ids(engine: Engine) -> list[int]:
    ids: list[int] = []
    for source in (getattr(engine.hf_config, "eos_token_id", None), engine.tokenizer.eos_token_id):
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def batchrun_generate(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, planner: PlannerConfig, block_size: int
) -> TimedRun:
    """The engine over `prompts` as a job shard runs them: planned, streamed with the engine's own
    in-flight bound; the prefix cache is emptied first so that no run reuses an earlier one's blocks."""
    engine.reset_prefix_cache()
    requests = [EngineRequest(request_id=i, prompt=p) for i, p in enumerate(prompts)]
    outputs: list[Optional[RequestOutput]] = [None] * len(prompts)
    start = time.perf_counter()
    for out in engine.stream(plan_requests(requests, planner, block_size), params):
        outputs[out.request_id] = out
    wall_s = time.perf_counter() - start
    done = [o for o in outputs if o is not None]
    assert len(done) == len(prompts)
    failed = [o for o in done if o.finish_reason == "error"]
    if failed:
        raise JobError(f"the engine failed {len(failed)} benchmark prompts: {failed[0].error}")
    run = TimedRun(
        wall_s,
        [o.token_ids for o in done],
        sum(len(o.prompt_token_ids) for o in done),
        sum(len(o.token_ids) for o in done),
        sum(o.metrics.num_cached_tokens for o in done),
        0,
    )
    run.num_computed_tokens = run.num_prompt_tokens - run.num_cached_tokens + run.num_output_tokens
    run.ttfts_s = [o.metrics.ttft_s for o in done if o.metrics.ttft_s is not None]
    run.itls_s = [o.metrics.itl_s for o in done if o.metrics.itl_s is not None]
    return run


def _matmul_shape(engine: Engine) -> tuple[int, int]:
    """(hidden, intermediate) of the model: its MLP matmuls are the bulk of the FLOPs."""
    c = engine.hf_config
    hidden = int(getattr(c, "hidden_size", 1024))
    return hidden, int(getattr(c, "intermediate_size", None) or 4 * hidden)
