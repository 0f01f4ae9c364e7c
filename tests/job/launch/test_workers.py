"""launcher.num_workers: real worker subprocesses, claims and work stealing, a worker SIGKILLed
mid-run, and the one merged _manifest.json."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.job import run_job
from batchrun.job.commit.claims import (
    CLAIMED,
    FAILED,
    HELD,
    QUARANTINED,
    ClaimBook,
    ShardQueue,
    process_start_time,
    steal_order,
)
from batchrun.job.commit.store import RunStore
from batchrun.job.formats.writer import RESULT_COLUMNS
from batchrun.job.run.affinity import partition_by_group, shard_groups
from batchrun.job.shards import Shard, Worker, assign_shards, discover_shards, open_filesystem
from tests.support import REPO

# Columns that depend on timing or on what the engine's prefix cache held from earlier shards,
# not on the row: everything else of a result row must be byte-identical across worker counts.
RUN_DEPENDENT = {"ttft_s", "itl_s", "latency_s", "num_cached_tokens"}

# Loaded in every Python process of the test (PYTHONPATH): in worker rank 0 it pauses after its
# first output and reports its pid; worker 1 waits for GO before it claims any shard, so the test
# can SIGKILL worker 0 while worker 1 still has everything ahead of it.
SITECUSTOMIZE = r"""
import os, pathlib, time
rank = os.environ.get("BATCHRUN_WORKER_RANK")
if rank is not None and "TEST_HOOK_DIR" in os.environ:
    hook = pathlib.Path(os.environ["TEST_HOOK_DIR"])
    from batchrun.engine import Engine
    from batchrun.job.commit.claims import ShardQueue
    real_stream, real_next_shard = Engine.stream, ShardQueue.next_shard
    def next_shard(self, *args, **kwargs):
        if rank == "1":
            while not (hook / "go1").exists():
                time.sleep(0.02)
        return real_next_shard(self, *args, **kwargs)
    def stream(self, *args, **kwargs):
        for n, out in enumerate(real_stream(self, *args, **kwargs)):
            yield out
            if rank == "0":
                (hook / "ready0").write_text(str(os.getpid()))
                while True:
                    time.sleep(1)
    Engine.stream, ShardQueue.next_shard = stream, next_shard
