"""The inference engine: its public API is what this module exports, nothing deeper."""

from batchrun.engine.config import TASKS, EngineConfig, EngineConfigError, SamplingParams, SpeculativeConfig
from batchrun.engine.engine import Engine
from batchrun.engine.group import TensorParallelError
from batchrun.engine.outputs import EngineRequest, EngineStats, RequestMetrics, RequestOutput, ThroughputProfile
from batchrun.engine.settings import EngineSettings
from batchrun.engine.tasks import ResolvedTask, resolve_task

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineRequest",
    "EngineSettings",
    "EngineStats",
    "RequestMetrics",
    "RequestOutput",
    "ResolvedTask",
    "SamplingParams",
    "SpeculativeConfig",
    "TASKS",
    "TensorParallelError",
    "ThroughputProfile",
    "resolve_task",
]
