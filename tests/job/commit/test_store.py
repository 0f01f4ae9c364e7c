"""The commit's unclear outcomes and the exclusivity it rests on, against real stores.

Local disks: the link and unlink calls are made to fail as NFS and a flaky disk make them fail.
S3: moto's real server behind tests/support/s3_fault_proxy.py, which loses replies and answers 412, 409 or
500 on chosen requests; worker runs are real `python -m batchrun` processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun.job.commit import directory as store_module
from batchrun.job.commit.store import CommitUnclear, RunStore, committed_files
from batchrun.job.errors import ConfigError
from tests.support.s3_fault_proxy import FaultProxy, Rule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::ResourceWarning")

TIMEOUT_S = 300  # a hang guard for subprocesses, never a timing assertion
# One HTTP try per s3fs call: the store's own retries (shortened below) are what is under test.
ONE_TRY = {"config_kwargs": {"retries": {"max_attempts": 1}}}


@pytest.fixture(autouse=True)
def _short_backoff(monkeypatch):
    monkeypatch.setattr(store_module, "RETRY_BASE_DELAY_S", 0.01)


@pytest.fixture
def proxy(s3):
    with FaultProxy(s3[2]) as p:
        yield p


def _attempt_with_files(store: RunStore, shard: str = "s0"):
    attempt = store.begin(shard)
    for path, content in ((attempt.results_tmp, b"results"), (attempt.metrics_tmp, b"metrics")):
        store.fs.pipe_file(path, content)
    return attempt


# ---- local disks -------------------------------------------------------------------------------


def test_a_retransmitted_link_answered_eexist_is_still_our_commit(tmp_path, monkeypatch):
    """NFSv3: the first LINK lands, its reply is lost, the retransmit answers EEXIST."""
    store = RunStore(str(tmp_path / "out"), {})
    attempt = _attempt_with_files(store)
    real_link = os.link

    def retransmitted_link(src, dst, *args, **kwargs):
        real_link(src, dst, *args, **kwargs)
        raise FileExistsError(17, "File exists", dst)

    monkeypatch.setattr(os, "link", retransmitted_link)
    assert store.commit(attempt, {"by": "us"})
    monkeypatch.undo()
    assert store.read_marker("s0")["attempt"] == attempt.attempt_id
    assert (tmp_path / "out" / "results" / "s0.parquet").read_bytes() == b"results"
    assert all(Path(p).exists() for p in committed_files(store).values())
    assert not list((tmp_path / "out" / "_commits").glob("*.tmp-*"))


def test_an_unlink_failure_after_the_link_does_not_undo_the_commit(tmp_path, monkeypatch):
    store = RunStore(str(tmp_path / "out"), {})
    attempt = _attempt_with_files(store)
    real_unlink = os.unlink

    def failing_unlink(path, *args, **kwargs):
        if ".tmp-" in str(path):
            raise OSError(5, "Input/output error", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", failing_unlink)
    assert store.commit(attempt, {"by": "us"})
    monkeypatch.undo()
    assert store.read_marker("s0")["attempt"] == attempt.attempt_id
    assert (tmp_path / "out" / "results" / "s0.parquet").read_bytes() == b"results"
    assert (tmp_path / "out" / "metrics" / "s0.parquet").read_bytes() == b"metrics"


def test_the_files_a_marker_names_are_fsynced_before_its_link(tmp_path, monkeypatch):
    out = tmp_path / "out"
    store = RunStore(str(out), {})
    attempt = _attempt_with_files(store)
    events: list[tuple[str, str]] = []
    real_fsync, real_link = os.fsync, os.link

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def link(src, dst, *args, **kwargs):
        if str(dst).endswith("_commits/s0.json"):
            events.append(("link", str(dst)))
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    assert store.commit(attempt, {})
    monkeypatch.undo()
    at_link = events.index(("link", str(out / "_commits" / "s0.json")))
    before = {path for _, path in events[:at_link]}
    after = {path for _, path in events[at_link:]}
    attempt_dir = Path(attempt.directory)
    assert {attempt.results_tmp, attempt.metrics_tmp} <= before
    assert {str(attempt_dir), str(attempt_dir.parent), str(attempt_dir.parent.parent), str(out)} <= before
    assert str(out / "_commits") in after


def test_committed_files_prefers_a_publication_that_lands_while_it_looks(tmp_path, monkeypatch):
    """The committer publishes right after the reader found the attempt's file: the reader must
    name the published file, not the pending one that just vanished."""
    store = RunStore(str(tmp_path / "out"), {})
    attempt = _attempt_with_files(store)
    marker = {
        "protocol": 2,
        "attempt": attempt.attempt_id,
        "attempt_dir": str(Path(attempt.directory).relative_to(store.root)),
    }
    assert store.create_json(store.marker_path("s0"), {**marker, "files": ["results.parquet", "metrics.parquet"]})
    real_exists = store.fs.exists
    published: list[bool] = []

    def exists_then_publish(path, **kwargs):
        found = real_exists(path, **kwargs)
        if path == attempt.results_tmp and found and not published:
            published.append(True)
            store.publish("s0", store.read_marker("s0"))  # the committer, a moment later
        return found

    monkeypatch.setattr(store.fs, "exists", exists_then_publish)
    paths = committed_files(store)
    monkeypatch.undo()
    assert paths == {"s0": store.results_path("s0")} and Path(paths["s0"]).read_bytes() == b"results"


# ---- S3 behind the fault proxy, in this process --------------------------------------------------


def test_a_lost_reply_then_412_is_our_commit(s3, proxy):
    _, bucket, _ = s3
    store = RunStore(f"s3://{bucket}/run", {**ONE_TRY, "endpoint_url": proxy.url})
    attempt = _attempt_with_files(store)
    marker = "_commits/s0.json"
    proxy.add(Rule("PUT", marker, "drop_reply", if_none_match=True, nth=(1,)), Rule("PUT", marker, 412, True))
    assert store.commit(attempt, {})
    assert proxy.actions(marker, "PUT")[:2] == ["drop_reply", "412"]
    assert store.read_marker("s0")["attempt"] == attempt.attempt_id
    assert store.fs.cat_file(f"{bucket}/run/results/s0.parquet") == b"results"


def test_an_error_whose_text_holds_412_is_not_a_precondition_failure(s3, proxy):
    """A 500 that mentions 412 (a request id, a key) used to count as "exists": the shard was then
    reported done by another worker, with no marker at all and its files deleted."""
    _, bucket, _ = s3
    store = RunStore(f"s3://{bucket}/run", {**ONE_TRY, "endpoint_url": proxy.url})
    attempt = _attempt_with_files(store)
    proxy.add(Rule("PUT", "_commits/s0.json", 500, if_none_match=True, message="request 4127 PreconditionFailed"))
    with pytest.raises(CommitUnclear):
        store.commit(attempt, {})
    assert len(proxy.actions("_commits/s0.json", "PUT")) >= 4  # retried: a 500 is transient
    store.abandon(attempt)  # as the worker's clean-up does: the unclear attempt is kept
    assert store.fs.exists(attempt.results_tmp) and store.fs.exists(attempt.metrics_tmp)
    assert store.read_marker("s0") is None


def test_a_409_is_retried_and_then_read_back(s3, proxy):
    """409 ConditionalRequestConflict: a concurrent conditional write is in flight. Retried; still
    conflicting, the outcome is read back instead of being taken for "exists"."""
    fs, bucket, _ = s3
    store = RunStore(f"s3://{bucket}/run", {**ONE_TRY, "endpoint_url": proxy.url})

    first = _attempt_with_files(store, "s0")  # one conflict, then the retry lands
    proxy.add(Rule("PUT", "_commits/s0.json", 409, if_none_match=True, nth=(1,)))
    assert store.commit(first, {})
    assert proxy.actions("_commits/s0.json", "PUT") == ["409", "forward"]
    assert store.read_marker("s0")["attempt"] == first.attempt_id

    racer = _attempt_with_files(store, "s1")  # the racing write was another attempt's, and it won
    fs.pipe_file(f"{bucket}/run/_commits/s1.json", json.dumps({"attempt": "the-other"}).encode())
    proxy.add(Rule("PUT", "_commits/s1.json", 409, if_none_match=True, nth=(1,)))
    assert not store.commit(racer, {})
    assert not store.fs.exists(racer.results_tmp)

    stuck = _attempt_with_files(store, "s2")  # conflicts to the end: undecided, nothing deleted
    proxy.add(Rule("PUT", "_commits/s2.json", 409, if_none_match=True))
    with pytest.raises(CommitUnclear):
        store.commit(stuck, {})
    store.abandon(stuck)
    assert store.fs.exists(stuck.results_tmp) and store.read_marker("s2") is None


def test_the_probe_refuses_a_store_that_ignores_if_none_match(s3, proxy):
    fs, bucket, _ = s3
    honest = RunStore(f"s3://{bucket}/run", {"endpoint_url": proxy.url})
    assert honest.verify_exclusive(False) == "if-none-match (exclusive)"
    proxy.add(Rule("PUT", "/run/_probe/", "strip_inm"))
    ignoring = RunStore(f"s3://{bucket}/run", {"endpoint_url": proxy.url})
    with pytest.raises(ConfigError) as refused:
        ignoring.verify_exclusive(False)
    assert refused.value.key == "output.allow_non_exclusive" and "\n" not in str(refused.value)
    method = ignoring.verify_exclusive(True)
    assert "NOT exclusive" in method and "If-None-Match" in method
    path = ignoring.marker_path("s0")  # allowed: creates at least look first
    assert ignoring.create_json(path, {"n": 1}) and not ignoring.create_json(path, {"n": 2})
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/run/_probe") or fs.ls(f"{bucket}/run/_probe") == []


# ---- real worker processes ------------------------------------------------------------------------


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchrun", *args], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _committed_ids(fs, bucket: str) -> list:
    store = RunStore(f"s3://{bucket}/run", {})
    ids = []
    for path in committed_files(store).values():
        with fs.open(path, "rb") as f:
            ids.extend(pq.read_table(f).column("id").to_pylist())
    return ids


def test_a_worker_whose_marker_put_lost_its_reply_commits_the_shard(
    s3, proxy, tmp_path, make_shards, job_overrides, hooked_env
):
    """The marker's conditional PUT lands but its reply is lost, and every retry then fails: the
    shard must end committed with its files, not with a marker naming deleted files."""
    fs, bucket, _ = s3
    ids = make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2)
    marker = f"{bucket}/run/_commits/part-00.json"
    proxy.add(Rule("PUT", marker, "drop_reply", if_none_match=True, nth=(1,)), Rule("PUT", marker, 500, True))
    env = hooked_env({"retry_base_delay_s": 0.01})
    env.update(AWS_ENDPOINT_URL=proxy.url, AWS_MAX_ATTEMPTS="1")  # one HTTP try per call, as ONE_TRY
    args = job_overrides(tmp_path / "in", f"s3://{bucket}/run")
    first = _run(args, env)
    assert first.returncode == 0, first.stderr
    assert proxy.actions(marker, "PUT")[:2] == ["drop_reply", "500"]
    fs.invalidate_cache()
    assert sorted(_committed_ids(fs, bucket)) == sorted(i for s in ids for i in s)
    assert fs.exists(f"{bucket}/run/results/part-00.parquet")

    rerun = _run(args, env)
    assert rerun.returncode == 0, rerun.stderr
    manifest = json.loads(fs.cat_file(f"{bucket}/run/_manifest.json"))
    assert [s["status"] for s in manifest["shards"]] == ["skipped", "skipped"]
    fs.invalidate_cache()
    assert sorted(_committed_ids(fs, bucket)) == sorted(i for s in ids for i in s)


def test_an_s3fs_without_exclusive_create_is_refused_unless_allowed(
    s3, tmp_path, make_shards, job_overrides, hooked_env
):
    fs, bucket, _ = s3
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2)
    env = hooked_env({"s3fs_without_create_mode": True})
    refused = _run(job_overrides(tmp_path / "in", f"s3://{bucket}/run"), env)
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if "output.allow_non_exclusive" in line]
    assert len(lines) == 1 and "s3fs" in lines[0], refused.stderr
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/run/_commits")

    allowed = _run(job_overrides(tmp_path / "in", f"s3://{bucket}/run", "output.allow_non_exclusive=true"), env)
    assert allowed.returncode == 0, allowed.stderr
    manifest = json.loads(fs.cat_file(f"{bucket}/run/_manifest.json"))
    assert "NOT exclusive" in manifest["commit_method"]
    assert [s["status"] for s in manifest["shards"]] == ["committed"]
