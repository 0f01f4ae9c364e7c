"""The inference engine: its public API is what this module exports, nothing deeper."""

from batchrun.engine.config import EngineConfig, EngineConfigError, SamplingParams, SpeculativeConfig
from batchrun.engine.engine import Engine
from batchrun.engine.group import TensorParallelError
from batchrun.engine.outputs import EngineRequest, EngineStats, RequestMetrics, RequestOutput, ThroughputProfile
from batchrun.engine.settings import EngineSettings

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineRequest",
    "EngineSettings",
    "EngineStats",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "TensorParallelError",
    "ThroughputProfile",
]
