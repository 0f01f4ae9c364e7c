"""The job-runner layer: Parquet shards in, result and metrics files out, exactly once.

It sees the engine's public API only (`batchrun.engine`), and no Hydra: the cli hands it a RunConfig.
"""

from batchrun.job.commit.checkpoints import committed_urls
from batchrun.job.config import (
    DataConfig,
    JobConfig,
    LauncherConfig,
    ModelConfig,
    OutputConfig,
    RunConfig,
    build_run_config,
    config_fields,
)
from batchrun.job.errors import ConfigError, JobError, ShardError
from batchrun.job.launch.entry import run_job
from batchrun.job.operate.summary import format_summary
from batchrun.job.results import RunResult, ShardSummary
from batchrun.job.run.runner import load_engine

__all__ = [
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "JobError",
    "LauncherConfig",
    "ModelConfig",
    "OutputConfig",
    "RunConfig",
    "RunResult",
    "ShardError",
    "ShardSummary",
    "build_run_config",
    "committed_urls",
    "config_fields",
    "format_summary",
    "load_engine",
    "run_job",
]
