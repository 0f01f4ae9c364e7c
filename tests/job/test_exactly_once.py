"""Exactly-once off the happy path: each case here broke the promise on an earlier main (issue #18).

Real Parquet files, real worker processes and signals, a real S3-protocol server; the store is
never mocked. Each test names the case it covers.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.job import run_job
from batchrun.job.commit.claims import CLAIMED, HELD, ClaimBook
from batchrun.job.commit.manifest import REDACTED
from batchrun.job.commit.store import RunStore, committed_files
from batchrun.job.run.runner import run_worker
from batchrun.job.shards import NAME_MAX_BYTES, discover_shards, is_safe_name, open_filesystem
from tests.support import REPO

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::ResourceWarning")

TIMEOUT_S = 300  # a hang guard for subprocesses, never a timing assertion


def _committed_ids(out: Path) -> list:
    """Every id in the committed results, read through the markers as a careful reader would."""
    store = RunStore(str(out), {})
    return [i for path in committed_files(store).values() for i in pq.read_table(path).column("id").to_pylist()]


def _write(path: Path, columns: dict, schema: pa.Schema | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)


@pytest.fixture
def spawn(hooked_env):
    """(args, hooks) -> a real `python -m batchrun` process with the test hooks loaded."""

    def start(args: list[str], hooks: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "batchrun", *args],
            env=hooked_env(hooks),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    return start


def _wait_for(predicate, what: str, procs=()) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                pytest.fail(f"{what}: a worker exited {p.returncode}: {p.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---- 1. hostile shard names ------------------------------------------------------------------


def test_case1_a_shard_named_dotdot_cannot_wipe_the_output(
    tmp_path, short_texts, tiny_engine, tiny_llama_dir, job_overrides
):
    src, out = tmp_path / "in", tmp_path / "out"
    names = {
        "a.parquet": "a",
        " ...parquet": "dots",
        "new\nline.parquet": "nl",
        ("x" * 200) + ".parquet": "long",
        "sp ace.parquet": "space",
    }
    for i, (name, prefix) in enumerate(names.items()):
        _write(src / name, {"id": [f"{prefix}-{r}" for r in range(2)], "text": short_texts[2 * i : 2 * i + 2]})
    ids = sorted(f"{p}-{r}" for p in names.values() for r in range(2))
    fs, path = open_filesystem(str(src), {})
    shard_names = [s.name for s in discover_shards(fs, path, str(src))]
    assert all(is_safe_name(n) and len(n.encode()) <= NAME_MAX_BYTES for n in shard_names), shard_names
    assert "a" in shard_names and len(set(shard_names)) == len(names)

    overrides = job_overrides(src, out)
    for _ in range(2):  # the second run used to remove the output root through _tmp/..
        result = run_job(cli.load_config(overrides), engine=tiny_engine)
        assert result.exit_code == 0, result.message
        assert sorted(_committed_ids(out)) == ids
    assert sorted(p.stem for p in (out / "results").iterdir()) == sorted(shard_names)

    store = RunStore(str(out), {})
    for bad in ("..", ".", "", "a/b", "..\\x"):
        with pytest.raises(ValueError):
            store.path("_tmp", bad)
        with pytest.raises(ValueError):
            store.results_path(bad)


# ---- 2. a worker frozen past its lease -------------------------------------------------------


def test_case2_a_worker_frozen_past_its_lease_exits_0_and_nothing_is_doubled(
    tmp_path, make_shards, tiny_llama_dir, job_overrides, spawn
):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=4) for i in s]
    out, hooks_dir = tmp_path / "out", tmp_path / "hooks"
    hooks_dir.mkdir()
    common = job_overrides(tmp_path / "in", out, "launcher.world_size=2", "launcher.claim_lease_s=2")
    frozen = spawn([*common, "launcher.rank=0"], {"dir": str(hooks_dir), "delay_s": 0.3, "rank": 0})
    _wait_for(lambda: any(hooks_dir.glob("started-0-*")), "worker 0 to start a shard", [frozen])
    frozen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3)  # past the lease: its claim is stale by the time the other worker looks
        other = spawn([*common, "launcher.rank=1"])
        stdout, stderr = other.communicate(timeout=TIMEOUT_S)
        assert other.returncode == 0, stderr
        assert len(list((out / "_commits").iterdir())) == 4  # it took the frozen worker's shards over
    finally:
        frozen.send_signal(signal.SIGCONT)
    stdout, stderr = frozen.communicate(timeout=TIMEOUT_S)
    assert frozen.returncode == 0, stderr  # its shards are done, by another worker: no failure
    assert "claim lost" in stderr or "committed by another worker" in stderr
    assert sorted(_committed_ids(out)) == sorted(ids) and len(_committed_ids(out)) == len(ids)
    assert sorted(p.stem for p in (out / "results").iterdir()) == [f"part-0{i}" for i in range(4)]
    merged = json.loads((out / "_manifest.json").read_text())
    assert merged["status"] == "completed"


def test_case2_a_worker_whose_store_was_out_of_reach_past_its_lease_takes_its_shard_back(
    tmp_path, make_shards, tiny_llama_dir, job_overrides, spawn
):
    """Its heartbeat could not renew part-00's claim for longer than the lease, so it stopped that
    shard; nobody else took it, and the claim left in the store is its own: it must take it back
    and finish, not wait for itself."""
    ids = [i for s in make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2) for i in s]
    out = tmp_path / "out"
    proc = spawn(
        job_overrides(tmp_path / "in", out, "launcher.claim_lease_s=1.5"),
        {"store_outage_on": "part-00", "store_outage_s": 3},
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)  # a hang guard
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"the worker never finished: {stderr[-3000:]}")
    assert proc.returncode == 0, stderr
    assert "shard part-00: claim lost" in stderr  # the outage did cost it the claim
    assert "shard part-00: taking back this worker's own lost claim" in stderr
    assert sorted(_committed_ids(out)) == sorted(ids) and len(_committed_ids(out)) == len(ids)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert {s["name"]: s["status"] for s in manifest["shards"]} == {"part-00": "committed", "part-01": "committed"}
    assert not (out / "_claims").exists()


def test_a_late_committer_never_replaces_the_winners_files(tmp_path):
    store = RunStore(str(tmp_path / "out"), {})
    late, winner = store.begin("s0"), store.begin("s0")  # the late one began first, then froze
    for attempt, content in ((late, b"late"), (winner, b"winner")):
        Path(attempt.results_tmp).write_bytes(content)
        Path(attempt.metrics_tmp).write_bytes(content)
    assert store.commit(winner, {"by": "winner"})
    assert not Path(late.results_tmp).read_bytes() == b"winner"  # each attempt has its own files
    assert not store.commit(late, {"by": "late"})
    assert (tmp_path / "out" / "results" / "s0.parquet").read_bytes() == b"winner"
    assert store.read_marker("s0")["attempt"] == winner.attempt_id


def test_a_commit_whose_publication_died_is_finished_by_the_next_reader(
    tmp_path, make_shards, tiny_engine, tiny_llama_dir, job_overrides
):
    ids = make_shards(tmp_path / "in", num_shards=2, rows_per_shard=3)
    out = tmp_path / "out"
    overrides = job_overrides(tmp_path / "in", out)
    assert run_job(cli.load_config(overrides), engine=tiny_engine).exit_code == 0
    # As if part-01's committer died right after creating its marker: its files are still in its attempt.
    marker = json.loads((out / "_commits" / "part-01.json").read_text())
    attempt = out / marker["attempt_dir"]
    attempt.mkdir(parents=True)
    for kind in ("results", "metrics"):
        (out / kind / "part-01.parquet").rename(attempt / f"{kind}.parquet")
    assert sorted(_committed_ids(out)) == sorted(i for s in ids for i in s)  # the reader sees it already
    rerun = run_job(cli.load_config(overrides), engine=tiny_engine)
    assert rerun.exit_code == 0 and [s.status for s in rerun.shards] == ["skipped", "skipped"]
    assert (out / "results" / "part-01.parquet").exists() and not attempt.exists()


# ---- 3. exclusive claims and commits on an object store ---------------------------------------


def test_case3_claims_and_markers_are_exclusive_on_s3(s3):
    fs, bucket, _ = s3
    store = RunStore(f"s3://{bucket}/run", {})
    assert store.commit_method.startswith("if-none-match")
    answers: list[str] = []
    books = [ClaimBook(store, lease_s=60) for _ in range(8)]
    barrier = threading.Barrier(len(books))

    def contend(book: ClaimBook) -> None:
        barrier.wait()
        answers.append(book.try_claim("s0"))

    threads = [threading.Thread(target=contend, args=(b,)) for b in books]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [CLAIMED] + [HELD] * 7  # exactly one contender got generation 0

    created = []
    barrier = threading.Barrier(8)

    def commit(i: int) -> None:
        barrier.wait()
        created.append(store.create_json(store.marker_path("s1"), {"by": i}))

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(created) == [False] * 7 + [True]


def test_case3_claim_staleness_on_s3_uses_the_stores_clock(s3):
    fs, bucket, _ = s3
    store = RunStore(f"s3://{bucket}/run", {})
    owner = ClaimBook(store, lease_s=2)
    owner.identity = {**owner.identity, "boot_id": "another-machine"}
    assert owner.try_claim("s0") == CLAIMED
    taker = ClaimBook(store, lease_s=2)
    real_time = time.time
    time.time = lambda: real_time() - 7200  # this host's clock is two hours slow
    try:
        with taker:
            assert taker.try_claim("s0") == HELD
            time.sleep(3.5)  # S3's LastModified has whole seconds
            assert taker.try_claim("s0") == CLAIMED
    finally:
        time.time = real_time


def test_the_claims_module_no_longer_claims_object_stores_race():
    import batchrun.job.commit.claims as claims

    assert "check, write, read back" not in claims.__doc__ and "If-None-Match" in claims.__doc__


# ---- 4. output inside the input directory; what counts as input -----------------------------


def test_case4_output_inside_the_input_is_never_read_back(
    tmp_path, make_shards, tiny_engine, tiny_llama_dir, job_overrides
):
    ids = [i for s in make_shards(tmp_path / "data", num_shards=2, rows_per_shard=2) for i in s]
    (tmp_path / "data" / "_SUCCESS").write_text("")
    (tmp_path / "data" / "README.txt").write_text("not a shard")
    (tmp_path / "data" / ".hidden.parquet").write_text("not a shard either")
    for data_uri in (tmp_path / "data", f"{tmp_path / 'data'}/*"):
        out = tmp_path / "data" / ("run-dir" if "*" not in str(data_uri) else "run-glob")
        for _ in range(2):
            result = run_job(cli.load_config(job_overrides(data_uri, out)), engine=tiny_engine)
            assert result.exit_code == 0, result.message
            assert [s.name for s in result.shards] == ["part-00", "part-01"]
        assert sorted(_committed_ids(out)) == sorted(ids)


def test_a_glob_that_matches_nothing_is_a_config_error(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "notes.txt").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"data.uri={tmp_path / 'in'}/*.parquet", f"output.uri={tmp_path / 'out'}"])
    assert exit_info.value.code == 2
    assert "config error: data.uri: no Parquet files" in capsys.readouterr().err


# ---- 5. a rerun after a change ----------------------------------------------------------------


def test_case5_a_rerun_with_other_settings_stops_naming_the_change(
    tmp_path, make_shards, tiny_engine, tiny_llama_dir, capsys, job_overrides
):
    make_shards(tmp_path / "in", num_shards=4, rows_per_shard=2)
    out = tmp_path / "out"
    first = job_overrides(tmp_path / "in", out)
    assert run_job(cli.load_config(first), engine=tiny_engine).exit_code == 0
    (out / "_commits" / "part-02.json").unlink()  # one shard lost
    changed = [*first, "engine.dtype=bfloat16"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(changed)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "output.on_change" in err and 'engine.dtype: "float32" -> "bfloat16"' in err
    assert not (out / "_commits" / "part-02.json").exists()  # nothing ran

    # Another worker of the same run whose own shards are all uncommitted must refuse too.
    with pytest.raises(Exception, match="engine.dtype"):
        run_worker(cli.load_config([*changed, "launcher.rank=2", "launcher.world_size=4"]), engine=tiny_engine)

    recompute = run_job(cli.load_config([*changed, "output.on_change=recompute"]), engine=tiny_engine)
    assert recompute.exit_code == 0 and [s.status for s in recompute.shards] == ["committed"] * 4
    for marker in (out / "_commits").iterdir():
        assert json.loads(marker.read_text())["fingerprint"]["settings"]["engine.dtype"] == "bfloat16"
    assert run_job(cli.load_config(changed), engine=tiny_engine).exit_code == 0  # consistent again


def test_case5_a_changed_input_file_is_noticed(tmp_path, make_shards, tiny_engine, tiny_llama_dir, job_overrides):
    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2)
    out = tmp_path / "out"
    overrides = job_overrides(tmp_path / "in", out)
    assert run_job(cli.load_config(overrides), engine=tiny_engine).exit_code == 0
    table = pq.read_table(tmp_path / "in" / "part-01.parquet")
    pq.write_table(table.slice(0, 1), tmp_path / "in" / "part-01.parquet")  # a row removed upstream
    with pytest.raises(Exception, match="part-01.*input.size"):
        run_job(cli.load_config(overrides), engine=tiny_engine)
    result = run_job(cli.load_config([*overrides, "output.on_change=recompute"]), engine=tiny_engine)
    assert [(s.name, s.status) for s in result.shards] == [("part-00", "skipped"), ("part-01", "committed")]
    assert len(pq.read_table(out / "results" / "part-01.parquet")) == 1


def test_case5_another_model_is_noticed_once_loaded(
    tmp_path, make_shards, short_texts, tiny_engine, tiny_llama_dir, job_overrides
):
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2)
    out = tmp_path / "out"
    overrides = job_overrides(tmp_path / "in", out)
    assert run_job(cli.load_config(overrides), engine=tiny_engine).exit_code == 0
    marker_path = out / "_commits" / "part-00.json"
    marker = json.loads(marker_path.read_text())
    # engine.think_tags: the tags the engine resolved (null for this model), which split outputs
    assert set(marker["fingerprint"]["model"]) == {
        "model.sha256",
        "tokenizer.sha256",
        "engine.resolved_dtype",
        "engine.think_tags",
    }
    marker["fingerprint"]["model"]["model.sha256"] = "0" * 64  # as if committed with another model file
    marker_path.write_text(json.dumps(marker))
    _write(tmp_path / "in" / "part-01.parquet", {"id": ["new"], "text": short_texts[:1]})  # work to do
    with pytest.raises(Exception, match="another model or tokenizer.*model.sha256"):
        run_job(cli.load_config(overrides), engine=tiny_engine)
    assert not (out / "_commits" / "part-01.json").exists()


# ---- 6. rows: bad text, typed and bad ids -----------------------------------------------------


def test_case6_bad_utf8_nan_and_typed_ids(tmp_path, short_texts, tiny_engine, tiny_llama_dir, job_overrides):
    src, out = tmp_path / "in", tmp_path / "out"
    good, bad = short_texts[0].encode(), b"broken \xff\xfe text"
    text = pa.Array.from_buffers(pa.string(), 3, pa.array([good, bad, good], pa.binary()).buffers())
    _write(src / "a-text.parquet", {"id": pa.array([1, 2, 3], pa.int64()), "text": text})
    _write(
        src / "b-floats.parquet",
        {"id": pa.array([1.5, float("nan"), None, 4.0], pa.float64()), "text": short_texts[1:5]},
    )
    result = run_job(cli.load_config(job_overrides(src, out)), engine=tiny_engine)
    assert result.exit_code == 0, result.message
    a = pq.read_table(out / "results" / "a-text.parquet")
    assert a.schema.field("id").type == pa.int64()
    rows = a.to_pylist()
    assert [(r["id"], r["error_type"]) for r in rows] == [(1, None), (2, "invalid_text"), (3, None)]
    assert "id 2" in rows[1]["error_message"] and "'text'" in rows[1]["error_message"]
    b = pq.read_table(out / "results" / "b-floats.parquet")
    assert b.schema.field("id").type == pa.float64()
    got = [(r["id"], r["error_type"]) for r in b.to_pylist()]
    assert got[0] == (1.5, None) and got[3] == (4.0, None)
    assert got[1][1] == got[2][1] == "null_id" and got[1][0] is None and got[2][0] is None
    import pandas as pd

    merged = pd.read_parquet(src / "a-text.parquet").merge(a.to_pandas(), on="id")  # int64 on both sides
    assert len(merged) == 3


def test_case6_a_misspelled_id_column_is_a_config_error(tmp_path, make_shards, capsys):
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"data.uri={tmp_path / 'in'}", f"output.uri={tmp_path / 'out'}", "data.id_column=ident"])
    assert exit_info.value.code == 2
    assert "config error: data.id_column: no column 'ident'" in capsys.readouterr().err


def test_ids_repeated_across_shards_are_counted(tmp_path, short_texts, tiny_engine, tiny_llama_dir, job_overrides):
    src, out = tmp_path / "in", tmp_path / "out"
    _write(src / "a.parquet", {"id": ["x", "y"], "text": short_texts[:2]})
    _write(src / "b.parquet", {"id": ["y", "z"], "text": short_texts[2:4]})
    assert run_job(cli.load_config(job_overrides(src, out)), engine=tiny_engine).exit_code == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["num_duplicate_ids"] == 1
    # Counted on whichever of the two shards committed second (shards commit in any order).
    assert sorted(s.get("num_duplicate_ids") or 0 for s in manifest["shards"]) == [0, 1]


# ---- 7. work stealing off: one shared plan ----------------------------------------------------


def test_case7_without_stealing_workers_split_one_plan(
    tmp_path, short_texts, tiny_engine, tiny_llama_dir, caplog, job_overrides
):
    src, out = tmp_path / "in", tmp_path / "out"
    for name in ("a", "b", "c", "d"):
        _write(src / f"{name}.parquet", {"id": [f"{name}0"], "text": short_texts[:1]})
    common = [*job_overrides(src, out), "launcher.work_stealing=false", "launcher.world_size=2"]
    first = run_job(cli.load_config([*common, "launcher.rank=0"]), engine=tiny_engine)
    assert [s.name for s in first.shards] == ["a", "c"]
    # A file that sorts in between appears before worker 1 lists: it would have taken aa and c,
    # leaving b to nobody. It follows the plan instead, and says what it leaves out.
    _write(src / "aa.parquet", {"id": ["aa0"], "text": short_texts[:1]})
    second = run_job(cli.load_config([*common, "launcher.rank=1"]), engine=tiny_engine)
    assert [s.name for s in second.shards] == ["b", "d"] and second.exit_code == 0
    assert "appeared after this run's plan was made" in caplog.text
    assert sorted(_committed_ids(out)) == ["a0", "b0", "c0", "d0"]
    assert json.loads((out / "_manifest.json").read_text())["status"] == "completed"


# ---- 8. an unexpected error on one shard ----------------------------------------------------------


def test_case8_an_unexpected_error_fails_one_shard_not_the_worker(
    tmp_path, make_shards, tiny_engine, tiny_llama_dir, monkeypatch, job_overrides
):
    ids = make_shards(tmp_path / "in", num_shards=3, rows_per_shard=2)
    out = tmp_path / "out"
    real_begin = RunStore.begin

    def failing_begin(self, shard):
        if shard == "part-01":
            raise PermissionError(13, "Access Denied")  # a bug, a quota, a policy: not transient
        return real_begin(self, shard)

    monkeypatch.setattr(RunStore, "begin", failing_begin)
    result = run_job(cli.load_config(job_overrides(tmp_path / "in", out)), engine=tiny_engine)
    assert result.exit_code == 1
    assert [(s.name, s.status) for s in result.shards] == [
        ("part-00", "committed"),
        ("part-01", "failed"),
        ("part-02", "committed"),
    ]
    assert "Access Denied" in result.shards[1].error
    monkeypatch.setattr(RunStore, "begin", real_begin)
    assert run_job(cli.load_config(job_overrides(tmp_path / "in", out)), engine=tiny_engine).exit_code == 0
    assert sorted(_committed_ids(out)) == sorted(i for s in ids for i in s)


def test_transient_storage_errors_are_retried(monkeypatch):
    from batchrun.job.commit.directory import with_retries

    monkeypatch.setattr("batchrun.job.commit.directory.time.sleep", lambda s: None)
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) < 3:
            raise TimeoutError("slow store")
        return "ok"

    assert with_retries(flaky, "reading") == "ok" and len(attempts) == 3
    with pytest.raises(FileNotFoundError):
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), "reading")


# ---- 9. a shard that kills its worker; signals ------------------------------------------------


def test_case9_a_shard_that_kills_its_worker_is_quarantined(
    tmp_path, make_shards, tiny_llama_dir, job_overrides, spawn
):
    make_shards(tmp_path / "in", num_shards=3, rows_per_shard=2)
    out, hooks_dir = tmp_path / "out", tmp_path / "hooks"
    hooks_dir.mkdir()
    args = job_overrides(tmp_path / "in", out, "launcher.max_shard_attempts=2")
    poison = {"dir": str(hooks_dir), "die_on": ["part-01"]}
    codes = []
    for _ in range(3):
        proc = spawn(args, poison)
        proc.communicate(timeout=TIMEOUT_S)
        codes.append(proc.returncode)
    assert codes[:2] == [-signal.SIGKILL, -signal.SIGKILL]  # it died on part-01 twice...
    assert codes[2] == 1  # ...and the third run quarantined it instead of dying a third time
    assert len(list(hooks_dir.glob("started-*-part-01-*"))) == 2
    manifest = json.loads((out / "_manifest.json").read_text())
    statuses = {s["name"]: s["status"] for s in manifest["shards"]}
    assert statuses == {"part-00": "skipped", "part-01": "quarantined", "part-02": "committed"}
    assert "launcher.max_shard_attempts" in next(s["error"] for s in manifest["shards"] if s["name"] == "part-01")


def test_case9_repeated_sigterm_still_writes_the_manifest_and_releases_claims(
    tmp_path, make_shards, tiny_llama_dir, job_overrides, spawn
):
    make_shards(tmp_path / "in", num_shards=3, rows_per_shard=4)
    out, hooks_dir = tmp_path / "out", tmp_path / "hooks"
    hooks_dir.mkdir()
    proc = spawn(job_overrides(tmp_path / "in", out), {"dir": str(hooks_dir), "delay_s": 0.5})
    _wait_for(lambda: any(hooks_dir.glob("started-*")), "the first shard", [proc])
    for _ in range(3):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 143, stderr
    assert "already stopping" in stderr
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["finished_at"]
    claim = json.loads(next((out / "_claims" / "part-00").iterdir()).read_text())
    assert claim["state"] == "released"


def test_case9_slurm_requeues_are_capped(tmp_path):
    """jobs/array.sbatch with stand-ins for python and scontrol: a stop requeues the task until
    SLURM_RESTART_COUNT reaches BATCHRUN_MAX_REQUEUES."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    fake_python = bin_dir / "python"
    fake_python.write_text("#!/bin/bash\ntrap 'exit 143' TERM\ntouch \"$READY\"\nwhile true; do sleep 0.05; done\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = REPO / "jobs" / "array.sbatch"
    results = {}
    for restarts in (0, 3):
        ready = tmp_path / f"ready{restarts}"
        env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "BATCHRUN_PYTHON": str(fake_python),
            "SLURM_JOB_ID": "7",
            "SLURM_ARRAY_JOB_ID": "7",
            "SLURM_ARRAY_TASK_ID": "1",
            "SLURM_RESTART_COUNT": str(restarts),
            "BATCHRUN_MAX_REQUEUES": "3",
            "READY": str(ready),
        }
        proc = subprocess.Popen(
            ["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        _wait_for(ready.exists, "the stand-in batchrun")
        proc.send_signal(signal.SIGUSR1)
        output, _ = proc.communicate(timeout=60)
        results[restarts] = (proc.returncode, output)
    assert results[0][0] == 0 and "requeueing 7_1" in results[0][1]
    assert results[3][0] == 143 and "not requeueing" in results[3][1]
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["requeue 7_1"]


# ---- 10. security -------------------------------------------------------------------------------


def test_case10_secrets_never_reach_the_manifest(tmp_path, make_shards, tiny_engine, tiny_llama_dir, job_overrides):
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=1)
    out = tmp_path / "out"
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY"
    overrides = [
        *job_overrides(tmp_path / "in", out),
        f"+data.storage_options.secret={secret}",
        "+data.storage_options.key=AKIAEXAMPLE",
        f"+output.storage_options.client_kwargs.aws_session_token={secret}",
        "+data.storage_options.anon=false",
    ]
    config = cli.load_config(overrides)  # the local filesystem accepts and ignores these options
    from batchrun.job.commit.manifest import redact

    redacted = redact(config.to_dict())
    assert redacted["data"]["storage_options"] == {"secret": REDACTED, "key": REDACTED, "anon": False}
    assert redacted["output"]["storage_options"]["client_kwargs"]["aws_session_token"] == REDACTED
    assert redacted["sampling"]["max_tokens"] == 8  # only storage options are touched
    assert run_job(config, engine=tiny_engine).exit_code == 0
    for manifest in out.glob("_manifest*.json"):
        assert secret not in manifest.read_text()


def test_case10_jinja2_is_required_at_a_version_without_known_sandbox_escapes():
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "jinja2>=3.1.6" in pyproject["project"]["dependencies"]


def test_nan_is_never_an_id():
    from batchrun.job.formats.reader import _id

    assert _id(float("nan")) is None and _id(None) is None and _id(1.0) == 1.0 and not math.isnan(_id(2.5))


def test_case10_caches_are_private_and_others_caches_are_refused(tmp_path):
    from batchrun.utils.private_dir import UnsafeCacheError, check_private, private_dir

    made = private_dir(tmp_path / "a" / "b" / "kernels", "kernel cache", "BATCHRUN_KERNEL_CACHE")
    for d in (tmp_path / "a", tmp_path / "a" / "b", made):
        assert d.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeCacheError, match=r"shared is writable by group or others .*chmod go-w.*BATCHRUN_CACHE"):
        private_dir(shared, "model cache", "BATCHRUN_CACHE")
    planted = made / "batchrun_cpu_0000.so"
    planted.write_bytes(b"\x7fELF")
    planted.chmod(0o666)
    with pytest.raises(UnsafeCacheError, match="batchrun_cpu_0000.so is writable"):
        check_private(planted, "kernel library", "BATCHRUN_KERNEL_CACHE")
    if os.geteuid() == 0:  # as root, a file of another user can be made here
        planted.chmod(0o600)
        os.chown(planted, 12345, 12345)
        with pytest.raises(UnsafeCacheError, match="owned by uid 12345"):
            check_private(planted, "kernel library", "BATCHRUN_KERNEL_CACHE")


