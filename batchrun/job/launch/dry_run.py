"""dry_run=true: what a run would do, counted before it is run.

The plan reads every input row as a run would (ShardReader / BatchFileReader: streamed, memory
bounded by data.batch_size and the planner window), checks and builds each prompt with the same
code as a run (the run's ShardFormat from shard_format.select_format, with the real tokenizer and
template, and rows.with_row_schema), so the rows it counts as errors, by type, are the rows a run writes as error rows,
and its prompt tokens are the ones the run's metrics count. It loads the engine for the tokenizer,
the max_model_len and the measured prefill and decode rates (Engine.throughput_profile); the engine
runs no request. Nothing is read from or written to output.uri: a plan is the same whatever an
earlier run committed there (a run skips what is committed; the plan counts the whole input).

The time estimate is the profile's rates applied to the counts: prompt tokens not in a shared
prefix at the prefill rate of the engine's chunk size, and every row's max_tokens x n output tokens
at the decode rate of a full batch. Rows that stop before max_tokens make the run faster; long
contexts and preemptions slower. With several workers the shards are dealt out longest first
(what work stealing approaches); on a CPU the workers split the cores, so each runs slower. A
worker that is a tensor-parallel group (engine.tensor_parallel_size) holds that many devices for
its whole run: its rates are the group's (the engine loaded here is one), and its device-hours
count every rank.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import posixpath
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from batchrun.engine import Engine, SamplingParams, ThroughputProfile
from batchrun.job.config import RunConfig, check_task, check_thinking
from batchrun.job.errors import ConfigError, ShardError
from batchrun.job.formats.prompts import Prompt
from batchrun.job.formats.reader import InputRow
from batchrun.job.formats.rows import INVALID_SCHEMA, with_row_schema
from batchrun.job.formats.shard_format import (
    RowReader,
    ShardFormat,
    engine_task,
    engine_think_tags,
    format_class,
    select_format,
)
from batchrun.job.launch.pool import num_local_workers
from batchrun.job.run.runner import load_engine
from batchrun.job.shards import Shard, discover_shards, open_filesystem, resolve_worker
from batchrun.utils.redact import redact


@dataclass(frozen=True)
class ShardPlan:
    name: str
    url: str
    num_rows: int  # input rows read
    num_result_rows: int  # result rows a run writes for them (sampling.n per row; a batch line's own n)
    error_counts: dict[str, int]  # error result rows by error_type
    num_prompt_tokens: int  # over the rows the engine would run, per result row (as the metrics count)
    num_prefill_tokens: int  # prompt tokens to compute: per row, less those in shared prefixes
    max_output_tokens: int  # the rows' max_tokens x n
    error: Optional[str] = None  # why a run would fail this shard (unreadable, a missing column)


@dataclass(frozen=True)
class Estimate:
    num_workers: int
    wall_s: float  # engine start-up plus the busiest worker's share
    # GPU-hours (tensor_parallel_size GPUs per worker), or CPU core-hours (every rank's threads)
    device_hours: float
    device_unit: str  # "GPU" or "CPU core"
    tensor_parallel_size: int = 1  # engine.tensor_parallel_size: devices (ranks) per worker


@dataclass(frozen=True)
class RunPlan:
    data_uri: str
    model: str
    device: str
    num_shards: int
    num_failed_shards: int
    num_rows: int
    num_result_rows: int
    num_ok: int  # result rows with a prompt
    error_counts: dict[str, int]  # error result rows by error_type
    error_examples: dict[str, str]  # error_type -> the message of its first row (why)
    num_truncated: int  # ok rows cut to fit (data.on_too_long=truncate)
    num_prompt_tokens: int
    prompt_tokens_p50: Optional[int]  # per prompt, over the rows with a prompt
    prompt_tokens_p99: Optional[int]
    prompt_tokens_max: Optional[int]
    block_size: int
    planner_window: int
    # Prompt tokens in full KV blocks that an earlier prompt of the same planner window starts with
    # too (the planner runs those prompts back to back; the prefix cache serves the blocks).
    num_shared_prefix_tokens: int
    num_prefill_tokens: int  # prompt tokens to compute: num_prompt_tokens less shared prefixes and samples
    max_tokens: int  # sampling.max_tokens
    n: int  # sampling.n
    max_output_tokens: int
    profile: dict[str, Any]  # the rates the estimate used, and where they were measured
    estimates: tuple[Estimate, ...]  # for 1 and N workers
    shards: tuple[ShardPlan, ...]
    # the engine's kernel set (EngineSettings.kernels): which function serves each kernel, and the
    # tuning's choices; what a run of this plan would run
    kernels: dict[str, Any] = dataclasses.field(default_factory=dict)
    # With model.lora_adapters: ok result rows per adapter the rows name (the rest run on the base model)
    adapter_counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_run(config: RunConfig, engine: Optional[Engine] = None, env: Optional[Mapping[str, str]] = None) -> RunPlan:
    """Plan the run `config` describes (the whole input, whichever worker asks). Raises
    ConfigError and JobError as a run's start would."""
    env = env if env is not None else os.environ
    assert config.data.uri is not None, "DataConfig requires a uri"
    input_format = format_class(config)
    input_format.check_config(config)
    data_fs, data_path = open_filesystem(config.data.uri, config.data.storage_options)
    out_fs, out_path = open_filesystem(config.output.uri, config.output.storage_options)
    same_fs = type(data_fs) is type(out_fs) and data_fs.protocol == out_fs.protocol
    exclude = (out_path.rstrip("/") or out_path) if same_fs else None
    shards = discover_shards(data_fs, data_path, config.data.uri, exclude, config.data.format)
    input_format.check_first_shard(config, data_fs, shards[0])
    worker = resolve_worker(config.launcher, env)
    local = num_local_workers(config, env) if config.launcher.rank is None else 1
    num_workers = local if local > 1 else worker.world_size

    engine = engine or load_engine(config.engine)
    check_task(config, engine_task(engine), engine.tokenizer)  # as a run would refuse it
    check_thinking(config, engine_think_tags(engine))
    profile = engine.throughput_profile()
    counter = _Counter(config, select_format(config, engine), engine.config.block_size, engine_task(engine))
    plans = [counter.shard(shard, data_fs) for shard in shards]
    return counter.result(config, engine, profile, plans, num_workers)


