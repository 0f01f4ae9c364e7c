"""The end-of-run report's total row says the run's rate, not a sum over overlapping shards."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from batchrun import cli
from batchrun.job import format_summary, run_job


def test_total_row_rate_is_output_tokens_over_the_run_wall_time(tmp_path, make_shards, tiny_engine, job_overrides):
    make_shards(tmp_path / "in", num_shards=3, rows_per_shard=3)
    out = tmp_path / "out"
    result = run_job(cli.load_config(job_overrides(tmp_path / "in", out)), engine=tiny_engine)
    assert result.exit_code == 0, result.message
    produced = sum(sum(pq.read_table(p).column("num_output_tokens").to_pylist()) for p in (out / "results").iterdir())
    assert result.num_output_tokens == produced > 0
    assert result.wall_s and result.engine_s and result.engine_s <= result.wall_s

    table = format_summary(result)
    header = next(line for line in table.splitlines() if line.startswith("shard "))
    total = next(line for line in table.splitlines() if line.startswith("total "))
    assert "shard tok/s" in header and "out tok" in header
    cells = total.split()  # total, "3/3", "done", rows, ok, errors, out tok, tok/s, TTFT
    assert int(cells[6]) == produced
    assert abs(float(cells[7]) - produced / result.wall_s) <= 0.05 + 1e-3 * produced / result.wall_s
    assert "do not add up" in table and "in the engine" in table

    throughput = json.loads((out / "_manifest.json").read_text())["throughput"]
    assert throughput["num_output_tokens"] == produced
    assert abs(throughput["output_tokens_per_s"] - produced / throughput["wall_s"]) < 1e-6
    print(table)
    assert abs(throughput["engine_output_tokens_per_s"] - produced / throughput["engine_s"]) < 1e-6
