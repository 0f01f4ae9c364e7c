"""launcher=ray: the run's workers as Ray actors, exactly once kept by the store, not by Ray.

`python -m batchrun job=summarize launcher=ray launcher.num_workers=N [launcher.ray_address=auto]`
starts N actors, each asking for engine.tensor_parallel_size GPUs where the cluster has GPUs (one
per rank of its tensor-parallel group; by default one actor per that many GPUs on each node), or
the CPU cores its ranks' threads run on (engine.num_threads) on a CPU cluster. Each actor is a
normal worker (runner.run_worker) as rank r of N (BATCHRUN_RANK / BATCHRUN_WORLD_SIZE,
shards.resolve_worker): its own shards first, then others' through the claims, every shard
committed once by its marker (store.py). Ray adds placement and restarts only:

- an actor whose process dies (SIGKILL, OOM, a lost node) is restarted by Ray up to
  launcher.max_restarts times and runs its worker again; meanwhile, and after, its shards are
  taken over through the claims (a dead owner on the same host at once, elsewhere after
  launcher.claim_lease_s). Rows it had not committed are recomputed, never duplicated.
- an actor past its restarts is given up; the others still take its shards, and whatever is left
  is redone by rerunning the same command.

The driver (this process) waits for every actor, merges `_manifest.json` with the commit markers
and exits as the local launcher does (pool.launcher_result): 0 every shard committed, 1 some shard
failed or is left, 2 a worker refused the configuration, 130/143 stopped by SIGINT/SIGTERM (each
actor is told to stop and commits nothing partial). Each actor's progress (its
output.metrics_textfile, rewritten every second) reaches the driver's one bar.

Nodes must see data.uri and output.uri (an object store or a shared filesystem) and have batchrun
installed; the driver's BATCHRUN_* variables are passed on to the actors. Credentials belong in the
nodes' environment (or a Secret), never in the config the actors are sent.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from tqdm import tqdm

from batchrun.job.commit.manifest import utc_now
from batchrun.job.config import RunConfig, build_run_config
from batchrun.job.errors import ConfigError, JobError
from batchrun.job.launch.pool import cpu_threads_per_worker, launcher_result, open_run
from batchrun.job.operate.textfile import textfile_path
from batchrun.job.results import RunResult
from batchrun.job.run.runner import run_worker
from batchrun.job.run.signals import StopRequest
from batchrun.utils.logs import StderrHandler
from batchrun.utils.redact import redact_query

log = logging.getLogger(__name__)

RAY_MISSING = "launcher=ray needs Ray on this machine and the cluster's: pip install 'batchrun[ray]'"
POLL_S = 0.5
REPORT_S = 1.0  # how often an actor sends its progress (and learns of a stop)
# Exit code recorded for an actor Ray gave up on (died more than launcher.max_restarts times):
# negative, as for a worker process killed by a signal (pool.launcher_result).
GIVEN_UP = -9
_PASSED_ON = re.compile(r"BATCHRUN_(?!RANK$|WORLD_SIZE$|LAUNCHER$)[A-Z0-9_]+")


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("launcher.name", RAY_MISSING) from None
    return ray


def run_ray_workers(config: RunConfig, env: Mapping[str, str]) -> RunResult:
    ray = import_ray()
    store, shards = open_run(config)
    started_at, t0 = utc_now(), time.perf_counter()
    owns_ray = not ray.is_initialized()
    if owns_ray:
        try:
            ray.init(address=config.launcher.ray_address, log_to_driver=True, include_dashboard=False)
        except (ConnectionError, ValueError, RuntimeError) as e:
            where = config.launcher.ray_address
            raise JobError(f"launcher.ray_address: cannot connect to Ray at {where}: {e}") from None
    try:
        with StopRequest() as stop:
            codes, devices = _run_actors(ray, config, env, len(shards), stop)
    finally:
        if owns_ray:
            ray.shutdown()
    for rank, device in enumerate(devices):
        log.info("ray worker %d ran on %s", rank, device or "the CPU")
    return launcher_result(config, store, shards, started_at, t0, codes, stop, "Ray workers")


def placement(
    config: RunConfig, resources: Mapping[str, float], node_gpus: Optional[Sequence[int]] = None
) -> tuple[int, dict[str, float], Optional[int]]:
    """(workers, each actor's Ray resources, each engine's CPU threads) on a cluster with
    `resources` (ray.cluster_resources()): engine.tensor_parallel_size GPUs per actor (one per rank
    of its group) where the cluster has GPUs and the engine may use one; else the threads of its
    ranks (engine.num_threads; null: the cluster's CPUs shared out per rank, pool.cpu_threads_per_worker).
    `node_gpus`: the GPUs of each live node (an actor's GPUs are all on one node, so a group fits
    only a node with as many; null: the cluster's total counts, as if on one node)."""
    gpus = int(resources.get("GPU", 0))
    tp = config.engine.tensor_parallel_size
    use_gpu = config.engine.device != "cpu" and gpus > 0
    if config.engine.device == "cuda" and not use_gpu:
        raise ConfigError("engine.device", "cuda requested but the Ray cluster has no GPU")
    if use_gpu:
        per_node = list(node_gpus) if node_gpus is not None else [gpus]
        if max(per_node, default=0) < tp:
            raise ConfigError(
                "engine.tensor_parallel_size",
                f"a group of {tp} ranks needs {tp} GPUs on one node; the Ray cluster's nodes have at most "
                f"{max(per_node, default=0)}",
            )
        n = config.launcher.num_workers or sum(g // tp for g in per_node)
        # One CPU per process of the group: rank 0 is the actor, the followers its child processes.
        return n, {"num_gpus": tp, "num_cpus": tp}, config.engine.num_threads
    n = config.launcher.num_workers or 1
    threads = config.engine.num_threads or cpu_threads_per_worker(int(resources.get("CPU", 1)), n, tp)
    # Ray reserves what the group's ranks run on: the engine gives each rank threads // tp, at least one.
    return n, {"num_gpus": 0, "num_cpus": max(1, threads // tp) * tp}, threads


def node_gpu_counts(nodes: Sequence[Mapping[str, Any]]) -> list[int]:
    """The GPUs of each live node of ray.nodes()."""
    return [int((node.get("Resources") or {}).get("GPU", 0)) for node in nodes if node.get("Alive")]


def _run_actors(
    ray: Any, config: RunConfig, env: Mapping[str, str], num_shards: int, stop: StopRequest
) -> tuple[list[int], list[Optional[str]]]:
    n, resources, threads = placement(config, ray.cluster_resources(), node_gpu_counts(ray.nodes()))
    log.info("starting %d Ray workers over %d shards (%s each)", n, num_shards, resources)
    board = ray.remote(num_cpus=0)(ProgressBoard).remote()
    worker_cls = ray.remote(RayWorker).options(
        max_restarts=config.launcher.max_restarts,
        # The run() call is retried on the restarted actor: it runs its worker again from the store.
        max_task_retries=config.launcher.max_restarts,
        runtime_env={"env_vars": {k: v for k, v in env.items() if _PASSED_ON.fullmatch(k)}},
        **resources,
    )
    raw = dataclasses.replace(config, engine=dataclasses.replace(config.engine, num_threads=threads)).to_dict()
    actors = [worker_cls.remote(raw, rank, n, board) for rank in range(n)]
    refs = {actor.run.remote(): rank for rank, actor in enumerate(actors)}
    codes: list[int] = [GIVEN_UP] * n
    devices: list[Optional[str]] = [None] * n
    bar = None if config.quiet else tqdm(total=None, unit="row", desc="batchrun ray", dynamic_ncols=True)
    told_stop = False
    try:
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S)
            for ref in done:
                rank = refs.pop(ref)
                try:
                    outcome = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # died past its restarts
                    log.error("ray worker %d was given up after %d restarts: %s", rank, config.launcher.max_restarts, e)
                    continue
                except ray.exceptions.RayError as e:  # an unexpected error inside the worker
                    log.error("ray worker %d failed: %s", rank, " ".join(str(e).split())[:400])
                    codes[rank] = 1
                    continue
                codes[rank], devices[rank] = outcome["exit_code"], outcome.get("device")
                if outcome["exit_code"]:
                    log.warning("ray worker %d: %s", rank, outcome["message"])
            if stop.requested and not told_stop:
                ray.get(board.stop.remote(stop.signum or signal.SIGTERM))
                told_stop = True
            if bar is not None:
                totals = ray.get(board.totals.remote())
                bar.n = totals["rows"]
                bar.set_postfix_str(f"{totals['output_tokens']} output tokens, {totals['restarts']} restart(s)")
                bar.refresh()
        for rank, counts in sorted(ray.get(board.by_rank.remote()).items()):
            log.info("ray worker %d reported %d rows, %d output tokens", rank, counts["rows"], counts["output_tokens"])
    finally:
        if bar is not None:
            bar.close()
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.kill(board)
    return codes, devices


class ProgressBoard:
    """A Ray actor on the driver's side: each worker actor posts its rows and tokens (from its
    metrics textfile) and learns here whether the driver asks it to stop."""

    def __init__(self) -> None:
        self.posts: dict[tuple[int, int], dict[str, float]] = {}  # (rank, pid) -> its latest counts
        self.signum: Optional[int] = None

    def post(self, rank: int, pid: int, counts: dict[str, float]) -> Optional[int]:
        """Returns the signal to stop with, once the driver asked."""
        self.posts[(rank, pid)] = counts
        return self.signum

    def stop(self, signum: int) -> None:
        self.signum = signum

    def by_rank(self) -> dict[int, dict[str, int]]:
        """Rows and tokens each rank reported, its incarnations together."""
        out: dict[int, dict[str, int]] = {}
        for (rank, _), c in self.posts.items():
            mine = out.setdefault(rank, {"rows": 0, "output_tokens": 0})
            mine["rows"] += int(c.get("batchrun_rows_done_total", 0))
            mine["output_tokens"] += int(c.get("batchrun_output_tokens_total", 0))
        return out

    def totals(self) -> dict[str, int]:
        """Rows and tokens of every incarnation of every worker (a restarted actor counts from 0)."""
        ranks = [rank for rank, _ in self.posts]
        return {
            "rows": int(sum(c.get("batchrun_rows_done_total", 0) for c in self.posts.values())),
            "output_tokens": int(sum(c.get("batchrun_output_tokens_total", 0) for c in self.posts.values())),
            "restarts": len(ranks) - len(set(ranks)),
        }


class RayWorker:
    """One worker of the run as a Ray actor: run() is runner.run_worker as rank `rank` of
    `world_size`, in the actor's main thread (so a stop is the usual graceful SIGTERM)."""

    def __init__(self, raw_config: dict[str, Any], rank: int, world_size: int, board: Any) -> None:
        self.raw_config, self.rank, self.world_size, self.board = raw_config, rank, world_size, board

    def run(self) -> dict[str, Any]:
        from batchrun.job.operate import textfile

        # The file is this worker's progress as the driver sees it: rewritten every REPORT_S.
        textfile.INTERVAL_S = min(textfile.INTERVAL_S, REPORT_S)
        handler = StderrHandler()  # redacts credentials, like the CLI's
        handler.setFormatter(logging.Formatter(f"[ray worker {self.rank}] %(levelname)s %(message)s"))
        logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
        config = build_run_config(self.raw_config)
        device = os.environ.get("CUDA_VISIBLE_DEVICES") or None
        with tempfile.TemporaryDirectory(prefix="batchrun-ray-") as tmp:
            template = config.output.metrics_textfile or os.path.join(tmp, "progress.prom")
            config = dataclasses.replace(
                config,
                launcher=dataclasses.replace(config.launcher, rank=None, world_size=None, num_workers=1),
                output=dataclasses.replace(config.output, metrics_textfile=template),
                quiet=True,  # the driver has the one bar
            )
            env = {
                **os.environ,
                "BATCHRUN_RANK": str(self.rank),
                "BATCHRUN_WORLD_SIZE": str(self.world_size),
                "BATCHRUN_LAUNCHER": "ray",
            }
            reporter = _Reporter(self.board, self.rank, textfile_path(template, self.rank, self.world_size))
            reporter.start()
            try:
                result = run_worker(config, None, env)
            except ConfigError as e:
                return {"exit_code": 2, "message": f"config error: {redact_query(str(e))}", "device": device}
            except JobError as e:
                return {"exit_code": 1, "message": f"error: {redact_query(str(e))}", "device": device}
            finally:
                reporter.finish()
        return {"exit_code": result.exit_code, "message": redact_query(result.message), "device": device}


class _Reporter(threading.Thread):
    """Posts the worker's textfile counts to the board every REPORT_S; a stop the driver asked for
    becomes a SIGTERM to this process, which the worker's StopRequest handles (main thread)."""

    def __init__(self, board: Any, rank: int, path: str) -> None:
        super().__init__(daemon=True, name=f"batchrun-ray-progress-{rank}")
        self.board, self.rank, self.path = board, rank, path
        self._done = threading.Event()
        self._signalled = False

    def run(self) -> None:
        import ray

        # At once, then every REPORT_S: an incarnation is on the board (a restart counted) from
        # its start, before its engine loads, even if it dies before its first row.
        self._post(ray)
        while not self._done.wait(REPORT_S):
            self._post(ray)

    def finish(self) -> None:
        self._done.set()
        self.join(timeout=5)
        import ray

        self._post(ray)

    def _post(self, ray: Any) -> None:
        try:
            signum = ray.get(self.board.post.remote(self.rank, os.getpid(), read_counts(self.path)), timeout=10)
        except Exception:  # progress only: the store has the run's true state
            return
        if signum and not self._signalled and not self._done.is_set():
            self._signalled = True
            os.kill(os.getpid(), signum)


_SAMPLE = re.compile(r"^(batchrun_[a-z_]+)(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def read_counts(path: str) -> dict[str, float]:
    """The unlabelled-by-type samples of a metrics textfile (textfile.py), by name; {} if unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for name, value in _SAMPLE.findall(text):
        if name in ("batchrun_rows_done_total", "batchrun_output_tokens_total", "batchrun_prompt_tokens_total"):
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out
