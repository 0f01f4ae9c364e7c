"""Several samples per row (sampling.n) and logprob columns through the job: rows and indices,
reproducible samples across runs and batch compositions, logprob columns, resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.job import ConfigError, build_run_config, run_job
from batchrun.job.formats.writer import RESULT_COLUMNS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SAMPLED = ("sampling.temperature=0.8", "sampling.seed=5", "sampling.ignore_eos=true")


def run_cli(overrides: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "batchrun", *overrides], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done


def rows(out: Path, shard: str) -> list[dict]:
    return pq.read_table(out / "results" / f"{shard}.parquet").to_pylist()


def test_n_samples_with_logprobs_through_the_cli_and_a_resume(tmp_path, make_shards, job_overrides, tiny_engine):
    ids = make_shards(tmp_path / "in", num_shards=2, rows_per_shard=3)
    out = tmp_path / "out"
    overrides = job_overrides(tmp_path / "in", out, *SAMPLED, "sampling.n=3", "sampling.logprobs=2")
    run_cli(overrides, tmp_path)
    tokenizer = tiny_engine.tokenizer
    first = {}
    for s, shard in enumerate(["part-00", "part-01"]):
        path = out / "results" / f"{shard}.parquet"
        assert pq.read_schema(path).names == [*RESULT_COLUMNS, "sample_index", "cumulative_logprob", "logprobs"]
        got = first[shard] = rows(out, shard)
        assert [(r["id"], r["sample_index"]) for r in got] == [(i, k) for i in ids[s] for k in range(3)]
        for i in range(3):
            samples = got[3 * i : 3 * i + 3]
            assert len({r["output"] for r in samples}) == 3, "a row's samples should differ"
            # the prompt was prefilled once: the other samples report all its full blocks as cached
            # (sample 0 only the template's blocks, from the rows before it)
            shared = (samples[0]["num_prompt_tokens"] - 1) // 16 * 16
            assert samples[0]["num_cached_tokens"] < shared
            assert [r["num_cached_tokens"] for r in samples[1:]] == [shared, shared]
        for r in got:
            assert r["error_type"] is None and len(r["logprobs"]) == r["num_output_tokens"] == 8
            assert r["cumulative_logprob"] == pytest.approx(sum(e["logprob"] for e in r["logprobs"]), abs=1e-9)
            for e in r["logprobs"]:
                assert e["token"] == tokenizer.decode([e["token_id"]])
                top = [t["logprob"] for t in e["top"]]
                assert len(top) == 2 and top == sorted(top, reverse=True) and e["logprob"] <= top[0] + 1e-9
            assert tokenizer.decode([e["token_id"] for e in r["logprobs"]], skip_special_tokens=True) == r["output"]
        metrics = pq.read_table(out / "metrics" / f"{shard}.parquet").to_pylist()[0]
        assert (metrics["num_rows"], metrics["num_ok"]) == (9, 9)
        assert metrics["prefix_cache_hit_rate"] > 0.5  # 2 of 3 samples reuse most of the prompt

    # Resume: part-01 as if its worker died before committing; the rerun skips part-00 only.
    part00 = (out / "results" / "part-00.parquet").read_bytes()
    for name in ("_commits/part-01.json", "results/part-01.parquet", "metrics/part-01.parquet"):
        (out / name).unlink()
    rerun = run_cli(overrides, tmp_path)
    assert "part-00  skipped" in rerun.stdout and "part-01  committed" in rerun.stdout, rerun.stdout
    assert (out / "results" / "part-00.parquet").read_bytes() == part00
    again = rows(out, "part-01")
    assert [(r["id"], r["sample_index"], r["output"]) for r in again] == [
        (r["id"], r["sample_index"], r["output"]) for r in first["part-01"]
    ]

    # Another batch composition (the shared engine runs 8 sequences, not 2): the same samples.
    wide = tmp_path / "wide"
    config = cli.load_config(job_overrides(tmp_path / "in", wide, *SAMPLED, "sampling.n=3", "sampling.logprobs=2"))
    assert run_job(config, engine=tiny_engine).exit_code == 0
    for shard in ("part-00", "part-01"):
        assert [r["output"] for r in rows(wide, shard)] == [r["output"] for r in first[shard]]
        for a, b in zip(rows(wide, shard), first[shard]):
            assert a["cumulative_logprob"] == pytest.approx(b["cumulative_logprob"], abs=1e-4)


def test_one_sample_keeps_the_results_as_they_were_and_equals_sample_zero(
    tmp_path, make_shards, job_overrides, tiny_engine
):
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=3)
    one, four = tmp_path / "one", tmp_path / "four"
    for out, extra in ((one, ()), (four, ("sampling.n=4",))):
        config = cli.load_config(job_overrides(tmp_path / "in", out, *SAMPLED, *extra))
        assert run_job(config, engine=tiny_engine).exit_code == 0
    assert pq.read_schema(one / "results" / "part-00.parquet").names == RESULT_COLUMNS
    single = rows(one, "part-00")
    assert [r["output"] for r in single] == [r["output"] for r in rows(four, "part-00") if r["sample_index"] == 0]


def test_error_rows_come_once_per_sample(tmp_path, job_overrides, tiny_engine):
    import pyarrow as pa

    (tmp_path / "in").mkdir()
    pq.write_table(
        pa.table({"id": ["a", "b"], "text": [None, "A short text to summarize."]}), tmp_path / "in" / "p.parquet"
    )
    config = cli.load_config(
        job_overrides(tmp_path / "in", tmp_path / "out", *SAMPLED, "sampling.n=2", "sampling.logprobs=0")
    )
    assert run_job(config, engine=tiny_engine).exit_code == 0
    got = rows(tmp_path / "out", "p")
    assert [(r["id"], r["sample_index"], r["error_type"]) for r in got] == [
        ("a", 0, "null_prompt"),
        ("a", 1, "null_prompt"),
        ("b", 0, None),
        ("b", 1, None),
    ]
    assert got[0]["logprobs"] is None and got[0]["cumulative_logprob"] is None
    assert all(e["top"] == [] for e in got[2]["logprobs"])  # logprobs=0: the token's own logprob only


def test_prompt_logprobs_score_every_prompt_token_after_the_first(tmp_path, make_shards, job_overrides, tiny_engine):
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2)
    overrides = job_overrides(tmp_path / "in", tmp_path / "out", "sampling.temperature=0", "sampling.prompt_logprobs=1")
    assert run_job(cli.load_config(overrides), engine=tiny_engine).exit_code == 0
    path = tmp_path / "out" / "results" / "part-00.parquet"
    assert pq.read_schema(path).names == [*RESULT_COLUMNS, "prompt_logprobs"]
    for r in rows(tmp_path / "out", "part-00"):
        scored = r["prompt_logprobs"]
        assert len(scored) == r["num_prompt_tokens"] - 1
        assert all(e["logprob"] <= 0 and len(e["top"]) == 1 and e["top"][0]["logprob"] >= e["logprob"] for e in scored)


def test_sampling_keys_are_checked():
    base = {"data": {"uri": "in"}}
    with pytest.raises(ConfigError, match="temperature > 0"):
        build_run_config({**base, "sampling": {"n": 2, "temperature": 0.0}})
    with pytest.raises(ConfigError, match="sampling.n"):
        build_run_config({**base, "sampling": {"n": "two"}})
    with pytest.raises(ConfigError, match="sample_index"):
        build_run_config({**base, "output": {"keep_columns": ["sample_index"]}})
    config = build_run_config({**base, "sampling": {"n": 4, "temperature": 0.8, "logprobs": 5, "prompt_logprobs": 0}})
    assert (config.sampling.n, config.sampling.logprobs, config.sampling.prompt_logprobs) == (4, 5, 0)
