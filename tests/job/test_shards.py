"""Shard discovery, naming and assignment: pure functions over paths and environment variables."""

from __future__ import annotations

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.job import ConfigError, JobError, LauncherConfig
from batchrun.job.shards import Shard, Worker, assign_shards, discover_shards, open_filesystem, resolve_worker


def _touch_parquet(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ["a"], "text": ["x"]}), path)


def _discover(uri: str) -> list[Shard]:
    fs, path = open_filesystem(uri, {})
    return discover_shards(fs, path, uri)


def test_directory_gives_stems_sorted_and_skips_hidden_and_non_parquet(tmp_path):
    for name in ["b.parquet", "a.parquet", "_SUCCESS", ".a.parquet.crc", "notes.txt", "_tmp/x.parquet"]:
        p = tmp_path / name
        if name.endswith(".parquet") and not name.startswith("."):
            _touch_parquet(p)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("not parquet")
    shards = _discover(str(tmp_path))
    assert [s.name for s in shards] == ["a", "b"]
    assert shards[0].url.startswith("file://") and shards[0].url.endswith("/a.parquet")


def test_same_stem_in_two_directories_gets_distinct_stable_names(tmp_path):
    _touch_parquet(tmp_path / "2024" / "part-0.parquet")
    _touch_parquet(tmp_path / "2025" / "part-0.parquet")
    _touch_parquet(tmp_path / "top.parquet")
    names = [s.name for s in _discover(str(tmp_path))]
    assert names == ["2024__part-0", "2025__part-0", "top"]
    # A name depends on the file's own path only: adding files never renames a shard.
    _touch_parquet(tmp_path / "2026" / "part-0.parquet")
    assert [s.name for s in _discover(str(tmp_path))][:2] == names[:2]


def test_glob_and_single_file(tmp_path):
    for name in ["a.parquet", "b.parquet", "sub/c.parquet"]:
        _touch_parquet(tmp_path / name)
    assert [s.name for s in _discover(str(tmp_path / "*.parquet"))] == ["a", "b"]
    assert [s.name for s in _discover(str(tmp_path / "**" / "*.parquet"))] == ["a", "b", "sub__c"]
    assert [s.name for s in _discover(str(tmp_path / "sub" / "c.parquet"))] == ["c"]


def test_memory_filesystem_urls():
    fs = fsspec.filesystem("memory")
    with fs.open("/shards-test/in/x.parquet", "wb") as f:
        pq.write_table(pa.table({"id": ["a"]}), f)
    shards = _discover("memory://shards-test/in")
    assert [(s.name, s.url) for s in shards] == [("x", "memory:///shards-test/in/x.parquet")]
    fs.rm("/shards-test", recursive=True)


def test_nothing_to_read_is_a_config_error_naming_data_uri(tmp_path):
    with pytest.raises(ConfigError, match="data.uri: nothing found"):
        _discover(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="data.uri: no Parquet files"):
        _discover(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="data.uri: no Parquet files"):
        _discover(str(tmp_path / "empty" / "*.parquet"))


def test_names_that_sanitizing_would_merge_stay_apart(tmp_path):
    _touch_parquet(tmp_path / "a b.parquet")
    _touch_parquet(tmp_path / "a_b.parquet")
    names = [s.name for s in _discover(str(tmp_path))]
    assert "a_b" in names and len(set(names)) == 2
    other = next(n for n in names if n != "a_b")
    assert other.startswith("a_b-") and len(other) == len("a_b-") + 10


def test_names_differing_only_in_case_are_refused_naming_both_files(tmp_path):
    """On a case-insensitive output filesystem `Data` and `data` would share one commit marker: the
    second would be reported done with its rows never answered. Discovery refuses the pair."""
    _touch_parquet(tmp_path / "in" / "Data.parquet")
    _touch_parquet(tmp_path / "in" / "data.parquet")
    with pytest.raises(JobError, match="differ only in letter case") as error:
        _discover(str(tmp_path / "in"))
    assert "/in/Data.parquet" in str(error.value) and "/in/data.parquet" in str(error.value)
    # Names made safe with a hash differ by the hash of their own path, so they may stay; and an
    # uppercase name that collides with nothing keeps its plain name.
    _touch_parquet(tmp_path / "ok" / "A b.parquet")
    _touch_parquet(tmp_path / "ok" / "a b.parquet")
    _touch_parquet(tmp_path / "ok" / "Part-0.parquet")
    names = [s.name for s in _discover(str(tmp_path / "ok"))]
    assert len({n.lower() for n in names}) == len(names) == 3 and "Part-0" in names


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, (0, 1, "default")),
        (
            {"RANK": "3", "WORLD_SIZE": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
            (3, 8, "torchrun RANK/WORLD_SIZE"),
        ),
        ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4"}, (2, 4, "SLURM_ARRAY_TASK_ID/COUNT")),
        # --array=5-8: ids start at SLURM_ARRAY_TASK_MIN, ranks at 0.
        ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "5"}, (2, 4, None)),
        # --array=0-6:2 -> ids 0, 2, 4, 6.
        (
            {
                "SLURM_ARRAY_TASK_ID": "4",
                "SLURM_ARRAY_TASK_COUNT": "4",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_ARRAY_TASK_STEP": "2",
            },
            (2, 4, None),
        ),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, (1, 2, "SLURM_PROCID/NTASKS")),
        # An array of 3 tasks, each running 2 srun tasks: 6 workers, array-major.
        (
            {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
            (5, 6, "SLURM_ARRAY_TASK_ID/COUNT + SLURM_PROCID/NTASKS"),
        ),
    ],
)
def test_worker_from_environment(env, expected):
    worker = resolve_worker(LauncherConfig(), env)
    assert (worker.rank, worker.world_size) == expected[:2]
    if expected[2] is not None:
        assert worker.source == expected[2]


