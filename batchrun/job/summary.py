"""The end-of-run report: where the results are, and one line per shard plus totals."""

from __future__ import annotations

from typing import Any, Optional

from batchrun.job.results import RunResult

_COLUMNS = ("shard", "status", "rows", "ok", "errors", "out tok/s", "TTFT p50")


def format_summary(result: RunResult) -> str:
    rows = [_row(s.name, s.status, s.metrics) for s in result.shards]
    metrics = [s.metrics for s in result.shards if s.metrics]
    wall = sum(m["wall_s"] for m in metrics)
    totals = {
        "num_rows": sum(m["num_rows"] for m in metrics),
        "num_ok": sum(m["num_ok"] for m in metrics),
        "num_errors": sum(m["num_errors"] for m in metrics),
        "output_tokens_per_s": sum(m["num_output_tokens"] for m in metrics) / wall if wall else None,
        "ttft_p50_s": result.ttft_p50_s,
    }
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
            "",
            f"{result.status}: {result.message}",
        ]
    )


def _row(name: str, status: str, m: Optional[dict[str, Any]]) -> tuple[str, ...]:
    if not m:
        return (name, status, "-", "-", "-", "-", "-")
    return (
        name,
        status,
        str(m["num_rows"]),
        str(m["num_ok"]),
        str(m["num_errors"]),
        _num(m.get("output_tokens_per_s"), "{:.1f}"),
        _num(m.get("ttft_p50_s"), "{:.2f}s"),
    )


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else fmt.format(value)
