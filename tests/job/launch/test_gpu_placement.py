"""launcher.num_workers null: one worker per visible GPU, each given its own and recording it in
its manifest; on this CPU machine the GPUs are simulated (CUDA_VISIBLE_DEVICES, a device count)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from batchrun import cli
from batchrun.job import ConfigError, run_job
from batchrun.job.launch.pool import num_local_workers, worker_configs


def _config(job_overrides, tmp_path, *extra):
    return cli.load_config(job_overrides(tmp_path / "in", tmp_path / "out", *extra))


def test_the_default_is_one_worker_per_visible_gpu(job_overrides, tmp_path):
    config = _config(job_overrides, tmp_path, "engine.device=auto")
    assert config.launcher.num_workers is None
    assert num_local_workers(config, {"CUDA_VISIBLE_DEVICES": "2,5,7"}) == 3
    assert num_local_workers(config, {}, device_count=4) == 4
    assert num_local_workers(config, {}, device_count=0) == 1  # no GPU: one worker, in this process
    # A scheduler already placed this process: it is one worker, whatever GPUs it sees.
    assert num_local_workers(config, {"CUDA_VISIBLE_DEVICES": "0,1", "RANK": "1", "WORLD_SIZE": "2"}) == 1
    assert num_local_workers(_config(job_overrides, tmp_path, "engine.device=cpu"), {}, device_count=4) == 1
    assert num_local_workers(_config(job_overrides, tmp_path, "launcher.num_workers=2"), {}, device_count=8) == 2
    workers = worker_configs(config, {"CUDA_VISIBLE_DEVICES": "2,5,7"})
    assert [(c.launcher.rank, c.launcher.world_size, e["CUDA_VISIBLE_DEVICES"]) for c, e in workers] == [
        (0, 3, "2"),
        (1, 3, "5"),
        (2, 3, "7"),
    ]
    with pytest.raises(ConfigError, match="launcher.num_workers: 4 workers need 4 GPUs; 3 visible"):
        worker_configs(_config(job_overrides, tmp_path, "launcher.num_workers=4"), {"CUDA_VISIBLE_DEVICES": "2,5,7"})


def test_each_worker_records_the_gpu_it_was_given(job_overrides, tmp_path, make_shards):
    """Two simulated GPUs: two real worker processes, each with one; the engines themselves run
    on the CPU here (no CUDA driver), so the run completes as any other."""
    import os

    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2)
    config = _config(job_overrides, tmp_path, "engine.device=auto")
    result = run_job(config, env={**os.environ, "CUDA_VISIBLE_DEVICES": "3,6"})
    assert (result.exit_code, result.status) == (0, "completed"), result.message
    out = tmp_path / "out"
    devices = {r: json.loads((out / f"_manifest.rank{r}.json").read_text())["worker"]["device"] for r in (0, 1)}
    assert devices == {0: "3", 1: "6"}
    merged = json.loads((out / "_manifest.json").read_text())
    assert sorted((w["rank"], w["device"]) for w in merged["workers"]) == [(0, "3"), (1, "6")]


def test_a_tensor_parallel_worker_is_given_one_gpu_per_rank(job_overrides, tmp_path):
    """engine.tensor_parallel_size=2: a worker per two visible GPUs, each given its two (rank 0's
    first), and a one-line refusal naming the keys where the GPUs cannot hold the groups."""
    config = _config(job_overrides, tmp_path, "engine.device=auto", "engine.tensor_parallel_size=2")
    assert num_local_workers(config, {}, device_count=4) == 2
    assert num_local_workers(config, {}, device_count=5) == 2  # the fifth GPU cannot hold a group
    assert num_local_workers(config, {"CUDA_VISIBLE_DEVICES": "1,3,5,7"}) == 2
    workers = worker_configs(config, {}, device_count=4)
    assert [(c.launcher.rank, c.launcher.world_size, e["CUDA_VISIBLE_DEVICES"]) for c, e in workers] == [
        (0, 2, "0,1"),
        (1, 2, "2,3"),
    ]
    # The engine's tensor_parallel_size goes to each worker unchanged: each worker is one group.
    assert {c.engine.tensor_parallel_size for c, _ in workers} == {2}
    workers = worker_configs(config, {"CUDA_VISIBLE_DEVICES": "1,3,5,7"})
    assert [e["CUDA_VISIBLE_DEVICES"] for _, e in workers] == ["1,3", "5,7"]

    with pytest.raises(
        ConfigError, match=r"^engine.tensor_parallel_size: a group of 2 ranks needs 2 GPUs, .*; 1 visible$"
    ):
        num_local_workers(config, {}, device_count=1)
    with pytest.raises(ConfigError, match=r"^engine.tensor_parallel_size: .* needs 2 GPUs, .*; 1 visible$"):
        worker_configs(
            _config(job_overrides, tmp_path, "engine.tensor_parallel_size=2", "launcher.num_workers=1"), {}, 1
        )
    three = _config(job_overrides, tmp_path, "engine.tensor_parallel_size=2", "launcher.num_workers=3")
    with pytest.raises(
        ConfigError,
        match=r"^launcher.num_workers: 3 workers of engine.tensor_parallel_size=2 GPUs each need 6 GPUs; 4 visible$",
    ):
        worker_configs(three, {}, device_count=4)
    # A scheduler placed this process: it is one worker, and its engine checks its own GPUs.
    assert num_local_workers(config, {"RANK": "0", "WORLD_SIZE": "2"}, device_count=1) == 1


def test_cpu_workers_share_the_cores_by_rank(job_overrides, tmp_path, monkeypatch):
    """On the CPU each worker's engine.num_threads is its ranks' share of the cores: whole
    threads per rank (the engine splits num_threads // tensor_parallel_size), at least one each;
    engine.num_threads given is each worker's, as at tensor_parallel_size 1."""
    from batchrun.job.launch import pool
    from batchrun.job.launch.pool import cpu_threads_per_worker

    assert cpu_threads_per_worker(16, 3, 1) == 5  # as before tensor parallelism: the cores // workers
    assert cpu_threads_per_worker(16, 3, 2) == 4  # 2 per rank x 2 ranks (not 16 // 3 = 5, split 2 + 2)
    assert cpu_threads_per_worker(16, 1, 4) == 16
    assert cpu_threads_per_worker(2, 2, 2) == 2  # more ranks than cores: one thread each
    monkeypatch.setattr(pool.os, "cpu_count", lambda: 8)
    cpu = _config(
        job_overrides, tmp_path, "engine.device=cpu", "launcher.num_workers=2", "engine.tensor_parallel_size=2"
    )
    cpu = dataclasses.replace(cpu, engine=dataclasses.replace(cpu.engine, num_threads=None))
    workers = worker_configs(cpu, {}, device_count=4)
    assert [(c.engine.num_threads, "CUDA_VISIBLE_DEVICES" in e) for c, e in workers] == [(4, False), (4, False)]
    given = _config(job_overrides, tmp_path, "engine.device=cpu", "launcher.num_workers=2", "engine.num_threads=3")
    assert {c.engine.num_threads for c, _ in worker_configs(given, {})} == {3}


def test_a_group_the_model_or_settings_refuse_is_a_one_line_config_error(
    job_overrides, tmp_path, make_shards, capsys, monkeypatch
):
    """Exit 2 with one line naming the keys: a setting a group cannot run, refused as the config is
    read, and a group size the model's heads do not divide in, refused by the worker's engine at
    its load (the tiny llama has 4 attention heads), before anything is committed."""
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=1)
    monkeypatch.chdir(tmp_path)
    cases = [
        (["engine.tensor_parallel_size=2", "engine.async_scheduling=true"], "engine.async_scheduling"),
        (["engine.tensor_parallel_size=3", "engine.device=cpu"], "does not fit llama"),
    ]
    for extra, says in cases:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(job_overrides(tmp_path / "in", tmp_path / "out", *extra))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err, err
        line = err.strip().splitlines()[-1]  # after the worker's own log lines, if it started
        assert line.startswith("batchrun: config error: engine.tensor_parallel_size") and says in line, line
    assert not list((tmp_path / "out").glob("_commits/*.json"))