def write_plan_json(plan: RunPlan, path: str, output_uri: str) -> None:
    """The plan as JSON at `path` (a local path or fsspec URL), refused inside output.uri: a dry
    run writes nothing there."""
    import fsspec

    fs, target = open_filesystem(path, {})
    out_fs, out_root = open_filesystem(output_uri, {})
    if type(fs) is type(out_fs) and fs.protocol == out_fs.protocol:
        target_abs, root_abs = posixpath.normpath(target), posixpath.normpath(out_root.rstrip("/") or out_root)
        if target_abs == root_abs or target_abs.startswith(root_abs.rstrip("/") + "/"):
            raise ConfigError(
                "dry_run_json", f"{path} is inside output.uri ({output_uri}); a dry run writes nothing there"
            )
    with fsspec.open(path, "w") as f:
        json.dump(redact(plan.to_dict()), f, indent=1, default=str)  # a signed data.uri's signature stays out
        f.write("\n")


class _Counter:
    """Counts rows shard by shard; the planner windows run across shard boundaries, as in a run."""

    def __init__(self, config: RunConfig, input_format: ShardFormat, block_size: int, task: str = "generate") -> None:
        self.config = config
        self.is_pooling = task != "generate"  # embed/score: no output tokens
        self.format = input_format
        self.block_size = block_size
        self.lengths: Counter[int] = Counter()  # prompt length -> rows: percentiles in memory bounded by max_model_len
        self.error_examples: dict[str, str] = {}
        self.num_truncated = 0
        self.num_shared = 0
        self.window: set[int] = set()  # chained hashes of the full blocks of the window's prompts
        self.window_rows = 0
        self.adapter_counts: Counter[str] = Counter()

    def shard(self, shard: Shard, fs: Any) -> ShardPlan:
        errors: Counter[str] = Counter()
        totals = dict(rows=0, results=0, prompt=0, prefill=0, output=0)
        seen_ids: set[Any] = set()
        failure: Optional[str] = None
        reader: Optional[RowReader] = None
        try:
            reader = self.format.open_reader(shard, fs)
            for row in reader.rows():
                prompt, params, adapter = self._prompt(row, seen_ids)
                n = self.format.num_samples(prompt, params)
                totals["rows"] += 1
                totals["results"] += n
                if prompt.token_ids is None:
                    error_type = prompt.error_type or ""
                    errors[error_type] += n
                    self.error_examples.setdefault(error_type, prompt.error_message or "")
                    continue
                length = len(prompt.token_ids)
                self.lengths[length] += 1
                if adapter is not None:
                    self.adapter_counts[adapter] += n
                self.num_truncated += prompt.error_message is not None
                totals["prompt"] += length * n
                totals["prefill"] += length - self._shared(prompt.token_ids, adapter)  # samples share one prefill
                if not self.is_pooling:
                    totals["output"] += (params or self.config.sampling).max_tokens * n
        except ShardError as e:
            failure = str(e)
        finally:
            if reader is not None:
                reader.close()
        return ShardPlan(
            shard.name,
            shard.url,
            totals["rows"],
            totals["results"],
            dict(sorted(errors.items())),
            totals["prompt"],
            totals["prefill"],
            totals["output"],
            failure,
        )

    def _prompt(self, row: InputRow, seen_ids: set[Any]) -> tuple[Prompt, Optional[SamplingParams], Optional[str]]:
        """The row's prompt (or error), its own params and its adapter, in the order
        flow.ShardRun.requests checks."""
        built = self.format.build(row, seen_ids)
        prompt, params = built.prompt, built.params
        if prompt.token_ids is not None:
            checked, schema_error = with_row_schema(row, params or self.config.sampling, self.config.data.schema_column)
            if schema_error is not None:
                return Prompt(error_type=INVALID_SCHEMA, error_message=schema_error), None, built.adapter
            params = params if checked is None else checked
        return prompt, params, built.adapter

    def _shared(self, ids: list[int], adapter: Optional[str] = None) -> int:
        """Tokens of this prompt's leading full blocks that an earlier prompt of its planner window
        has too. Blocks as the prefix cache keys them: full blocks among all but the last token
        (engine/kv_cache.match_prefix), each keyed by its tokens and every token before them, and
        by the row's adapter (rows of different adapters share no KV)."""
        if self.window_rows >= self.config.planner.window:
            self.window.clear()
            self.window_rows = 0
        self.window_rows += 1
        bs = self.block_size
        key = hash(("adapter", adapter)) if adapter is not None else 0
        shared = 0
        for i in range((len(ids) - 1) // bs):
            key = hash((key, tuple(ids[i * bs : (i + 1) * bs])))
            if key in self.window:
                shared += bs
            else:
                self.window.add(key)
        self.num_shared += shared
        return shared

    def result(
        self, config: RunConfig, engine: Engine, profile: ThroughputProfile, plans: list[ShardPlan], num_workers: int
    ) -> RunPlan:
        errors: Counter[str] = Counter()
        for p in plans:
            errors.update(p.error_counts)
        num_results = sum(p.num_result_rows for p in plans)
        num_ok_results = num_results - sum(errors.values())
        rates = _rates(profile, num_ok_results)
        tp = config.engine.tensor_parallel_size
        estimates = tuple(_estimate(plans, profile, rates, w, tp) for w in sorted({1, num_workers}))
        return RunPlan(
            data_uri=config.data.uri or "",
            model=engine.model_path,
            device=profile.device,
            num_shards=len(plans),
            num_failed_shards=sum(p.error is not None for p in plans),
            num_rows=sum(p.num_rows for p in plans),
            num_result_rows=num_results,
            num_ok=num_ok_results,
            error_counts=dict(sorted(errors.items())),
            error_examples=dict(sorted(self.error_examples.items())),
            num_truncated=self.num_truncated,
            num_prompt_tokens=sum(p.num_prompt_tokens for p in plans),
            prompt_tokens_p50=_percentile(self.lengths, 0.50),
            prompt_tokens_p99=_percentile(self.lengths, 0.99),
            prompt_tokens_max=max(self.lengths) if self.lengths else None,
            block_size=self.block_size,
            planner_window=config.planner.window,
            num_shared_prefix_tokens=self.num_shared,
            num_prefill_tokens=sum(p.num_prefill_tokens for p in plans),
            max_tokens=config.sampling.max_tokens,
            n=config.sampling.n,
            max_output_tokens=sum(p.max_output_tokens for p in plans),
            profile=rates,
            estimates=estimates,
            shards=tuple(plans),
            kernels=engine.settings.as_dict()["kernels"],
            adapter_counts=dict(sorted(self.adapter_counts.items())),
        )


def _percentile(lengths: Counter[int], q: float) -> Optional[int]:
    """Nearest rank: the smallest length that at least q of the prompts do not exceed."""
    total = sum(lengths.values())
    if not total:
        return None
    rank, seen = q * total, 0
    for length in sorted(lengths):
        seen += lengths[length]
        if seen >= rank:
            return length
    return max(lengths)


def _rate_at(points: Mapping[int, float], x: float) -> float:
    """A measured rate at `x`, linear between the measured points and the nearest one outside them."""
    xs = sorted(int(k) for k in points)
    if x <= xs[0]:
        return float(points[xs[0]])
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            return float(points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo))
    return float(points[xs[-1]])