"""


def _rows(out: Path) -> dict[str, list[dict]]:
    return {p.stem: pq.read_table(p).to_pylist() for p in sorted((out / "results").glob("*.parquet"))}


def _all_ids(out: Path) -> list[str]:
    return [r["id"] for rows in _rows(out).values() for r in rows]


def test_two_worker_processes_give_the_same_rows_as_one(tmp_path, make_shards, job_overrides):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=3) for i in s]
    one = run_job(cli.load_config(job_overrides(tmp_path / "in", tmp_path / "one")))
    assert one.exit_code == 0
    two = run_job(cli.load_config(job_overrides(tmp_path / "in", tmp_path / "two", "launcher.num_workers=2")))
    assert (two.exit_code, two.status) == (0, "completed"), two.message
    assert [(s.name, s.status) for s in two.shards] == [(f"part-0{i}", "committed") for i in range(4)]

    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert list(rows_one) == list(rows_two) == [f"part-0{i}" for i in range(4)]
    for shard in rows_one:
        assert pq.read_schema(tmp_path / "two" / "results" / f"{shard}.parquet").names == RESULT_COLUMNS
        strip = lambda rows: [json.dumps({k: v for k, v in r.items() if k not in RUN_DEPENDENT}) for r in rows]  # noqa: E731
        assert strip(rows_one[shard]) == strip(rows_two[shard])
    assert sorted(_all_ids(tmp_path / "two")) == sorted(ids)

    out = tmp_path / "two"
    # Which worker ran which shard depends on who was faster (stealing); that both ran as their
    # own processes does not.
    workers = {pq.read_table(p).column("worker")[0].as_py() for p in (out / "metrics").glob("*.parquet")}
    assert workers <= {0, 1}
    pids = {json.loads((out / f"_manifest.rank{r}.json").read_text())["worker"]["pid"] for r in (0, 1)}
    assert len(pids) == 2 and os.getpid() not in pids
    merged = json.loads((out / "_manifest.json").read_text())
    assert merged["status"] == "completed" and merged["worker"]["world_size"] == 2
    assert [s["status"] for s in merged["shards"]] == ["committed"] * 4
    assert sorted(w["rank"] for w in merged["workers"]) == [0, 1]
    assert all(json.loads((out / f"_manifest.rank{r}.json").read_text())["status"] == "completed" for r in (0, 1))
    assert not (out / "_claims").exists() and not (out / "_attempts").exists()
    # The launcher writes the run's report once both workers are done (the workers write none).
    report = (out / "report.html").read_text()
    assert "<dt>workers</dt><dd>2</dd>" in report and "<dt>shards</dt><dd>4 committed of 4</dd>" in report

    # The analysis notebook's loading cell reads the merged manifest beside the workers' own.
    import contextlib
    import io

    import nbformat

    notebook = nbformat.read(REPO / "notebooks" / "analyze_run.ipynb", as_version=4)
    first_code = next(c.source for c in notebook.cells if c.cell_type == "code")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        os.environ["BATCHRUN_RUN_DIR"] = str(out)
        try:
            exec(compile(first_code, "analyze_run.ipynb", "exec"), {})
        finally:
            del os.environ["BATCHRUN_RUN_DIR"]
    lines = printed.getvalue().splitlines()
    assert lines[0].startswith("run of 2 workers: completed") and lines[1].startswith("worker 0/2: completed")
    assert "4 committed shards: part-00, part-01, part-02, part-03" in lines


def test_a_sigkilled_worker_is_taken_over_and_every_id_appears_once(tmp_path, make_shards, job_overrides):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=3) for i in s]
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        **os.environ,
        "TEST_HOOK_DIR": str(hook),
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "batchrun",
        *job_overrides(tmp_path / "in", tmp_path / "out", "launcher.num_workers=2"),
    ]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
    while not (hook / "ready0").exists():
        if launcher.poll() is not None:
            pytest.fail(f"launcher exited early ({launcher.returncode}): {launcher.stderr.read()}")
        assert time.monotonic() < deadline, "worker 0 never reached its first shard"
        time.sleep(0.05)
    time.sleep(0.1)  # ready0 is written before its pid text lands only in theory; read it whole
    worker0 = int((hook / "ready0").read_text())
    out = tmp_path / "out"
    assert (out / "_claims" / "part-00").is_dir()  # worker 0 holds its first shard
    os.kill(worker0, signal.SIGKILL)
    while process_start_time(worker0) is not None:  # SIGKILL lands asynchronously (a big address space)
        assert time.monotonic() < deadline, "worker 0 did not die"
        time.sleep(0.01)
    (hook / "go1").touch()
    stdout, stderr = launcher.communicate(timeout=300)

    # Worker 1 took over worker 0's half-done shard and its unstarted one: the run completed.
    assert launcher.returncode == 0, stderr
    assert "died by a signal; the others took their shards over" in stderr
    assert "completed: 2 workers: 4 committed" in stdout
    assert sorted(_all_ids(out)) == sorted(ids) and len(_all_ids(out)) == len(ids)
    merged = json.loads((out / "_manifest.json").read_text())
    assert merged["status"] == "completed"
    assert [(s["name"], s["status"], s["worker"]) for s in merged["shards"]] == [
        (f"part-0{i}", "committed", 1) for i in range(4)
    ]
    rank0 = json.loads((out / "_manifest.rank0.json").read_text())
    assert rank0["status"] == "running" and rank0["shards"][0]["status"] == "running"  # what SIGKILL left
    # The killed worker's attempts are left as they were (only their owner removes them), and never
    # read: its first shard, and any it had opened beside it (its own part-02; one of worker 1's,
    # stolen while worker 1 had not started), each then taken over from the dead worker.
    left = sorted(p.parent.name for p in (out / "_attempts").glob("*/*"))
    assert "part-00" in left and len(left) == len(set(left))
    assert all(f"shard {name}: taking over the claim" in stderr for name in left)

    # A rerun finds nothing to do and changes nothing.
    before = {p.name: p.read_bytes() for p in (out / "results").iterdir()}
    rerun = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert {p.name: p.read_bytes() for p in (out / "results").iterdir()} == before


# ---- claims, without an engine ------------------------------------------------------------------


def _elsewhere(book: ClaimBook) -> ClaimBook:
    """A claim book that looks like a worker on another machine: its pid proves nothing here."""
    book.identity = {**book.identity, "host": "elsewhere", "boot_id": "another-boot"}
    return book


def test_a_claim_is_exclusive_until_released_or_its_owner_is_gone(tmp_path):
    store = RunStore(str(tmp_path / "out"), {})
    a, b = ClaimBook(store, lease_s=60), ClaimBook(store, lease_s=60)
    b.owner = "other"  # same process as `a`: only the owner id tells them apart
    assert a.try_claim("s0") == CLAIMED and a.try_claim("s0") == CLAIMED  # idempotent for the owner
    assert b.try_claim("s0") == HELD and b.holder("s0") == a.owner
    a.release("s0")
    assert b.try_claim("s0") == CLAIMED and sorted(p.name for p in (tmp_path / "out" / "_claims" / "s0").iterdir()) == [
        "000000.json",
        "000001.json",
    ]
    assert b.died_attempts("s0") == 0  # a released claim is no died attempt

    # An owner in this kernel and pid namespace whose process is gone: taken over at once.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    c = ClaimBook(store, lease_s=60)
    c.identity = {**c.identity, "pid": dead.pid}
    assert c.try_claim("s1") == CLAIMED
    assert a.try_claim("s1") == CLAIMED and a.holder("s1") == a.owner and a.died_attempts("s1") == 1

    # A live pid that was started at another time is pid reuse: its owner is gone too.
    reused = ClaimBook(store, lease_s=60)
    reused.identity = {**reused.identity, "pid_start": -1}
    assert reused.try_claim("s3") == CLAIMED and a.try_claim("s3") == CLAIMED

    # The same host name but another kernel (a container, another machine): only the lease tells.
    far = _elsewhere(ClaimBook(store, lease_s=60))
    far.identity["host"] = a.identity["host"]
    assert far.try_claim("s2") == CLAIMED and a.try_claim("s2") == HELD
    short = ClaimBook(store, lease_s=0.05)
    time.sleep(0.1)
    assert short.try_claim("s2") == CLAIMED


def test_a_failed_claim_of_a_finished_run_in_this_process_is_taken_at_once(tmp_path):
    """run_job called again in the same process (a notebook, a retry loop) after a shard failed:
    the failed claim names this live pid, but the run that wrote it has closed its claim book, so
    its owner is provably gone and the rerun must not wait out the lease."""
    store = RunStore(str(tmp_path / "out"), {})
    with ClaimBook(store, lease_s=600) as first:
        assert first.try_claim("s0") == CLAIMED
        first.release("s0", FAILED)
        live = ClaimBook(store, lease_s=600)
        assert live.try_claim("s0") == HELD  # while `first` is open its failed claim keeps others off
    assert live.try_claim("s0") == CLAIMED and live.died_attempts("s0") == 0


def test_claim_ages_are_read_on_the_stores_clock(tmp_path):
    """A worker whose clock runs an hour ahead must not think a live claim stale, and one whose
    clock runs behind must still see a dead one's lease run out: ages are store mtimes against the
    store's own time (a probe file), never one host's clock against another's."""
    store = RunStore(str(tmp_path / "out"), {})
    owner = _elsewhere(ClaimBook(store, lease_s=2))
    assert owner.try_claim("s0") == CLAIMED
    ahead, behind = ClaimBook(store, lease_s=2), ClaimBook(store, lease_s=2)
    real_time = time.time
    try:
        time.time = lambda: real_time() + 3600
        with ahead:  # measures the store's clock against its own
            assert ahead.try_claim("s0") == HELD
        time.time = lambda: real_time() - 3600
        with behind:
            time.sleep(2.5)  # the owner wrote nothing since
            assert behind.try_claim("s0") == CLAIMED
    finally:
        time.time = real_time


