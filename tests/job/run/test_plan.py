"""plan_worker: a worker's plan from the store's state, read from an in-memory store (memory://)
filled by the real commit protocol; planning writes nothing."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from batchrun import cli
from batchrun.job.commit.fingerprint import input_fingerprint, settings_fingerprint
from batchrun.job.commit.store import RunStore
from batchrun.job.errors import ConfigError
from batchrun.job.formats.writer import write_metrics
from batchrun.job.run.plan import WorkerPlan, model_changes, plan_worker
from batchrun.job.shards import Shard, Worker

MODEL = {"model.weights": "w1", "model.tokenizer": "t1"}


def _config(out: str, *extra: str) -> Any:
    return cli.load_config(["model.path=tiny", "data.uri=memory://unused-input", f"output.uri={out}", *extra])


def _shards(n: int) -> list[Shard]:
    return [Shard(f"s{i}", f"/in/s{i}.parquet", f"memory://in/s{i}.parquet", 100 + i, "v1") for i in range(n)]


def _commit(store: RunStore, shard: Shard, settings: dict[str, Any], model: dict[str, Any] = MODEL) -> None:
    """Commit `shard` as a run would: the attempt's files, then the marker naming its fingerprint."""
    attempt = store.begin(shard.name)
    for path in (attempt.results_tmp, attempt.metrics_tmp):
        write_metrics(store.fs, path, {"shard": shard.name, "num_rows": 1, "num_errors": 0})
    fingerprint = {"settings": settings, "model": model, "input": input_fingerprint(shard)}
    marker = {"shard": shard.name, "num_rows": 1, "fingerprint": fingerprint, "metrics": {"num_errors": 0}}
    assert store.commit(attempt, marker)


def _snapshot(store: RunStore) -> dict[str, bytes]:
    store.fs.invalidate_cache()
    return {path: store.fs.cat_file(path) for path in store.fs.find(store.root)}


@pytest.fixture
def out() -> str:
    return f"memory://plan-{uuid.uuid4().hex[:8]}/out"


ALONE = Worker(0, 1, "test")


def _plan(config: Any, shards: list[Shard], worker: Worker = ALONE) -> tuple[WorkerPlan, RunStore]:
    store = RunStore(config.output.uri, {})
    before = _snapshot(store)
    plan = plan_worker(config, worker, store, None, shards)
    assert _snapshot(store) == before, "planning wrote to the store"
    return plan, store


def test_a_fresh_output_plans_every_shard_and_nothing_stale(out):
    config = _config(out)
    plan, _ = _plan(config, _shards(3))
    assert [s.name for s in plan.todo] == ["s0", "s1", "s2"] == [s.name for s in plan.shards]
    assert plan.stale == frozenset() and plan.markers == {} and plan.steal == () and plan.skipped == ()
    assert plan.settings == settings_fingerprint(config)


def test_ranks_split_the_shards_and_steal_the_others_uncommitted_ones(out):
    config = _config(out, "launcher.work_stealing=true")
    shards = _shards(4)
    plan0, store = _plan(config, shards, Worker(0, 2, "test"))
    plan1, _ = _plan(config, shards, Worker(1, 2, "test"))
    assert {s.name for s in plan0.shards}.isdisjoint({s.name for s in plan1.shards})
    assert {s.name for s in plan0.shards} | {s.name for s in plan1.shards} == {s.name for s in shards}
    assert {s.name for s in plan0.steal} == {s.name for s in plan1.shards}
    _commit(store, plan1.shards[0], settings_fingerprint(config))
    again, _ = _plan(config, shards, Worker(0, 2, "test"))
    assert {s.name for s in again.steal} == {s.name for s in plan1.shards[1:]}
    no_stealing, _ = _plan(_config(out, "launcher.work_stealing=false"), shards, Worker(0, 2, "test"))
    assert no_stealing.steal == ()


