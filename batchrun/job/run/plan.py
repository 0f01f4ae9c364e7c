"""Which shards a worker runs, decided before its engine loads, from the store's state as read.

`plan_worker` only reads (the shard listing given, the committed markers, the published results,
and the input's group column when data.group_column splits it); it writes nothing, so the same
store state always gives the same plan. The one write of planning, `_plan.json` (the shared
shard list of workers that split by rank), is `shared_shards`, done before it.

A committed shard is redone only when its marker's fingerprint differs from this run's
(output.on_change=recompute; with error, a difference is a ConfigError naming it): the settings
and the input are compared here, the model once the engine has loaded (`model_changes`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchrun.job.commit.claims import steal_order
from batchrun.job.commit.fingerprint import differences, input_fingerprint, settings_fingerprint
from batchrun.job.commit.manifest import utc_now
from batchrun.job.commit.store import RunStore
from batchrun.job.config import RunConfig
from batchrun.job.errors import ConfigError, JobError
from batchrun.job.run.affinity import partition_by_group, shard_groups
from batchrun.job.shards import Shard, Worker, assign_shards

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlan:
    """One worker's share of the run, as planned at its start."""

    worker: Worker
    all_shards: tuple[Shard, ...]  # the run's shards, in the order every worker splits them
    shards: tuple[Shard, ...]  # this worker's own
    todo: tuple[Shard, ...]  # own shards to run: not committed, or committed stale
    steal: tuple[Shard, ...]  # other workers' uncommitted shards, to take once its own are done
    stale: frozenset[str]  # own committed shards to recompute (settings or input differ)
    markers: Mapping[str, Mapping[str, Any]]  # own committed shards' markers ({} when unreadable)
    unpublished: frozenset[str]  # own committed, current shards whose results file is missing
    settings: Mapping[str, Any]  # this run's settings fingerprint

    @property
    def skipped(self) -> tuple[Shard, ...]:
        """Own shards committed before, with this run's settings and input: not run again."""
        return tuple(s for s in self.shards if s.name in self.markers and s.name not in self.stale)


def shared_shards(store: RunStore, listed: Sequence[Shard]) -> list[Shard]:
    """Without work stealing, workers split the shard list by rank, so they must split the SAME
    list: the first worker to start writes `_plan.json` (create-if-absent) and every worker,
    now and on reruns, uses it. Inputs that appear later are not part of this run."""
    path = store.path("_plan.json")
    doc: dict[str, Any] = {"created_at": utc_now(), "shards": [dataclasses.asdict(s) for s in listed]}
    if not store.create_json(path, doc):
        existing = store.read_json(path)
        if not isinstance(existing, dict) or not isinstance(existing.get("shards"), list):
            raise JobError(f"output.uri: {store.url(path)} is unreadable; delete it if no worker is running")
        doc = existing
    # The plan fixes names and order. Everything else comes from this worker's own listing: the
    # plan on disk is redacted (directory._encode), and sizes and versions must be the files' own
    # now, so that a rewritten input is seen as changed (the markers' input fingerprints).
    here = {s.name: s for s in listed}
    planned = [here.get(s.name, s) for s in (Shard(**entry) for entry in doc["shards"])]
    extra = {s.name for s in listed} - {s.name for s in planned}
    if extra:
        log.warning(
            "%d input file(s) appeared after this run's plan was made (%s) and are not part of it; "
            "run them with another output.uri, or with launcher.work_stealing=true",
            len(extra),
            ", ".join(sorted(extra)[:3]),
        )
    return planned


def is_stealing(config: RunConfig, worker: Worker) -> bool:
    return config.launcher.work_stealing and worker.world_size > 1


