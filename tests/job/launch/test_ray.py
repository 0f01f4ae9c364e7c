"""launcher=ray and the Ray Data stage on one real local Ray cluster (conftest.ray_cluster: `ray
start --head --num-cpus 2`, for the session): the same exactly-once results as the local launcher,
a worker actor SIGKILLed mid-run and replaced, and Ray Data's greedy outputs equal to the job's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.job import run_job
from batchrun.job.commit.claims import process_start_time

pytestmark = pytest.mark.ray

# Columns that depend on timing or on what the prefix cache held, not on the row.
RUN_DEPENDENT = {"ttft_s", "itl_s", "latency_s", "num_cached_tokens"}


def _rows(out: Path) -> dict[str, list[dict]]:
    strip = lambda rows: [{k: v for k, v in r.items() if k not in RUN_DEPENDENT} for r in rows]  # noqa: E731
    return {p.stem: strip(pq.read_table(p).to_pylist()) for p in sorted((out / "results").glob("*.parquet"))}


def _ray_command(job_overrides, data, out, address: str, *extra: str) -> list[str]:
    overrides = job_overrides(data, out, "launcher=ray", f"launcher.ray_address={address}", *extra)
    return [sys.executable, "-m", "batchrun", *overrides]


def _bar(stderr: str) -> tuple[int, int, int]:
    """(rows, output tokens, restarts) of the driver's bar as last drawn (tqdm, quiet=false)."""
    draws = re.findall(r"batchrun ray: (\d+)row \[[^\]]*?(\d+) output tokens, (\d+) restart\(s\)\]", stderr)
    assert draws, f"no progress bar in the driver's stderr: {stderr[-2000:]}"
    rows, tokens, restarts = draws[-1]
    return int(rows), int(tokens), int(restarts)


def _worker_rows(out: Path) -> dict[int, int]:
    """Rows each rank committed, from the shard records of its manifest."""
    done = {}
    for p in out.glob("_manifest.rank*.json"):
        doc = json.loads(p.read_text())
        done[doc["worker"]["rank"]] = sum(s["num_rows"] for s in doc["shards"] if s["status"] == "committed")
    return done


def test_the_ray_launcher_commits_every_row_once_as_the_local_launcher_does(
    ray_cluster, tmp_path, make_shards, job_overrides
):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=3) for i in s]
    local = run_job(cli.load_config(job_overrides(tmp_path / "in", tmp_path / "local", "launcher.num_workers=2")))
    assert local.exit_code == 0, local.message
    # engine.device=cpu: CPU placement (engine.num_threads cores per actor) on a cluster with GPUs.
    cmd = _ray_command(
        job_overrides,
        tmp_path / "in",
        tmp_path / "ray",
        ray_cluster.address,
        "launcher.num_workers=2",
        "engine.device=cpu",
        "quiet=false",
    )
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "completed: 2 Ray workers: 4 committed" in done.stdout
    # Every worker's progress reaches the driver: each rank reported the rows its manifest says it
    # committed (however the shards fell between them), and the one bar counts all 12.
    worker_rows = _worker_rows(tmp_path / "ray")
    assert sorted(worker_rows) == [0, 1] and sum(worker_rows.values()) == len(ids), worker_rows
    for rank, n in worker_rows.items():
        assert re.search(rf"ray worker {rank} reported {n} rows, \d+ output tokens", done.stderr), (rank, n)
    rows, tokens, restarts = _bar(done.stderr)
    assert (rows, restarts) == (len(ids), 0)
    assert tokens == sum(r["num_output_tokens"] for rows_ in _rows(tmp_path / "ray").values() for r in rows_)

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
    assert [w["device"] for w in workers] == [None, None]  # CPU actors are given no GPU
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
    cmd = _ray_command(
        job_overrides, tmp_path / "in", tmp_path / "out", ray_cluster.address, "launcher.num_workers=2", "quiet=false"
    )
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
    # The bar counted the new incarnation as a restart, and every row (the dead one's too).
    rows, _, restarts = _bar(stderr)
    assert restarts == 1 and rows >= len(ids)


def test_auto_address_places_one_worker_per_gpu_and_records_each_device(
    ray_cluster, tmp_path, make_shards, job_overrides
):
    """launcher.ray_address=auto finds the cluster as `ray job submit` leaves it (RAY_ADDRESS);
    num_workers null on a cluster with GPUs (2, simulated) gives one actor per GPU, one GPU each."""
    ids = [i for s in make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2) for i in s]
    cmd = _ray_command(job_overrides, tmp_path / "in", tmp_path / "out", "auto", "engine.device=auto")
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "completed: 2 Ray workers: 2 committed" in done.stdout
    out = tmp_path / "out"
    got = [r["id"] for rows in _rows(out).values() for r in rows]
    assert sorted(got) == sorted(ids) and len(got) == len(ids)
    merged = json.loads((out / "_manifest.json").read_text())
    assert sorted(w["rank"] for w in merged["workers"]) == [0, 1]
    assert sorted(w["device"] for w in merged["workers"]) == ["0", "1"]  # Ray gave each its own GPU


