"""The one "can Triton run here?" check that every kernel dispatch asks, and the GPU a launch is
sized for.

Launchers size their tiles, padding and split counts for the GPU they launch on (`gpu_target`).
While `simulated_gpu` is active (on a machine without one: kernels/triton_aot.py's compile-only
checks, and bench/gpu_launches.py's count of a decode step's kernels in Triton's interpreter), CPU
tensors take the Triton paths and the launchers size for the simulated GPU, so a check compiles,
or counts, exactly the variants a run on that GPU would launch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from batchrun.utils.private_dir import private_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuTarget:
    """What a launcher needs to know of the GPU it launches on."""

    capability: tuple[int, int]  # compute capability, e.g. (9, 0)
    num_sms: int  # streaming multiprocessors: how many programs one wave runs
    max_shared: int  # bytes of shared memory one block may use (the opt-in maximum): caps tile sizes


# The opt-in shared memory per block of each compute capability a launcher may be sized for without
# the GPU at hand (simulated ones, kernels/triton_aot.py's ARCHS); a real GPU reports its own.
MAX_SHARED_PER_BLOCK: dict[tuple[int, int], int] = {
    (8, 0): 166912,
    (8, 6): 101376,
    (8, 9): 101376,
    (9, 0): 232448,
}


# Process-wide, as is the launch patch that goes with it (kernels/triton_aot.py: compile_only).
_simulated: Optional[GpuTarget] = None


@contextlib.contextmanager
def simulated_gpu(target: GpuTarget) -> Iterator[GpuTarget]:
    """Inside, every tensor counts as living on `target`: the dispatches take the Triton paths and
    the launchers size for it. Only for checks without the GPU: compile-only ones (whose launches
    compile, never run) and counts in Triton's interpreter (whose launches run there)."""
    global _simulated
    before = _simulated
    _simulated = target
    try:
        yield target
    finally:
        _simulated = before


@functools.lru_cache(maxsize=1)
def triton_installed() -> bool:
    """Whether `triton` imports (asked once per process, before any Triton kernel is used).

    Triton loads the compiled kernels it finds in its cache directory, so that directory is held
    to the rule of batchrun's own caches (utils/private_dir.py): created 0700, refused (an
    UnsafeCacheError, not cached here, so every later ask refuses too) when another user owns it
    or others can write it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        log.debug("triton is not installed: GPU tensors take the plain-torch paths")
        return False
    private_dir(triton_cache_dir(), "Triton kernel cache", "TRITON_CACHE_DIR")
    return True


def triton_cache_dir() -> str:
    """Where Triton reads and writes compiled kernels: $TRITON_CACHE_DIR, else $TRITON_HOME (or
    the home directory)/.triton/cache, as Triton itself resolves it."""
    try:
        from triton import knobs

        return os.path.expanduser(str(knobs.cache.dir))
    except (ImportError, AttributeError):  # a Triton without knobs reads the same variables
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
        return os.path.expanduser(os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache"))


def triton_usable(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve a tensor: it lives on a CUDA device (or a simulated GPU is
    active) and triton is installed."""
    return (x.is_cuda or _simulated is not None) and triton_installed()


@functools.cache
def _cuda_target(index: int) -> GpuTarget:
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    # The opt-in maximum is what a kernel may ask for. Torch builds without that attribute report
    # only the default per-block figure (48 KiB), which would shrink tiles a kernel can have, so the
    # capability's table entry comes before it.
    max_shared = getattr(props, "shared_memory_per_block_optin", None) or MAX_SHARED_PER_BLOCK.get(capability)
    if max_shared is None:
        max_shared = props.shared_memory_per_block
    return GpuTarget(capability, props.multi_processor_count, max_shared)


def gpu_target(device: torch.device) -> Optional[GpuTarget]:
    """The GPU a launch on `device` is sized for: the simulated one while `simulated_gpu` is active,
    else a CUDA device's own; None off a GPU (only Triton's interpreter launches there)."""
    if _simulated is not None:
        return _simulated
    if device.type != "cuda":
        return None
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


def triton_fp8_usable(device: torch.device) -> bool:
    """Whether Triton kernels may hold float8_e4m3fn values on `device`: a GPU of compute capability
    8.9 or newer (older ones have no e4m3 conversions and Triton refuses the type there); off a GPU,
    which only Triton's interpreter reaches, yes."""
    target = gpu_target(device)
    return target is None or target.capability >= (8, 9)