def test_a_frozen_owner_finds_its_claim_lost_and_a_failing_heartbeat_warns(tmp_path, caplog):
    store = RunStore(str(tmp_path / "out"), {})
    frozen = _elsewhere(ClaimBook(store, lease_s=0.2))
    assert frozen.try_claim("s0") == CLAIMED
    time.sleep(0.3)  # frozen: no heartbeat
    taker = ClaimBook(store, lease_s=0.2)
    assert taker.try_claim("s0") == CLAIMED and taker.died_attempts("s0") == 1
    frozen.renew()  # wakes up
    assert frozen.is_lost("s0") and not taker.is_lost("s0")
    assert "claim lost" in caplog.text
    frozen.release("s0")  # must not overwrite anything of the taker's
    assert taker.holder("s0") == taker.owner

    broken = ClaimBook(store, lease_s=0.2)
    assert broken.try_claim("s1") == CLAIMED
    broken.store = RunStore(str(tmp_path / "out"), {})
    broken.store.write_json = lambda path, obj: (_ for _ in ()).throw(OSError("disk gone"))
    broken.renew()
    assert "claim heartbeat failed" in caplog.text and not broken.is_lost("s1")
    time.sleep(0.25)
    broken.renew()  # still failing after a whole lease: it cannot prove it holds the shard
    assert broken.is_lost("s1")


