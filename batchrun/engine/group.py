"""A tensor-parallel worker: one group of engine.tensor_parallel_size processes, led by rank 0.

Rank 0 is the process that built the Engine: scheduler, KV block manager, sampler, grammars and the
job stay there, and so does every decision (which requests run, chunking, eager steps). It starts
the N-1 followers itself (`python -m batchrun.engine.follower`, one per rank); the job never sees
them. Two channels join the group:

- control: one `multiprocessing.connection` per follower (127.0.0.1, an authkey made per group).
  Rank 0 sends what to run next: start-up facts, the tuning and the KV plan, then per step the
  forward's flattened batch (`ship_forward`) and each logits computation (`ship_logits`). A
  follower blocks on it between steps for as long as rank 0 wants (reading a shard, waiting for a
  claim), and an end of file there means rank 0 is gone.
- data: a torch.distributed process group built from a TCPStore on rank 0 (gloo on the CPU, NCCL
  on GPUs): the all-reduces inside the model, the broadcast of the hidden rows whose logits rank 0
  wants, and the gather of the vocabulary slices. Its timeout bounds how long one rank waits for
  another inside a step.

So no rank takes a branch alone: a follower runs exactly the forwards and logits rank 0 ships, in
its order. Failure ends the group, never a half of it:
- a follower that dies: rank 0's next (or current) collective fails at once (the peer's socket
  closes), and a monitor thread that watches the followers' processes marks the group failed, so
  the next step raises TensorParallelError, which the job treats as fatal (nothing more committed;
  its claims are released or its pid is provably gone). If rank 0 is still running `grace_s` after
  a death without having closed the group, the monitor ends the process (exit code 70);
- rank 0 that dies: each follower's control channel reaches its end, or its collective fails, or
  its parent-pid watch fires (within a second): the follower exits;
- a rank that hangs with nobody dead: the collective timeout raises on the others;
- SIGINT/SIGTERM: followers ignore both, so a signal sent to the whole process group (a terminal's
  Ctrl-C, Slurm, Kubernetes) reaches rank 0's normal stop path, which closes the group.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from typing import Any, Optional

import torch
import torch.distributed as dist

from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.model.tensor_parallel import TensorParallel, TPShard

log = logging.getLogger(__name__)

ENV_KEY = "BATCHRUN_TP_GROUP"  # the follower's rendezvous: rank, size, addresses, authkey (hex)
COLLECTIVE_TIMEOUT_S = 120.0  # a rank waiting longer for another inside one step ends the group
GRACE_S = 20.0  # after a follower's death, rank 0's own stop path gets this long before the monitor exits
START_TIMEOUT_S = 600.0  # a follower not connected by then is not coming (a missing interpreter, a crash)
DEATH_EXIT_CODE = 70


class TensorParallelError(RuntimeError):
    """A rank of the engine's tensor-parallel group died, failed or stopped answering: the group
    (and the engine) cannot go on. Fatal for a job: its open shards are left uncommitted."""


class ProcessCollectives:
    """The model's Collectives (model/tensor_parallel.py) over a torch.distributed process group;
    a failed or timed-out collective raises TensorParallelError."""

    def __init__(self, pg: Any, rank: int, size: int, find_dead: Optional[Callable[[], Optional[str]]] = None) -> None:
        """`find_dead`: rank 0's way to name the rank whose death failed a collective."""
        self.pg, self.rank, self.size = pg, rank, size
        self.find_dead = find_dead

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            dead = self.find_dead() if self.find_dead is not None else None
            why = dead or _one_line(e)
            raise TensorParallelError(f"tensor-parallel {what} failed on rank {self.rank}: {why}") from e

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._wait(self.pg.allreduce([tensor]), "all-reduce")

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self._wait(self.pg.allreduce([tensor], opts), "all-reduce (max)")

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.pg.broadcast([tensor], opts), "broadcast")

    def gather(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self._wait(self.pg.gather([parts], [tensor], opts), "gather")
            return parts
        self._wait(self.pg.gather([], [tensor], opts), "gather")
        return None


def process_group(backend: str, store: Any, rank: int, size: int) -> Any:
    """The group's data channel over `store` (rank 0's TCPStore): gloo over 127.0.0.1 on the CPU,
    NCCL on GPUs, with the collective timeout. Built as an object, not torch's default group: the
    process may hold its own."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    prefix = dist.PrefixStore("batchrun-tp", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, size, opts)
    return dist.ProcessGroupGloo(prefix, rank, size, timeout)


def encode_meta(meta: AttentionMetadata) -> dict[str, Any]:
    """The step's attention metadata as plain arrays and lists (pickled to the followers)."""
    return {
        "slot_mapping": meta.slot_mapping.cpu().numpy(),
        "query_start_loc": meta.query_start_loc,
        "seq_lens": meta.seq_lens,
        "block_tables": meta.block_tables.cpu().numpy(),
        "block_size": meta.block_size,
        "decode_seq_ids": meta.decode_seq_ids.cpu().numpy(),
        "decode_seq_lens": meta.decode_seq_lens.cpu().numpy(),
        "prefill_seq_ids": meta.prefill_seq_ids,
        "batch_invariant": meta.batch_invariant,
    }


def decode_meta(fields: dict[str, Any], device: torch.device) -> AttentionMetadata:
    """`encode_meta`'s inverse, its tensors on `device`."""
    tensors = ("slot_mapping", "block_tables", "decode_seq_ids", "decode_seq_lens")
    return AttentionMetadata(
        **{k: (torch.from_numpy(v).to(device) if k in tensors else v) for k, v in fields.items()}  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class FollowerReport:
    """What a follower says once its shard is loaded."""

    rank: int
    pid: int
    available_memory: int  # free bytes its KV cache may be sized from
    weight_bytes: int  # bytes of the weights it holds
    owned_weight_bytes: float  # its share of the whole model's (model/tensor_parallel.py: owned_weight_bytes)


class Group:
    """Rank 0's side of the group: the followers' processes and channels, the data channel, the
    monitor. `tensor_parallel()` is what rank 0's model holds; `link` ships the steps."""

    def __init__(self, size: int, device: torch.device, processes: list[subprocess.Popen[bytes]]) -> None:
        self.size, self.device = size, device
        self.processes = processes  # ranks 1..size-1
        self.conns: list[Connection] = []  # ranks 1..size-1, in rank order
        self.comm: Optional[ProcessCollectives] = None
        self._store: Any = None
        self.failure: Optional[str] = None  # why the group cannot go on (the monitor's finding)
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="tp-group-monitor", daemon=True)
        atexit.register(self.close)

    # -- start-up ---------------------------------------------------------------------------------

    def connect(self, listener: Listener, backend: str, store: Any, start_message: dict[str, Any]) -> None:
        """Accept each follower's control connection, send it the start message, and join the data
        channel with them."""
        by_rank: dict[int, Connection] = {}
        accepted: list[Connection] = []
        errors: list[BaseException] = []

        def accept_all() -> None:
            try:
                for _ in self.processes:
                    accepted.append(listener.accept())
            except BaseException as e:  # noqa: BLE001 -- reported by the waiting thread
                errors.append(e)

        acceptor = threading.Thread(target=accept_all, daemon=True)
        acceptor.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while acceptor.is_alive():
            acceptor.join(0.2)
            self._check_alive("while starting")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel followers did not connect within {START_TIMEOUT_S:.0f} s")
        if errors:
            raise TensorParallelError(f"tensor-parallel followers could not connect: {errors[0]}")
        for conn in accepted:
            hello = conn.recv()
            by_rank[int(hello["rank"])] = conn
        self.conns = [by_rank[r] for r in range(1, self.size)]
        for conn in self.conns:
            conn.send(("start", start_message))
        self._store = store
        self.comm = ProcessCollectives(process_group(backend, store, 0, self.size), 0, self.size, self._await_death)
        self._monitor.start()

    def tensor_parallel(self) -> TensorParallel:
        assert self.comm is not None, "connect first"
        return TensorParallel(TPShard(0, self.size), self.comm, self)

    def wait_loaded(self) -> list[FollowerReport]:
        """Each follower's report once its shard is loaded (rank order)."""
        return [FollowerReport(**self._receive(conn, "loaded")) for conn in self.conns]

    def set_up(self, tuning: Any, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """The followers take rank 0's tuning and allocate their KV caches of `num_blocks`."""
        message = {"tuning": tuning, "num_blocks": num_blocks, "block_size": block_size, "max_model_len": max_model_len}
        self._send_all(("setup", message))
        for conn in self.conns:
            self._receive(conn, "ready")

    # -- steps (model/tensor_parallel.py: StepLink) ------------------------------------------------

    def ship_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, num_layers: Optional[int]
    ) -> None:
        payload = {
            "input_ids": input_ids.cpu().numpy(),
            "positions": positions.cpu().numpy(),
            "meta": encode_meta(meta),
            "num_layers": num_layers,
        }
        self._send_all(("forward", payload))

    def ship_logits(self, num_rows: int) -> None:
        self._send_all(("logits", num_rows))

    # -- failure and the end ----------------------------------------------------------------------

    def close(self) -> None:
        """Tell the followers to exit and wait for them (killing any that does not within 10 s)."""
        if self._closed.is_set():
            return
        self._closed.set()
        for conn in self.conns:
            try:
                conn.send(("exit", None))
            except (OSError, ValueError):
                pass  # already gone
        deadline = time.monotonic() + 10.0
        for proc in self.processes:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.comm = None
        self._store = None
        atexit.unregister(self.close)

    def _send_all(self, message: tuple[str, Any]) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except (OSError, ValueError) as e:
                self._check_alive("at a step")
                raise TensorParallelError(f"tensor-parallel rank {rank} cannot be reached: {e}") from e

    def _receive(self, conn: Connection, kind: str) -> dict[str, Any]:
        while not conn.poll(0.2):
            self._check_alive(f"before it was {kind}")
        try:
            got, payload = conn.recv()
        except (EOFError, OSError) as e:
            self._check_alive(f"before it was {kind}")
            raise TensorParallelError(f"a tensor-parallel follower closed its channel before it was {kind}") from e
        if got == "error":
            raise TensorParallelError(f"tensor-parallel rank {payload['rank']} failed: {payload['message']}")
        assert got == kind, f"expected {kind!r} from a follower, got {got!r}"
        return payload  # type: ignore[no-any-return]

    def _dead(self) -> Optional[str]:
        for rank, proc in enumerate(self.processes, start=1):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    def _await_death(self) -> Optional[str]:
        """The rank whose death failed a collective: its process may take a moment to be reaped."""
        deadline = time.monotonic() + 2.0
        while (dead := self._dead()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead is not None:
            self.failure = self.failure or dead
        return dead

    def _check_alive(self, when: str) -> None:
        dead = self._dead()
        if dead is not None:
            self.failure = self.failure or dead
            raise TensorParallelError(f"{dead} {when}")

    def _watch(self) -> None:
        while not self._closed.wait(0.5):
            dead = self._dead()
            if dead is None:
                continue
            self.failure = self.failure or dead
            log.error("%s: the tensor-parallel group cannot go on", dead)
            if self._closed.wait(GRACE_S):
                return
            log.critical("%s and rank 0 did not stop within %.0f s: exiting", dead, GRACE_S)
            logging.shutdown()
            os._exit(DEATH_EXIT_CODE)


def start_group(
    size: int, device: torch.device, config: Any, threads_per_rank: Optional[int], devices: Sequence[str]
) -> Group:
    """Start ranks 1..size-1 of a group for `config` (an EngineConfig) and join them (rank 0 is this
    process, on `device`; rank r runs on devices[r]). Returns once every follower is connected and
    the data channel is up; the followers are loading their shards then."""
    authkey = secrets.token_bytes(32)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    processes = []
    for rank in range(1, size):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env[ENV_KEY] = repr(
            {
                "rank": rank,
                "size": size,
                "control": listener.address,
                "authkey": authkey.hex(),
                "store_port": store.port,
                "backend": backend,
                "parent": os.getpid(),
            }
        )
        processes.append(subprocess.Popen([sys.executable, "-m", "batchrun.engine.follower"], env=env))
    group = Group(size, device, processes)
    try:
        start = {"config": config, "threads": threads_per_rank, "devices": list(devices)}
        group.connect(listener, backend, store, start)
    except BaseException:
        group.close()
        raise
    finally:
        listener.close()
    return group


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]
