"""The project's sbatch array script (jobs/array.sbatch) on a real one-node Slurm cluster.

The test starts Debian's slurmctld and slurmd itself from a generated slurm.conf (auth/none, no
cgroups, no accounting), as root, on free ports, and stops them afterwards. It skips only when the
Slurm daemons are not installed (`apt-get install slurm-wlm`; .ci/run installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support import REPO

ARRAY_SCRIPT = REPO / "jobs" / "array.sbatch"

pytestmark = pytest.mark.skipif(
    not all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")),
    reason="Slurm is not installed (apt-get install slurm-wlm)",
)

# Every Python process of the test loads this (PYTHONPATH). On their first attempt only, array task 1
# pauses after its first output until the test has sent the preemption signal, and task 0 pauses
# after its first output until task 1 has reached that point.
SITECUSTOMIZE = r"""
import os, pathlib, time
hook = pathlib.Path(os.environ.get("TEST_HOOK_DIR", "."))
task, first_attempt = os.environ.get("SLURM_ARRAY_TASK_ID"), os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
if task in ("0", "1") and first_attempt:
    from batchrun.engine import Engine
    real_stream = Engine.stream
    def stream(self, *args, **kwargs):
        for n, out in enumerate(real_stream(self, *args, **kwargs)):
            yield out
            if n == 0 and task == "1" and not (hook / "go").exists():
                (hook / "ready").touch()
                while not (hook / "go").exists():
                    time.sleep(0.02)
            elif n == 0 and task == "0":
                # Workers steal unstarted shards: task 0 must not finish all four before task 1 has
                # started (its Python start-up can lag by seconds on a loaded machine).
                deadline = time.monotonic() + 300
                while not (hook / "ready").exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
    Engine.stream = stream
"""

CONF = """\
ClusterName=batchrun-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, what: str, timeout_s: float = 300, logs: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s  # a hang guard, not a timing assertion
    while not predicate():
        if time.monotonic() >= deadline:
            detail = (
                "".join(f"\n--- {p.name} ---\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.out")))
                if logs
                else ""
            )
            raise AssertionError(f"timed out waiting for {what}{detail}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF of a running one-node cluster (this host, all its CPUs)."""
    root = tmp_path_factory.mktemp("slurm")
    for d in ("state", "spool"):
        (root / d).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        CONF.format(
            host=socket.gethostname().split(".")[0],
            ctld_port=_free_port(),
            d_port=_free_port(),
            root=root,
            cpus=os.cpu_count() or 1,
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [
        subprocess.Popen(
            [daemon, "-D", "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(root / f"{daemon}.stderr", "w"),
        )
        for daemon in ("slurmctld", "slurmd")
    ]

    def idle() -> bool:
        for d in daemons:
            assert d.poll() is None, f"{d.args[0]} exited: {(root / f'{d.args[0]}.stderr').read_text()[-2000:]}"
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        return state.returncode == 0 and state.stdout.strip() == "idle"

    try:
        _wait(idle, "the Slurm node to come up idle", 60)
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
        for d in daemons:
            d.send_signal(signal.SIGTERM)
        for d in daemons:
            try:
                d.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()


def _squeue(env, *args: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", *args], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_array_job_commits_every_shard_once_and_a_preempted_task_resumes(slurm, tmp_path, make_shards, tiny_llama_dir):
    ids = [i for s in make_shards(tmp_path / "in", num_shards=4, rows_per_shard=2) for i in s]
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / "out"
    env = {
        **slurm,
        "TEST_HOOK_DIR": str(hook),
        "BATCHRUN_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(hook), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    overrides = [
        f"model.path={tiny_llama_dir}",
        f"data.uri={tmp_path / 'in'}",
        f"output.uri={out}",
        "engine.kv_cache_memory=67108864",
        "engine.max_num_seqs=2",
        "engine.max_num_batched_tokens=1024",
        "engine.dtype=float32",
        "engine.num_threads=1",
        "sampling.max_tokens=8",
    ]
    submit = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--array=0-1",
            f"--chdir={tmp_path}",
            f"--output={tmp_path}/task-%a.out",
            str(ARRAY_SCRIPT),
            *overrides,
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = submit.stdout.strip().split(";")[0]

    # Preempt task 1 in the middle of its first shard, the way Slurm does before a time limit.
    _wait(lambda: (hook / "ready").exists(), "array task 1 to reach its first shard", logs=tmp_path)
    subprocess.run(["scancel", "--batch", "--signal=USR1", f"{job_id}_1"], env=env, check=True)
    (hook / "go").touch()
    log1 = tmp_path / "task-1.out"
    _wait(lambda: log1.exists() and "requeueing" in log1.read_text(), "task 1 to requeue itself", logs=tmp_path)
    requeued_at = time.monotonic()

    def resumed() -> bool:
        # Slurm holds a requeued job back for a while (reason BeginTime); an admin may start it now.
        # Not in the same second as the requeue: slurmd revokes the old job credential with
        # one-second resolution and kills a relaunch whose credential is not newer
        # ("Job credential revoked", seen when released at once).
        if time.monotonic() - requeued_at > 3 and _squeue(slurm, "-j", f"{job_id}_1", "-o", "%T:%r") == [
            "PENDING:BeginTime"
        ]:
            subprocess.run(["scontrol", "update", f"JobId={job_id}_1", "StartTime=now"], env=env, check=True)
        text = log1.read_text()
        return "restart 1" in text and "batchrun array task: exit" in text.split("restart 1")[-1]

    _wait(resumed, "the requeued task 1 to run and finish", logs=tmp_path)
    _wait(lambda: not _squeue(slurm, "-j", job_id), "the array job to leave the queue")

    text1 = log1.read_text()
    assert "got SIGUSR1" in text1 and "stopped by SIGUSR1 (exit 143); requeueing" in text1, text1
    assert "restart 1" in text1 and text1.rstrip().endswith("exit 0"), text1
    assert (tmp_path / "task-0.out").read_text().rstrip().endswith("exit 0")

    results = sorted((out / "results").glob("*.parquet"))
    all_ids = [i for p in results for i in pq.read_table(p).column("id").to_pylist()]
    assert sorted(all_ids) == sorted(ids) and len(all_ids) == len(ids)  # every id exactly once
    assert sorted(p.name for p in (out / "_commits").iterdir()) == [f"part-0{i}.json" for i in range(4)]
    merged = json.loads((out / "_manifest.json").read_text())
    assert merged["status"] == "completed" and merged["worker"]["world_size"] == 2
    assert [s["status"] for s in merged["shards"]] == ["committed"] * 4
    for rank in (0, 1):
        worker = json.loads((out / f"_manifest.rank{rank}.json").read_text())["worker"]
        assert worker["source"].startswith("SLURM_ARRAY_TASK_ID/COUNT") and worker["world_size"] == 2
    assert not (out / "_tmp").exists()