def _rates(profile: ThroughputProfile, num_ok_results: int) -> dict[str, Any]:
    """The rates a run's steps would go at: prefill in chunks of max_num_batched_tokens, decode
    with the batch as full as the rows allow."""
    batch = max(1, min(profile.max_num_seqs, num_ok_results))
    return {
        "prefill_tok_s": _rate_at(profile.prefill_tok_s, profile.max_num_batched_tokens),
        "prefill_chunk_tokens": profile.max_num_batched_tokens,
        "decode_tok_s": _rate_at(profile.decode_tok_s, batch),
        "decode_batch": batch,
        "startup_s": profile.startup_s,
        "num_threads": profile.num_threads,
        "measured": {"prefill_tok_s": profile.prefill_tok_s, "decode_tok_s": profile.decode_tok_s},
    }


def _estimate(
    plans: list[ShardPlan], profile: ThroughputProfile, rates: dict[str, Any], workers: int, tp: int = 1
) -> Estimate:
    """`workers` engines of `tp` ranks each, at the profile's rates (a group's, when `tp` > 1)."""
    # On a CPU the workers split the cores (pool.worker_configs): each goes at 1/workers of the rate.
    slowdown = workers if profile.device == "cpu" else 1
    times = sorted(
        (
            slowdown * (p.num_prefill_tokens / rates["prefill_tok_s"] + p.max_output_tokens / rates["decode_tok_s"])
            for p in plans
        ),
        reverse=True,
    )
    loads = [0.0] * workers
    for t in times:  # longest first onto the least loaded worker
        heapq.heapreplace(loads, loads[0] + t)
    wall = profile.startup_s + max(loads)
    if profile.device == "cpu":
        # The profile's threads are one rank's (a group splits its threads between its ranks).
        return Estimate(workers, wall, wall * profile.num_threads * tp / 3600, "CPU core", tp)
    # A worker holds its group's GPUs from start to end, idle ranks included.
    return Estimate(workers, wall, wall * workers * tp / 3600, "GPU", tp)


