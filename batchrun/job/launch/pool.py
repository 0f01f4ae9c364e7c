"""launcher.num_workers=N: N worker processes on this machine, one engine each, then one report.

Each worker is a real subprocess (`python -m batchrun.job.launch.pool CONFIG.json`) running run_job as
rank r of N: its own shards first (round-robin), then, with launcher.work_stealing, other workers'
unstarted shards and those of workers that died (claims.py). On a GPU machine each worker sees its
own engine.tensor_parallel_size GPUs (CUDA_VISIBLE_DEVICES; one, unless the worker is a
tensor-parallel group); on CPU the cores are split between them (engine.num_threads), by rank of
every worker's group (cpu_threads_per_worker).

The launcher forwards SIGTERM/SIGINT to the workers (each stops and commits nothing partial), waits
for all of them, merges their manifests with the commit markers into `_manifest.json`, and reports
from the markers: a worker that died mid-run (even by SIGKILL) costs nothing when the others took
its shards over, and a rerun of the same command redoes whatever is left.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Optional

from batchrun.job.commit.manifest import utc_now, write_merged_manifest
from batchrun.job.commit.store import RunStore
from batchrun.job.config import RunConfig, build_run_config
from batchrun.job.errors import ConfigError, JobError
from batchrun.job.results import DONE_STATUSES, RunResult, ShardSummary
from batchrun.job.run.runner import run_worker
from batchrun.job.run.signals import StopRequest
from batchrun.job.shards import Shard, discover_shards, open_filesystem, resolve_worker
from batchrun.utils.logs import StderrHandler
from batchrun.utils.redact import redact_query

log = logging.getLogger(__name__)

POLL_S = 0.2


def num_local_workers(config: RunConfig, env: Mapping[str, str], device_count: Optional[int] = None) -> int:
    """launcher.num_workers, or where it is null one worker per engine.tensor_parallel_size visible
    GPUs: one where a scheduler (or the config) gives this process its rank, on the CPU, and where
    no GPU is visible. `device_count`: the GPUs torch would see (tests simulate a GPU host with it)."""
    if config.launcher.num_workers is not None:
        return config.launcher.num_workers
    if config.launcher.rank is not None or resolve_worker(config.launcher, env).source != "default":
        return 1
    gpu_ids = _gpu_ids(config, env, device_count)
    if gpu_ids is None:
        return 1
    _check_group_fits(config, gpu_ids)
    return max(1, len(gpu_ids) // config.engine.tensor_parallel_size)


def worker_configs(
    config: RunConfig, env: Mapping[str, str], device_count: Optional[int] = None
) -> list[tuple[RunConfig, dict[str, str]]]:
    """Each worker's config (its rank, its share of the CPU threads) and environment (its GPUs:
    engine.tensor_parallel_size of them, one per rank of its group). `device_count` as in
    num_local_workers."""
    n = num_local_workers(config, env, device_count)
    gpu_ids = _gpu_ids(config, env, device_count)
    tp = config.engine.tensor_parallel_size
    if gpu_ids is not None:
        _check_group_fits(config, gpu_ids)
        if n * tp > len(gpu_ids):
            each = "" if tp == 1 else f" of engine.tensor_parallel_size={tp} GPUs each"
            need = f"{n} workers{each} need {n * tp} GPUs"
            raise ConfigError("launcher.num_workers", f"{need}; {len(gpu_ids)} visible")
    threads = config.engine.num_threads
    if gpu_ids is None and threads is None:
        threads = cpu_threads_per_worker(os.cpu_count() or 1, n, tp)
    out = []
    for rank in range(n):
        launcher = dataclasses.replace(config.launcher, rank=rank, world_size=n, num_workers=1)
        cfg = dataclasses.replace(
            config,
            launcher=launcher,
            quiet=True,  # N progress bars would tangle
            engine=dataclasses.replace(config.engine, num_threads=threads),
        )
        worker_env = {**env, "BATCHRUN_WORKER_RANK": str(rank)}
        if gpu_ids is not None:
            # The group's rank r takes cuda:r of these (engine/group_startup.py): rank 0 the first.
            worker_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids[rank * tp : (rank + 1) * tp])
        out.append((cfg, worker_env))
    return out


def cpu_threads_per_worker(num_cores: int, num_workers: int, tensor_parallel_size: int) -> int:
    """engine.num_threads for each of `num_workers` engines sharing `num_cores`, each a group of
    `tensor_parallel_size` processes. The cores are shared out per rank (every rank is a process
    with its own torch threads) and a worker gets its ranks' share: a whole multiple of its group
    size, so the engine's own split (num_threads // tensor_parallel_size per rank) leaves no core
    idle by rounding twice. At least one thread per rank, even where the ranks outnumber the
    cores: a rank cannot run on none."""
    return max(1, num_cores // (num_workers * tensor_parallel_size)) * tensor_parallel_size


def _check_group_fits(config: RunConfig, gpu_ids: list[str]) -> None:
    """Refused here, before any process starts, rather than by each worker's engine at its load."""
    tp = config.engine.tensor_parallel_size
    if len(gpu_ids) < tp:
        raise ConfigError(
            "engine.tensor_parallel_size",
            f"a group of {tp} ranks needs {tp} GPUs, one per rank; {len(gpu_ids)} visible",
        )