def test_an_actor_past_its_restarts_is_given_up_and_the_other_takes_its_shards(
    ray_cluster, tmp_path, make_shards, job_overrides, hooked_env
):
    """launcher.max_restarts=0: the SIGKILLed actor is not restarted (its rank never runs again),
    the other worker takes its shards over through the claims, and the run still completes."""
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=2) for i in s]
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    env = hooked_env({"dir": str(hooks), "delay_s": 0.4, "rank": "ray"})
    cmd = _ray_command(
        job_overrides,
        tmp_path / "in",
        tmp_path / "out",
        ray_cluster.address,
        "launcher.num_workers=2",
        "launcher.max_restarts=0",
        "engine.device=cpu",
        "quiet=false",
    )
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
    while not (started := sorted(hooks.glob("started-*"))):
        if driver.poll() is not None:
            pytest.fail(f"the driver exited early ({driver.returncode}): {driver.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "no worker reached its first output"
        time.sleep(0.05)
    victim = int(started[0].name.rsplit("-", 1)[1])
    out = tmp_path / "out"
    by_pid = {json.loads(p.read_text())["worker"]["pid"]: p for p in out.glob("_manifest.rank*.json")}
    victim_manifest = by_pid[victim]
    victim_rank = json.loads(victim_manifest.read_text())["worker"]["rank"]
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = driver.communicate(timeout=600)

    assert driver.returncode == 0, stderr[-3000:]
    assert f"ray worker {victim_rank} was given up after 0 restarts" in stderr
    assert "completed: 2 Ray workers: 4 committed" in stdout and "-9" in stdout  # its exit code recorded
    got = [r["id"] for rows in _rows(out).values() for r in rows]
    assert sorted(got) == sorted(ids) and len(got) == len(ids)
    dead = json.loads(victim_manifest.read_text())
    assert dead["worker"]["pid"] == victim and dead["status"] == "running"  # never ran again
    assert _bar(stderr)[2] == 0
    merged = json.loads((out / "_manifest.json").read_text())
    assert [s["status"] for s in merged["shards"]] == ["committed"] * 4


def test_sigterm_to_the_driver_stops_every_actor_and_a_rerun_completes(
    ray_cluster, tmp_path, make_shards, job_overrides, hooked_env
):
    """The driver's SIGTERM reaches each actor as its own SIGTERM: each worker stops gracefully
    (its manifest says interrupted, nothing partial is committed), the driver exits 143, and the
    same command run again commits every id exactly once."""
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=3) for i in s]
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    cmd = _ray_command(
        job_overrides,
        tmp_path / "in",
        tmp_path / "out",
        ray_cluster.address,
        "launcher.num_workers=2",
        "engine.device=cpu",
    )
    env = hooked_env({"dir": str(hooks), "delay_s": 0.8, "rank": "ray"})
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
    while len({p.name.rsplit("-", 1)[1] for p in hooks.glob("started-*")}) < 2:  # both workers mid-shard
        if driver.poll() is not None:
            pytest.fail(f"the driver exited early ({driver.returncode}): {driver.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "the workers did not both reach an output"
        time.sleep(0.05)
    driver.send_signal(signal.SIGTERM)
    _, stderr = driver.communicate(timeout=600)
    assert driver.returncode == 143, stderr[-3000:]
    out = tmp_path / "out"
    # A worker whose last shard ended before the stop reached it completed; none was killed.
    statuses = [json.loads(p.read_text())["status"] for p in sorted(out.glob("_manifest.rank*.json"))]
    assert len(statuses) == 2 and "interrupted" in statuses and set(statuses) <= {"interrupted", "completed"}
    # What was committed is whole: every results file holds its shard's rows, and nothing else.
    shard_ids = {f"part-{s:02d}": {f"part{s}-row{r}" for r in range(3)} for s in range(4)}
    committed = _rows(out)
    assert len(committed) < 4
    for name, rows in committed.items():
        assert {r["id"] for r in rows} == shard_ids[name]

    rerun = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    got = [r["id"] for rows in _rows(out).values() for r in rows]
    assert sorted(got) == sorted(ids) and len(got) == len(ids)


def test_placement_one_gpu_per_actor_or_the_cpus_shared_out(job_overrides, tmp_path):
    """launcher=ray's placement from the cluster's resources (ray.cluster_resources())."""
    import dataclasses

    from batchrun.job.errors import ConfigError
    from batchrun.job.launch.ray_launch import placement

    def config(device, num_workers=None, num_threads=None):
        c = cli.load_config(job_overrides(tmp_path, tmp_path / "out", "launcher=ray", f"engine.device={device}"))
        return dataclasses.replace(
            c,
            engine=dataclasses.replace(c.engine, num_threads=num_threads),
            launcher=dataclasses.replace(c.launcher, num_workers=num_workers),
        )

    gpu_host = {"CPU": 32.0, "GPU": 4.0}
    assert placement(config("auto"), gpu_host) == (4, {"num_gpus": 1, "num_cpus": 1}, None)
    assert placement(config("cuda", num_workers=2), gpu_host) == (2, {"num_gpus": 1, "num_cpus": 1}, None)
    # engine.device=cpu on a GPU cluster: CPU actors, the cores shared out (or engine.num_threads each).
    assert placement(config("cpu"), gpu_host) == (1, {"num_gpus": 0, "num_cpus": 32}, 32)
    assert placement(config("cpu", num_workers=4), gpu_host) == (4, {"num_gpus": 0, "num_cpus": 8}, 8)
    assert placement(config("auto", num_workers=3, num_threads=2), {"CPU": 8.0}) == (
        3,
        {"num_gpus": 0, "num_cpus": 2},
        2,
    )
    with pytest.raises(ConfigError, match="engine.device: cuda requested but the Ray cluster has no GPU"):
        placement(config("cuda"), {"CPU": 8.0})


def test_placement_of_tensor_parallel_groups(job_overrides, tmp_path):
    """engine.tensor_parallel_size=2: each actor asks for its group's GPUs (or its ranks' cores),
    and a group must fit one node (Ray places an actor's GPUs on one node)."""
    import dataclasses

    from batchrun.job.errors import ConfigError
    from batchrun.job.launch.ray_launch import node_gpu_counts, placement

    def config(device, num_workers=None, num_threads=None):
        overrides = ["launcher=ray", f"engine.device={device}", "engine.tensor_parallel_size=2"]
        c = cli.load_config(job_overrides(tmp_path, tmp_path / "out", *overrides))
        return dataclasses.replace(
            c,
            engine=dataclasses.replace(c.engine, num_threads=num_threads),
            launcher=dataclasses.replace(c.launcher, num_workers=num_workers),
        )

    gpu_host = {"CPU": 32.0, "GPU": 4.0}
    assert placement(config("auto"), gpu_host) == (2, {"num_gpus": 2, "num_cpus": 2}, None)
    assert placement(config("auto"), gpu_host, [4]) == (2, {"num_gpus": 2, "num_cpus": 2}, None)
    assert placement(config("cuda", num_workers=1), gpu_host) == (1, {"num_gpus": 2, "num_cpus": 2}, None)
    # Three nodes of 3, 2 and 1 GPUs: a group on the first and one on the second; 6 // 2 would be 3.
    assert placement(config("auto"), {"CPU": 48.0, "GPU": 6.0}, [3, 2, 1])[0] == 2
    with pytest.raises(ConfigError, match=r"^engine.tensor_parallel_size: a group of 2 ranks needs 2 GPUs on one node"):
        placement(config("auto"), {"CPU": 16.0, "GPU": 2.0}, [1, 1])
    with pytest.raises(ConfigError, match=r"^engine.tensor_parallel_size: .*nodes have at most 1$"):
        placement(config("cuda"), {"CPU": 16.0, "GPU": 1.0})
    # On the CPU: each actor reserves its ranks' threads, whole threads per rank.
    assert placement(config("cpu"), gpu_host) == (1, {"num_gpus": 0, "num_cpus": 32}, 32)
    assert placement(config("cpu", num_workers=3), gpu_host) == (3, {"num_gpus": 0, "num_cpus": 10}, 10)
    assert placement(config("auto", num_workers=2, num_threads=5), {"CPU": 8.0}) == (
        2,
        {"num_gpus": 0, "num_cpus": 4},  # the engine runs 5 // 2 = 2 threads on each of its 2 ranks
        5,
    )
    assert placement(config("cpu", num_workers=2, num_threads=1), {"CPU": 8.0})[1] == {"num_gpus": 0, "num_cpus": 2}
    nodes = [
        {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 4.0}},
        {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 4.0}},
        {"Alive": True, "Resources": {"CPU": 8.0}},
    ]
    assert node_gpu_counts(nodes) == [4, 0]


