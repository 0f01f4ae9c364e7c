"""The benchmark job end to end on a tiny model: files and columns, never speed."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest
import yaml

from batchrun import cli
from batchrun.benchmark import doc
from batchrun.benchmark.config import BenchmarkConfig
from batchrun.benchmark.hf_baseline import hf_generate, load_hf_model
from batchrun.benchmark.report import SUMMARY_COLUMNS
from batchrun.benchmark.throughput import batchrun_generate, run_benchmark
from batchrun.benchmark.workloads import build_workload
from batchrun.engine import SamplingParams
from batchrun.job.config import PlannerConfig
from batchrun.job.run.runner import load_engine

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_torch_thread")]

TINY_ENGINE = [
    "engine.dtype=float32",
    "engine.max_num_seqs=8",
    "engine.max_num_batched_tokens=512",
    f"engine.kv_cache_memory={64 << 20}",
    "engine.num_threads=1",
]


def test_benchmark_job_writes_its_table_and_plot(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    monkeypatch.setattr(doc, "DOCS_PATH", docs)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "job=benchmark",
                f"model.path={tiny_llama_dir}",
                *TINY_ENGINE,
                f"output.uri={tmp_path / 'out'}",
                "benchmark.num_prompts=3",
                "benchmark.max_tokens=4",
                "benchmark.repeats=1",
                "benchmark.hf_batch_size=2",
                "benchmark.write_docs=true",
            ]
        )
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "out tok/s" in printed and "x hf_bf16" in printed and "matmul peak" in printed

    directory = tmp_path / "out" / "benchmark"
    table = pq.read_table(directory / "summarize.parquet")
    assert table.column_names == SUMMARY_COLUMNS
    rows = {r["system"]: r for r in table.to_pylist()}
    assert list(rows) == ["batchrun", "batchrun_job", "hf_fp32", "hf_bf16"]
    assert [rows[s]["dtype"] for s in rows] == ["float32", "float32", "float32", "bfloat16"]
    for r in rows.values():
        assert r["num_prompts"] == 3 and r["repeats"] == 1 and 3 <= r["num_output_tokens"] <= 12
        assert r["output_tok_s"] > 0 and r["ttft_p50_s"] > 0 and r["flops_per_s"] > 0 and r["peak_flops_per_s"] > 0
        assert r["ratio_vs_hf_fp32"] > 0 and r["ratio_vs_hf_bf16"] > 0 and r["ratio_vs_no_prefix_cache"] is None
    assert rows["hf_fp32"]["ratio_vs_hf_fp32"] == 1.0
    # Both in float32: the baseline and the engine produce the same greedy tokens.
    assert rows["hf_fp32"]["greedy_match"] is True and rows["hf_fp32"]["identical_fraction"] == 1.0
    assert rows["batchrun"]["greedy_match"] is None and rows["hf_bf16"]["greedy_match"] is None
    assert rows["batchrun"]["max_num_seqs"] == 8 and rows["hf_fp32"]["hf_batch_size"] == 2
    # The job path over the same rows (one Parquet shard, results and commit included): the same
    # greedy tokens as the engine's own stream, and its speed printed beside it.
    assert rows["batchrun_job"]["greedy_match"] is True and rows["batchrun_job"]["ratio_vs_engine"] > 0
    assert rows["batchrun"]["ratio_vs_engine"] is None and "x engine" in printed

    runs = pq.read_table(directory / "summarize_runs.parquet").to_pylist()
    assert [(r["system"], r["round"]) for r in runs] == [
        (s, 0) for s in ("batchrun", "batchrun_job", "hf_fp32", "hf_bf16")
    ]
    assert (directory / "summarize.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    settings = json.loads((directory / "summarize.json").read_text())
    assert settings["engine"]["dtype"] == "float32" and settings["engine"]["max_num_batched_tokens"] == 512
    assert set(settings["matmul_peak_flops_per_s"]) == {"float32", "bfloat16"} and settings["num_parameters"] > 0

    # benchmark.write_docs=true: the table replaces (here: appends) the workload's section of the docs page.
    section = docs.read_text().split("<!-- bench:throughput-summarize -->\n")[1]
    assert "`python -m batchrun job=benchmark model.path=" in section and "write_docs" not in section
    assert "| system | dtype | out tok/s |" in section and "| hf_bf16 | bfloat16 |" in section
    assert section.endswith("<!-- /bench:throughput-summarize -->\n")


def test_the_job_path_systems_run_the_rows_as_shards_with_the_engines_tokens(tmp_path, tiny_llama_dir, capsys):
    args = [
        "job=benchmark",
        f"model.path={tiny_llama_dir}",
        *TINY_ENGINE,
        f"output.uri={tmp_path / 'out'}",
        "benchmark.num_prompts=4",
        "benchmark.max_tokens=3",
        "benchmark.repeats=1",
        "benchmark.job_shards=3",
        "benchmark.systems=[batchrun,batchrun_job,batchrun_job_sharded,batchrun_job_sharded_sequential]",
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 0
    assert "x 1 shard" in capsys.readouterr().out
    rows = {r["system"]: r for r in pq.read_table(tmp_path / "out" / "benchmark" / "summarize.parquet").to_pylist()}
    for name in ("batchrun_job", "batchrun_job_sharded", "batchrun_job_sharded_sequential"):
        assert rows[name]["greedy_match"] is True and rows[name]["ratio_vs_engine"] > 0
    assert rows["batchrun_job_sharded"]["ratio_vs_job_one_shard"] > 0
    assert rows["batchrun_job"]["ratio_vs_job_one_shard"] == 1.0
    # The job systems need input rows: another workload is a config error naming the key.
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "benchmark.workload=random"])
    assert exit_info.value.code == 2
    assert "benchmark.systems: batchrun_job" in capsys.readouterr().err


def test_shared_prefix_workload_and_the_prefix_cache_ratio(tmp_path, tiny_llama_dir):
    # A step budget of 64 tokens spreads the prefills over steps, so later prompts find the shared
    # blocks cached (prompts prefilled in the same step each compute them).
    overrides = [
        "job=benchmark",
        f"model.path={tiny_llama_dir}",
        *TINY_ENGINE,
        f"output.uri={tmp_path}",
        "engine.max_num_batched_tokens=64",
        "benchmark.workload=shared_prefix",
        "benchmark.num_prompts=5",
        "benchmark.max_tokens=4",
        "benchmark.shared_prefix_tokens=120",
        "benchmark.repeats=2",
        "benchmark.systems=[batchrun,batchrun_no_prefix_cache]",
    ]
    config, bench = cli.load_benchmark_config(overrides)
    engine = load_engine(config.engine)
    workload = build_workload(config, bench, engine)
    assert len({tuple(p) for p in workload.prompts}) == 5
    assert abs(workload.notes["shared_prefix_tokens"] - 120) <= 8
    assert all(
        p[: workload.notes["shared_prefix_tokens"]] == workload.prompts[0][: workload.notes["shared_prefix_tokens"]]
        for p in workload.prompts
    )

    result = run_benchmark(config, bench, engine=engine)
    rows = {r["system"]: r for r in result.rows}
    assert list(rows) == ["batchrun", "batchrun_no_prefix_cache"]
    # Cached blocks are reused within a round only: every round starts from an empty cache.
    hits = [r["num_cached_tokens"] for r in result.runs if r["system"] == "batchrun"]
    assert hits[0] == hits[1] > 0 and rows["batchrun"]["prefix_cache_hit_rate"] > 0.5
    assert rows["batchrun_no_prefix_cache"]["prefix_cache_hit_rate"] == 0
    assert rows["batchrun_no_prefix_cache"]["greedy_match"] is True  # the cache changes no token
    assert rows["batchrun"]["ratio_vs_no_prefix_cache"] > 0
    assert (tmp_path / "benchmark" / "shared_prefix.parquet").exists()


def test_hf_baseline_and_batchrun_make_the_same_greedy_tokens_in_float32(tiny_engine, tiny_llama_dir):
    texts = ["def f(x):\n    return", "The quick brown fox", "A list is a mutable sequence " * 12, "x"]
    prompts = [tiny_engine.tokenizer.encode(t) for t in texts]  # lengths differ: left padding is exercised
    hf = load_hf_model(tiny_llama_dir)
    eos = [tiny_engine.tokenizer.eos_token_id]
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=ignore_eos)
        ours = batchrun_generate(tiny_engine, prompts, params, PlannerConfig(), block_size=16)
        theirs = hf_generate(
            hf,
            prompts,
            12,
            batch_size=3,
            pad_token_id=tiny_engine.tokenizer.pad_token_id,
            eos_token_ids=eos,
            ignore_eos=ignore_eos,
        )
        assert ours.token_ids == theirs.token_ids
        assert theirs.num_output_tokens == sum(map(len, theirs.token_ids)) and len(theirs.ttfts_s) == len(prompts)
        if ignore_eos:
            assert all(len(t) == 12 for t in ours.token_ids)


def test_reset_prefix_cache_makes_the_next_request_cold(tiny_engine):
    prompt = list(range(5, 5 + 80))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    tiny_engine.generate([prompt], params)
    assert tiny_engine.generate([prompt], params)[0].metrics.num_cached_tokens == 64
    assert tiny_engine.reset_prefix_cache() >= 4
    assert tiny_engine.generate([prompt], params)[0].metrics.num_cached_tokens == 0


def test_benchmark_yaml_lists_every_key_and_bad_values_name_the_key(capsys, tmp_path, monkeypatch):
    node = yaml.safe_load((cli.CONF_DIR / "job" / "benchmark.yaml").read_text())
    assert sorted(node["benchmark"]) == sorted(f.name for f in dataclasses.fields(BenchmarkConfig))
    assert cli.load_benchmark_config(["job=benchmark"])[1] == BenchmarkConfig()
    with pytest.raises(cli.ConfigError, match="benchmark.systems: unknown hf_fp16"):
        cli.load_benchmark_config(["job=benchmark", "benchmark.systems=[batchrun,hf_fp16]"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["benchmark.repeats=2"])  # the group exists only in job=benchmark
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == "batchrun: config error: benchmark: not a group of this job (use job=benchmark)"
    )


def test_the_cli_imports_the_benchmark_only_for_job_benchmark():
    """Every other job starts without the benchmark's modules (and the HF baselines they load)."""
    import subprocess
    import sys

    code = (
        "import sys; from batchrun import cli; "
        "cfg = cli.load_config([]); "
        "print(sorted(m for m in sys.modules if m.startswith(('batchrun.benchmark', 'benchmarks'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert not hasattr(cli.load_config(["job=benchmark"]), "benchmark")  # the group is the benchmark's own
