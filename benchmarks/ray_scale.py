"""launcher=ray on a local Ray cluster: the same job with 1 worker actor and with 2, and a
kill-and-replace trial (2 workers, one actor's process SIGKILLed mid-run), each as the real command
(`python -m batchrun ... launcher=ray`) against one cluster this script starts and stops.

    python -m benchmarks.ray_scale [--model smollm2-135m|tiny] [--rows 64] [--shards 8]
        [--max-tokens 32] [--kill-at 0.5] [--rounds 1] [--write-docs]

The cluster has the machine's CPUs (`ray start --head --num-cpus N`); engine.num_threads is left
null so the launcher shares the cores out (1 worker: all of them, 2 workers: half each): the
comparison is the same cores split over one engine or two. Wall time is the driver's, from its
start to its exit (joining the cluster, starting the actors, loading the model, the run, the
merge). The kill lands once `--kill-at` of the same round's 2-worker wall time has passed (after
the victim's manifest shows it running); the trial checks Ray restarted the actor (its rank's
manifest names a new process), every input id is in the results exactly once, and the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.benchmark.timing import round_order
from batchrun.testing import local_ray_cluster, make_tiny_model, sample_texts

RUNS = ("1 worker", "2 workers", "2 workers, one killed")
_BAR = re.compile(r"batchrun ray: (\d+)row \[[^\]]*?(\d+) output tokens, (\d+) restart\(s\)\]")


@dataclass
class Trial:
    name: str
    exit_code: int
    wall_s: float
    num_ids: int  # distinct ids in the results
    num_rows: int  # result rows (a duplicate would make it exceed num_ids)
    output_tokens: int
    outputs: dict[str, Optional[str]] = field(repr=False)
    restarts: Optional[int] = None  # the driver's bar's last count
    killed_pid: Optional[int] = None
    replaced: Optional[bool] = None  # the killed rank ran again in a new process and completed
    killed_mid_run: Optional[bool] = None  # the victim's manifest said running when it was killed

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="a model.path, or `tiny`: a tiny random llama (float32)"
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-chars", type=int, default=600, help="each text is cut to this many characters")
    parser.add_argument("--kill-at", type=float, default=0.5, help="fraction of the 2-worker wall time")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--machine", default=None, help="how docs/benchmarks.md names the machine")
    parser.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = parser.parse_args()

    from batchrun.model.loader import load_model

    work = Path(tempfile.mkdtemp(prefix="batchrun-ray-bench-"))
    try:
        model, dtype = (
            (str(make_tiny_model(work / "tiny", "llama")), "float32") if args.model == "tiny" else (args.model, "auto")
        )
        load_model(model)  # the converted-weights cache filled before any timing
        data = work / "in"
        ids = _write_input(data, args.rows, args.shards, args.max_chars)
        repo = str(Path(__file__).resolve().parents[2])
        trials: dict[str, list[Trial]] = {name: [] for name in RUNS}
        with local_ray_cluster(num_cpus=os.cpu_count() or 2, pythonpath=[repo]) as cluster:
            base = [
                "job=summarize",
                f"model.path={model}",
                f"engine.dtype={dtype}",
                f"data.uri={data}",
                "data.on_too_long=truncate",
                f"sampling.max_tokens={args.max_tokens}",
                "engine.device=cpu",
                "launcher=ray",
                f"launcher.ray_address={cluster.address}",
                "quiet=false",
            ]
            for round_index in range(args.rounds):
                # The kill trial needs this round's 2-worker wall time: it always runs last.
                for name in round_order(list(RUNS[:2]), round_index) + [RUNS[2]]:
                    out = work / f"out-{round_index}-{RUNS.index(name)}"
                    kill_after = args.kill_at * trials["2 workers"][-1].wall_s if "killed" in name else None
                    trial = _run(name, base, 1 if name == "1 worker" else 2, out, kill_after)
                    trials[name].append(trial)
                    print(f"round {round_index}: {trial}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    reference = trials["1 worker"][0].outputs
    rows = []
    for name, runs in trials.items():
        for t in runs:
            once = t.num_ids == len(ids) and t.num_rows == len(ids)
            kill = (
                f"pid {t.killed_pid} killed {'mid-run' if t.killed_mid_run else 'after its work'}; "
                f"restarted: {'yes' if t.replaced else 'NO'} (bar: {t.restarts} restart(s))"
                if t.killed_pid
                else ""
            )
            same = sum(t.outputs.get(i) == reference.get(i) for i in ids)
            rows.append(
                [
                    name,
                    t.exit_code,
                    f"{t.wall_s:.1f}",
                    f"{t.tok_s:.1f}",
                    "yes" if once else f"NO ({t.num_rows} rows, {t.num_ids} ids)",
                    f"{same}/{len(ids)}",
                    kill,
                ]
            )
    header = ["run", "exit", "wall s", "out tok/s", "every id once", "outputs = 1 worker's", "kill"]
    table = markdown_table(header, rows)
    two, killed = trials["2 workers"], trials["2 workers, one killed"]
    ratios = [k.wall_s / t.wall_s for k, t in zip(killed, two)]
    speedups = [o.wall_s / t.wall_s for o, t in zip(trials["1 worker"], two)]
    notes = (
        f"{args.rows} pydoc topics (first {args.max_chars} characters) in {args.shards} Parquet shards, the "
        f"summarize job on {'a tiny random llama (3 layers, hidden 64)' if args.model == 'tiny' else args.model} "
        f"(engine.device=cpu, dtype {dtype}), {args.max_tokens} greedy tokens, "
        f"through `launcher=ray` on a local cluster of {os.cpu_count()} CPUs ({args.rounds} round(s)); wall "
        f"time is the driver's whole command. 2 workers over 1: {', '.join(f'{s:.2f}x' for s in speedups)} "
        f"faster; the kill trial took {', '.join(f'{r:.2f}x' for r in ratios)} the 2-worker wall time (the "
        f"killed process's rows in flight recomputed, plus the actor's restart and model load)."
    )
    print(table)
    print(notes)
    if args.write_docs:
        title = "Ray launcher: 1 worker against 2, and a worker actor killed and replaced"
        command = script_command("benchmarks.ray_scale", None)
        print(write_section("ray_scale", command, stamp(args.machine), table, notes, title))
    bad = [t for runs in trials.values() for t in runs if t.exit_code != 0 or t.num_rows != len(ids)]
    if bad:
        raise SystemExit(f"{len(bad)} run(s) did not commit every id exactly once with exit 0")


def _write_input(data: Path, num_rows: int, num_shards: int, max_chars: int) -> list[str]:
    texts = sample_texts()
    ids = [f"row{i:05d}" for i in range(num_rows)]
    data.mkdir(parents=True)
    for s in range(num_shards):
        chunk = range(s, num_rows, num_shards)
        table = pa.table({"id": [ids[i] for i in chunk], "text": [texts[i % len(texts)][:max_chars] for i in chunk]})
        pq.write_table(table, data / f"part-{s:03d}.parquet")
    return ids


def _run(name: str, base: list[str], num_workers: int, out: Path, kill_after_s: Optional[float]) -> Trial:
    cmd = [sys.executable, "-m", "batchrun", *base, f"launcher.num_workers={num_workers}", f"output.uri={out}"]
    t0 = time.perf_counter()
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed_pid, killed_manifest, mid_run = None, None, None
    if kill_after_s is not None:
        while driver.poll() is None:
            manifests = sorted(out.glob("_manifest.rank*.json"))
            if len(manifests) == num_workers and time.perf_counter() - t0 >= kill_after_s:
                doc = _read_json(manifests[0])
                if doc is not None:
                    killed_pid, killed_manifest = doc["worker"]["pid"], manifests[0]
                    mid_run = doc["status"] == "running"
                    os.kill(killed_pid, signal.SIGKILL)
                    break
            time.sleep(0.05)
    stdout, stderr = driver.communicate()
    wall = time.perf_counter() - t0
    if driver.returncode != 0:
        print(stderr[-3000:], file=sys.stderr)
    outputs: dict[str, Optional[str]] = {}
    num_rows = tokens = 0
    for path in sorted((out / "results").glob("*.parquet")):
        for row in pq.read_table(path, columns=["id", "output", "num_output_tokens"]).to_pylist():
            outputs[row["id"]] = row["output"]
            num_rows += 1
            tokens += row["num_output_tokens"] or 0
    draws = _BAR.findall(stderr)
    replaced = None
    if killed_manifest is not None:
        doc = _read_json(killed_manifest) or {}
        replaced = doc.get("worker", {}).get("pid") != killed_pid and doc.get("status") == "completed"
    return Trial(
        name,
        driver.returncode,
        wall,
        len(outputs),
        num_rows,
        tokens,
        outputs,
        restarts=int(draws[-1][2]) if draws else None,
        killed_pid=killed_pid,
        replaced=replaced,
        killed_mid_run=mid_run,
    )


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # being rewritten
    return doc if isinstance(doc, dict) else None


if __name__ == "__main__":
    main()