@pytest.mark.parametrize("on_too_long", ["error", "truncate"])
def test_the_ray_data_stage_gives_the_jobs_greedy_outputs(ray_cluster, tmp_path, job_overrides, on_too_long):
    """ray.data.read_parquet of the bundled sample and of a file of bad rows, through the stage,
    against a job over the same files: every row equal, typed error rows included. The sample's
    texts are longer than the tiny model's context: `error` makes them prompt_too_long rows,
    `truncate` makes them 32 greedy outputs."""
    import shutil

    import pyarrow as pa
    import ray
    import ray.data

    from batchrun.integrations.ray_data import BatchrunPredictor

    sample = Path(cli.package_path("data/sample"))
    data = tmp_path / "in"
    shutil.copytree(sample, data)
    bad = pa.table(
        {
            "id": ["bad-null-text", "bad-blank-text", None, "ok-short"],
            "title": ["t"] * 4,
            "text": [None, "   ", "a row without an id", "Tell me about lists."],
        }
    )
    pq.write_table(bad, data / "zz-bad.parquet")
    config = cli.load_config(
        job_overrides(data, tmp_path / "job", "sampling.max_tokens=6", f"data.on_too_long={on_too_long}")
    )
    assert config.sampling.is_greedy
    job = run_job(config)
    assert job.exit_code == 0, job.message
    expected = {r["id"]: r for rows in _rows(tmp_path / "job").values() for r in rows}

    ray.init(address=ray_cluster.address, log_to_driver=False)
    try:
        ds = ray.data.read_parquet([str(sample), str(data / "zz-bad.parquet")])
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
    assert len(rows) == len(expected) == 36
    # A message's "row N" is the row's place in its shard in a job, in its batch here.
    for r in [*got.values(), *expected.values()]:
        r["error_message"] = r["error_message"] and re.sub(r"^row \d+: ", "row N: ", r["error_message"])
    assert got == expected
    errors = [r["error_type"] for r in rows]
    assert errors.count("null_prompt") == 1 and errors.count("empty_prompt") == 1 and errors.count("null_id") == 1
    assert got["ok-short"]["error_type"] is None and got["ok-short"]["num_output_tokens"] >= 1
    too_long = errors.count("prompt_too_long")
    outputs = sum(r["error_type"] is None for r in rows)
    if on_too_long == "error":
        assert too_long >= 16 and outputs == 36 - 3 - too_long
    else:
        assert too_long == 0 and outputs == 33


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


