"""The whole job against a real S3-protocol server (moto in server mode) with s3fs as the client."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from batchrun.engine import SamplingParams
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::ResourceWarning")


def test_s3_in_and_out_with_resume(s3, tmp_path, make_shards, tiny_engine, tiny_llama_dir, monkeypatch):
    import s3fs

    fs, bucket, s3_endpoint = s3  # endpoint and credentials from the AWS_* environment
    ids = make_shards(tmp_path / "in", num_shards=3, rows_per_shard=2)
    for p in sorted((tmp_path / "in").iterdir()):
        fs.put_file(str(p), f"{bucket}/input/{p.name}")
    fs.pipe_file(f"{bucket}/input/_SUCCESS", b"")

    def config(storage_options: dict) -> RunConfig:
        return RunConfig(
            job=JobConfig(prompt_template="Summarize:\n{text}"),
            model=ModelConfig(path=tiny_llama_dir),
            sampling=SamplingParams(temperature=0.0, max_tokens=8),
            data=DataConfig(uri=f"s3://{bucket}/input", storage_options=storage_options),
            output=OutputConfig(uri=f"s3://{bucket}/run", storage_options=storage_options, keep_columns=("title",)),
            quiet=True,
        )

    result = run_job(config({}), engine=tiny_engine)
    assert result.exit_code == 0 and result.output_url == f"s3://{bucket}/run"
    fs.invalidate_cache()
    expected = [f"{bucket}/run/results/part-0{i}.parquet" for i in range(3)]
    assert sorted(fs.ls(f"{bucket}/run/results")) == expected
    for i in range(3):
        with fs.open(f"{bucket}/run/results/part-0{i}.parquet", "rb") as f:
            rows = pq.read_table(f).to_pylist()
        assert [r["id"] for r in rows] == ids[i] and all(r["error_type"] is None for r in rows)
    assert fs.find(f"{bucket}/run/_attempts") == []
    manifest = json.loads(fs.cat_file(f"{bucket}/run/_manifest.json"))
    assert [s["status"] for s in manifest["shards"]] == ["committed"] * 3
    report = fs.cat_file(f"{bucket}/run/report.html").decode()  # written through the store, on S3 too
    assert all(f'<td class="text">part-0{i}</td>' in report for i in range(3))

    # Uncommit one shard; the rerun redoes only that one. Here the endpoint comes through
    # storage_options instead of the environment.
    fs.rm(f"{bucket}/run/_commits/part-01.json")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3fs.S3FileSystem.clear_instance_cache()
    rerun = run_job(config({"endpoint_url": s3_endpoint}), engine=tiny_engine)
    assert [(s.name, s.status) for s in rerun.shards] == [
        ("part-00", "skipped"),
        ("part-01", "committed"),
        ("part-02", "skipped"),
    ]
    fs.invalidate_cache()
    assert fs.exists(f"{bucket}/run/_commits/part-01.json")