def _gpu_ids(config: RunConfig, env: Mapping[str, str], device_count: Optional[int] = None) -> Optional[list[str]]:
    """The GPUs the workers share out, or None when the engine runs on the CPU."""
    if config.engine.device == "cpu":
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    if device_count is None:
        import torch  # only here: a CPU-only launcher does not pay for importing it

        device_count = torch.cuda.device_count()
    count = device_count
    if count == 0:
        if config.engine.device == "cuda":
            raise ConfigError("engine.device", "cuda requested but no GPU is visible")
        return None
    return [str(i) for i in range(count)]


def open_run(config: RunConfig) -> tuple[RunStore, list[Shard]]:
    """A launcher's store and shard list: the same listing the workers make (runner._JobRun, plan.py), as
    the merged manifest's shards and the report are named from it."""
    assert config.data.uri is not None
    try:
        store = RunStore(config.output.uri, config.output.storage_options)
    except Exception as e:
        raise JobError(f"output.uri: cannot open {config.output.uri}: {e}") from None
    data_fs, data_path = open_filesystem(config.data.uri, config.data.storage_options)
    same_fs = type(data_fs) is type(store.fs) and data_fs.protocol == store.fs.protocol
    shards = discover_shards(
        data_fs, data_path, config.data.uri, exclude=store.root if same_fs else None, data_format=config.data.format
    )
    return store, shards


def run_local_workers(config: RunConfig, env: Mapping[str, str]) -> RunResult:
    store, shards = open_run(config)
    started_at, t0 = utc_now(), time.perf_counter()
    workers = worker_configs(config, env)
    log.info("starting %d workers over %d shards; output %s", len(workers), len(shards), store.url(store.root))
    with tempfile.TemporaryDirectory(prefix="batchrun-workers-") as tmp, StopRequest() as stop:
        procs = []
        for cfg, worker_env in workers:
            path = os.path.join(tmp, f"rank{cfg.launcher.rank}.json")
            with open(path, "w") as f:
                json.dump(cfg.to_dict(), f, default=str)
            # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it once
            # (a second signal would end a worker at once instead of gracefully).
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "batchrun.job.launch.pool", path], env=worker_env, start_new_session=True
                )
            )
        forwarded = False
        while any(p.poll() is None for p in procs):
            if stop.requested and not forwarded:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(stop.signum or 15)
                forwarded = True
            time.sleep(POLL_S)
    codes = [p.returncode for p in procs]
    return launcher_result(config, store, shards, started_at, t0, codes, stop)


def launcher_result(
    config: RunConfig,
    store: RunStore,
    shards: list[Shard],
    started_at: str,
    t0: float,
    codes: list[int],
    stop: StopRequest,
    what: str = "workers",
) -> RunResult:
    """After all workers ended (exit `codes`, negative: died by a signal): merge `_manifest.json`
    and report from the commit markers. Exit 0 when every shard is done, whoever did it; the stop
    signal's code when stopped first; else 1 (2 when a worker refused its configuration)."""
    if not config.launcher.work_stealing:  # the workers ran the shared plan's shards (plan.shared_shards)
        plan = store.read_json(store.path("_plan.json"))
        if isinstance(plan, dict) and isinstance(plan.get("shards"), list):
            shards = [Shard(**s) for s in plan["shards"]]
    doc = write_merged_manifest(store, shards, len(codes))
    summaries = []
    for record in doc["shards"]:
        status, metrics = record["status"], None
        if status == "committed":
            marker = store.read_marker(record["name"]) or {}
            metrics = marker.get("metrics")
            if (marker.get("committed_at") or "") < started_at:
                status = "skipped"
        summaries.append(ShardSummary(record["name"], status, metrics, record.get("error")))
    died = [r for r, c in enumerate(codes) if c < 0]
    if died:
        log.warning(
            "worker(s) %s died by a signal; %s",
            ", ".join(map(str, died)),
            "the others took their shards over"
            if doc["status"] == "completed"
            else "rerun the same command to redo what they left",
        )
    num_left = sum(s.status not in DONE_STATUSES for s in summaries)
    if stop.requested and num_left:
        exit_code, status = stop.exit_code, "interrupted"
    elif num_left == 0:
        exit_code, status = 0, "completed"
    else:
        exit_code = 2 if 2 in codes else 1
        status = "failed"
    message = (
        f"{len(codes)} {what}: {sum(s.status == 'committed' for s in summaries)} committed, "
        f"{sum(s.status == 'skipped' for s in summaries)} already done, {num_left} not done "
        f"(worker exit codes {codes})"
    )
    if num_left and not stop.requested:
        message += "; rerun the same command to redo the rest"
    produced = [(w.get("throughput") or {}) for w in doc.get("workers", [])]
    engine_s = sum(t.get("engine_s") or 0.0 for t in produced)
    return RunResult(
        exit_code,
        status,
        message,
        store.url(store.root),
        store.url(store.path("_manifest.json")),
        summaries,
        None,
        num_output_tokens=sum(t.get("num_output_tokens") or 0 for t in produced),
        wall_s=time.perf_counter() - t0,
        engine_s=engine_s or None,
    )


def _worker_main(config_path: str) -> int:
    with open(config_path) as f:
        config = build_run_config(json.load(f))
    handler = StderrHandler()  # redacts credentials, like the CLI's
    handler.setFormatter(logging.Formatter(f"[worker {config.launcher.rank}] %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    try:
        result = run_worker(config)
    except ConfigError as e:
        print(
            f"batchrun worker {config.launcher.rank}: config error: {redact_query(str(e))}", file=sys.stderr, flush=True
        )
        return 2
    except JobError as e:
        print(f"batchrun worker {config.launcher.rank}: error: {redact_query(str(e))}", file=sys.stderr, flush=True)
        return 1
    log.info("%s", result.message)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
