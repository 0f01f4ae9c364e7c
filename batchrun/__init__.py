"""batchrun: offline batch LLM inference, Parquet shards in, results and metrics out, exactly once."""

from batchrun.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)

__version__ = "0.1.0"
__all__ = [
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "EngineStats",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