def test_a_worker_takes_back_its_own_claim_lost_while_the_store_was_out_of_reach(tmp_path):
    """Its heartbeat could not renew the claim for a whole lease, so it let the shard go; the claim
    in the store is still its own, which nobody else may take before the lease runs out, so it
    takes it again at the next generation (no attempt died) instead of waiting for itself."""
    store = RunStore(str(tmp_path / "out"), {})
    book = ClaimBook(store, lease_s=0.2)
    assert book.try_claim("s0") == CLAIMED
    book.store = RunStore(str(tmp_path / "out"), {})
    book.store.write_json = lambda path, obj: (_ for _ in ()).throw(OSError("store out of reach"))
    book.renew()
    time.sleep(0.25)
    book.renew()
    assert book.is_lost("s0")
    book.release("s0")  # what a worker does with a shard whose claim it lost
    book.store = store  # the store is back
    assert book.try_claim("s0") == CLAIMED and not book.is_lost("s0") and book.died_before("s0") == 0
    assert sorted(p.name for p in (tmp_path / "out" / "_claims" / "s0").iterdir()) == ["000000.json", "000001.json"]
    assert book.holder("s0") == book.owner and book.died_attempts("s0") == 0
    book.renew()
    assert not book.is_lost("s0")


def test_a_shard_this_worker_quarantined_stays_quarantined(tmp_path):
    """Its own quarantined claim is not a lost claim of its own to take back."""
    store = RunStore(str(tmp_path / "out"), {})
    dying = _elsewhere(ClaimBook(store, lease_s=0.05))
    assert dying.try_claim("s0") == CLAIMED
    time.sleep(0.1)  # ...and dies on it
    book = ClaimBook(store, lease_s=0.05, max_attempts=1)
    assert book.try_claim("s0") == QUARANTINED and book.try_claim("s0") == QUARANTINED


def test_an_unparseable_claim_file_is_live_for_a_lease_then_taken_over(tmp_path):
    """A claim file cut short (a crash leftover) or not a claim at all (a foreign writer) must not
    block its shard forever: judged by its age on the store's clock, it is live for a lease (it may
    be mid-write) and then taken over as a died attempt."""
    store = RunStore(str(tmp_path / "out"), {})
    claims = tmp_path / "out" / "_claims"

    def leave(shard: str, data: bytes, age_s: float, generation: int = 0) -> Path:
        path = claims / shard / f"{generation:06d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written = path.stat().st_mtime  # by the store's clock: this disk's
        os.utime(path, (written - age_s, written - age_s))
        return path

    with ClaimBook(store, lease_s=2) as book:  # measures the store's clock
        for name, data in {"empty": b"", "cut": b'{"owner": "w', "list": b"[]", "null": b"null"}.items():
            fresh = leave(f"{name}-fresh", data, age_s=0)
            leave(f"{name}-old", data, age_s=10)
            assert book.try_claim(f"{name}-fresh") == HELD, name
            assert book.try_claim(f"{name}-old") == CLAIMED and book.died_attempts(f"{name}-old") == 1, name
            assert sorted(p.name for p in (claims / f"{name}-old").iterdir()) == ["000000.json", "000001.json"]
            written = fresh.stat().st_mtime
            os.utime(fresh, (written - 10, written - 10))  # it stayed as it was for a lease
            assert book.try_claim(f"{name}-fresh") == CLAIMED, name

        # The attempts that died before an unreadable claim still count toward quarantine.
        leave("counted", json.dumps({"owner": "gone", "state": "running", "died_attempts": 1}).encode(), 10)
        leave("counted", b"", age_s=10, generation=1)
        assert book.try_claim("counted") == CLAIMED and book.died_attempts("counted") == 2


