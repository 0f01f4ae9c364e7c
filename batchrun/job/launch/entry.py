"""run_job: the entry point of a run. One worker in this process, or, with launcher.num_workers=N
(and no rank given; null: one per visible GPU), N worker processes on this machine (pool.py), or
with launcher=ray N Ray actors (ray_launch.py), each running runner.run_worker.
Where the whole run ends (the one worker, the launcher, or the last of several workers to finish)
it writes the run's report.html (report.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

from batchrun.engine import Engine
from batchrun.job.config import RunConfig
from batchrun.job.launch.pool import num_local_workers, run_local_workers
from batchrun.job.launch.ray_launch import run_ray_workers
from batchrun.job.operate.report import write_report_at_end
from batchrun.job.results import RunResult
from batchrun.job.run.runner import run_worker
from batchrun.job.shards import resolve_worker


def run_job(config: RunConfig, engine: Optional[Engine] = None, env: Optional[Mapping[str, str]] = None) -> RunResult:
    """Run the job (or this worker's share of it). Raises JobError when it cannot start at all and
    ConfigError for a configuration it refuses.

    `engine` may be passed in to reuse a loaded one (notebooks, tests); `env` defaults to
    os.environ and is where torchrun/Slurm ranks are read from when the config leaves them unset.
    """
    env = env if env is not None else os.environ
    if config.launcher.name == "ray":
        result, world_size = run_ray_workers(config, env), 1  # the driver ends after all its actors
    elif config.launcher.rank is None and _num_workers(config, env, engine) > 1:
        result = run_local_workers(config, env)
        world_size = 1  # the launcher ends after all its workers: the run has ended
    else:
        result = run_worker(config, engine, env)
        world_size = resolve_worker(config.launcher, env).world_size
    # Once per run, after its manifest is final; a stopped run resumes, and its rerun writes it.
    if result.status != "interrupted":
        write_report_at_end(config.output.uri, config.output.storage_options, world_size)
    return result


def _num_workers(config: RunConfig, env: Mapping[str, str], engine: Optional[Engine]) -> int:
    """An engine passed in is used here, in this process, unless num_workers asks for more."""
    if engine is not None and config.launcher.num_workers is None:
        return 1
    return num_local_workers(config, env)
