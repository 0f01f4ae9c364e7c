"""engine.batch_invariant across a resume: a bf16 job killed (SIGKILL) in the middle of a shard and
rerun with chunked prompts and a small batch writes exactly the rows (tokens, text, logprobs) of an
uninterrupted run with whole prompts in one batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

# The real CLI, killing itself (SIGKILL: no clean-up runs) at the second finished row of the second
# shard, the first shard committed by then (one shard open at a time).
WORKER = r"""
import os, signal
from batchrun.job.run.shard_run import ShardRun
real_on_output, seen = ShardRun.on_output, {}
def on_output(self, out):
    real_on_output(self, out)
    seen[self.shard.name] = seen.get(self.shard.name, 0) + 1
    if self.shard.name.startswith("part-01") and seen[self.shard.name] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
ShardRun.on_output = on_output
from batchrun.cli import main
main()
"""


def _overrides(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model}",
        f"data.uri={data}",
        f"output.uri={out}",
        "engine.dtype=bfloat16",
        "engine.batch_invariant=true",
        "engine.kv_cache_memory=67108864",
        "engine.num_threads=1",
        "sampling.temperature=0",
        "sampling.max_tokens=12",
        "sampling.logprobs=0",
        "planner.max_open_shards=1",
        "quiet=true",
        *extra,
    ]


def _rows(out: Path) -> dict[str, dict]:
    """id -> the result row's generated columns (what a rerun must reproduce)."""
    rows = {}
    for path in sorted((out / "results").glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            rows[row["id"]] = {k: v for k, v in row.items() if k in ("text", "logprobs", "cumulative_logprob")}
    return rows


def test_killed_and_resumed_shard_gives_the_rows_of_an_uninterrupted_run(tmp_path, make_shards, tiny_model_factory):
    # Qwen3-MoE: its head_dim 24 takes the torch attention path and its experts see batch-sized
    # segments; with the option off, chunked prompts change its bf16 logprobs.
    model = tiny_model_factory("qwen3_moe")
    ids = [i for shard in make_shards(tmp_path / "in", num_shards=2, rows_per_shard=4) for i in shard]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def cli(out: Path, *extra: str, worker: bool = False) -> subprocess.CompletedProcess:
        head = ["-c", WORKER] if worker else ["-m", "batchrun"]
        argv = [sys.executable, *head, *_overrides(model, tmp_path / "in", out, *extra)]
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    whole = cli(tmp_path / "whole", "engine.max_num_seqs=8", "engine.max_num_batched_tokens=1024")
    assert whole.returncode == 0, whole.stderr
    want = _rows(tmp_path / "whole")
    assert sorted(want) == sorted(ids) and all(r["logprobs"] for r in want.values())

    # Two rows at a time, prompts in 32-token chunks: killed in the second shard, then resumed.
    small = ("engine.max_num_seqs=2", "engine.max_num_batched_tokens=32")
    killed = cli(tmp_path / "resumed", *small, worker=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(p.name for p in (tmp_path / "resumed" / "_commits").iterdir()) == ["part-00.json"]
    resumed = cli(tmp_path / "resumed", *small)
    assert resumed.returncode == 0, resumed.stderr
    assert "part-00  skipped" in resumed.stdout and "part-01  committed" in resumed.stdout, resumed.stdout
    assert _rows(tmp_path / "resumed") == want
