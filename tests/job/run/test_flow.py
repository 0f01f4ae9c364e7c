"""Rows flowing across shard boundaries (job/run/flow.py): several shards open in one engine stream,
each committed on its own, in input order, with greedy output unchanged; the bounds on open
shards; stealing only with idle capacity. Kills with shards open side by side are in
tests/job/run/test_resume.py; a poison shard running alone is tests/job/test_exactly_once.py's case 9."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.engine import EngineRequest
from batchrun.job import run_job
from batchrun.job.commit.claims import ClaimBook, ShardQueue
from batchrun.job.commit.store import RunStore
from batchrun.job.config import PlannerConfig
from batchrun.job.run import flow
from batchrun.job.run.planner import plan_requests
from batchrun.job.shards import Shard

RESULT_DEPENDENT = {"ttft_s", "itl_s", "latency_s", "num_cached_tokens"}  # timing and cache state


def _watch_open_shards(monkeypatch) -> list[int]:
    """Record how many shards are open at every output the flow delivers."""
    seen: list[int] = []
    real_deliver = flow.ShardFlow._deliver

    def deliver(self, run, out):
        seen.append(len(self.open))
        real_deliver(self, run, out)

    monkeypatch.setattr(flow.ShardFlow, "_deliver", deliver)
    return seen


def _results(out) -> dict[str, list[dict]]:
    return {
        p.stem: [{k: v for k, v in r.items() if k not in RESULT_DEPENDENT} for r in pq.read_table(p).to_pylist()]
        for p in sorted((out / "results").glob("*.parquet"))
    }


@pytest.mark.parametrize("max_open", [1, 3])
def test_shards_overlap_up_to_the_bound_and_give_the_same_results(
    tmp_path, make_shards, tiny_engine, job_overrides, monkeypatch, max_open
):
    ids = make_shards(tmp_path / "in", num_shards=6, rows_per_shard=3)
    seen = _watch_open_shards(monkeypatch)
    args = job_overrides(tmp_path / "in", tmp_path / "out", f"planner.max_open_shards={max_open}")
    result = run_job(cli.load_config(args), engine=tiny_engine)
    assert result.exit_code == 0 and [s.status for s in result.shards] == ["committed"] * 6
    assert max(seen) == max_open  # the tiny engine runs 8 sequences: it always has room for more
    results = _results(tmp_path / "out")
    for s, shard_ids in enumerate(ids):
        assert [r["id"] for r in results[f"part-{s:02d}"]] == shard_ids  # input order per shard
    # Greedy output does not depend on which shards' rows shared the engine.
    sequential = tmp_path / "sequential"
    args = job_overrides(tmp_path / "in", sequential, "planner.max_open_shards=1", "planner.enabled=false")
    assert run_job(cli.load_config(args), engine=tiny_engine).exit_code == 0
    assert _results(sequential) == results
    # Each shard's metrics are its own rows' (the request counts are not other shards' deltas).
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    for entry in manifest["shards"]:
        marker = json.loads((tmp_path / "out" / "_commits" / f"{entry['name']}.json").read_text())
        assert marker["metrics"]["num_rows"] == 3 and marker["metrics"]["num_preemptions"] == 0
        assert marker["metrics"]["wall_s"] > 0


def test_empty_and_all_error_shards_commit_between_busy_ones(tmp_path, short_texts, tiny_engine, job_overrides):
    import pyarrow as pa

    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(pa.table({"id": ["a0", "a1"], "text": short_texts[:2]}), src / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}), src / "b.parquet")
    pq.write_table(pa.table({"id": ["c0", "c1"], "text": ["", None]}), src / "c.parquet")
    pq.write_table(pa.table({"id": ["d0"], "text": short_texts[2:3]}), src / "d.parquet")
    result = run_job(cli.load_config(job_overrides(src, tmp_path / "out")), engine=tiny_engine)
    assert result.exit_code == 0 and [s.status for s in result.shards] == ["committed"] * 4
    results = _results(tmp_path / "out")
    assert [len(results[n]) for n in "abcd"] == [2, 0, 2, 1]
    assert [r["error_type"] for r in results["c"]] == ["empty_prompt", "null_prompt"]


def test_a_shard_that_breaks_part_way_fails_alone_while_others_share_the_engine(
    tmp_path, make_shards, tiny_engine, job_overrides, monkeypatch
):
    make_shards(tmp_path / "in", num_shards=3, rows_per_shard=4)
    real_on_output = flow.ShardRun.on_output

    def on_output(self, out):
        if self.shard.name == "part-01" and len(self.in_flight) == 2:
            raise OSError("the results store refused a row group")  # a failure after retries
        real_on_output(self, out)

    monkeypatch.setattr(flow.ShardRun, "on_output", on_output)
    result = run_job(cli.load_config(job_overrides(tmp_path / "in", tmp_path / "out")), engine=tiny_engine)
    assert result.exit_code == 1
    assert [(s.name, s.status) for s in result.shards] == [
        ("part-00", "committed"),
        ("part-01", "failed"),
        ("part-02", "committed"),
    ]
    assert "results store refused" in result.shards[1].error
    assert sorted(p.name for p in (tmp_path / "out" / "results").iterdir()) == ["part-00.parquet", "part-02.parquet"]
    assert not (tmp_path / "out" / "_attempts" / "part-01").exists()  # its attempt's files are gone


def test_the_planner_passes_a_pause_on_after_planning_what_it_read():
    def req(i: int, n: int) -> EngineRequest:
        return EngineRequest(request_id=i, prompt=list(range(n)))

    source = [req(0, 2), req(1, 40), None, req(2, 3), req(3, 50)]
    planned = list(plan_requests(iter(source), PlannerConfig(window=10), block_size=4))
    # Each stretch between pauses is planned on its own (longest first); the pause stays in place.
    assert [None if r is None else r.request_id for r in planned] == [1, 0, None, 3, 2]
    assert list(plan_requests(iter(source), PlannerConfig(enabled=False), 4)) == source


def test_the_engine_steps_through_a_pause_and_admits_again(tiny_engine):
    paused_with_work = []

    def source():
        yield EngineRequest(request_id="a", prompt=[1, 2, 3, 4])
        while tiny_engine.scheduler.has_unfinished():  # a pause while "a" is in flight
            paused_with_work.append(True)
            yield None
        yield EngineRequest(request_id="b", prompt=[5, 6, 7])

    from batchrun.engine import SamplingParams

    outs = list(tiny_engine.stream(source(), SamplingParams(temperature=0.0, max_tokens=3)))
    assert [o.request_id for o in outs] == ["a", "b"] and paused_with_work
    assert all(len(o.token_ids) == 3 for o in outs)


def test_stealing_waits_for_idle_capacity(tmp_path):
    store = RunStore(str(tmp_path / "out"), {})
    own, theirs = Shard("mine", "x", "x"), Shard("theirs", "y", "y")
    with ClaimBook(store, lease_s=60) as book:
        queue = ShardQueue([own], [theirs], book, lambda name: False, lambda s, st: None, lambda: False, 0.01)
        assert queue.next_shard(wait=False, steal=False) == own
        assert queue.next_shard(wait=False, steal=False) is None and not queue.is_done  # "theirs" stays next
        assert queue.next_shard(wait=False, steal=True) == theirs
        assert queue.next_shard(wait=False) is None and queue.is_done
