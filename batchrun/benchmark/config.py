"""What `job=benchmark` measures: its config group (conf/job/benchmark.yaml) and its systems.

The group lives with the benchmark, not in the job's RunConfig: only `job=benchmark` composes it,
and the cli takes it out of the composed config and checks it here, with the job layer's checker
(`build_section`: one line naming a bad key or value), before it imports the benchmark itself.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

from batchrun.job.config import PlanOrder, build_section

WorkloadName = Literal["summarize", "shared_prefix", "random"]
BENCHMARK_SYSTEMS = (
    "batchrun",
    "batchrun_no_prefix_cache",
    "batchrun_no_planner",
    *(f"batchrun_{order}" for order in typing.get_args(PlanOrder)),
    "batchrun_job",
    "batchrun_job_sharded",
    "batchrun_job_sharded_sequential",
    "hf_fp32",
    "hf_bf16",
)


@dataclass(frozen=True)
class BenchmarkConfig:
    """What `job=benchmark` measures (the `benchmark` config group; see conf/job/benchmark.yaml)."""

    workload: WorkloadName = "summarize"
    num_prompts: int = 32
    max_tokens: int = 64  # greedy new tokens per prompt (sampling.* is not used: the benchmark is greedy)
    repeats: int = 3  # rounds; each runs every system once
    hf_batch_size: int = 16  # HF static batch size (16 was its best setting on the 2-core machine)
    # null: batchrun, hf_fp32, hf_bf16 (+ batchrun_job for summarize, + no_prefix_cache for shared_prefix)
    systems: Optional[tuple[str, ...]] = None
    # batchrun_job_sharded*: the rows split into this many shards (batchrun_job: one shard)
    job_shards: int = 10
    shared_prefix_tokens: int = 670  # shared_prefix: tokens every prompt shares (chat template included)
    random_min_tokens: int = 32  # random: prompt lengths drawn uniformly from [min, max]
    random_max_tokens: int = 512
    seed: int = 0  # random prompts
    write_docs: bool = False  # also replace the workload's section of docs/benchmarks.md (bench/doc.py)

    def __post_init__(self) -> None:
        if self.workload not in ("summarize", "shared_prefix", "random"):
            raise ValueError(f"benchmark.workload must be summarize, shared_prefix or random, got {self.workload!r}")
        for name in (
            "num_prompts",
            "max_tokens",
            "repeats",
            "hf_batch_size",
            "shared_prefix_tokens",
            "random_min_tokens",
            "random_max_tokens",
            "job_shards",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"benchmark.{name} must be >= 1, got {getattr(self, name)}")
        if self.random_min_tokens > self.random_max_tokens:
            raise ValueError("benchmark.random_min_tokens must be <= benchmark.random_max_tokens")
        unknown = [s for s in self.systems or () if s not in BENCHMARK_SYSTEMS]
        if unknown:
            raise ValueError(f"benchmark.systems: unknown {', '.join(unknown)} (known: {', '.join(BENCHMARK_SYSTEMS)})")
        if self.systems is not None and not self.systems:
            raise ValueError("benchmark.systems: empty; use null for the default set")
        job_systems = [s for s in self.systems or () if s.startswith("batchrun_job")]
        if job_systems and self.workload != "summarize":
            raise ValueError(
                f"benchmark.systems: {job_systems[0]} runs input rows through the job, so it needs "
                f"benchmark.workload=summarize (got {self.workload})"
            )

    def system_names(self) -> list[str]:
        if self.systems is not None:
            return list(dict.fromkeys(self.systems))
        extra = {"shared_prefix": ["batchrun_no_prefix_cache"], "summarize": ["batchrun_job"]}.get(self.workload, [])
        return ["batchrun", *extra, "hf_fp32", "hf_bf16"]


def benchmark_config(values: Mapping[str, Any]) -> BenchmarkConfig:
    """The composed `benchmark` group as a BenchmarkConfig; ConfigError naming the key when bad."""
    config: BenchmarkConfig = build_section(BenchmarkConfig, values, "benchmark")
    return config