def test_batches_in_flight_on_one_actor_share_its_engine(job_overrides, tmp_path, short_texts):
    """The stage's __call__ is async: two batches awaited together run in one engine stream, so
    they take fewer engine steps than the same batches one after the other, with the same outputs."""
    import asyncio

    import pyarrow as pa

    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    from batchrun.integrations.ray_data import BatchrunPredictor

    config = cli.load_config(
        job_overrides(tmp_path, tmp_path / "out", "sampling.max_tokens=12", "engine.max_num_seqs=8")
    )
    stage = BatchrunPredictor(config)  # its own engine: the stage's thread keeps it
    batches = [
        pa.table({"id": [f"b{b}-{i}" for i in range(3)], "text": short_texts[3 * b : 3 * b + 3]}) for b in range(2)
    ]

    def steps_for(run) -> tuple[int, list[dict]]:
        before = stage.engine.stats().num_steps
        tables = asyncio.run(run())
        rows = [{k: v for k, v in r.items() if k not in RUN_DEPENDENT} for t in tables for r in t.to_pylist()]
        return stage.engine.stats().num_steps - before, rows

    async def one_after_the_other():
        return [await stage(b) for b in batches]

    async def together():
        return list(await asyncio.gather(*(stage(b) for b in batches)))

    alone_steps, alone_rows = steps_for(one_after_the_other)
    shared_steps, shared_rows = steps_for(together)
    assert shared_rows == alone_rows and all(r["error_type"] is None for r in alone_rows)
    # One after the other: each batch's prefill and decode steps; together: one set for both.
    assert shared_steps < 0.75 * alone_steps, (shared_steps, alone_steps)


def test_without_ray_the_launcher_says_so_in_one_line(monkeypatch, tmp_path, job_overrides):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when not installed
    config = cli.load_config(job_overrides(cli.package_path("data/sample"), tmp_path / "out", "launcher=ray"))
    with pytest.raises(cli.ConfigError, match=r"launcher.name: launcher=ray needs Ray .*pip install 'batchrun\[ray\]'"):
        run_job(config)
    with pytest.raises(cli.ConfigError, match="launcher.ray_address: used only with launcher=ray"):
        cli.load_config(job_overrides(tmp_path, tmp_path / "out", "launcher.ray_address=auto"))
