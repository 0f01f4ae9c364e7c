"""Chaos: 2-4 real worker processes over one output (local disk, and moto's S3 server), with seeded
random SIGKILLs, SIGSTOPs past the claim lease then SIGCONT, graceful SIGTERMs, and restarts. After
the chaos the workers are left to finish; then every input id must be in the committed results
exactly once, every shard must have exactly one marker naming complete files, and every exit code
must be one the README documents (0, or 143 for SIGTERM; 137 is the SIGKILL itself).

BATCHRUN_CHAOS_TRIALS sets the trials per store (default 3: 6 in all, what CI's time allows; a soak
run sets more); BATCHRUN_CHAOS_REPORT names a file to which each trial appends one JSON line of what
happened.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun.job.commit.store import RunStore, committed_files

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

LEASE_S = 1.5
NUM_SHARDS, ROWS_PER_SHARD = 6, 3
TIMEOUT_S = 240  # a hang guard per trial, never a timing assertion
# As a shell reports them (128 + signal for a death by signal): 0 done, 143 stopped by SIGTERM
# (gracefully, or before the run had started), 137 the SIGKILL itself.
DOCUMENTED_EXITS = {0, 143, 137}


def _worker(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "batchrun", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )


def _trial(seed: int, data: Path, out_uri: str, tiny_llama_dir: str, env: dict) -> dict:
    rng = random.Random(seed)
    world = rng.randint(2, 4)
    common = [
        f"model.path={tiny_llama_dir}",
        f"data.uri={data}",
        f"output.uri={out_uri}",
        "engine.kv_cache_memory=33554432",
        "engine.max_num_seqs=2",
        "engine.max_num_batched_tokens=512",
        "engine.dtype=float32",
        "engine.num_threads=1",
        "sampling.max_tokens=4",
        "quiet=true",
        f"launcher.world_size={world}",
        f"launcher.claim_lease_s={LEASE_S}",
        "launcher.max_shard_attempts=1000",
        "output.checkpoint_rows=1",  # every row its own part: kills land between parts, and mid-part
    ]
    procs = {r: _worker([*common, f"launcher.rank={r}"], env) for r in range(world)}
    events = {"kill": 0, "stop": 0, "term": 0, "restart": 0}
    exits: list[int] = []
    stopped: dict[int, float] = {}
    finished: set[int] = set()
    deadline = time.monotonic() + TIMEOUT_S
    num_events = rng.randint(2, 5)
    next_event = time.monotonic() + rng.uniform(2.0, 5.0)  # workers take a few seconds to start
    while True:
        assert time.monotonic() < deadline, f"trial {seed} did not finish"
        now = time.monotonic()
        for rank, until in list(stopped.items()):
            if now >= until:
                procs[rank].send_signal(signal.SIGCONT)
                del stopped[rank]
        for rank, proc in procs.items():
            if proc.poll() is not None and rank not in stopped and rank not in finished:
                code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
                exits.append(code)
                if code == 0:
                    finished.add(rank)
                assert code in DOCUMENTED_EXITS, f"trial {seed}: rank {rank} exited {code}: {proc.stderr.read()}"
                if code != 0:  # killed or stopped: run it again, as Slurm's requeue or a rerun would
                    procs[rank] = _worker([*common, f"launcher.rank={rank}"], env)
                    events["restart"] += 1
        if all(p.poll() is not None and p.returncode == 0 for p in procs.values()) and not stopped:
            break
        if num_events and now >= next_event:
            live = [r for r, p in procs.items() if p.poll() is None and r not in stopped]
            if live:
                rank = rng.choice(live)
                action = rng.choice(["kill", "stop", "term"])
                if action == "kill":
                    procs[rank].send_signal(signal.SIGKILL)
                elif action == "stop":
                    procs[rank].send_signal(signal.SIGSTOP)
                    stopped[rank] = now + LEASE_S * rng.uniform(1.5, 3.0)  # past its lease
                else:
                    procs[rank].send_signal(signal.SIGTERM)
                events[action] += 1
                num_events -= 1
            next_event = now + rng.uniform(0.5, 3.0)
        time.sleep(0.05)
    for proc in procs.values():
        proc.stderr.close()
    return {"seed": seed, "world": world, **events, "exits": sorted(exits)}


def _check(out_uri: str, expected_ids: list[str]) -> tuple[int, int]:
    """(lost, duplicated) ids in the committed results, after checking markers and files."""
    store = RunStore(out_uri, {})
    files = committed_files(store)
    assert sorted(files) == [f"part-{i:02d}" for i in range(NUM_SHARDS)]  # one marker per shard
    ids = []
    for shard, path in files.items():
        with store.fs.open(path, "rb") as f:
            table = pq.read_table(f)
        assert len(table) == store.read_marker(shard)["num_rows"] == ROWS_PER_SHARD
        ids += table.column("id").to_pylist()
    return len(set(expected_ids) - set(ids)), len(ids) - len(set(ids))


@pytest.mark.parametrize("store_kind", ["local", "s3"])
def test_chaos_every_id_exactly_once(store_kind, tmp_path, make_shards, tiny_llama_dir, hooked_env, request):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=NUM_SHARDS, rows_per_shard=ROWS_PER_SHARD) for i in s]
    bucket = request.getfixturevalue("s3")[1] if store_kind == "s3" else None  # sets the AWS_* environment
    trials = int(os.environ.get("BATCHRUN_CHAOS_TRIALS", "3"))
    base_seed = int(os.environ.get("BATCHRUN_CHAOS_SEED", "1234"))
    report = os.environ.get("BATCHRUN_CHAOS_REPORT")
    for trial in range(trials):
        out_uri = str(tmp_path / f"out{trial}") if store_kind == "local" else f"s3://{bucket}/run{trial}"
        delay_s = random.Random(base_seed + trial).uniform(0.05, 0.2)  # per output row: hit shards mid-way
        env = hooked_env({"delay_s": delay_s})
        summary = _trial(base_seed + trial, tmp_path / "in", out_uri, tiny_llama_dir, env)
        lost, duplicated = _check(out_uri, ids)
        summary.update(store=store_kind, lost=lost, duplicated=duplicated)
        if report:
            with open(report, "a") as f:
                f.write(json.dumps(summary) + "\n")
        assert (lost, duplicated) == (0, 0), summary
