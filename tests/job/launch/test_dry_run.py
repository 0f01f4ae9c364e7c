"""dry_run=true: the plan counts what a run then does, and writes nothing to output.uri."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.job import ConfigError, run_job
from batchrun.job.launch.dry_run import plan_run, write_plan_json
from batchrun.job.run.runner import load_engine


def _write(path: Path, columns: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


def _hostile_input(src: Path, texts: list[str]) -> None:
    """One shard per kind of bad row a run must answer with an error row."""
    bad = pa.Array.from_buffers(
        pa.string(), 3, pa.array([texts[0].encode(), b"broken \xff\xfe text", texts[1].encode()], pa.binary()).buffers()
    )
    _write(src / "a-utf8.parquet", {"id": pa.array([1, 2, 3], pa.int64()), "text": bad})
    too_long = " ".join(texts) * 4  # far over the tiny model's 512 tokens
    _write(
        src / "b-text.parquet",
        {
            "id": ["x", "y", "z", "x", None, "w", "v"],  # a duplicate and a null id
            "text": [texts[2], "", None, texts[3], texts[4], "   ", too_long],
        },
    )
    _write(src / "c-ints.parquet", {"id": ["i0", "i1"], "text": pa.array([7, 8], pa.int64())})  # not text
    messages = pa.array(
        [[{"role": "user", "content": texts[5]}], [{"role": "user", "content": None}]],
        pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
    )
    _write(src / "d-messages.parquet", {"id": ["m0", "m1"], "text": messages})  # a malformed message


def _committed(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (out / "_commits").glob("*.json")}


def test_plan_counts_what_the_run_does_on_hostile_input(tmp_path, short_texts, tiny_engine, job_overrides):
    src, out = tmp_path / "in", tmp_path / "out"
    _hostile_input(src, short_texts)
    config = cli.load_config(job_overrides(src, out, "dry_run=true", "planner.window=4"))
    plan = plan_run(config, engine=tiny_engine)
    assert not out.exists()  # not even the directory: a dry run writes nothing to output.uri

    assert plan.num_shards == 4 and plan.num_failed_shards == 0
    assert plan.error_counts == {
        "duplicate_id": 1,
        "empty_prompt": 2,
        "invalid_text": 1,
        "null_id": 1,
        "null_prompt": 1,
        "prompt_too_long": 1,
        "template_error": 1,
        "wrong_type": 2,
    }
    assert "not valid UTF-8" in plan.error_examples["invalid_text"]
    assert plan.num_rows == plan.num_result_rows == 14 and plan.num_ok == 4
    assert plan.max_output_tokens == 4 * 8  # ok rows x sampling.max_tokens
    assert plan.prompt_tokens_p50 is not None and plan.prompt_tokens_p99 >= plan.prompt_tokens_p50
    assert [e.num_workers for e in plan.estimates] == [1] and plan.estimates[0].wall_s > 0

    result = run_job(config, engine=tiny_engine)
    assert result.exit_code == 0, result.message
    markers = _committed(out)
    for shard in plan.shards:
        marker = markers[shard.name]
        assert marker["num_rows"] == shard.num_result_rows, shard.name
        assert marker["error_counts"] == shard.error_counts, shard.name
        assert marker["metrics"]["num_prompt_tokens"] == shard.num_prompt_tokens, shard.name
    assert plan.num_prompt_tokens == sum(m["metrics"]["num_prompt_tokens"] for m in markers.values())


def test_plan_of_an_openai_batch_file_counts_what_the_run_does(tmp_path, tiny_engine, tiny_llama_dir):
    from tests.job.formats.test_openai_batch import batch_config, mixed_batch, write_batch

    lines, _ = mixed_batch()  # good requests, several n, and every kind of bad line
    write_batch(tmp_path / "in" / "batch.jsonl", lines, tiny_llama_dir)
    out = tmp_path / "out"
    config = batch_config(tmp_path / "in", out, tiny_llama_dir)
    plan = plan_run(config, engine=tiny_engine)
    assert not out.exists() and plan.error_counts
    assert run_job(config, engine=tiny_engine).exit_code == 0
    marker = _committed(out)["batch"]
    assert (marker["num_rows"], marker["error_counts"]) == (plan.num_result_rows, plan.error_counts)
    assert marker["metrics"]["num_prompt_tokens"] == plan.num_prompt_tokens


def test_shared_prefixes_are_counted_per_planner_window(tmp_path, short_texts, tiny_engine, job_overrides):
    src = tmp_path / "in"
    # The system prompt is the shared prefix: every prompt starts with the same long text.
    long_system = " ".join(short_texts[:2])
    _write(src / "a.parquet", {"id": ["a", "b", "c"], "text": short_texts[2:5]})
    overrides = job_overrides(src, tmp_path / "out", f"job.system_prompt='{long_system}'", "job.chat_template=never")
    plan = plan_run(cli.load_config(overrides), engine=tiny_engine)
    # The two later prompts find the first one's full blocks of the system prompt.
    assert plan.num_shared_prefix_tokens > 0 and plan.num_shared_prefix_tokens % plan.block_size == 0
    assert plan.num_prefill_tokens == plan.num_prompt_tokens - plan.num_shared_prefix_tokens
    alone = plan_run(cli.load_config([*overrides, "planner.window=1"]), engine=tiny_engine)
    assert alone.num_shared_prefix_tokens == 0  # no two prompts in one window


def test_cli_dry_run_prints_and_writes_the_plan_json_only(tmp_path, make_shards, job_overrides):
    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=3)
    out, plan_path = tmp_path / "out", tmp_path / "plan.json"
    args = job_overrides(tmp_path / "in", out, "dry_run=true", f"dry_run_json={plan_path}", "launcher.num_workers=2")
    proc = subprocess.run(
        [sys.executable, "-m", "batchrun", *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "dry run:" in proc.stdout and "2 worker(s)" in proc.stdout
    assert not out.exists()
    doc = json.loads(plan_path.read_text())
    assert doc["num_shards"] == 2 and doc["num_rows"] == 6 and doc["error_counts"] == {}
    assert [e["num_workers"] for e in doc["estimates"]] == [1, 2]


def test_plan_json_is_refused_inside_output_uri(tmp_path, make_shards, tiny_engine, job_overrides):
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=1)
    config = cli.load_config(job_overrides(tmp_path / "in", tmp_path / "out"))
    plan = plan_run(config, engine=tiny_engine)
    with pytest.raises(ConfigError, match="dry_run_json"):
        write_plan_json(plan, str(tmp_path / "out" / "plan.json"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_plan_of_the_bundled_sample_counts_what_the_run_does(tmp_path, smollm2_cache_dir):
    out = tmp_path / "out"
    overrides = [
        f"output.uri={out}",
        f"engine.cache_dir={smollm2_cache_dir}",
        "engine.dtype=bfloat16",  # the counts do not depend on it; bf16 is the faster on a CPU
        "sampling.max_tokens=1",  # the counts do not depend on it; the run is shorter
        "quiet=true",
    ]
    config = cli.load_config(overrides)
    engine = load_engine(config.engine)  # one load and start-up profile for the plan and the run
    plan = plan_run(config, engine=engine)
    assert not out.exists()
    assert plan.num_shards == 4 and plan.num_rows == 32
    result = run_job(config, engine=engine)
    assert result.exit_code == 0, result.message
    markers = _committed(out)
    assert sum(m["num_rows"] for m in markers.values()) == plan.num_result_rows
    assert sum(sum(m["error_counts"].values()) for m in markers.values()) == sum(plan.error_counts.values())
    assert sum(m["metrics"]["num_prompt_tokens"] for m in markers.values()) == plan.num_prompt_tokens


def test_the_estimate_counts_every_gpu_of_a_tensor_parallel_worker(tmp_path, make_shards, tiny_engine, job_overrides):
    """engine.tensor_parallel_size=2 on a machine of 4 (simulated) GPUs: 2 workers, each holding 2
    GPUs for the whole run, so GPU-hours = wall x workers x 2; the rates are the group's own."""
    from batchrun.engine import ThroughputProfile
    from batchrun.job.launch.dry_run import ShardPlan, _estimate, _rates, format_plan

    gpu = ThroughputProfile({512: 4000.0}, {8: 400.0}, 8, 512, 30.0, "cuda", 1)
    plans = [ShardPlan(f"s{i}", f"s{i}.parquet", 10, 10, {}, 0, 4000, 8000, None) for i in range(4)]
    rates = _rates(gpu, 40)
    one, group = _estimate(plans, gpu, rates, 2), _estimate(plans, gpu, rates, 2, 2)
    assert group.wall_s == one.wall_s == 30.0 + 2 * (1.0 + 20.0)  # two shards per worker
    assert group.device_hours == pytest.approx(group.wall_s * 2 * 2 / 3600)
    assert group.device_hours == pytest.approx(2 * one.device_hours)
    assert (group.device_unit, group.tensor_parallel_size) == ("GPU", 2)
    # On the CPU the profile's threads are one rank's: core-hours count both ranks' threads.
    cpu = ThroughputProfile({512: 4000.0}, {8: 400.0}, 8, 512, 30.0, "cpu", 3)
    assert _estimate(plans, cpu, rates, 1, 2).device_hours == pytest.approx(
        _estimate(plans, cpu, rates, 1).device_hours * 2
    )

    # The workers a launch would start: 4 visible GPUs // 2 per group.
    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2)
    overrides = job_overrides(tmp_path / "in", tmp_path / "out", "engine.device=auto", "engine.tensor_parallel_size=2")
    plan = plan_run(cli.load_config(overrides), engine=tiny_engine, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert [(e.num_workers, e.tensor_parallel_size) for e in plan.estimates] == [(1, 2), (2, 2)]
    assert "estimate:       2 worker(s) of tensor_parallel_size 2:" in format_plan(plan)
    with pytest.raises(ConfigError, match="^engine.tensor_parallel_size: .*; 1 visible$"):
        plan_run(cli.load_config(overrides), engine=tiny_engine, env={"CUDA_VISIBLE_DEVICES": "0"})