def test_config_wins_over_environment_and_bad_ranks_are_config_errors():
    env = {"RANK": "3", "WORLD_SIZE": "8"}
    assert resolve_worker(LauncherConfig(rank=1, world_size=2), env) == Worker(1, 2, "config")
    assert resolve_worker(LauncherConfig(rank=3), env) == Worker(3, 8, "torchrun RANK/WORLD_SIZE")
    # One value given two ways must agree: the line names both.
    with pytest.raises(ConfigError, match="launcher.rank: launcher.rank=5 contradicts RANK=3"):
        resolve_worker(LauncherConfig(rank=5), env)
    with pytest.raises(ConfigError, match="launcher.world_size=4 contradicts WORLD_SIZE=8"):
        resolve_worker(LauncherConfig(world_size=4), env)
    with pytest.raises(ConfigError, match="launcher.rank"):
        resolve_worker(LauncherConfig(rank=2, world_size=2), {})
    with pytest.raises(ConfigError, match="launcher.world_size"):
        resolve_worker(LauncherConfig(rank=0, world_size=0), {})
    with pytest.raises(ConfigError, match="SLURM_ARRAY_TASK_COUNT"):
        resolve_worker(LauncherConfig(), {"SLURM_ARRAY_TASK_ID": "1"})
    with pytest.raises(ConfigError, match="not an integer"):
        resolve_worker(LauncherConfig(), {"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 20])
def test_assignment_partitions_the_shards_deterministically(world_size):
    shards = [Shard(f"s{i:02d}", f"p{i}", f"u{i}") for i in range(13)]
    shuffled = shards[5:] + shards[:5]
    parts = [assign_shards(shuffled, Worker(r, world_size, "test")) for r in range(world_size)]
    names = [s.name for part in parts for s in part]
    assert sorted(names) == [s.name for s in shards] and len(names) == len(set(names))
    assert parts == [assign_shards(shards, Worker(r, world_size, "test")) for r in range(world_size)]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [s.name for s in parts[0]] == [s.name for s in shards][::world_size]


@pytest.mark.parametrize(
    "config, env, expected",
    [
        # Kubernetes Indexed Job: the index is the rank; the world size is the user's to give.
        (LauncherConfig(world_size=4), {"JOB_COMPLETION_INDEX": "3"}, (3, 4, "Kubernetes JOB_COMPLETION_INDEX")),
        (LauncherConfig(), {"JOB_COMPLETION_INDEX": "1", "BATCHRUN_WORLD_SIZE": "2"}, (1, 2, "Kubernetes")),
        (LauncherConfig(world_size=2), {"JOB_COMPLETION_INDEX": "0", "BATCHRUN_WORLD_SIZE": "2"}, (0, 2, "Kubernetes")),
        # The Ray launcher's actors (and any batchrun launcher) name their worker outright; a Ray
        # cluster started inside a Slurm allocation leaves SLURM_* in the actors' environment.
        (
            LauncherConfig(),
            {"BATCHRUN_RANK": "1", "BATCHRUN_WORLD_SIZE": "3", "BATCHRUN_LAUNCHER": "ray", "SLURM_PROCID": "0"},
            (1, 3, "ray launcher BATCHRUN_RANK/WORLD_SIZE"),
        ),
        # torchrun inside srun: torchrun's ranks are the finer split.
        (LauncherConfig(), {"RANK": "5", "WORLD_SIZE": "8", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, (5, 8, "torch")),
        # Both explicit: the environment is not read at all.
        (LauncherConfig(rank=0, world_size=1), {"JOB_COMPLETION_INDEX": "7"}, (0, 1, "config")),
        (LauncherConfig(world_size=3), {}, (0, 3, "config+default")),
        # A rank from the config, the world size from the environment.
        (LauncherConfig(rank=1), {"BATCHRUN_WORLD_SIZE": "2"}, (1, 2, "launcher.rank + BATCHRUN_WORLD_SIZE")),
    ],
)
def test_one_resolution_for_every_scheduler(config, env, expected):
    worker = resolve_worker(config, env)
    assert (worker.rank, worker.world_size) == expected[:2]
    assert worker.source.startswith(expected[2])


@pytest.mark.parametrize(
    "config, env, message",
    [
        (LauncherConfig(), {"JOB_COMPLETION_INDEX": "0"}, "launcher.world_size: JOB_COMPLETION_INDEX is set"),
        (
            LauncherConfig(world_size=3),
            {"JOB_COMPLETION_INDEX": "0", "BATCHRUN_WORLD_SIZE": "2"},
            "launcher.world_size=3 contradicts BATCHRUN_WORLD_SIZE=2",
        ),
        (LauncherConfig(world_size=2), {"JOB_COMPLETION_INDEX": "2"}, "launcher.rank: must be in \\[0, 2\\), got 2"),
        (
            LauncherConfig(),
            {"JOB_COMPLETION_INDEX": "0", "BATCHRUN_WORLD_SIZE": "2", "SLURM_PROCID": "0"},
            "both Slurm .* and Kubernetes",
        ),
        (
            LauncherConfig(world_size=4),
            {"BATCHRUN_RANK": "0", "BATCHRUN_WORLD_SIZE": "2"},
            "launcher.world_size=4 contradicts BATCHRUN_WORLD_SIZE=2",
        ),
        (
            LauncherConfig(world_size=2),
            {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "3"},
            "launcher.world_size=2 contradicts SLURM_ARRAY_TASK_COUNT/SLURM_NTASKS=3",
        ),
        (LauncherConfig(), {"JOB_COMPLETION_INDEX": "x", "BATCHRUN_WORLD_SIZE": "2"}, "not an integer"),
        # A world size with nothing naming this worker's rank (a Job not in Indexed mode): every pod
        # would otherwise run as 0 of 1.
        (
            LauncherConfig(),
            {"BATCHRUN_WORLD_SIZE": "4"},
            "launcher.rank: BATCHRUN_WORLD_SIZE=4 is set but nothing gives this worker's rank",
        ),
        (
            LauncherConfig(rank=1, world_size=None),
            {"BATCHRUN_WORLD_SIZE": "x"},
            "environment variable BATCHRUN_WORLD_SIZE='x' is not an integer",
        ),
    ],
)
def test_contradictions_are_refused_in_one_line_naming_the_keys(config, env, message):
    with pytest.raises(ConfigError, match=message) as error:
        resolve_worker(config, env)
    assert "\n" not in str(error.value)


def test_the_worker_records_the_gpu_it_was_given():
    assert resolve_worker(LauncherConfig(), {"CUDA_VISIBLE_DEVICES": "3"}).device == "3"
    assert resolve_worker(LauncherConfig(), {"CUDA_VISIBLE_DEVICES": ""}).device is None
    assert resolve_worker(LauncherConfig(), {}).device is None


def test_a_previous_runs_shard_published_after_listing_is_read_from_its_published_file(tmp_path):
    """Listed while its publication was pending (its results still in the attempt), published
    before the shard opens: the attempt's file is gone, the published one is read."""
    import json

    from batchrun.job.shards import refreshed

    run = tmp_path / "run"
    attempt = run / "_attempts" / "s0" / "a1"
    attempt.mkdir(parents=True)
    (run / "_commits").mkdir()
    (run / "_commits" / "s0.json").write_text(json.dumps({"attempt_dir": "_attempts/s0/a1"}))
    table = pa.table({"id": ["a"], "finish_reason": ["stop"], "error_type": [None], "error_message": [None]})
    pq.write_table(table, attempt / "results.parquet")
    fs, path = open_filesystem(str(run), {})
    [listed] = discover_shards(fs, path, str(run))
    assert "/_attempts/" in listed.path
    (run / "results").mkdir()
    (attempt / "results.parquet").rename(run / "results" / "s0.parquet")
    attempt.rmdir()
    now = refreshed(listed, fs)
    assert now.name == "s0" and now.path == f"{path}/results/s0.parquet" and now.size == listed.size
    (run / "results" / "s0.parquet").unlink()
    with pytest.raises(FileNotFoundError):
        refreshed(listed, fs)
