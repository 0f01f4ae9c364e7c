"""launcher.num_workers null: one worker per visible GPU, each given its own and recording it in
its manifest; on this CPU machine the GPUs are simulated (CUDA_VISIBLE_DEVICES, a device count)."""

from __future__ import annotations

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
