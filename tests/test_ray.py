"""launcher=ray and the Ray Data stage on one real local Ray cluster (conftest.ray_cluster: `ray
start --head --num-cpus 2`, for the session): the same exactly-once results as the local launcher,
a worker actor SIGKILLed mid-run and replaced, and Ray Data's greedy outputs equal to the job's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.job import run_job
from batchrun.job.claims import process_start_time

pytestmark = pytest.mark.ray

# Columns that depend on timing or on what the prefix cache held, not on the row.
RUN_DEPENDENT = {"ttft_s", "itl_s", "latency_s", "num_cached_tokens"}


def _rows(out: Path) -> dict[str, list[dict]]:
    strip = lambda rows: [{k: v for k, v in r.items() if k not in RUN_DEPENDENT} for r in rows]  # noqa: E731
    return {p.stem: strip(pq.read_table(p).to_pylist()) for p in sorted((out / "results").glob("*.parquet"))}


def _ray_command(job_overrides, data, out, address: str, *extra: str) -> list[str]:
    overrides = job_overrides(data, out, "launcher=ray", f"launcher.ray_address={address}", *extra)
    return [sys.executable, "-m", "batchrun", *overrides]


def test_the_ray_launcher_commits_every_row_once_as_the_local_launcher_does(
    ray_cluster, tmp_path, make_shards, job_overrides
):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=3) for i in s]
    local = run_job(cli.load_config(job_overrides(tmp_path / "in", tmp_path / "local", "launcher.num_workers=2")))
    assert local.exit_code == 0, local.message
    cmd = _ray_command(job_overrides, tmp_path / "in", tmp_path / "ray", ray_cluster, "launcher.num_workers=2")
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "completed: 2 Ray workers: 4 committed" in done.stdout

    out = tmp_path / "ray"
    assert _rows(out) == _rows(tmp_path / "local")
    got = [r["id"] for rows in _rows(out).values() for r in rows]
    assert sorted(got) == sorted(ids) and len(got) == len(set(got))
    merged = json.loads((out / "_manifest.json").read_text())
    assert merged["status"] == "completed" and merged["worker"]["world_size"] == 2
    assert [s["status"] for s in merged["shards"]] == ["committed"] * 4
    workers = sorted(merged["workers"], key=lambda w: w["rank"])
    assert [w["rank"] for w in workers] == [0, 1]
    assert all(w["source"] == "ray launcher BATCHRUN_RANK/WORLD_SIZE" for w in workers)
    assert len({w["pid"] for w in workers}) == 2 and os.getpid() not in {w["pid"] for w in workers}
    assert not (out / "_claims").exists()
    assert (out / "report.html").exists()


def test_a_sigkilled_worker_actor_is_replaced_and_every_id_is_committed_once(
    ray_cluster, tmp_path, make_shards, job_overrides, hooked_env
):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=3) for i in s]
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    # Each output row waits a little, so the kill lands while the worker has rows in flight.
    env = hooked_env({"dir": str(hooks), "delay_s": 0.4, "rank": "ray"})
    cmd = _ray_command(job_overrides, tmp_path / "in", tmp_path / "out", ray_cluster, "launcher.num_workers=2")
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
    started = []
    while not started:
        if driver.poll() is not None:
            pytest.fail(f"the driver exited early ({driver.returncode}): {driver.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "no worker reached its first output"
        started = sorted(hooks.glob("started-*"))
        time.sleep(0.05)
    victim = int(started[0].name.rsplit("-", 1)[1])
    out = tmp_path / "out"
    ranks = {json.loads(p.read_text())["worker"]["pid"]: p for p in out.glob("_manifest.rank*.json")}
    killed_manifest = ranks[victim]
    os.kill(victim, signal.SIGKILL)
    while process_start_time(victim) is not None:
        assert time.monotonic() < deadline, "the worker actor did not die"
        time.sleep(0.01)
    stdout, stderr = driver.communicate(timeout=600)

    assert driver.returncode == 0, stderr[-3000:]
    assert "completed: 2 Ray workers" in stdout
    got = [r["id"] for rows in _rows(out).values() for r in rows]
    assert sorted(got) == sorted(ids) and len(got) == len(ids)
    merged = json.loads((out / "_manifest.json").read_text())
    assert merged["status"] == "completed"
    assert [s["status"] for s in merged["shards"]] == ["committed"] * 4
    # Ray restarted the actor: its rank ran again in a new process and finished.
    replaced = json.loads(killed_manifest.read_text())
    assert replaced["worker"]["pid"] != victim and replaced["status"] == "completed"


def test_the_ray_data_stage_gives_the_jobs_greedy_outputs(ray_cluster, tmp_path, job_overrides):
    import ray
    import ray.data

    from batchrun.integrations.ray_data import BatchrunPredictor

    sample = Path(cli.package_path("data/sample"))
    config = cli.load_config(job_overrides(sample, tmp_path / "job", "sampling.max_tokens=6"))
    assert config.sampling.is_greedy
    job = run_job(config)
    assert job.exit_code == 0, job.message
    expected = {r["id"]: r for rows in _rows(tmp_path / "job").values() for r in rows}

    ray.init(address=ray_cluster, log_to_driver=False)
    try:
        ds = ray.data.read_parquet(str(sample))
        out = ds.map_batches(
            BatchrunPredictor,
            fn_constructor_args=(config.to_dict(),),
            concurrency=1,
            num_cpus=1,
            batch_size=5,
            batch_format="pyarrow",
        )
        rows = out.take_all()
    finally:
        ray.shutdown()
    got = {r["id"]: {k: v for k, v in r.items() if k not in RUN_DEPENDENT} for r in rows}
    assert len(rows) == len(expected) == 32
    assert got == expected
    assert {r["finish_reason"] for r in rows} <= {"stop", "length", "error"}


def test_a_bad_row_is_a_typed_error_row_and_the_batch_goes_on(tiny_engine, job_overrides, tmp_path):
    """The stage's rows without Ray: a null text, an empty one and a null id each end typed."""
    import asyncio

    import pyarrow as pa

    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    from batchrun.integrations.ray_data import BatchrunPredictor

    config = cli.load_config(job_overrides(tmp_path, tmp_path / "out", "sampling.max_tokens=4"))
    stage = BatchrunPredictor(config, engine=tiny_engine)
    batch = pa.table({"id": ["a", "b", None, "d"], "text": ["Tell me about lists.", None, "Hello there.", " "]})
    table = asyncio.run(stage(batch))
    rows = table.to_pylist()
    assert table.schema.names[:4] == ["id", "output", "finish_reason", "error_type"]
    assert [r["error_type"] for r in rows] == [None, "null_prompt", "null_id", "empty_prompt"]
    assert rows[0]["output"] is not None and rows[0]["num_output_tokens"] >= 1


def test_without_ray_the_launcher_says_so_in_one_line(monkeypatch, tmp_path, job_overrides):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when not installed
    config = cli.load_config(job_overrides(cli.package_path("data/sample"), tmp_path / "out", "launcher=ray"))
    with pytest.raises(cli.ConfigError, match=r"launcher.name: launcher=ray needs Ray .*pip install 'batchrun\[ray\]'"):
        run_job(config)
    with pytest.raises(cli.ConfigError, match="launcher.ray_address: used only with launcher=ray"):
        cli.load_config(job_overrides(tmp_path, tmp_path / "out", "launcher.ray_address=auto"))
