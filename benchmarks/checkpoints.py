"""What checkpoints inside a shard cost: the same rows as one shard through the job path with
checkpoints off, at the default interval (output.checkpoint_rows / checkpoint_s), and at a short
one, in alternating rounds in one process, with greedy outputs checked identical across them.

    python -m benchmarks.checkpoints [--model smollm2-135m] [--rows 256] [--max-tokens 32]
        [--rounds 3] [--short-rows 16] [--write-docs]

At the default interval a shard that finishes within 60 s and 10000 rows writes no part at all, so
the default figure is the cost a shard of this size pays (the buffering per input row and the one
final write); the short interval shows the cost per part (written, fsynced, its marker created, the
parts merged into the results file at the end) when parts are many.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.benchmark.jobpath import JobPath
from batchrun.benchmark.timing import TimedRun, round_order
from batchrun.engine import Engine, EngineConfig, SamplingParams
from batchrun.job.config import DataConfig, JobConfig, OutputConfig, RunConfig
from batchrun.testing import sample_texts
from benchmarks.workloads import SUMMARIZE_SYSTEM, SUMMARIZE_TEMPLATE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-chars", type=int, default=600, help="each text is cut to this many characters")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short-rows", type=int, default=16, help="checkpoint_rows of the short interval")
    parser.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    texts = sample_texts()
    rows = {
        "id": [f"row{i:05d}" for i in range(args.rows)],
        "text": [texts[i % len(texts)][: args.max_chars] for i in range(args.rows)],
    }
    base = RunConfig(
        job=JobConfig(
            name="benchmark", system_prompt=SUMMARIZE_SYSTEM, prompt_template=SUMMARIZE_TEMPLATE, chat_template="auto"
        ),
        engine=EngineConfig(model=args.model, dtype=args.dtype),
        data=DataConfig(uri="unused", on_too_long="truncate"),
        output=OutputConfig(uri="unused"),
        quiet=True,
    )
    default = OutputConfig()
    systems = {
        "off": (0, 0.0),
        f"default ({default.checkpoint_rows} rows / {default.checkpoint_s:g} s)": (
            default.checkpoint_rows,
            default.checkpoint_s,
        ),
        f"every {args.short_rows} rows": (args.short_rows, 0.0),
    }
    paths = {
        name: JobPath(
            dataclasses.replace(
                base, output=dataclasses.replace(base.output, checkpoint_rows=every_rows, checkpoint_s=every_s)
            ),
            rows,
            num_shards=1,
        )
        for name, (every_rows, every_s) in systems.items()
    }
    engine = Engine(base.engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    runs: dict[str, list[TimedRun]] = {name: [] for name in systems}
    try:
        for path in paths.values():
            path(engine, params, num_rows=2)  # untimed warm-up
        for round_index in range(args.rounds):
            for name in round_order(list(systems), round_index):
                runs[name].append(paths[name](engine, params))
    finally:
        for path in paths.values():
            path.close()
    reference = runs["off"][0].token_ids
    identical = all(run.token_ids == reference for name_runs in runs.values() for run in name_runs)
    table_rows = []
    for name, name_runs in runs.items():
        rates = [r.num_output_tokens / r.wall_s for r in name_runs]
        ratios = [r.wall_s / off.wall_s for r, off in zip(runs["off"], name_runs)]
        table_rows.append(
            [
                name,
                f"{statistics.median(r.wall_s for r in name_runs):.2f}",
                f"{statistics.median(rates):.1f}",
                f"{statistics.median(1 / x for x in ratios):.3f}",
            ]
        )
    table = markdown_table(["checkpoints", "wall s (median)", "out tok/s", "x off (same round)"], table_rows)
    notes = (
        f"{args.rows} pydoc topics (first {args.max_chars} characters) as one shard through the summarize "
        f"prompt on {args.model} ({args.dtype}), {args.max_tokens} greedy tokens, {args.rounds} rounds in "
        f"alternating order; `x off`: output tok/s over checkpoints off in the same round (median). Greedy "
        f"outputs identical across all: {'yes' if identical else 'NO'}."
    )
    print(table)
    print(notes)
    if not identical:
        raise SystemExit("greedy outputs differ between checkpoint settings")
    if args.write_docs:
        title = "Checkpoints inside a shard (job path, checkpoints off against on)"
        command = script_command("benchmarks.checkpoints", None)
        print(write_section("checkpoints", command, stamp(), table, notes, title))


if __name__ == "__main__":
    main()
