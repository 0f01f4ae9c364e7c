"""Runners: one scheduled batch in, the tokens it produced out (`execute` -> `StepResult`, or a
`PendingStep` whose tokens are still on the device). The engine picks one at start-up: the GPU
runner (CUDA graphs, steps run ahead) on a GPU, the CPU runner elsewhere."""

from batchrun.engine.runners.base import ModelRunner, kv_bytes_per_block, token_logprobs
from batchrun.engine.runners.cpu import CpuRunner
from batchrun.engine.runners.gpu import GpuRunner
from batchrun.engine.runners.outputs import ForwardOutput, PendingStep

__all__ = [
    "CpuRunner",
    "ForwardOutput",
    "GpuRunner",
    "ModelRunner",
    "PendingStep",
    "kv_bytes_per_block",
    "token_logprobs",
]
