"""Checkpoints inside a shard (batchrun/job/commit/checkpoints.py): a killed worker loses the rows since its
last committed part, a rerun sends only the remaining rows to the engine, and readers never see a
row twice. Real worker processes, real SIGKILLs at random points of the run and of the commit
protocol, real Parquet; the store is never mocked.

BATCHRUN_CHECKPOINT_KILLS sets the number of kills (default 6, what CI's time allows; a soak run
sets more); BATCHRUN_CHECKPOINT_REPORT names a file to which each kill appends one JSON line (what
was killed where, rows recomputed).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.job import committed_urls, run_job
from batchrun.job.commit.checkpoints import committed_parts, read_parts
from batchrun.job.commit.store import RunStore, committed_files
from batchrun.job.config import build_run_config

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

NUM_ROWS = 400
CHECKPOINT_ROWS = 25
TIMEOUT_S = 300  # a hang guard per process, never a timing assertion
KILL_POINTS = ("part_written", "part_committed", "merge", "marker_created")


def _one_shard(directory: Path, texts: list[str], num_rows: int = NUM_ROWS) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    ids = [f"row-{i:04d}" for i in range(num_rows)]
    # Short, varied prompts: the planner reorders them (longest first), so rows finish far from
    # input order and parts hold scattered rows.
    prompts = [texts[i % len(texts)][: 40 + (i * 37) % 160] for i in range(num_rows)]
    pq.write_table(pa.table({"id": ids, "title": ids, "text": prompts}), directory / "big.parquet")
    return ids


def _args(tiny_llama_dir: str, data: Path, out: str, *extra: str) -> list[str]:
    return [
        f"model.path={tiny_llama_dir}",
        f"data.uri={data}",
        f"output.uri={out}",
        "engine.kv_cache_memory=33554432",
        "engine.max_num_seqs=8",
        "engine.max_num_batched_tokens=1024",
        "engine.dtype=float32",
        "engine.num_threads=1",
        "sampling.max_tokens=2",
        f"output.checkpoint_rows={CHECKPOINT_ROWS}",
        "output.checkpoint_s=0",
        "launcher.max_shard_attempts=1000",  # every kill is a died attempt
        "quiet=true",
        *extra,
    ]


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchrun", *args], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _part_rows(store: RunStore, shard: str = "big") -> set[int]:
    rows: set[int] = set()
    for part in read_parts(store, shard):
        for first, end, _ in part.rows:
            part_rows = set(range(first, end))
            assert not rows & part_rows, f"part {part.index} repeats rows"
            rows |= part_rows
    return rows


def _outputs(directory: Path, pid: int) -> list[int]:
    path = directory / f"outputs-{pid}"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def _results(out: str) -> pa.Table:
    store = RunStore(out, {})
    [(shard, path)] = committed_files(store).items()
    with store.fs.open(path, "rb") as f:
        return pq.read_table(f)


def test_sigkill_at_random_points_loses_at_most_one_interval(tmp_path, short_texts, tiny_llama_dir, hooked_env):
    ids = _one_shard(tmp_path / "in", short_texts)
    reference = str(tmp_path / "reference")
    done = _run(_args(tiny_llama_dir, tmp_path / "in", reference, "output.checkpoint_rows=0"), hooked_env())
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _results(reference).select(["id", "output", "finish_reason", "num_output_tokens"])

    kills = int(os.environ.get("BATCHRUN_CHECKPOINT_KILLS", "6"))
    report = os.environ.get("BATCHRUN_CHECKPOINT_REPORT")
    rng = random.Random(int(os.environ.get("BATCHRUN_CHAOS_SEED", "1234")))
    trial, killed = 0, 0
    while killed < kills:
        out = str(tmp_path / f"out{trial}")
        hooks_dir = tmp_path / f"hooks{trial}"
        hooks_dir.mkdir()
        store = RunStore(out, {})
        while True:  # kill this run until it completes
            hooks: dict = {"dir": str(hooks_dir), "record": True}
            if killed < kills:
                if rng.random() < 0.6:
                    hooks["kill_after"] = rng.randint(1, NUM_ROWS)
                else:
                    hooks["kill_at"] = rng.choice(KILL_POINTS)
                    hooks["kill_at_count"] = rng.randint(1, 4) if hooks["kill_at"].startswith("part") else 1
            before = _part_rows(store)
            proc = subprocess.Popen(
                [sys.executable, "-m", "batchrun", *_args(tiny_llama_dir, tmp_path / "in", out)],
                env=hooked_env(hooks),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            _, stderr = proc.communicate(timeout=TIMEOUT_S)
            sent = _outputs(hooks_dir, proc.pid)
            # Only the rows no committed part holds go to the engine again.
            assert not set(sent) & before, f"rows of committed parts recomputed: {sorted(set(sent) & before)[:5]}"
            if proc.returncode == 0:
                break
            assert proc.returncode == -signal.SIGKILL, stderr[-3000:]
            killed += 1
            after = _part_rows(store) if not store.read_marker("big") else set(range(NUM_ROWS))
            recomputed = len(set(sent) - after)
            event = {"trial": trial, "hooks": {k: v for k, v in hooks.items() if k != "dir"}, "sent": len(sent)}
            event.update(committed_before=len(before), committed_after=len(after), recomputed=recomputed)
            if report:
                with open(report, "a") as f:
                    f.write(json.dumps(event) + "\n")
            assert recomputed <= CHECKPOINT_ROWS, event
        table = _results(out)
        assert table.column("id").to_pylist() == ids  # every id once, in input order
        assert table.select(expected.column_names).equals(expected)  # the same rows as one clean run
        assert not committed_parts(store), "the parts of a committed shard are removed"
        trial += 1


def test_readers_see_committed_parts_of_an_unfinished_shard_never_twice(
    tmp_path, short_texts, tiny_llama_dir, hooked_env
):
    _one_shard(tmp_path / "in", short_texts, num_rows=120)
    out = str(tmp_path / "out")
    hooks = {"dir": str(tmp_path), "kill_at": "part_committed", "kill_at_count": 3}
    killed = _run(_args(tiny_llama_dir, tmp_path / "in", out), hooked_env(hooks))
    assert killed.returncode == -signal.SIGKILL
    urls = committed_urls(out)
    assert sorted(urls) == [f"big/part-{k:06d}" for k in range(3)]
    import datasets

    rows = datasets.load_dataset("parquet", data_files=list(urls.values()), split="train")
    assert len(rows) == 3 * CHECKPOINT_ROWS and len(set(rows["id"])) == len(rows)
    assert committed_urls(out, parts=False) == {}
    assert committed_urls(out, kind="metrics") == {}  # a shard's metrics row comes with its commit
    resumed = _run(_args(tiny_llama_dir, tmp_path / "in", out), hooked_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(committed_urls(out)) == ["big"]
    metrics = pq.read_table(committed_urls(out, kind="metrics")["big"]).to_pylist()
    assert len(metrics) == 1 and metrics[0]["num_rows"] == 120 and metrics[0]["num_ok"] == 120


def test_sigterm_commits_the_finished_rows_before_stopping(tmp_path, short_texts, tiny_llama_dir, hooked_env):
    """A graceful stop (Slurm's preemption SIGTERM) keeps every finished row, not one interval's less."""
    _one_shard(tmp_path / "in", short_texts, num_rows=200)
    out = str(tmp_path / "out")
    env = hooked_env({"dir": str(tmp_path), "record": True, "delay_s": 0.02})
    args = _args(tiny_llama_dir, tmp_path / "in", out, "output.checkpoint_rows=1000")  # no part by rows
    proc = subprocess.Popen([sys.executable, "-m", "batchrun", *args], env=env, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(TIMEOUT_S * 10):
            if len(_outputs(tmp_path, proc.pid)) >= 40:
                break
            proc.wait(timeout=0.1) if proc.poll() is not None else __import__("time").sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    done = _part_rows(RunStore(out, {}))
    assert len(done) >= 40 and done <= set(_outputs(tmp_path, proc.pid))
    assert "committed part(s) kept" in stderr


def test_parts_of_other_settings_stop_the_rerun_or_are_redone(tmp_path, short_texts, tiny_llama_dir, hooked_env):
    _one_shard(tmp_path / "in", short_texts, num_rows=80)
    out = str(tmp_path / "out")
    killed = _run(
        _args(tiny_llama_dir, tmp_path / "in", out), hooked_env({"kill_at": "part_committed", "kill_at_count": 2})
    )
    assert killed.returncode == -signal.SIGKILL
    other = _run(_args(tiny_llama_dir, tmp_path / "in", out, "sampling.max_tokens=3"), hooked_env())
    assert other.returncode == 2 and "output.on_change" in other.stderr
    redo = _run(
        _args(tiny_llama_dir, tmp_path / "in", out, "sampling.max_tokens=3", "output.on_change=recompute"),
        hooked_env(),
    )
    assert redo.returncode == 0, redo.stderr[-3000:]
    assert max(_results(out).column("num_output_tokens").to_pylist()) == 3


def test_openai_batch_shard_resumes_from_its_parts(tmp_path, tiny_llama_dir, one_torch_thread, tiny_engine):
    """Batch files are checkpointed too: output and error lines come back whole, once each."""
    lines = []
    for i in range(30):
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 2}
        if i % 7 == 3:
            body["n"] = 2
            body["temperature"] = 0.8
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    lines.insert(5, "not json")
    data = tmp_path / "in"
    data.mkdir()
    (data / "batch.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    out = str(tmp_path / "out")

    def config(*extra: str):
        return build_run_config(
            {
                "job": {"name": "openai_batch", "prompt_template": None},
                "data": {"uri": str(data), "format": "openai_batch", "openai_model_name": "tiny"},
                "model": {"path": tiny_llama_dir},
                "output": {"uri": out, "checkpoint_rows": 4, "checkpoint_s": 0},
                "sampling": {"max_tokens": 2, "seed": 7},
                "quiet": True,
            }
        )

    from batchrun.job.run import flow

    real = flow.ShardRun.on_output
    calls = {"n": 0}

    def stop_part_way(self, out_):
        real(self, out_)
        calls["n"] += 1
        if calls["n"] == 17:
            raise KeyboardInterrupt  # an abrupt end in the middle: nothing but the parts survives

    flow.ShardRun.on_output = stop_part_way
    try:
        with pytest.raises(KeyboardInterrupt):
            run_job(config(), engine=tiny_engine)
    finally:
        flow.ShardRun.on_output = real
    store = RunStore(out, {})
    assert read_parts(store, "batch"), "parts were committed before the interruption"
    result = run_job(config(), engine=tiny_engine)
    assert result.exit_code == 0
    answered = []
    for kind in ("outputs", "errors"):
        for path in committed_files(store, kind).values():
            answered += [json.loads(x)["custom_id"] for x in store.fs.cat_file(path).decode().splitlines()]
    assert sorted(answered, key=str) == sorted([None] + [f"req-{i}" for i in range(30)], key=str)


def test_parts_by_time_alone(tmp_path, short_texts, tiny_llama_dir, hooked_env):
    """output.checkpoint_rows=0: parts are committed by output.checkpoint_s alone."""
    _one_shard(tmp_path / "in", short_texts, num_rows=60)
    out = str(tmp_path / "out")
    args = _args(tiny_llama_dir, tmp_path / "in", out, "output.checkpoint_rows=0", "output.checkpoint_s=0.2")
    killed = _run(args, hooked_env({"delay_s": 0.03, "kill_after": 45}))
    assert killed.returncode == -signal.SIGKILL
    parts = read_parts(RunStore(out, {}), "big")
    assert len(parts) >= 2 and all(p.num_result_rows < 45 for p in parts)  # by time, not one batch at the end
    resumed = _run(args, hooked_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _results(out).column("id").to_pylist() == [f"row-{i:04d}" for i in range(60)]
