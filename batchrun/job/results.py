"""What a run reports: one summary per shard and one result per run (handed to the cli, the local
launcher and notebooks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# A shard's status in a summary and in the manifest:
#   committed    this run committed it
#   skipped      committed already (an earlier run, or another worker in this one)
#   failed       it failed in this run (the error says why); the others went on
#   quarantined  attempts at it died launcher.max_shard_attempts times; nobody takes it any more
#   interrupted  a stop signal abandoned it; nothing of it is committed
#   pending      not started (this worker stopped first)
#   elsewhere    another worker holds its claim and had not committed it when this one stopped
SHARD_STATUSES = ("committed", "skipped", "failed", "quarantined", "interrupted", "pending", "elsewhere")
DONE_STATUSES = ("committed", "skipped")


@dataclass(frozen=True)
class ShardSummary:
    name: str
    status: str  # one of SHARD_STATUSES
    metrics: Optional[dict[str, Any]] = None  # the metrics row, for committed and skipped shards
    error: Optional[str] = None


@dataclass(frozen=True)
class RunResult:
    exit_code: int  # 0 done, 1 some shard failed, 128 + signal number when stopped
    status: str  # completed | failed | interrupted
    message: str  # one line for the log
    output_url: str
    manifest_url: str
    shards: list[ShardSummary]
    ttft_p50_s: Optional[float]  # over the rows generated in this run
    # What this run produced and how long it took, whatever the shards' overlap (see run_throughput).
    num_output_tokens: Optional[int] = None
    wall_s: Optional[float] = None
    engine_s: Optional[float] = None


def run_throughput(num_output_tokens: int, wall_s: Optional[float], engine_s: Optional[float]) -> dict[str, Any]:
    """The run's rates, as the manifest and the summary report them. `num_output_tokens`: tokens
    the engine generated in this run (rows of shards committed earlier are not this run's work);
    `wall_s`: start to finish, engine start-up included; `engine_s`: the time the engine streamed
    rows, summed over workers, so that tokens over it is the rate of one engine."""

    def rate(seconds: Optional[float]) -> Optional[float]:
        return num_output_tokens / seconds if seconds else None

    return {
        "num_output_tokens": num_output_tokens,
        "wall_s": wall_s,
        "engine_s": engine_s,
        "output_tokens_per_s": rate(wall_s),
        "engine_output_tokens_per_s": rate(engine_s),
    }
