"""The end-of-run report: where the results are, and one line per shard plus totals.

Shards overlap in the engine (up to planner.max_open_shards at once), so a shard's rate is its own
tokens over its own open time, and those rates do not add up: the total row's rate is the run's,
its output tokens over its wall time (results.run_throughput), never a sum or mean of shards'."""

from __future__ import annotations

from typing import Any, Optional

from batchrun.job.results import RunResult, run_throughput

_TOK_NOTE = ["shard tok/s: a shard's output tokens over its own open time (shards overlap: these do not add up)"]
_COLUMNS = ("shard", "status", "rows", "ok", "errors", "out tok", "shard tok/s", "TTFT p50")


def format_summary(result: RunResult) -> str:
    rows = [_row(s.name, s.status, s.metrics) for s in result.shards]
    metrics = [s.metrics for s in result.shards if s.metrics]
    run = run_throughput(result.num_output_tokens or 0, result.wall_s, result.engine_s)
    totals = {
        "num_rows": sum(m["num_rows"] for m in metrics),
        "num_ok": sum(m["num_ok"] for m in metrics),
        "num_errors": sum(m["num_errors"] for m in metrics),
        "num_output_tokens": sum(m["num_output_tokens"] for m in metrics),
        "output_tokens_per_s": run["output_tokens_per_s"] if result.num_output_tokens is not None else None,
        "ttft_p50_s": result.ttft_p50_s,
    }
    # Runs that generate nothing (embed, score) are rated in rows/s; their tok/s lines would say 0.
    rows_line = _rows_line(metrics, run["wall_s"], result.num_output_tokens)
    done = sum(s.status in ("committed", "skipped") for s in result.shards)
    rows.append(_row("total", f"{done}/{len(result.shards)} done", totals if metrics else None))
    widths = [max(len(r[i]) for r in [_COLUMNS, *rows]) for i in range(len(_COLUMNS))]

    def line(cells: tuple[str, ...]) -> str:
        padded = (c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(padded)

    table = [
        line(_COLUMNS),
        line(tuple("-" * w for w in widths)),
        *map(line, rows[:-1]),
        line(tuple("-" * w for w in widths)),
        line(rows[-1]),
    ]
    return "\n".join(
        [
            f"results:  {result.output_url.rstrip('/')}/results/",
            f"metrics:  {result.output_url.rstrip('/')}/metrics/",
            f"manifest: {result.manifest_url}",
            "",
            *table,
            *(rows_line or _TOK_NOTE),
            *([] if rows_line else _run_line(run, result.num_output_tokens)),
            *_reasoning_line(metrics),
            "",
            f"{result.status}: {result.message}",
        ]
    )


def _reasoning_line(metrics: list[dict[str, Any]]) -> list[str]:
    """A reasoning model's run: how its output tokens split (metrics without the sums: none)."""
    if not any(m.get("num_reasoning_tokens") is not None for m in metrics):
        return []
    reasoning = sum(m.get("num_reasoning_tokens") or 0 for m in metrics)
    answer = sum(m.get("num_answer_tokens") or 0 for m in metrics)
    cut = sum(m.get("num_thinking_length") or 0 for m in metrics)
    return [f"reasoning: {reasoning} tokens in traces, {answer} in answers; {cut} rows cut inside the trace"]


def _row(name: str, status: str, m: Optional[dict[str, Any]]) -> tuple[str, ...]:
    if not m:
        return (name, status, "-", "-", "-", "-", "-", "-")
    return (
        name,
        status,
        str(m["num_rows"]),
        str(m["num_ok"]),
        str(m["num_errors"]),
        _num(m.get("num_output_tokens"), "{}"),
        _num(m.get("output_tokens_per_s"), "{:.1f}"),
        _num(m.get("ttft_p50_s"), "{:.2f}s"),
    )


def _run_line(run: dict[str, Any], num_output_tokens: Optional[int]) -> list[str]:
    """The run's rate: over its wall time (the total row's) and over the time in the engine."""
    if num_output_tokens is None or run["wall_s"] is None:
        return []
    line = f"total tok/s: this run's {num_output_tokens} output tokens over its {run['wall_s']:.1f}s wall time"
    if run["engine_output_tokens_per_s"] is not None:
        line += f"; {run['engine_output_tokens_per_s']:.1f} tok/s over its {run['engine_s']:.1f}s in the engine"
    return [line]


def _rows_line(metrics: list[dict[str, Any]], wall_s: Optional[float], num_output_tokens: Optional[int]) -> list[str]:
    """Runs that generate nothing (embed, score): their rate is rows and prompt tokens per second."""
    num_rows = sum(m["num_rows"] for m in metrics)
    if num_output_tokens or not num_rows or not wall_s:
        return []
    num_prompt = sum(m.get("num_prompt_tokens") or 0 for m in metrics)
    truncated = sum(m.get("num_truncated_rows") or 0 for m in metrics)
    line = f"rows/s: {num_rows / wall_s:.1f} ({num_rows} rows, {num_prompt / wall_s:.1f} prompt tok/s"
    line += f" over {wall_s:.1f}s)"
    return [line + (f"; {truncated} rows truncated to the model's input limit" if truncated else "")]


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else fmt.format(value)
