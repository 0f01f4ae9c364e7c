"""The run report: `{output.uri}/report.html`, one self-contained page with the notebook's figures.

It is drawn from the committed files only (store.committed_files: the markers, their results and
metrics files, never an attempt's or a part's), so it says what a reader of the run would find, and
from `_manifest.json` for the run's status and the shards that did not commit. The page carries
everything it shows: figures are inline SVG drawn by matplotlib's Agg backend, the style sheet is
inline, there is no script, so it opens from a bucket or a laptop with no network. Every string
that comes from the data (shard names, ids, error messages, the manifest) is HTML-escaped.

Large runs stay bounded: the latency figures are drawn from a uniform sample of at most
MAX_SAMPLES rows (bottom-k on random keys, so every row is equally likely to be kept), and at most
MAX_ERROR_ROWS error rows are listed; error counts are exact.
"""

from __future__ import annotations

import datetime as dt
import html
import io
import logging
import posixpath
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchrun.job.commit.manifest import read_worker_manifests
from batchrun.job.commit.store import RunStore, committed_files
from batchrun.job.errors import JobError
from batchrun.job.formats.writer import read_metrics
from batchrun.utils.redact import redact_text

log = logging.getLogger(__name__)

REPORT_NAME = "report.html"
MAX_SAMPLES = 1_000_000  # latency values kept per figure
MAX_ERROR_ROWS = 50  # error rows listed (the counts cover all of them)
MAX_MESSAGE_CHARS = 300
FIGURE_IDS = ("fig-throughput", "fig-ttft", "fig-itl", "fig-errors")

_RESULT_COLUMNS = ["id", "error_type", "error_message", "ttft_s", "itl_s"]