def test_a_shard_whose_attempts_die_is_quarantined(tmp_path):
    store = RunStore(str(tmp_path / "out"), {})
    for attempt in range(3):
        book = _elsewhere(ClaimBook(store, lease_s=0.05, max_attempts=3))
        assert book.try_claim("s0") == (CLAIMED if attempt < 3 else QUARANTINED)
        time.sleep(0.1)  # ...and dies on it
    assert ClaimBook(store, lease_s=0.05, max_attempts=3).try_claim("s0") == QUARANTINED
    assert ClaimBook(store, lease_s=0.05, max_attempts=3).try_claim("s0") == QUARANTINED
    assert ClaimBook(store, lease_s=0.05, max_attempts=5).try_claim("s0") == CLAIMED  # the limit raised


def test_claims_on_an_object_store_filesystem(make_shards):
    import fsspec

    fsspec.filesystem("memory").store.clear()
    store = RunStore("memory://claims-run", {})
    a, b = ClaimBook(store, lease_s=60), ClaimBook(store, lease_s=60)
    b.owner = "other"
    assert a.try_claim("s0") == CLAIMED and b.try_claim("s0") == HELD
    a.drop("s0")
    assert b.try_claim("s0") == CLAIMED


def test_the_second_committer_of_a_shard_discards_its_attempt(tmp_path):
    store = RunStore(str(tmp_path / "out"), {})

    def attempt(content: bytes):
        a = store.begin("s0")
        Path(a.results_tmp).parent.mkdir(parents=True, exist_ok=True)
        Path(a.results_tmp).write_bytes(content)
        Path(a.metrics_tmp).write_bytes(b"m")
        return a

    # Two workers on one shard (an expired lease, a race on an object store): the first marker stands.
    assert store.commit(attempt(b"first"), {"shard": "s0", "by": "first"})
    assert not store.commit(attempt(b"second"), {"shard": "s0", "by": "second"})
    assert (tmp_path / "out" / "results" / "s0.parquet").read_bytes() == b"first"
    assert store.read_marker("s0")["by"] == "first"
    assert not (tmp_path / "out" / "_attempts").exists()


def test_steal_order_takes_each_owners_last_shards_first():
    shards = [Shard(f"s{i}", f"s{i}", f"s{i}") for i in range(7)]
    # Worker 0 of 3 owns s0, s3, s6; worker 1 owns s1, s4; worker 2 owns s2, s5.
    parts = [assign_shards(shards, Worker(r, 3, "t")) for r in range(3)]
    assert [s.name for s in steal_order(parts, 0)] == ["s4", "s5", "s1", "s2"]
    assert steal_order([shards], 0) == []


def test_prefix_affinity_puts_a_group_on_one_worker(tmp_path):
    import pyarrow as pa

    # Shards of documents A (3 shards), B (2) and C (1); row order inside a shard does not matter.
    docs = {"a1": "A", "a2": "A", "a3": "A", "b1": "B", "b2": "B", "c1": "C"}
    (tmp_path / "in").mkdir()
    for name, doc in docs.items():
        pq.write_table(
            pa.table({"id": [f"{name}-0", f"{name}-1"], "doc": [doc, doc], "text": ["q", "q"]}),
            tmp_path / "in" / f"{name}.parquet",
        )
    fs, path = open_filesystem(str(tmp_path / "in"), {})
    shards = discover_shards(fs, path, str(tmp_path / "in"))
    groups = shard_groups(fs, shards, "doc")
    parts = partition_by_group(shards, groups, 2)
    assert [[s.name for s in p] for p in parts] == [["a1", "a2", "a3"], ["b1", "b2", "c1"]]
    assert sorted(s.name for p in partition_by_group(shards, groups, 4) for s in p) == sorted(docs)
    # Round-robin would have split A across both workers.
    assert {s.name for s in assign_shards(shards, Worker(1, 2, "t"))} & {"a1", "a2", "a3"}


def _compose_slurm_preset(output_uri: str, *extra: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(cli.CONF_DIR), version_base="1.3"):
        return compose(
            config_name="config",
            return_hydra_config=True,
            overrides=[
                "hydra/launcher=slurm",
                f"output.uri={output_uri}",
                "launcher.world_size=4",
                "launcher.rank=3",
                *extra,
            ],
        )