def plan_worker(
    config: RunConfig, worker: Worker, store: RunStore, data_fs: Any, all_shards: Sequence[Shard]
) -> WorkerPlan:
    """This worker's plan over `all_shards` (the listing, or the shared plan: `shared_shards`).
    Raises JobError when the output cannot be listed, ConfigError when output.on_change=error
    and a committed shard differs from this run."""
    world = worker.world_size
    if config.data.group_column and world > 1:
        groups = shard_groups(data_fs, list(all_shards), config.data.group_column)
        parts = partition_by_group(list(all_shards), groups, world)
    else:
        parts = [assign_shards(list(all_shards), Worker(r, world, worker.source)) for r in range(world)]
    shards = tuple(parts[worker.rank])
    try:
        committed = store.committed_shards()
    except Exception as e:
        raise JobError(f"output.uri: cannot list {config.output.uri}: {e}") from None
    settings = settings_fingerprint(config)
    markers = {s.name: store.read_marker(s.name) or {} for s in shards if s.name in committed}
    stale = _stale(config, store, shards, committed, markers, settings)
    todo = tuple(s for s in shards if s.name not in committed or s.name in stale)
    stealing = is_stealing(config, worker)
    steal = tuple(s for s in steal_order(parts, worker.rank) if s.name not in committed) if stealing else ()
    published = store.published_shards() if markers else set()
    unpublished = frozenset(name for name in markers if name not in stale and name not in published)
    return WorkerPlan(worker, tuple(all_shards), shards, todo, steal, frozenset(stale), markers, unpublished, settings)


def _stale(
    config: RunConfig,
    store: RunStore,
    shards: Sequence[Shard],
    committed: set[str],
    markers: Mapping[str, Mapping[str, Any]],
    settings: Mapping[str, Any],
) -> set[str]:
    """Own committed shards whose markers' settings or input differ from this run's."""
    reference = next((m for m in markers.values() if m.get("fingerprint")), None)
    if reference is None and committed:  # another worker's shard: all of a run must agree
        reference = store.read_marker(sorted(committed)[0]) or {}
    changed_settings = differences((reference or {}).get("fingerprint", {}).get("settings", {}), dict(settings))
    stale: dict[str, list[str]] = {}
    for shard in shards:
        if shard.name not in markers:
            continue
        fingerprint = markers[shard.name].get("fingerprint") or {}
        changes = differences(fingerprint.get("settings", {}), dict(settings))
        changes += differences(fingerprint.get("input", {}), input_fingerprint(shard))
        if changes:
            stale[shard.name] = changes
    if changed_settings and not stale and markers:  # the reference was another worker's
        stale = {name: changed_settings for name in markers}
    if (changed_settings or stale) and config.output.on_change == "error":
        changes = changed_settings or next(iter(stale.values()))
        where = f"{len(stale)} shard(s) (e.g. {next(iter(stale))})" if stale else "shards"
        raise ConfigError(
            "output.on_change",
            f"{where} in {config.output.uri} were committed with other "
            f"settings or inputs ({'; '.join(changes[:4])}); use a new output.uri, or set "
            "output.on_change=recompute to redo them",
        )
    for name, changes in stale.items():
        log.warning(
            "shard %s: committed with other settings or input (%s); recomputing it", name, "; ".join(changes[:4])
        )
    return set(stale)


def model_changes(config: RunConfig, plan: WorkerPlan, model: Mapping[str, Any]) -> list[str]:
    """Own committed, current shards whose markers name another model or tokenizer than the one
    loaded: to recompute (output.on_change=recompute), or a ConfigError naming them (error)."""
    changed = {
        name: differences((m.get("fingerprint") or {}).get("model", {}), dict(model))
        for name, m in plan.markers.items()
        if name not in plan.stale
    }
    changed = {name: c for name, c in changed.items() if c}
    if changed and config.output.on_change == "error":
        name, changes = next(iter(changed.items()))
        raise ConfigError(
            "output.on_change",
            f"{len(changed)} shard(s) (e.g. {name}) in {config.output.uri} "
            f"were committed with another model or tokenizer ({'; '.join(changes)}); use a new "
            "output.uri, or set output.on_change=recompute to redo them",
        )
    for name in changed:
        log.warning("shard %s: committed with another model or tokenizer; recomputing it", name)
    return list(changed)
