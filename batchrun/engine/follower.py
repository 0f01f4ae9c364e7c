"""A follower of a tensor-parallel group: `python -m batchrun.engine.follower`, started by rank 0
(engine/group.py), which passes the rendezvous in the environment (group.ENV_KEY).

It loads its rank's shard, reports its free memory, takes rank 0's tuning and KV block count,
allocates its KV cache, and then runs exactly what rank 0 ships, in order: a forward over the
same flattened batch (into its own cache), or its slice of a logits computation. It decides
nothing. It ignores SIGINT and SIGTERM (rank 0's stop path closes the group) and exits when rank 0
says so, when rank 0 is gone (end of the control channel, a failed collective, or its parent pid
changed), or when a collective times out.
"""

from __future__ import annotations

import ast
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Client, Connection
from typing import Any

import torch
import torch.distributed as dist

from batchrun.engine.group import (
    COLLECTIVE_TIMEOUT_S,
    ENV_KEY,
    ProcessCollectives,
    TensorParallelError,
    decode_meta,
    process_group,
)
from batchrun.model.tensor_parallel import TensorParallel, TPShard

log = logging.getLogger("batchrun.engine.follower")


def _watch_parent(parent: int) -> None:
    """Exit within a second of rank 0's death, wherever this process is blocked."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def _serve(
    conn: Connection, model: Any, kv_caches: Any, comm: ProcessCollectives, device: torch.device, dtype: torch.dtype
) -> None:
    """Run what rank 0 ships until it says exit; `dtype`: the hidden rows' (the engine's activations)."""
    hidden_size = model.spec.hidden_size
    while True:
        kind, payload = conn.recv()
        if kind == "forward":
            input_ids = torch.from_numpy(payload["input_ids"]).to(device)
            positions = torch.from_numpy(payload["positions"]).to(device)
            model(input_ids, positions, kv_caches, decode_meta(payload["meta"], device), payload["num_layers"])
        elif kind == "logits":
            hidden = torch.empty(payload, hidden_size, dtype=dtype, device=device)  # (num_rows, hidden_size)
            comm.broadcast(hidden)
            model.compute_logits(hidden)
        elif kind == "exit":
            return
        else:
            raise AssertionError(f"unknown message {kind!r} from rank 0")


def run(spec: dict[str, Any]) -> None:
    """Join the group described by `spec`, load, set up and serve (or stop: rank 0's start-up may
    fail after this rank loaded, and then it says exit instead of sending the KV plan)."""
    from datetime import timedelta

    from batchrun.engine.device import available_memory
    from batchrun.engine.runners.base import ModelRunner
    from batchrun.engine.startup import bind, load_target
    from batchrun.kernels.binding import with_tuning
    from batchrun.model.prepare import apply_linear_choices, module_weight_bytes, owned_weight_bytes

    rank, size = int(spec["rank"]), int(spec["size"])
    conn = Client(tuple(spec["control"]), authkey=bytes.fromhex(spec["authkey"]))
    conn.send({"rank": rank})
    kind, start = conn.recv()
    assert kind == "start", kind
    config = start["config"]
    if start["threads"]:
        torch.set_num_threads(start["threads"])
    device = torch.device(start["devices"][rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        "127.0.0.1", int(spec["store_port"]), size, is_master=False, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    comm = ProcessCollectives(process_group(spec["backend"], store, rank, size), rank, size)
    try:
        tp = TensorParallel(TPShard(rank, size), comm, None)
        target = load_target(config, bind(config, device=device), tp)
        model = target.model
        conn.send(
            (
                "loaded",
                {
                    "rank": rank,
                    "pid": os.getpid(),
                    "available_memory": available_memory(model.kernels.target),
                    "weight_bytes": module_weight_bytes(model),
                    "owned_weight_bytes": owned_weight_bytes(model),
                },
            )
        )
        kind, setup = conn.recv()
        if kind == "exit":  # rank 0 failed after we loaded: its error is the one to report, not ours
            return
        assert kind == "setup", kind
        model.use_kernels(with_tuning(model.kernels, setup["tuning"]))
        apply_linear_choices(model, model.kernels)
        cache = ModelRunner(
            model,
            setup["num_blocks"],
            setup["block_size"],
            target.dtype,
            device,
            config.kv_cache_dtype,
            max_model_len=setup["max_model_len"],
        )
        conn.send(("ready", {}))
    except TensorParallelError:
        raise
    except Exception as e:
        log.exception("rank %d could not start", rank)
        conn.send(("error", {"rank": rank, "message": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}))
        raise SystemExit(1) from None
    _serve(conn, model, cache.kv_caches, comm, device, target.dtype)


def main() -> None:
    spec = ast.literal_eval(os.environ[ENV_KEY])
    # The group stops through rank 0: a signal sent to the whole process group must not end a
    # follower under rank 0's feet (it would fail a step of a run that is stopping cleanly).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s tp rank {spec['rank']} %(levelname)s %(name)s: %(message)s"
    )
    threading.Thread(target=_watch_parent, args=(int(spec["parent"]),), daemon=True).start()
    try:
        run(spec)
    except (EOFError, ConnectionError, TensorParallelError) as e:  # rank 0 is gone or the group failed
        log.warning("leaving the group: %s: %s", type(e).__name__, " ".join(str(e).split())[:300])
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
