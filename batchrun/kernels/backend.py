"""The one "can Triton run here?" check that every kernel dispatch asks."""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def triton_installed() -> bool:
    """Whether `triton` imports (asked once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        log.debug("triton is not installed: GPU tensors take the plain-torch paths")
        return False
    return True


def triton_usable(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve a tensor: it lives on a CUDA device and triton is installed."""
    return x.is_cuda and triton_installed()


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def triton_fp8_usable(device: torch.device) -> bool:
    """Whether Triton kernels may hold float8_e4m3fn values on `device`: a GPU of compute capability
    8.9 or newer (older ones have no e4m3 conversions and Triton refuses the type there); off a GPU,
    which only Triton's interpreter reaches, yes."""
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (8, 9)