def test_the_slurm_launcher_preset_composes(tmp_path, monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("BATCHRUN_SUBMITIT_DIR", raising=False)
    monkeypatch.delenv("BATCHRUN_CACHE", raising=False)
    cfg = _compose_slurm_preset(str(tmp_path / "run"))
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.signal_delay_s, launcher.tasks_per_node, launcher.max_num_timeout) == (90, 1, 20)
    assert cfg.hydra.sweep.subdir == "rank3"
    # One task per worker, with a GPU for each rank of its tensor-parallel group.
    assert launcher.gpus_per_node == 1
    grouped = _compose_slurm_preset(str(tmp_path / "run"), "engine.tensor_parallel_size=2").hydra.launcher
    assert (grouped.tasks_per_node, grouped.gpus_per_node) == (1, 2)
    assert cfg.launcher.rank == 3 and cfg.launcher.world_size == 4  # the batchrun side is untouched

    # submitit's pickles (credentials included, unpickled on the compute node) live in a private
    # directory of this user's, never in the output directory others may write.
    folder = Path(cfg.hydra.sweep.dir)
    assert folder.parent == tmp_path / "home" / ".cache" / "batchrun" / "submitit"
    assert not folder.is_relative_to(tmp_path / "run") and launcher.submitit_folder == f"{folder}/%j"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    assert _compose_slurm_preset(str(tmp_path / "run")).hydra.sweep.dir == str(folder)  # a requeue finds it
    assert _compose_slurm_preset(str(tmp_path / "other")).hydra.sweep.dir != str(folder)


def test_the_slurm_preset_keeps_an_s3_runs_pickles_in_a_private_local_directory(tmp_path, monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    monkeypatch.setenv("BATCHRUN_SUBMITIT_DIR", str(tmp_path / "submitit"))
    monkeypatch.chdir(tmp_path)
    folder = Path(_compose_slurm_preset("s3://bucket/runs/docs").hydra.sweep.dir)
    assert folder.parent == tmp_path / "submitit" and "s3:" not in str(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not (tmp_path / "s3:").exists()

    folder.chmod(0o777)  # anyone could now plant pickles there: refused, not used
    with pytest.raises(Exception, match="writable by group or others"):
        assert not _compose_slurm_preset("s3://bucket/runs/docs").hydra.sweep.dir


def test_a_worker_waits_for_its_shards_held_elsewhere_and_takes_back_a_dead_owners(tmp_path):
    store = RunStore(str(tmp_path / "out"), {})
    other = _elsewhere(ClaimBook(store, lease_s=0.2))
    assert other.try_claim("s0") == CLAIMED and other.try_claim("s1") == CLAIMED
    committed: set[str] = set()
    skipped: list[tuple[str, str]] = []

    def on_skip(shard, status):
        skipped.append((shard.name, status))
        if shard.name == "s1":
            committed.add("s1")  # the other worker finishes s1 while this one waits

    mine = ClaimBook(store, lease_s=0.2)
    own = [Shard(n, n, n) for n in ("s0", "s1", "s2")]
    got = [s.name for s in ShardQueue(own, [], mine, committed.__contains__, on_skip, lambda: False, 0.01)]
    # s2 at once; s1 was committed by its holder; s0's holder stopped beating, so it came back.
    assert got == ["s2", "s0"]
    assert skipped[:2] == [("s0", "elsewhere"), ("s1", "elsewhere")] and ("s1", "skipped") in skipped


def test_a_claim_error_fails_that_shard_only(tmp_path):
    store = RunStore(str(tmp_path / "out"), {})
    book = ClaimBook(store, lease_s=60)
    errors = []
    own = [Shard("s0", "s0", "s0"), Shard("x" * 300, "bad", "bad"), Shard("s2", "s2", "s2")]
    queue = ShardQueue(
        own,
        [],
        book,
        lambda name: False,
        lambda *a: None,
        lambda: False,
        on_error=lambda shard, e: errors.append((shard.path, type(e).__name__)),
    )
    assert [s.name for s in queue] == ["s0", "s2"]
    assert errors == [("bad", "ValueError")]  # the store refuses the name before any file call