class _Sample:
    """A uniform sample without replacement of at most `size` values from a stream of arrays."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seen = 0
        self._rng = np.random.default_rng(seed)
        self._values = np.empty(0)
        self._keys = np.empty(0)

    def add(self, values: np.ndarray) -> None:
        self.seen += len(values)
        self._values = np.concatenate([self._values, values])
        self._keys = np.concatenate([self._keys, self._rng.random(len(values))])
        if len(self._values) > 2 * self.size:
            self._shrink()

    def _shrink(self) -> None:
        keep = np.argpartition(self._keys, self.size)[: self.size]
        self._values, self._keys = self._values[keep], self._keys[keep]

    @property
    def values(self) -> np.ndarray:
        if len(self._values) > self.size:
            self._shrink()
        return self._values


@dataclass
class _RunData:
    uri: str
    manifest: Optional[dict[str, Any]]
    shards: list[dict[str, Any]] = field(default_factory=list)  # metrics rows + the marker's times
    not_committed: list[dict[str, Any]] = field(default_factory=list)  # the manifest's other shards
    outcomes: Counter[str] = field(default_factory=Counter)  # "ok" or the error type -> rows
    error_rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # shard, id, type, message
    ttft: _Sample = field(default_factory=lambda: _Sample(MAX_SAMPLES, 0))
    itl: _Sample = field(default_factory=lambda: _Sample(MAX_SAMPLES, 1))


def write_report(uri: str, storage_options: Optional[Mapping[str, Any]] = None, out: Optional[str] = None) -> str:
    """Render the report of the run at `uri` and write it, whole or not at all, to `out` (a path
    or fsspec URL; default `{uri}/report.html`). Returns where it went. JobError when `uri` holds
    no run."""
    options = dict(storage_options or {})
    store = RunStore(uri, options)
    page = render_report(store).encode()
    if out is None:
        target, path = store, store.path(REPORT_NAME)
    else:
        directory, name = posixpath.split(out.rstrip("/"))
        target = RunStore(directory or ".", options)
        path = target.path(name)
    target.write_bytes(path, page)
    return target.url(path)


def write_report_at_end(uri: str, storage_options: Mapping[str, Any], world_size: int) -> None:
    """At the end of a run: write the report once the whole run has ended (every worker's manifest
    is final), a failure to do so only logged. Each worker writes its final manifest before it
    looks, so the last of several to finish sees every other one done (two finishing together
    both write the same page)."""
    try:
        if world_size > 1 and not _all_workers_done(RunStore(uri, storage_options), world_size):
            return
        url = write_report(uri, storage_options)
        log.info("report: %s", redact_text(url))
    except Exception as e:
        log.warning("could not write the run report: %s: %s", type(e).__name__, redact_text(" ".join(str(e).split())))


def _all_workers_done(store: RunStore, world_size: int) -> bool:
    docs = read_worker_manifests(store)
    return len({d["worker"]["rank"] for d in docs}) >= world_size and all(d.get("status") != "running" for d in docs)


# ---- reading the committed files -------------------------------------------------------------------


def _read_run(store: RunStore) -> _RunData:
    manifest = store.read_json(store.path("_manifest.json"))
    manifest = manifest if isinstance(manifest, dict) else None
    results = committed_files(store, "results")
    if manifest is None and not results:
        raise JobError(f"no batchrun run at {store.url(store.root)}: no _manifest.json and no committed shard")
    data = _RunData(redact_text(store.url(store.root)), manifest)
    metrics = committed_files(store, "metrics")
    for shard in sorted(results):
        row = read_metrics(store.fs, metrics[shard]) if shard in metrics else None
        if row is None:  # published between the listing and the read: it is at its final name now
            row = read_metrics(store.fs, store.metrics_path(shard))
        marker = store.read_marker(shard) or {}
        data.shards.append(
            {
                **(row or {"shard": shard}),
                "started_at": _parse_time(marker.get("started_at")),
                "committed_at": _parse_time(marker.get("committed_at")),
            }
        )
        _read_results(store, shard, results[shard], data)
    committed = set(results)
    for record in (manifest or {}).get("shards") or []:
        if isinstance(record, dict) and record.get("name") not in committed:
            data.not_committed.append(record)
    return data


def _read_results(store: RunStore, shard: str, path: str, data: _RunData) -> None:
    try:
        table = _read_table(store, path)
    except FileNotFoundError:
        # published between committed_files' look and ours: the published file is there now
        path = committed_files(store, "results").get(shard, path)
        table = _read_table(store, path)
    error_type = table.column("error_type")
    if error_type.null_count:
        data.outcomes["ok"] += error_type.null_count  # a row is ok exactly when it has no error type
    for entry in pc.value_counts(pc.drop_null(error_type)).to_pylist():
        data.outcomes[entry["values"]] += entry["counts"]
    for column, sample in (("ttft_s", data.ttft), ("itl_s", data.itl)):
        sample.add(pc.drop_null(table.column(column)).to_numpy().astype(float))
    room = MAX_ERROR_ROWS - len(data.error_rows)
    if room > 0 and error_type.null_count < len(error_type):
        rows = table.take(pc.indices_nonzero(pc.is_valid(error_type))[:room]).to_pylist()
        for row in rows:
            message = row["error_message"] or ""
            if len(message) > MAX_MESSAGE_CHARS:
                message = message[: MAX_MESSAGE_CHARS - 3] + "..."
            row_id = "" if row["id"] is None else str(row["id"])
            data.error_rows.append((shard, row_id, row["error_type"], message))


def _read_table(store: RunStore, path: str) -> Any:
    with store.fs.open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        names = set(parquet.schema_arrow.names)
        table = parquet.read(columns=[c for c in _RESULT_COLUMNS if c in names])
    for column in _RESULT_COLUMNS:  # an embed or score run has no ttft_s or itl_s: empty samples
        if column not in names:
            table = table.append_column(column, pa.nulls(table.num_rows, pa.float64()))
    return table


def _parse_time(value: Any) -> Optional[dt.datetime]:
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


# ---- figures ---------------------------------------------------------------------------------------


def _figures(data: _RunData) -> dict[str, str]:
    """figure id -> inline SVG."""
    # Figures on their own Agg canvas, not pyplot: no display needed, no global figure state, and
    # the backend a host process (a notebook) chose is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def new(height: float = 3.2) -> tuple[Any, Any]:
        fig = Figure(figsize=(9, height))
        FigureCanvasAgg(fig)
        return fig, fig.add_subplot()

    out = {}
    fig, ax = new()
    _throughput(ax, data.shards)
    out["fig-throughput"] = _svg(fig, "fig-throughput")
    for key, sample, label in (
        ("fig-ttft", data.ttft, "time to first token (s)"),
        ("fig-itl", data.itl, "inter-token latency (s)"),
    ):
        fig, ax = new()
        _histogram(ax, sample, label)
        out[key] = _svg(fig, key)
    fig, ax = new(max(2.0, 0.9 + 0.35 * len(data.outcomes)))
    _outcomes(ax, data.outcomes)
    out["fig-errors"] = _svg(fig, "fig-errors")
    return out


def _throughput(ax: Any, shards: Sequence[dict[str, Any]]) -> None:
    """Run-wide tokens/s over time. Each committed shard's tokens are spread evenly over its span
    (its marker's started_at to committed_at) and the spans are summed: shards overlap in the
    engine, so the sum, not any one shard's rate, is the run's rate at that moment."""
    spans = []
    for s in shards:
        start, end = s.get("started_at"), s.get("committed_at")
        if start is None and end is not None and s.get("wall_s") is not None:
            start = end - dt.timedelta(seconds=float(s["wall_s"]))
        if start is None or end is None or s.get("num_output_tokens") is None:
            continue
        prompt = s.get("num_prompt_tokens") or 0
        spans.append((start, end, float(s["num_output_tokens"]), float(s["num_output_tokens"] + prompt)))
    if not spans:
        _no_data(ax, "no committed shard with timing")
        return
    t0 = min(start for start, _, _, _ in spans)
    scale = 60.0 if max((end - t0).total_seconds() for _, end, _, _ in spans) > 600 else 1.0
    edges = sorted({(t - t0).total_seconds() for start, end, _, _ in spans for t in (start, end)})
    if len(edges) == 1:
        edges.append(edges[0] + 1e-3)
    output_rate, total_rate = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
    lefts = np.array(edges[:-1])
    for start, end, output, total in spans:
        a, b = (start - t0).total_seconds(), (end - t0).total_seconds()
        duration = max(b - a, 1e-3)
        inside = (lefts >= a) & (lefts < max(b, a + 1e-3))
        output_rate[inside] += output / duration
        total_rate[inside] += total / duration
    x = np.array(edges) / scale
    # Prompt tokens often outnumber output tokens many times: each rate gets its own axis.
    ax.stairs(output_rate, x, fill=True, alpha=0.35, color="tab:blue", label="output tokens/s (left)")
    ax.stairs(output_rate, x, color="tab:blue", linewidth=1.2)
    total = ax.twinx()
    total.stairs(total_rate, x, color="tab:orange", linewidth=1.2, linestyle="--")
    ax.plot([], [], color="tab:orange", linestyle="--", label="prompt + output tokens/s (right)")
    ax.set_xlabel("minutes since the first shard started" if scale == 60 else "seconds since the first shard started")
    ax.set_ylabel("output tokens / s")
    total.set_ylabel("prompt + output tokens / s")
    ax.set_ylim(0, output_rate.max() * 1.25 or 1)
    total.set_ylim(0, total_rate.max() * 1.25 or 1)
    ax.legend(loc="upper right")
    ax.set_title(f"throughput over time ({len(spans)} shards)")


def _histogram(ax: Any, sample: _Sample, label: str) -> None:
    values = sample.values
    if not len(values):
        _no_data(ax, f"no {label.split(' (')[0]} in the committed rows")
        return
    ax.hist(values, bins=40, color="tab:blue")
    for q, style in ((50, "-"), (95, "--"), (99, ":")):
        ax.axvline(
            np.percentile(values, q), color="black", linestyle=style, label=f"p{q} {np.percentile(values, q):.3g} s"
        )
    ax.set_xlabel(label)
    ax.set_ylabel("rows")
    ax.legend(loc="upper right")
    of = (
        f"a uniform sample of {len(values):,} of {sample.seen:,} rows"
        if sample.seen > len(values)
        else f"{sample.seen:,} rows"
    )
    ax.set_title(f"{label.split(' (')[0]} ({of})")


def _outcomes(ax: Any, outcomes: Counter[str]) -> None:
    if not outcomes:
        _no_data(ax, "no committed rows")
        return
    items = sorted(outcomes.items(), key=lambda kv: (kv[0] != "ok", -kv[1], kv[0]))[::-1]
    names, counts = [k for k, _ in items], [v for _, v in items]
    bars = ax.barh(names, counts, color=["tab:green" if k == "ok" else "tab:red" for k in names])
    ax.bar_label(bars, labels=[f"{c:,}" for c in counts], padding=3)
    ax.set_xlabel("rows")
    ax.set_xlim(right=max(counts) * 1.15)
    ax.set_title("rows by outcome: ok or the typed error")


def _no_data(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_axis_off()


_ID_ATTR = re.compile(r'\bid="([^"]+)"')
_ID_REF = re.compile(r'(url\(#|href="#)([^")]+)')


def _svg(fig: Any, prefix: str) -> str:
    """The figure as an <svg> element for inline use: text stays text (svg.fonttype none: small and
    selectable), and its ids get `prefix` so that several figures' ids never collide in one page."""
    import matplotlib

    fig.tight_layout()
    buffer = io.StringIO()
    # A fixed hash salt and no date: the same run gives the same page, byte for byte.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": prefix}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    text = _ID_ATTR.sub(lambda m: f'id="{prefix}-{m.group(1)}"', text)
    return _ID_REF.sub(lambda m: f"{m.group(1)}{prefix}-{m.group(2)}", text)


# ---- the page --------------------------------------------------------------------------------------

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.uri { font-family: monospace; color: #555; word-break: break-all; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; vertical-align: top; }
th { background: #f2f2f2; text-align: left; }
td.text { text-align: left; max-width: 520px; word-break: break-word; }
td:first-child { white-space: nowrap; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 14px; }
dt { color: #666; } dd { margin: 0; }
figure { margin: 0.5em 0; } figure svg { width: 100%; height: auto; }
.failed { color: #b00; }
"""


def render_report(store: RunStore) -> str:
    """The report page of the run in `store`, as HTML text."""
    data = _read_run(store)
    figures = _figures(data)
    e = html.escape
    m = data.manifest or {}
    num_rows = sum(data.outcomes.values())
    num_errors = num_rows - data.outcomes.get("ok", 0)
    overview = {
        "status": m.get("status"),
        "model": (m.get("model") or {}).get("path"),
        "workers": (m.get("worker") or {}).get("world_size"),
        "started": m.get("started_at"),
        "finished": m.get("finished_at"),
        "shards": f"{len(data.shards)} committed of {m.get('num_shards_total', len(data.shards))}",
        "rows": f"{num_rows:,} ({num_errors:,} errors)",
        "output tokens": f"{sum(s.get('num_output_tokens') or 0 for s in data.shards):,}",
        **_reasoning_overview(data.shards),
        "message": m.get("message"),
    }
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>batchrun report: {e(data.uri)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>batchrun run report</h1>",
        f'<p class="uri">{e(data.uri)}</p>',
        '<dl id="overview">',
        *(f"<dt>{e(k)}</dt><dd>{e(_text(v))}</dd>" for k, v in overview.items() if v is not None),
        "</dl>",
        "<p>From the committed shards only (their commit markers, results and metrics files).</p>",
    ]
    # What an operator must act on comes first.
    if data.not_committed:
        parts += [
            f'<h2 class="failed">Shards not committed ({len(data.not_committed)})</h2>',
            _table(
                "failed-shards",
                ["shard", "status", "worker", "error"],
                [[r.get("name"), r.get("status"), r.get("worker"), r.get("error")] for r in data.not_committed],
                text_columns={0, 1, 3},
            ),
        ]
    titles = {
        "fig-throughput": "Throughput over time",
        "fig-ttft": "Time to first token",
        "fig-itl": "Inter-token latency",
        "fig-errors": "Rows by outcome",
    }
    for key in FIGURE_IDS:
        parts += [f"<h2>{titles[key]}</h2>", f'<figure id="{key}">{figures[key]}</figure>']
    parts += ["<h2>Shards</h2>", _shard_table(data.shards)]
    if data.error_rows:
        shown = f"the first {len(data.error_rows)} of {num_errors:,}" if num_errors > len(data.error_rows) else "all"
        parts += [
            f"<h2>Error rows ({shown})</h2>",
            _table("error-rows", ["shard", "id", "error_type", "error_message"], data.error_rows, {0, 1, 2, 3}),
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


_SHARD_COLUMNS = [
    ("shard", "shard"),
    ("worker", "worker"),
    ("num_rows", "rows"),
    ("num_ok", "ok"),
    ("num_errors", "errors"),
    ("num_output_tokens", "output tokens"),
    ("wall_s", "wall s"),
    ("output_tokens_per_s", "output tok/s"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p95_s", "TTFT p95 s"),
    ("itl_p50_s", "ITL p50 s"),
    ("itl_p95_s", "ITL p95 s"),
    ("prefix_cache_hit_rate", "prefix cache hits"),
    ("num_preemptions", "preemptions"),
]


def _reasoning_overview(shards: Sequence[dict[str, Any]]) -> dict[str, str]:
    """A reasoning model's run (its metrics have the reasoning sums): the traces' share of the
    output tokens and the rows max_tokens cut inside their trace."""
    if not any(s.get("num_reasoning_tokens") is not None for s in shards):
        return {}
    reasoning = sum(s.get("num_reasoning_tokens") or 0 for s in shards)
    answer = sum(s.get("num_answer_tokens") or 0 for s in shards)
    cut = sum(s.get("num_thinking_length") or 0 for s in shards)
    return {"reasoning tokens": f"{reasoning:,} in traces, {answer:,} in answers, {cut:,} rows cut in the trace"}


def _shard_table(shards: Sequence[dict[str, Any]]) -> str:
    rows = [[s.get(key) for key, _ in _SHARD_COLUMNS] for s in shards]
    return _table("shard-table", [label for _, label in _SHARD_COLUMNS], rows, text_columns={0})


_TEXT_CELL = ' class="text"'


def _table(table_id: str, header: Sequence[str], rows: Sequence[Sequence[Any]], text_columns: set[int]) -> str:
    e = html.escape
    out = [f'<table id="{table_id}"><thead><tr>', *(f"<th>{e(h)}</th>" for h in header), "</tr></thead><tbody>"]
    for row in rows:
        cells = (f"<td{_TEXT_CELL if i in text_columns else ''}>{e(_text(v))}</td>" for i, v in enumerate(row))
        out.append(f"<tr>{''.join(cells)}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if value == value else ""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