def test_case10_the_nightly_lock_is_not_in_a_shared_directory(tmp_path):
    script = REPO / "jobs" / "nightly" / "nightly.sh"
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexit 0\n")
    fake_python.chmod(0o755)
    env = {**os.environ, "BATCHRUN_PYTHON": str(fake_python), "HOME": str(tmp_path / "home")}
    env.pop("XDG_RUNTIME_DIR", None)
    env.pop("BATCHRUN_NIGHTLY_LOCK_DIR", None)
    done = subprocess.run(
        ["bash", str(script), str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lock_dir = tmp_path / "home" / ".cache" / "batchrun"
    assert lock_dir.stat().st_mode & 0o777 == 0o700 and list(lock_dir.glob("nightly-*.lock"))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    done = subprocess.run(
        ["bash", str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "BATCHRUN_NIGHTLY_LOCK_DIR": str(shared)},
    )
    assert done.returncode == 2 and "not writable by others" in done.stderr


def test_case10_the_engine_refuses_caches_others_can_write(tmp_path, tiny_llama_dir):
    from batchrun.model.loader import load_model
    from batchrun.utils.private_dir import UnsafeCacheError

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeCacheError, match="model cache .*shared is writable"):
        load_model(tiny_llama_dir, cache_dir=str(shared))
    load_model(tiny_llama_dir, cache_dir=str(tmp_path / "mine"))
    assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o700
    # The kernel library is loaded as code: a world-writable kernel cache is refused, in a fresh
    # process (this one may have loaded its kernels already).
    probe = "from batchrun.kernels import cpu_native; cpu_native.library()"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "BATCHRUN_KERNEL_CACHE": str(shared)},
    )
    assert done.returncode != 0 and "UnsafeCacheError: kernel cache" in done.stderr and "chmod go-w" in done.stderr
