"""`bind_kernels`: the kernel set for a device target and model dtype, from the binder that serves
it: the Triton binder for a GPU (real or simulated) where Triton is installed, the CPU binder
otherwise (kernels/bind_triton.py, kernels/bind_cpu.py). Engine start-up binds once
(engine/startup.py), before the model is prepared, and again with the tuning it measured.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import torch

from batchrun.kernels.kernel_set import BindOptions, KernelSet
from batchrun.kernels.target import DeviceTarget, find_target
from batchrun.kernels.tuning import Tuning


def bind_kernels(
    target: DeviceTarget,
    dtype: torch.dtype,
    tuning: Optional[Tuning] = None,
    *,
    kv_cache_dtype: str = "auto",
    fuse: bool = True,
    dense_min_rows: Optional[int] = None,
    binder: Optional[str] = None,
) -> KernelSet:
    """The kernel set for `target` and the model's compute `dtype`. `tuning`: start-up's choices
    (None: the static tables'); `kv_cache_dtype`: engine.kv_cache_dtype (an fp8 cache needs a GPU
    with e4m3 for the Triton kernels); `fuse`: the fused projection GEMMs at all (False: the
    unfused pairs, for checks and benchmarks); `dense_min_rows`: see BindOptions. `binder`: "triton"
    or "cpu" instead of the target's own (the Triton set on a CPU target runs in Triton's
    interpreter, with its tiles: the decoder tests)."""
    options = BindOptions(kv_cache_dtype=kv_cache_dtype, fuse=fuse, dense_min_rows=dense_min_rows)
    return _bind(target, dtype, tuning or Tuning(), options, binder)


def _bind(
    target: DeviceTarget, dtype: torch.dtype, tuning: Tuning, options: BindOptions, binder: Optional[str] = None
) -> KernelSet:
    if binder == "triton" or (binder is None and target.runs_triton):
        from batchrun.kernels.bind_triton import bind_triton

        return bind_triton(target, dtype, tuning, options)
    from batchrun.kernels.bind_cpu import bind_cpu

    return bind_cpu(target, dtype, tuning, options)


def with_tuning(kernels: KernelSet, tuning: Tuning) -> KernelSet:
    """The same binder, target and options as `kernels`, reading `tuning` (start-up's second bind)."""
    return _bind_as(kernels, kernels.dtype, tuning, kernels.options)


def rebind(kernels: KernelSet, *, kv_cache_dtype: str) -> KernelSet:
    """The same binder, target, dtype and tuning as `kernels` for another KV cache (a draft model's)."""
    options = dataclasses.replace(kernels.options, kv_cache_dtype=kv_cache_dtype)
    return _bind_as(kernels, kernels.dtype, kernels.tuning, options)


def _bind_as(kernels: KernelSet, dtype: torch.dtype, tuning: Tuning, options: BindOptions) -> KernelSet:
    """Bound by `kernels`' own binder (a Triton set on a CPU target stays a Triton set)."""
    return _bind(kernels.target, dtype, tuning, options, kernels.binder)


def default_kernels(device: Union[torch.device, str], dtype: torch.dtype) -> KernelSet:
    """The kernel set a model built on `device` in `dtype` gets when its caller names none: the
    binder for the device's target with the tables' choices, as an engine on that device binds it."""
    return bind_kernels(find_target(device), dtype)


@functools.cache
def reference_kernels() -> KernelSet:
    """The plain-torch references on the CPU (float32, no native kernels): what a model module built
    without a kernel set runs until it is given one (DecoderLM.use_kernels)."""
    target = DeviceTarget(torch.device("cpu"), None, False, False, False)
    return bind_kernels(target, torch.float32)
