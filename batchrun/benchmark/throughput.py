"""The benchmark job: batchrun against HF transformers `generate` on the same prompts, in one process.

    python -m batchrun job=benchmark [benchmark.workload=summarize|shared_prefix|random] [benchmark.*=...]

Every system runs the same token-id prompts with greedy decoding. Runs alternate (round 1: each
system once, round 2: each again, ...) so that all systems see the same drift of a shared machine,
and ratios are taken within a round, then the median over rounds; the order within a round rotates
by one system per round. Before every batchrun run the
engine's prefix cache is emptied: a repeat must not reuse the previous repeat's blocks.

Systems (benchmark.systems; null picks batchrun, hf_fp32 and hf_bf16, plus batchrun_job for the
summarize workload and batchrun_no_prefix_cache for shared_prefix):
  batchrun                  the engine as configured (engine.*), fed through the planner (planner.*)
                            with the job's in-flight bound, exactly as a job shard is
  batchrun_no_prefix_cache  a second engine with enable_prefix_caching=false and the same batch limits
  batchrun_no_planner       the engine, prompts in input order
  batchrun_<order>          the engine with planner.order=<order> (longest_first, shortest_first, input)
  batchrun_job              the job itself over the same rows as one Parquet shard (jobpath.py):
                            reading, prompts, planner, results and commit included (summarize only)
  batchrun_job_sharded      the same rows as benchmark.job_shards shards, flowing across boundaries
  batchrun_job_sharded_sequential  those shards one after another (planner.max_open_shards=1)
  hf_fp32, hf_bf16          HF `generate` in static batches of benchmark.hf_batch_size (hf_baseline.py)

Workloads: summarize (the job's prompt over the rows at data.uri, by default the bundled 32 CPython
documentation topics, with the chat template), shared_prefix (one long instruction of about
benchmark.shared_prefix_tokens tokens, then short distinct questions) and random (random token ids
of random lengths, ignore_eos, as vLLM's and nano-vllm's throughput benchmarks do), built in
workloads.py.

Results go to {output.uri}/benchmark/ (see report.py) and are printed as a table; with
benchmark.write_docs=true the table also replaces docs/benchmarks.md's section for the workload
(doc.py).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, get_args

import torch

from batchrun.benchmark.config import BENCHMARK_SYSTEMS, BenchmarkConfig
from batchrun.benchmark.doc import command_line, stamp, write_section
from batchrun.benchmark.hf_baseline import cast_model, count_parameters, hf_generate, load_hf_model
from batchrun.benchmark.jobpath import JobPath
from batchrun.benchmark.report import BenchmarkResult, build_result, markdown_benchmark, write_result
from batchrun.benchmark.timing import TimedRun, matmul_peak, round_order
from batchrun.benchmark.workloads import BenchmarkWorkload, build_workload
from batchrun.engine import Engine, EngineRequest, RequestOutput, SamplingParams
from batchrun.job.config import PlannerConfig, PlanOrder
from batchrun.job.errors import JobError
from batchrun.job.run.planner import plan_requests
from batchrun.job.run.runner import load_engine

if TYPE_CHECKING:
    from batchrun.job.config import RunConfig

log = logging.getLogger(__name__)

PLANNER_ORDERS = ("longest_first", "shortest_first", "input")
SYSTEMS = BENCHMARK_SYSTEMS
HF_DTYPES = {"hf_fp32": torch.float32, "hf_bf16": torch.bfloat16}


def run_benchmark(config: RunConfig, bench: BenchmarkConfig, engine: Optional[Engine] = None) -> BenchmarkResult:
    """Run the benchmark job: `config` sets up the engine, planner and summarize rows as a job
    would, `bench` what is measured; `engine` may be passed in to reuse a loaded one (tests)."""
    load_start = os.getloadavg()
    engine = engine or load_engine(config.engine)
    workload = build_workload(config, bench, engine)
    systems, job_paths = _build_systems(config, bench, engine, workload)
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
    for round_index in range(bench.repeats):
        for name in round_order(list(systems), round_index):
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
        "engine": engine.settings.as_dict(),
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
    for job_path in job_paths:
        job_path.close()
    result = build_result(bench, runs, settings)
    write_result(result, config.output.uri, dict(config.output.storage_options))
    if bench.write_docs:
        table, notes = markdown_benchmark(result)
        command = command_line("python -m batchrun", sys.argv[1:], drop=("benchmark.write_docs",))
        title = f"Engine against HF transformers `generate` ({bench.workload})"
        log.info("wrote %s", write_section(f"throughput-{bench.workload}", command, stamp(), table, notes, title))
    return result


# ---- systems --------------------------------------------------------------------------------------

RunFn = Callable[[list[list[int]], SamplingParams], TimedRun]
_PLAN_ORDERS: dict[str, PlanOrder] = {order: order for order in get_args(PlanOrder)}


def _build_systems(
    config: RunConfig, bench: BenchmarkConfig, engine: Engine, workload: BenchmarkWorkload
) -> tuple[dict[str, RunFn], list[JobPath]]:
    names = bench.system_names()
    systems: dict[str, RunFn] = {}
    job_paths: list[JobPath] = []
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
            systems[name] = _hf_system(hf_models[name], bench.hf_batch_size, pad_token_id, eos_token_ids)
            continue
        if name.startswith("batchrun_job"):
            job_path = _job_path(config, workload, 1 if name == "batchrun_job" else bench.job_shards)
            job_paths.append(job_path)
            systems[name] = _job_system(job_path, engine, 1 if name.endswith("_sequential") else None)
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
            planner = dataclasses.replace(planner, enabled=True, order=_PLAN_ORDERS[name.removeprefix("batchrun_")])
        systems[name] = _engine_system(target, planner, block_size)
    return systems, job_paths


def _hf_system(model: Any, batch_size: int, pad_token_id: int, eos_token_ids: list[int]) -> RunFn:
    def run(prompts: list[list[int]], params: SamplingParams) -> TimedRun:
        return hf_generate(
            model, prompts, params.max_tokens, batch_size, pad_token_id, eos_token_ids, ignore_eos=params.ignore_eos
        )

    return run


def _job_system(job_path: JobPath, engine: Engine, max_open: Optional[int]) -> RunFn:
    def run(prompts: list[list[int]], params: SamplingParams) -> TimedRun:
        return job_path(engine, params, max_open, len(prompts))

    return run


def _engine_system(engine: Engine, planner: PlannerConfig, block_size: int) -> RunFn:
    def run(prompts: list[list[int]], params: SamplingParams) -> TimedRun:
        return batchrun_generate(engine, prompts, params, planner, block_size)

    return run


def _job_path(config: RunConfig, workload: BenchmarkWorkload, num_shards: int) -> JobPath:
    """The workload's input rows as Parquet shards; the warm-up's short call reads them all too."""
    assert workload.rows is not None, "BenchmarkConfig allows job systems for the summarize workload only"
    columns = [c for c in [config.data.id_column, *config.job.input_columns(config.data)] if c]
    rows = {c: [row.id if c == config.data.id_column else row.values[c] for row in workload.rows] for c in columns}
    return JobPath(config, rows, num_shards)


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
    return TimedRun.from_outputs(wall_s, done)


def _matmul_shape(engine: Engine) -> tuple[int, int]:
    """(hidden, intermediate) of the model: its MLP matmuls are the bulk of the FLOPs."""
    c = engine.hf_config
    hidden = int(getattr(c, "hidden_size", 1024))
    return hidden, int(getattr(c, "intermediate_size", None) or 4 * hidden)