def test_committed_current_shards_are_skipped_and_a_missing_results_file_is_to_publish(out):
    config = _config(out)
    shards = _shards(3)
    store = RunStore(out, {})
    _commit(store, shards[0], settings_fingerprint(config))
    _commit(store, shards[1], settings_fingerprint(config))
    store.fs.rm(store.results_path("s1"))  # its committer died between marker and publication
    plan, _ = _plan(config, shards)
    assert [s.name for s in plan.todo] == ["s2"]
    assert [s.name for s in plan.skipped] == ["s0", "s1"]
    assert set(plan.markers) == {"s0", "s1"} and plan.markers["s0"]["shard"] == "s0"
    assert plan.unpublished == frozenset({"s1"})
    assert plan.stale == frozenset()


def test_other_settings_or_a_changed_input_make_shards_stale_with_recompute(out):
    old = _config(out, "sampling.max_tokens=3")
    shards = _shards(3)
    store = RunStore(out, {})
    _commit(store, shards[0], settings_fingerprint(old))
    new = _config(out, "output.on_change=recompute")
    plan, _ = _plan(new, shards)
    assert plan.stale == frozenset({"s0"}) and [s.name for s in plan.todo] == ["s0", "s1", "s2"]
    assert plan.skipped == ()

    _commit(store, shards[1], settings_fingerprint(new))
    rewritten = [shards[0], Shard("s1", shards[1].path, shards[1].url, size=999, version="v2"), shards[2]]
    plan, _ = _plan(new, rewritten)
    assert plan.stale == frozenset({"s0", "s1"})


def test_other_settings_with_on_change_error_are_refused_naming_the_key(out):
    shards = _shards(2)
    _commit(RunStore(out, {}), shards[0], settings_fingerprint(_config(out, "sampling.max_tokens=3")))
    with pytest.raises(ConfigError) as info:
        _plan(_config(out), shards)
    assert info.value.key == "output.on_change" and "sampling.max_tokens" in str(info.value)


def test_another_workers_marker_with_other_settings_makes_own_committed_shards_stale(out):
    """The settings of a run are compared with any committed marker, not only this worker's."""
    shards = _shards(2)
    store = RunStore(out, {})
    old = settings_fingerprint(_config(out, "sampling.max_tokens=3"))
    _commit(store, Shard("other", "/in/other.parquet", "memory://in/other.parquet", 1, "v1"), old)
    plan, _ = _plan(_config(out, "output.on_change=recompute"), shards)
    assert plan.stale == frozenset() and len(plan.todo) == 2  # nothing of its own committed: nothing stale
    with pytest.raises(ConfigError):
        _plan(_config(out), shards)


def test_model_changes_name_current_shards_committed_with_another_model(out):
    config = _config(out, "output.on_change=recompute")
    shards = _shards(2)
    store = RunStore(out, {})
    _commit(store, shards[0], settings_fingerprint(config))
    _commit(store, shards[1], settings_fingerprint(config), {**MODEL, "model.weights": "w2"})
    plan, _ = _plan(config, shards)
    assert model_changes(config, plan, MODEL) == ["s1"]
    assert model_changes(config, plan, {**MODEL, "model.weights": "w2"}) == ["s0"]
    with pytest.raises(ConfigError) as info:
        model_changes(_config(out), plan, MODEL)
    assert info.value.key == "output.on_change" and "another model" in str(info.value)


def test_batch_invariant_is_part_of_the_settings_fingerprint(tmp_path):
    """In bf16 the option changes which reduction order a row's tokens come from, so a rerun that
    flips it would mix rows computed both ways: the fingerprint names it (speed-only keys such as
    the batch limits stay out)."""
    from batchrun.job.commit.fingerprint import differences

    off = settings_fingerprint(_config(str(tmp_path)))
    on = settings_fingerprint(_config(str(tmp_path), "engine.batch_invariant=true"))
    assert differences(off, on) == ["engine.batch_invariant: false -> true"]
    budget = settings_fingerprint(_config(str(tmp_path), "engine.max_num_batched_tokens=64"))
    assert differences(off, budget) == []
