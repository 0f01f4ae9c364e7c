"""Per-shard metrics: accumulated row by row as results arrive, summarized into one metrics row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from batchrun.engine import EngineStats, RequestMetrics
from batchrun.job.commit.checkpoints import REQUEST_COUNTERS


@dataclass
class ShardTally:
    """Running totals over one shard's result rows."""

    num_rows: int = 0
    num_ok: int = 0
    num_prompt_tokens: int = 0  # over rows the engine ran
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error_counts: dict[str, int] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    # From the engine's per-request metrics: this shard's own, however shards overlap in the engine.
    num_preemptions: int = 0
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    # embed/score: rows cut to the model's input limit, and the tokens cut
    num_truncated_rows: int = 0
    num_truncated_tokens: int = 0
    # A reasoning model's run (the engine has think tags): the metrics row has these sums; null otherwise.
    reasoning: bool = False
    num_reasoning_tokens: int = 0
    num_answer_tokens: int = 0
    num_thinking_length: int = 0  # rows whose trace max_tokens cut (finish_reason thinking_length)

    def add(self, row: dict[str, Any]) -> None:
        """One result row (generation or embed/score: writer.output_result, pooled_result,
        error_result; or a committed part's row, its missing columns null)."""
        self.num_rows += 1
        if row["error_type"] is None:
            self.num_ok += 1
        else:
            self.error_counts[row["error_type"]] = self.error_counts.get(row["error_type"], 0) + 1
        # The engine saw this row: it has output tokens (generation) or a latency (embed/score,
        # whose files have no output tokens).
        if row.get("num_output_tokens") is not None or row.get("latency_s") is not None:
            self.num_prompt_tokens += row["num_prompt_tokens"] or 0
            self.num_output_tokens += row.get("num_output_tokens") or 0
            self.num_cached_tokens += row.get("num_cached_tokens") or 0
        truncated = row.get("num_truncated_tokens") or 0
        if truncated:
            self.num_truncated_rows += 1
            self.num_truncated_tokens += truncated
        self.num_reasoning_tokens += row.get("num_reasoning_tokens") or 0
        self.num_answer_tokens += row.get("num_answer_tokens") or 0
        if row.get("finish_reason") == "thinking_length":
            self.num_thinking_length += 1
        if row.get("ttft_s") is not None:
            self.ttfts.append(row["ttft_s"])
        if row.get("itl_s") is not None:
            self.itls.append(row["itl_s"])

    def add_request(self, metrics: RequestMetrics) -> None:
        self.add_counts({name: getattr(metrics, name) for name in REQUEST_COUNTERS})

    def add_counts(self, counts: dict[str, int]) -> None:
        """REQUEST_COUNTERS summed elsewhere (a committed part's rows)."""
        for name in REQUEST_COUNTERS:
            setattr(self, name, getattr(self, name) + int(counts.get(name, 0)))

    @property
    def num_errors(self) -> int:
        return self.num_rows - self.num_ok


def percentile(values: list[float], q: float) -> Optional[float]:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def metrics_row(
    shard: str, worker: int, tally: ShardTally, wall_s: float, before: EngineStats, after: EngineStats
) -> dict[str, Any]:
    """The shard's metrics row (writer.METRICS_SCHEMA). Request counts come from the shard's own
    rows; the KV peak and expert counts are the engine's over the shard's lifetime (see flow.py)."""
    speculating = after.num_spec_proposed is not None
    proposed = tally.num_spec_proposed if speculating else None
    accepted = tally.num_spec_accepted if speculating else None
    wall = max(wall_s, 1e-9)
    return {
        "shard": shard,
        "worker": worker,
        "num_rows": tally.num_rows,
        "num_ok": tally.num_ok,
        "num_errors": tally.num_errors,
        "num_prompt_tokens": tally.num_prompt_tokens,
        "num_output_tokens": tally.num_output_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": tally.num_output_tokens / wall,
        "total_tokens_per_s": (tally.num_prompt_tokens + tally.num_output_tokens) / wall,
        **{f"ttft_p{q}_s": percentile(tally.ttfts, q) for q in (50, 95, 99)},
        **{f"itl_p{q}_s": percentile(tally.itls, q) for q in (50, 95, 99)},
        "prefix_cache_hit_rate": (
            tally.num_cached_tokens / tally.num_prompt_tokens if tally.num_prompt_tokens else None
        ),
        "num_preemptions": tally.num_preemptions,
        # Since the last reset_peak_stats(): the opening of the oldest shard open when this one opened.
        "peak_kv_blocks_used": after.peak_kv_blocks_used,
        "num_kv_blocks_total": after.num_kv_blocks_total,
        "num_spec_proposed": proposed,
        "num_spec_accepted": accepted,
        "spec_acceptance_rate": accepted / proposed if proposed and accepted is not None else None,
        "expert_token_counts": _expert_delta(after.expert_token_counts, before.expert_token_counts),
        "rows_per_s": tally.num_rows / wall,
        "prompt_tokens_per_s": tally.num_prompt_tokens / wall,
        "num_truncated_rows": tally.num_truncated_rows,
        "num_truncated_tokens": tally.num_truncated_tokens,
        "num_reasoning_tokens": tally.num_reasoning_tokens if tally.reasoning else None,
        "num_answer_tokens": tally.num_answer_tokens if tally.reasoning else None,
        "num_thinking_length": tally.num_thinking_length if tally.reasoning else None,
    }


def _expert_delta(after: Optional[list[list[int]]], before: Optional[list[list[int]]]) -> Optional[list[list[int]]]:
    if after is None:
        return None
    if before is None:
        return [list(layer) for layer in after]
    return [[a - b for a, b in zip(la, lb, strict=True)] for la, lb in zip(after, before, strict=True)]
