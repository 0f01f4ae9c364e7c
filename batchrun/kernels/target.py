"""What the engine runs on, found once at start-up: the device, the GPU its launches are sized for,
and which kernel families this process has (the native CPU kernels, Triton).

`find_target` is the one place that asks the machine; everything after it reads the frozen
`DeviceTarget` it returns. A simulated GPU is a value, not a mode: `find_target("cpu",
simulate=SM90)` is a CPU device whose Triton kernel set (kernels/bind_triton.py) sizes tiles, split
counts and padding for an sm_90, so Triton's interpreter runs (launch counts) and the compile-only
checks (kernels/triton_aot.py) launch exactly the variants a run on that GPU would.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from batchrun.kernels import cpu_native
from batchrun.kernels.backend import triton_installed


@dataclass(frozen=True)
class GpuTarget:
    """What a launcher needs to know of the GPU it launches on."""

    capability: tuple[int, int]  # compute capability, e.g. (9, 0)
    num_sms: int  # streaming multiprocessors: how many programs one wave runs
    max_shared: int  # bytes of shared memory one block may use (the opt-in maximum): caps tile sizes

    @property
    def name(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def has_fp8(self) -> bool:
        """Whether Triton kernels may hold float8_e4m3fn values here: compute capability 8.9 and up
        (older GPUs have no e4m3 conversions and Triton refuses the type there)."""
        return self.capability >= (8, 9)


# The opt-in shared memory per block of each compute capability a launcher may be sized for without
# the GPU at hand (simulated ones, kernels/triton_aot.py's ARCHS); a real GPU reports its own.
MAX_SHARED_PER_BLOCK: dict[tuple[int, int], int] = {
    (8, 0): 166912,
    (8, 6): 101376,
    (8, 9): 101376,
    (9, 0): 232448,
}

# An H100/H200 (sm_90, 132 SMs): the GPU the simulated checks and the launch counts are sized for.
SM90 = GpuTarget((9, 0), 132, MAX_SHARED_PER_BLOCK[(9, 0)])


@dataclass(frozen=True)
class DeviceTarget:
    """The device a kernel set is bound for (`find_target`)."""

    device: torch.device  # where the model's tensors live ("cuda:N" with its index, or "cpu")
    gpu: Optional[GpuTarget]  # the GPU launches are sized for; None on the CPU
    is_simulated: bool  # `gpu` is simulated: the tensors are CPU tensors (interpreter, compile-only checks)
    native_cpu_kernels: bool  # the csrc/ kernels are built and BATCHRUN_CPU_KERNELS is on (CPU only)
    # triton imports and its kernel cache directory is safe (kernels/backend.py); asked for GPU targets
    # only (real or simulated): on the CPU no Triton kernel runs, nor is its cache touched
    has_triton: bool

    @property
    def name(self) -> str:
        """ "cpu", "sm_90", or "sm_90 (simulated)"."""
        if self.gpu is None:
            return "cpu"
        return f"{self.gpu.name} (simulated)" if self.is_simulated else self.gpu.name

    @property
    def runs_triton(self) -> bool:
        """Whether the Triton kernel set serves this target (a GPU, real or simulated, with triton)."""
        return self.gpu is not None and self.has_triton

    @property
    def is_gpu(self) -> bool:
        """A real CUDA device (not a simulated one): memory, synchronization and graphs are the GPU's."""
        return self.gpu is not None and not self.is_simulated

    def available_memory(self) -> int:
        """Free bytes the KV cache may be sized from: free GPU memory, or available RAM on the CPU."""
        if self.is_gpu:
            return torch.cuda.mem_get_info(self.device)[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def describe(self) -> dict[str, object]:
        gpu = self.gpu
        return {
            "name": self.name,
            "device": str(self.device),
            "capability": None if gpu is None else list(gpu.capability),
            "num_sms": None if gpu is None else gpu.num_sms,
            "max_shared": None if gpu is None else gpu.max_shared,
            "native_cpu_kernels": self.native_cpu_kernels,
            "triton": self.has_triton,
        }


@functools.cache
def cuda_target(index: int) -> GpuTarget:
    """The GpuTarget of CUDA device `index`, from its properties."""
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    # The opt-in maximum is what a kernel may ask for. Torch builds without that attribute report
    # only the default per-block figure (48 KiB), which would shrink tiles a kernel can have, so the
    # capability's table entry comes before it.
    max_shared = getattr(props, "shared_memory_per_block_optin", None) or MAX_SHARED_PER_BLOCK.get(capability)
    if max_shared is None:
        max_shared = props.shared_memory_per_block
    return GpuTarget(capability, props.multi_processor_count, max_shared)


def find_target(device: Union[torch.device, str], simulate: Optional[GpuTarget] = None) -> DeviceTarget:
    """The target for `device` ("cpu", "cuda", "cuda:N"): a CUDA device's own GpuTarget, or on the
    CPU whether the native kernels are built and switched on (BATCHRUN_CPU_KERNELS, read here,
    once). `simulate`: a GPU the CPU device's Triton kernel set is sized for instead (tests,
    compile-only checks, launch counts)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return DeviceTarget(torch.device("cuda", index), cuda_target(index), False, False, triton_installed())
    if simulate is not None:
        return DeviceTarget(device, simulate, True, False, triton_installed())
    native = cpu_native.enabled() and cpu_native.available()
    return DeviceTarget(device, None, False, native, False)