def format_plan(plan: RunPlan, max_shards: int = 20) -> str:
    """The plan as the cli prints it."""
    lines = [
        f"dry run: {plan.data_uri} with {plan.model} on {plan.device} (nothing was run or written)",
        f"shards:         {plan.num_shards}"
        + (f" ({plan.num_failed_shards} would fail)" if plan.num_failed_shards else ""),
        f"rows:           {plan.num_rows} ({plan.num_result_rows} result rows, n={plan.n}): "
        f"{plan.num_ok} ok, {sum(plan.error_counts.values())} error rows"
        + (f", {plan.num_truncated} truncated" if plan.num_truncated else ""),
    ]
    for error_type, count in plan.error_counts.items():
        lines.append(f"  {error_type:<14}{count:>8}  e.g. {plan.error_examples.get(error_type, '')}")
    lines += [
        f"prompt tokens:  {plan.num_prompt_tokens} (per prompt p50 {_or_dash(plan.prompt_tokens_p50)}, "
        f"p99 {_or_dash(plan.prompt_tokens_p99)}, max {_or_dash(plan.prompt_tokens_max)})",
        f"shared prefix:  {plan.num_shared_prefix_tokens} tokens in full {plan.block_size}-token blocks that an "
        f"earlier prompt of the same {plan.planner_window}-row planner window starts with "
        f"({_share(plan.num_shared_prefix_tokens, plan.num_prompt_tokens)} of prompt tokens); "
        f"{plan.num_prefill_tokens} to compute",
        f"output tokens:  at most {plan.max_output_tokens} "
        f"({plan.num_ok} ok result rows x max_tokens {plan.max_tokens})",
        f"profile:        prefill {plan.profile['prefill_tok_s']:.0f} tok/s "
        f"({plan.profile['prefill_chunk_tokens']}-token chunks), decode {plan.profile['decode_tok_s']:.0f} tok/s "
        f"({plan.profile['decode_batch']} sequences), start-up {plan.profile['startup_s']:.1f}s",
    ]
    if plan.adapter_counts:
        per_adapter = ", ".join(f"{name} {count}" for name, count in plan.adapter_counts.items())
        base = plan.num_ok - sum(plan.adapter_counts.values())
        lines.append(f"adapters:       {per_adapter} ok result rows; {base} on the base model")
    if plan.kernels:
        k = plan.kernels
        lines.append(
            f"kernels:        {k['binder']} kernel set for {k['target']['name']} ({k['dtype']}, "
            f"KV cache {k['kv_cache_dtype']}), tuning: {k['tuning']['source']}"
        )
    for e in plan.estimates:
        group = f" of tensor_parallel_size {e.tensor_parallel_size}" if e.tensor_parallel_size > 1 else ""
        lines.append(
            f"estimate:       {e.num_workers} worker(s){group}: {_duration(e.wall_s)} wall, "
            f"{e.device_hours:.3f} {e.device_unit}-hours (every row to max_tokens: an upper bound)"
        )
    failed = [p for p in plan.shards if p.error]
    for p in failed[:max_shards]:
        lines.append(f"would fail:     {p.name}: {p.error}")
    return "\n".join(lines)


def _or_dash(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
