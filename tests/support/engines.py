"""Tiny engines: a real Engine over a tiny model with the suite's small, fixed limits.

Given max_num_seqs and max_num_batched_tokens, start-up runs no batch-limit profile, and a small KV
pool saves allocating the default 1 GiB; on a 2-core machine both are most of an engine's start-up.
A test overrides what it checks (dtype, a KV dtype, a token budget, speculation, ...) and keeps the
rest, so its config says only what is particular to it.
"""

from __future__ import annotations

from typing import Any, Optional

from batchrun.engine import Engine, EngineConfig
from batchrun.engine.startup import start_engine
from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.target import GpuTarget

# What conftest's session-wide `tiny_engine` runs with; every field may be overridden.
TINY_ENGINE: dict[str, Any] = dict(
    dtype="float32",
    device="cpu",
    kv_cache_memory=64 << 20,
    max_num_seqs=8,
    max_num_batched_tokens=1024,
)


def tiny_config(model: str, **config: Any) -> EngineConfig:
    """EngineConfig over `model` (a directory or a registry name): TINY_ENGINE, overridden by `config`."""
    return EngineConfig(**{"model": model, **TINY_ENGINE, **config})


def make_tiny_engine(
    model: str, *, kernels: Optional[KernelSet] = None, simulate: Optional[GpuTarget] = None, **config: Any
) -> Engine:
    """An Engine over `model` with `tiny_config(model, **config)`. `kernels`: a kernel set bound by the
    test (Triton's on the CPU, for the interpreter); `simulate`: the GPU whose kernel set a CPU engine
    binds (kernels/target.py), so CPU tensors take that GPU's kernels."""
    engine_config = tiny_config(model, **config)
    return Engine(engine_config, start_engine(engine_config, kernels=kernels, simulate=simulate))
