"""`KernelUser`: the base of the model modules that run the kernel set's kernels."""

from __future__ import annotations

from typing import Optional

from torch import nn

from batchrun.kernels.binding import reference_kernels
from batchrun.kernels.kernel_set import KernelSet


class KernelUser(nn.Module):
    """A module that calls the fields of its kernel set (kernels/kernel_set.py): given at
    construction (None: the CPU references) and again by `use_kernels` (DecoderLM.use_kernels
    hands every module the model's set)."""

    def __init__(self, kernels: Optional[KernelSet] = None) -> None:
        super().__init__()
        self.kernels = kernels if kernels is not None else reference_kernels()

    def use_kernels(self, kernels: KernelSet) -> None:
        self.kernels = kernels
