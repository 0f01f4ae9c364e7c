"""What shard boundaries and the job layer cost: the same rows through the engine's own stream, the
job as one shard, the job as many small shards flowing into each other, and those shards one after
another (planner.max_open_shards=1), in alternating rounds in one process.

    python -m benchmarks.shard_flow [--rows 80] [--shards 10] [--repeats 3] [--write-docs]

The rows are CPython's pydoc topics (real English text, cut to --max-chars), through the summarize
job's prompt on the default model, 64 greedy tokens each. It is `job=benchmark` with the systems
batchrun, batchrun_job, batchrun_job_sharded and batchrun_job_sharded_sequential (throughput.py).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.benchmark.config import BenchmarkConfig
from batchrun.benchmark.doc import WRITE_DOCS_HELP, script_command, stamp, write_section
from batchrun.benchmark.report import format_benchmark, markdown_benchmark
from batchrun.benchmark.throughput import run_benchmark
from batchrun.engine import EngineConfig
from batchrun.job.config import DataConfig, JobConfig, OutputConfig, RunConfig
from batchrun.testing import sample_texts
from benchmarks.workloads import SUMMARIZE_SYSTEM, SUMMARIZE_TEMPLATE

SYSTEMS = ("batchrun", "batchrun_job", "batchrun_job_sharded", "batchrun_job_sharded_sequential")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=80)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=1500, help="each text is cut to this many characters")
    parser.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    root = Path(tempfile.mkdtemp(prefix="batchrun-shard-flow-"))
    try:
        texts = sample_texts()
        rows = [texts[i % len(texts)][: args.max_chars] for i in range(args.rows)]
        (root / "in").mkdir()
        ids = [f"row{i:04d}" for i in range(args.rows)]
        pq.write_table(pa.table({"id": ids, "text": rows}), root / "in" / "rows.parquet")
        config = RunConfig(
            job=JobConfig(
                name="benchmark",
                system_prompt=SUMMARIZE_SYSTEM,
                prompt_template=SUMMARIZE_TEMPLATE,
                chat_template="auto",
            ),
            engine=EngineConfig(),
            data=DataConfig(uri=str(root / "in"), on_too_long="truncate"),
            output=OutputConfig(uri=str(root / "out")),
            quiet=True,
        )
        bench = BenchmarkConfig(
            workload="summarize",
            num_prompts=args.rows,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            systems=SYSTEMS,
            job_shards=args.shards,
        )
        result = run_benchmark(config, bench)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(format_benchmark(result))
    if args.write_docs:
        table, notes = markdown_benchmark(result)
        notes += (
            f"\n\n{args.rows} pydoc topics (first {args.max_chars} characters) through the summarize prompt; "
            f"`batchrun_job_sharded*` split them into {args.shards} shards. `x engine`: output tok/s over the "
            "engine's own stream of the same prompts; `x 1 shard`: over the job with the rows as one shard "
            "(both per round, median over rounds)."
        )
        title = "Shard boundaries and the job layer (job path against the engine's stream)"
        print(write_section("shard-flow", script_command("benchmarks.shard_flow", None), stamp(), table, notes, title))


if __name__ == "__main__":
    main()
