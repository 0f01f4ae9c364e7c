"""Where the engine runs: device and dtype resolution, and the memory and weight sizes it plans with.
The device's own facts (a GPU's properties, free memory) are read through its DeviceTarget
(kernels/target.py), found once at start-up."""

from __future__ import annotations

import torch

from batchrun.kernels.target import DeviceTarget

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX-512 BF16 or AMX), where bf16 beats fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("engine.device is 'cuda' but no CUDA GPU is visible")
    return torch.device(name)


def resolve_dtype(name: str, target: DeviceTarget) -> torch.dtype:
    """engine.dtype; "auto": bf16 on a GPU and on CPUs that multiply it natively, else float32."""
    if name != "auto":
        return _DTYPES[name]
    return torch.bfloat16 if target.is_gpu or cpu_has_fast_bf16() else torch.float32


def weight_count(model: torch.nn.Module) -> int:
    """Elements of a model's parameters and buffers, a tensor shared by two modules counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel()
    return total


def available_memory(target: DeviceTarget) -> int:
    """Free bytes the KV cache may be sized from: free GPU memory, or available RAM on the CPU."""
    return target.available_memory()
