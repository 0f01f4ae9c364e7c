"""Kubernetes Indexed Jobs: the bundled manifest, and JOB_COMPLETION_INDEX as the rank of real
worker processes that together complete one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import yaml

from tests.support import REPO

MANIFEST = REPO / "jobs" / "k8s" / "indexed-job.yaml"


def test_the_indexed_job_manifest_has_the_fields_a_run_relies_on():
    job = yaml.safe_load(MANIFEST.read_text())
    assert job["kind"] == "Job" and job["apiVersion"] == "batch/v1"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert isinstance(spec["backoffLimitPerIndex"], int) and spec["backoffLimitPerIndex"] >= 1
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # required with backoffLimitPerIndex
    (container,) = pod["containers"]
    # One pod per worker, with one GPU per rank of its group (engine.tensor_parallel_size), and a
    # memory-backed /dev/shm for NCCL between the group's processes.
    tp = [int(a.split("=", 1)[1]) for a in container["args"] if a.startswith("engine.tensor_parallel_size=")]
    assert tp == [1] and container["resources"]["limits"]["nvidia.com/gpu"] == tp[0]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e for e in container.get("env", [])}
    assert int(env["BATCHRUN_WORLD_SIZE"]["value"]) == spec["completions"]
    # Credentials come from a Secret, never from the arguments (they would land in the manifest).
    assert any("secretRef" in source for source in container["envFrom"])
    text = " ".join(container["args"]).lower()
    assert "secret" not in text and "key" not in text and "storage_options" not in text
    assert container["command"][-1] == "batchrun" and "output.uri=s3://" in text


def test_two_indexed_pods_complete_one_run(tmp_path, make_shards, job_overrides):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=2) for i in s]
    cmd = [sys.executable, "-m", "batchrun", *job_overrides(tmp_path / "in", tmp_path / "out")]
    pods = [
        subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env={**os.environ, "JOB_COMPLETION_INDEX": str(index), "BATCHRUN_WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in (0, 1)
    ]
    outcomes = [pod.communicate(timeout=600) for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], [err[-2000:] for _, err in outcomes]
    out = tmp_path / "out"
    got = [r["id"] for p in sorted((out / "results").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert sorted(got) == sorted(ids) and len(got) == len(set(got))
    for rank in (0, 1):
        worker = json.loads((out / f"_manifest.rank{rank}.json").read_text())["worker"]
        assert (worker["rank"], worker["world_size"]) == (rank, 2)
        assert worker["source"] == "Kubernetes JOB_COMPLETION_INDEX + BATCHRUN_WORLD_SIZE"
    merged = json.loads((out / "_manifest.json").read_text())
    assert merged["status"] == "completed" and [s["status"] for s in merged["shards"]] == ["committed"] * 4


def test_an_index_without_a_world_size_is_refused_in_one_line(tmp_path, make_shards, job_overrides):
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=1)
    cmd = [sys.executable, "-m", "batchrun", *job_overrides(tmp_path / "in", tmp_path / "out")]
    env = {k: v for k, v in os.environ.items() if k != "BATCHRUN_WORLD_SIZE"}
    done = subprocess.run(cmd, cwd=tmp_path, env={**env, "JOB_COMPLETION_INDEX": "1"}, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "batchrun: config error: launcher.world_size: JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job) but "
        "the world size is not: set launcher.world_size or BATCHRUN_WORLD_SIZE to the Job's completions"
    ]
