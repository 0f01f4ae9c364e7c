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
