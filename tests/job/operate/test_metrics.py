"""Per-shard metrics from result rows and engine counters (differences over the shard)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from batchrun.engine import EngineStats, RequestMetrics, SamplingParams
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
from batchrun.job.formats.writer import METRICS_SCHEMA
from batchrun.job.operate.metrics import ShardTally, metrics_row
from tests.support.engines import make_tiny_engine


def _stats(**kw) -> EngineStats:
    base = dict(
        num_kv_blocks_total=100,
        peak_kv_blocks_used=10,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_cached_tokens=0,
        num_generated_tokens=0,
        num_steps=0,
    )
    return EngineStats(**{**base, **kw})


def _row(error_type=None, prompt=10, output=4, cached=2, ttft=0.5, itl=0.1) -> dict:
    engine_saw = error_type is None
    return {
        "error_type": error_type,
        "num_prompt_tokens": prompt,
        "num_output_tokens": output if engine_saw else None,
        "num_cached_tokens": cached if engine_saw else None,
        "ttft_s": ttft if engine_saw else None,
        "itl_s": itl if engine_saw else None,
    }


def test_metrics_row_sums_rows_and_differences_counters():
    """Request counts (preemptions, speculation) are the shard's own rows' sums, not engine deltas:
    other shards open at the same time move the engine's counters too."""
    tally = ShardTally()
    for i, ttft in enumerate((0.1, 0.2, 0.3, 0.4)):
        tally.add(_row(ttft=ttft))
        tally.add_request(RequestMetrics(num_preemptions=i % 2, num_spec_proposed=10, num_spec_accepted=7 + i % 2))
    tally.add(_row(error_type="empty_prompt"))
    before = _stats(
        num_preemptions=3, num_spec_proposed=100, num_spec_accepted=50, expert_token_counts=[[5, 5], [1, 9]]
    )
    after = _stats(
        num_preemptions=5,
        peak_kv_blocks_used=7,
        num_spec_proposed=140,
        num_spec_accepted=80,
        expert_token_counts=[[9, 7], [4, 9]],
    )
    m = metrics_row("s", 1, tally, 2.0, before, after)
    assert list(m) == METRICS_SCHEMA.names
    assert (m["num_rows"], m["num_ok"], m["num_errors"]) == (5, 4, 1)
    assert (m["num_prompt_tokens"], m["num_output_tokens"]) == (40, 16)  # the error row never ran
    assert m["output_tokens_per_s"] == 8.0 and m["total_tokens_per_s"] == 28.0
    assert m["ttft_p50_s"] == pytest.approx(0.25) and m["prefix_cache_hit_rate"] == pytest.approx(0.2)
    assert m["num_preemptions"] == 2 and m["peak_kv_blocks_used"] == 7 and m["num_kv_blocks_total"] == 100
    assert (m["num_spec_proposed"], m["num_spec_accepted"], m["spec_acceptance_rate"]) == (40, 30, 0.75)
    assert metrics_row("s", 1, tally, 2.0, _stats(), _stats())["spec_acceptance_rate"] is None  # speculation off
    assert m["expert_token_counts"] == [[4, 2], [3, 0]]


def test_metrics_row_of_an_empty_shard_has_nulls_not_errors():
    m = metrics_row("s", 0, ShardTally(), 0.0, _stats(), _stats())
    assert m["num_rows"] == 0 and m["output_tokens_per_s"] == 0.0
    assert m["ttft_p50_s"] is None and m["itl_p99_s"] is None and m["prefix_cache_hit_rate"] is None
    assert m["spec_acceptance_rate"] is None and m["expert_token_counts"] is None


def test_speculative_engine_fills_the_speculation_columns(tmp_path, make_shards, tiny_llama_dir):
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=3)
    engine = make_tiny_engine(
        tiny_llama_dir, max_num_seqs=4, kv_cache_memory=16 << 20, speculative={"method": "ngram", "adaptive": False}
    )
    config = RunConfig(
        job=JobConfig(prompt_template="{text}"),
        model=ModelConfig(path=tiny_llama_dir),
        sampling=SamplingParams(temperature=0.0, max_tokens=16),
        data=DataConfig(uri=str(tmp_path / "in")),
        output=OutputConfig(uri=str(tmp_path / "out")),
        quiet=True,
    )
    assert run_job(config, engine=engine).exit_code == 0
    m = pq.read_table(tmp_path / "out" / "metrics" / "part-00.parquet").to_pylist()[0]
    assert m["num_spec_proposed"] is not None and m["num_spec_accepted"] is not None
    assert m["num_spec_accepted"] <= m["num_spec_proposed"]
