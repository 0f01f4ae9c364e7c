"""Which input files make up the run, what each shard is called, and which worker takes which.

Shard names are the input path relative to `data.uri`'s directory, without the suffix and with '/'
turned into '__' (a flat directory gives plain file stems). The name depends only on the file's own
path, never on which other files exist, so adding inputs later cannot rename a committed shard.

Assignment is round-robin over shards sorted by name: worker `rank` of `world_size` takes shards
rank, rank + world_size, ... It needs no file sizes (no extra listing on object stores) and every
worker computes the same split independently; with many similar shards it balances well enough.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import fsspec
from fsspec.core import url_to_fs

from batchrun.job.errors import ConfigError, JobError


@dataclass(frozen=True)
class LauncherConfig:
    """How this process finds its place among the workers; None reads it from the environment."""

    name: str = "local"
    rank: Optional[int] = None  # this worker's index; None: torchrun RANK, Slurm ids, else 0
    world_size: Optional[int] = None  # number of workers; None: torchrun WORLD_SIZE, Slurm counts, else 1
    # Worker processes this command starts on this machine (one engine each, one GPU each on
    # cuda); 1 runs in this process. With N > 1 the command is the launcher of ranks 0..N-1.
    num_workers: int = 1
    # Idle workers take unstarted (and dead workers') shards through claim files (claims.py).
    work_stealing: bool = True
    claim_lease_s: float = 120.0  # a claim without a heartbeat for this long may be taken over

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"launcher.num_workers must be >= 1, got {self.num_workers}")
        if self.claim_lease_s <= 0:
            raise ValueError(f"launcher.claim_lease_s must be > 0, got {self.claim_lease_s}")


@dataclass(frozen=True)
class Shard:
    name: str  # unique within the run; names the output files
    path: str  # path inside the filesystem (what fs.open takes)
    url: str  # the same with its protocol, for logs and the manifest


@dataclass(frozen=True)
class Worker:
    rank: int
    world_size: int
    source: str  # where rank and world size came from, for the log and the manifest


_GLOB_CHARS = re.compile(r"[*?\[]")
_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")


def open_filesystem(uri: str, storage_options: Mapping[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec filesystem and in-filesystem path for a local path or any fsspec URL."""
    return url_to_fs(uri, **dict(storage_options))


def discover_shards(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> list[Shard]:
    """The Parquet files at `path` in `fs` (a directory, a glob or one file), sorted by shard name.

    `uri` is what the user wrote, for messages.
    """
    path = path.rstrip("/") or path
    try:
        if _GLOB_CHARS.search(path):
            root = _glob_root(path)
            files = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            root = path
            files = [p for p in fs.find(path) if p.endswith(".parquet") and not _is_hidden(posixpath.relpath(p, root))]
        elif fs.isfile(path):
            root, files = posixpath.dirname(path), [path]
        else:
            raise JobError(f"data.uri: nothing found at {uri}")
    except (OSError, PermissionError) as e:
        raise JobError(f"data.uri: cannot list {uri}: {e}") from None
    if not files:
        raise JobError(f"data.uri: no Parquet files at {uri}")
    shards = [Shard(shard_name(p, root), p, fs.unstrip_protocol(p)) for p in sorted(files)]
    by_name: dict[str, Shard] = {}
    for shard in shards:
        if shard.name in by_name:
            raise JobError(f"input files {by_name[shard.name].url} and {shard.url} both map to shard name "
                           f"{shard.name!r}; rename one")
        by_name[shard.name] = shard
    return sorted(shards, key=lambda s: s.name)


def shard_name(path: str, root: str) -> str:
    rel = posixpath.relpath(path, root) if root else path
    stem = rel[: -len(posixpath.splitext(rel)[1]) or None]
    return _UNSAFE.sub("_", stem.replace("/", "__")).strip("_") or "shard"


def _glob_root(pattern: str) -> str:
    parts = pattern.split("/")
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if _GLOB_CHARS.search(p))]]
    return "/".join(fixed)


def _is_hidden(rel_path: str) -> bool:
    """Spark's _SUCCESS, checksums and our own temporary files start with '_' or '.'."""
    return any(part.startswith(("_", ".")) for part in rel_path.split("/"))


def resolve_worker(config: LauncherConfig, env: Mapping[str, str]) -> Worker:
    """Rank and world size: config values win, then torchrun, then Slurm (array x tasks), then 0 of 1."""
    env_rank, env_world, source = _worker_from_env(env)
    rank = config.rank if config.rank is not None else env_rank
    world = config.world_size if config.world_size is not None else env_world
    if config.rank is not None or config.world_size is not None:
        source = "config" if config.rank is not None and config.world_size is not None else f"config+{source}"
    if world < 1:
        raise ConfigError("launcher.world_size", f"must be >= 1, got {world} (from {source})")
    if not 0 <= rank < world:
        raise ConfigError("launcher.rank", f"must be in [0, {world}), got {rank} (from {source})")
    return Worker(rank, world, source)


def _worker_from_env(env: Mapping[str, str]) -> tuple[int, int, str]:
    def num(name: str, default: Optional[int] = None) -> int:
        value = env.get(name)
        if value is None or value == "":
            if default is None:
                raise ConfigError("launcher", f"{name} is not set but its partner variables are")
            return default
        try:
            return int(value)
        except ValueError:
            raise ConfigError("launcher", f"environment variable {name}={value!r} is not an integer") from None

    if "RANK" in env and "WORLD_SIZE" in env:
        return num("RANK"), num("WORLD_SIZE"), "torchrun RANK/WORLD_SIZE"
    rank, world, sources = 0, 1, []
    if "SLURM_ARRAY_TASK_ID" in env:
        step = num("SLURM_ARRAY_TASK_STEP", 1)
        rank = (num("SLURM_ARRAY_TASK_ID") - num("SLURM_ARRAY_TASK_MIN", 0)) // step
        world = num("SLURM_ARRAY_TASK_COUNT")
        sources.append("SLURM_ARRAY_TASK_ID/COUNT")
    if "SLURM_PROCID" in env:
        # Each array task may itself run several tasks (srun): ranks nest as array x tasks.
        num_tasks = num("SLURM_NTASKS", 1)
        rank, world = rank * num_tasks + num("SLURM_PROCID"), world * num_tasks
        sources.append("SLURM_PROCID/NTASKS")
    return rank, world, " + ".join(sources) or "default"


def assign_shards(shards: Sequence[Shard], worker: Worker) -> list[Shard]:
    """This worker's shards: round-robin over shards sorted by name."""
    return sorted(shards, key=lambda s: s.name)[worker.rank:: worker.world_size]
