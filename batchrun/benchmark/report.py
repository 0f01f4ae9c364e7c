"""The benchmark's table, files and printout: one row per system, ratios taken within a round.

Files in {output.uri}/benchmark/ (one set per workload, so workloads sit side by side):
  {workload}.parquet       one row per system (SUMMARY_COLUMNS)
  {workload}_runs.parquet  one row per system and round
  {workload}.png           output tok/s per system (min..max over rounds) and TTFT/ITL percentiles
  {workload}.json          the engine's resolved settings, matmul peaks, machine load, the config

Achieved FLOP/s is approximate: 2 x parameters x tokens computed / wall time, where tokens computed
are the prompt tokens not served from a prefix cache plus the output tokens (for the HF baseline,
every position of every padded batch step). Attention FLOPs are left out. The peak is the best
rate of a (tokens, hidden) x (hidden, intermediate) matmul in the same dtype, timed in every round.
"""

from __future__ import annotations

import io
import json
import posixpath
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.benchmark.doc import markdown_table
from batchrun.benchmark.timing import TimedRun, median_ratio
from batchrun.job.shards import open_filesystem

if TYPE_CHECKING:
    from batchrun.benchmark.config import BenchmarkConfig

REFERENCES = {
    "ratio_vs_hf_fp32": "hf_fp32",
    "ratio_vs_hf_bf16": "hf_bf16",
    "ratio_vs_no_prefix_cache": "batchrun_no_prefix_cache",
    "ratio_vs_engine": "batchrun",  # the job path's systems against the engine's own stream
    "ratio_vs_job_one_shard": "batchrun_job",  # sharded job runs against the same rows as one shard
}
JOB_RATIOS = ("ratio_vs_engine", "ratio_vs_job_one_shard")  # filled on the job path's rows only
SUMMARY_COLUMNS = [
    "workload",
    "system",
    "dtype",
    "num_prompts",
    "max_tokens",
    "repeats",
    "mean_prompt_tokens",
    "num_output_tokens",  # per round
    "prefix_cache_hit_rate",  # prompt tokens served from the prefix cache
    "wall_s",
    "output_tok_s",
    "output_tok_s_min",
    "output_tok_s_max",
    "total_tok_s",  # medians over rounds
    "ttft_p50_s",
    "ttft_p95_s",
    "itl_p50_s",
    "itl_p95_s",  # over requests of every round
    *REFERENCES,  # output tok/s over the reference's, per round, median over rounds
    "flops_per_s",
    "peak_flops_per_s",
    "peak_fraction",
    # greedy_match: tokens identical to batchrun's for every prompt, recorded where both must agree
    # (HF in float32 against a float32 engine; batchrun variants of the same engine); else null.
    # identical_fraction: prompts whose tokens equal batchrun's, or the first system's when batchrun
    # did not run (that system's own row: its last round against its first)
    "greedy_match",
    "identical_fraction",
    "max_num_seqs",
    "max_num_batched_tokens",
    "hf_batch_size",
]


@dataclass
class BenchmarkResult:
    workload: str
    rows: list[dict[str, Any]]  # SUMMARY_COLUMNS, one per system
    runs: list[dict[str, Any]]  # one per system and round
    settings: dict[str, Any]  # engine settings, peaks, load (the .json file)
    files: Optional[list[str]] = None  # URLs written


def build_result(bench: BenchmarkConfig, runs: dict[str, list[TimedRun]], settings: dict[str, Any]) -> BenchmarkResult:
    engine = settings["engine"]
    engine_dtype = engine["dtype"]
    reference_name = "batchrun" if "batchrun" in runs else next(iter(runs))
    reference = runs[reference_name][0].token_ids
    rows, run_rows = [], []
    for system, timed in runs.items():
        dtype = {"hf_fp32": "float32", "hf_bf16": "bfloat16"}.get(system, engine_dtype)
        tok_s = [t.num_output_tokens / t.wall_s for t in timed]
        ttfts = [v for t in timed for v in t.ttfts_s]
        itls = [v for t in timed for v in t.itls_s]
        peak = settings["matmul_peak_flops_per_s"].get(dtype)
        flops = statistics.median(2.0 * settings["num_parameters"] * t.num_computed_tokens / t.wall_s for t in timed)
        # batchrun itself: its last round against its first (greedy runs must repeat exactly).
        mine = timed[-1].token_ids if system == reference_name else timed[0].token_ids
        identical = sum(a == b for a, b in zip(mine, reference, strict=True)) / len(reference)
        must_match = system != reference_name and (
            system.startswith("batchrun") or (system == "hf_fp32" and engine_dtype == "float32")
        )
        is_batchrun = system.startswith("batchrun")
        first = timed[0]
        rows.append(
            {
                "workload": bench.workload,
                "system": system,
                "dtype": dtype,
                "num_prompts": len(first.token_ids),
                "max_tokens": bench.max_tokens,
                "repeats": len(timed),
                "mean_prompt_tokens": first.num_prompt_tokens / len(first.token_ids),
                "num_output_tokens": first.num_output_tokens,
                "prefix_cache_hit_rate": sum(t.num_cached_tokens for t in timed)
                / sum(t.num_prompt_tokens for t in timed),
                "wall_s": statistics.median(t.wall_s for t in timed),
                "output_tok_s": statistics.median(tok_s),
                "output_tok_s_min": min(tok_s),
                "output_tok_s_max": max(tok_s),
                "total_tok_s": statistics.median((t.num_prompt_tokens + t.num_output_tokens) / t.wall_s for t in timed),
                "ttft_p50_s": _percentile(ttfts, 50),
                "ttft_p95_s": _percentile(ttfts, 95),
                "itl_p50_s": _percentile(itls, 50),
                "itl_p95_s": _percentile(itls, 95),
                **{
                    column: _ratio(timed, runs.get(ref))
                    if column not in JOB_RATIOS or system.startswith("batchrun_job")
                    else None
                    for column, ref in REFERENCES.items()
                },
                "flops_per_s": flops,
                "peak_flops_per_s": peak,
                "peak_fraction": flops / peak if peak else None,
                "greedy_match": (identical == 1.0) if must_match else None,
                "identical_fraction": identical,
                "max_num_seqs": engine["max_num_seqs"] if is_batchrun else None,
                "max_num_batched_tokens": engine["max_num_batched_tokens"] if is_batchrun else None,
                "hf_batch_size": None if is_batchrun else bench.hf_batch_size,
            }
        )
        for round_index, t in enumerate(timed):
            run_rows.append(
                {
                    "workload": bench.workload,
                    "system": system,
                    "round": round_index,
                    "wall_s": t.wall_s,
                    "num_prompt_tokens": t.num_prompt_tokens,
                    "num_output_tokens": t.num_output_tokens,
                    "num_cached_tokens": t.num_cached_tokens,
                    "num_computed_tokens": t.num_computed_tokens,
                    "output_tok_s": t.num_output_tokens / t.wall_s,
                    "ttft_p50_s": _percentile(t.ttfts_s, 50),
                    "itl_p50_s": _percentile(t.itls_s, 50),
                }
            )
    return BenchmarkResult(bench.workload, rows, run_rows, settings)


def _percentile(values: list[float], q: float) -> Optional[float]:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def _ratio(timed: list[TimedRun], reference: Optional[list[TimedRun]]) -> Optional[float]:
    """Median over rounds of this system's output tok/s over the reference's in the same round."""
    if not reference:
        return None
    return median_ratio(
        [t.num_output_tokens / t.wall_s for t in timed], [t.num_output_tokens / t.wall_s for t in reference]
    )


# ---- files ----------------------------------------------------------------------------------------


def write_result(result: BenchmarkResult, output_uri: str, storage_options: dict[str, Any]) -> None:
    fs, root = open_filesystem(output_uri, storage_options)
    directory = posixpath.join(root, "benchmark")
    fs.makedirs(directory, exist_ok=True)
    name = result.workload

    def put(filename: str, data: bytes) -> str:
        path = posixpath.join(directory, filename)
        with fs.open(path, "wb") as f:
            f.write(data)
        return str(fs.unstrip_protocol(path))

    files = [
        put(f"{name}.parquet", _parquet(result.rows, SUMMARY_COLUMNS)),
        put(f"{name}_runs.parquet", _parquet(result.runs, list(result.runs[0]))),
        put(f"{name}.png", _plot(result)),
        put(f"{name}.json", json.dumps(result.settings, indent=2, default=str).encode()),
    ]
    result.files = files


def _parquet(rows: list[dict[str, Any]], columns: list[str]) -> bytes:
    table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows])
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def _plot(result: BenchmarkResult) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    names = [r["system"] for r in rows]
    x = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    tok_s = [r["output_tok_s"] for r in rows]
    errors = [
        [r["output_tok_s"] - r["output_tok_s_min"] for r in rows],
        [r["output_tok_s_max"] - r["output_tok_s"] for r in rows],
    ]
    bars = left.bar(
        x, tok_s, yerr=errors, capsize=4, color=["tab:blue" if n.startswith("batchrun") else "tab:gray" for n in names]
    )
    for bar, r in zip(bars, rows):
        label = f"{r['output_tok_s']:.0f}"
        if r["system"] == "batchrun" and r["ratio_vs_hf_bf16"] is not None:
            label += f"\n{r['ratio_vs_hf_bf16']:.1f}x hf_bf16"
        left.annotate(
            label, (bar.get_x() + bar.get_width() / 2, r["output_tok_s_max"]), ha="center", va="bottom", fontsize=8
        )
    left.set_xticks(x, names, rotation=20, ha="right")
    left.set_ylabel("output tokens / s (median, min..max over rounds)")
    left.set_title(f"{result.workload}: {rows[0]['num_prompts']} prompts, {rows[0]['max_tokens']} new tokens")
    width = 0.2
    for k, (column, label) in enumerate(
        [("ttft_p50_s", "TTFT p50"), ("ttft_p95_s", "TTFT p95"), ("itl_p50_s", "ITL p50"), ("itl_p95_s", "ITL p95")]
    ):
        right.bar(x + (k - 1.5) * width, [r[column] or 0.0 for r in rows], width, label=label)
    right.set_yscale("log")
    right.set_xticks(x, names, rotation=20, ha="right")
    right.set_ylabel("seconds (HF: per static batch)")
    right.legend(fontsize=8)
    load = result.settings.get("load_average_start", [None])[0]
    fig.suptitle(
        f"batchrun vs HF generate, engine {result.settings['engine']['dtype']}, load average {load:.1f}"
        if load is not None
        else "batchrun vs HF generate",
        fontsize=10,
    )
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


# ---- printout -------------------------------------------------------------------------------------

_PRINTED = [
    ("system", "system", "{}"),
    ("dtype", "dtype", "{}"),
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("total_tok_s", "total tok/s", "{:.1f}"),
    ("ttft_p50_s", "TTFT p50", "{:.2f}"),
    ("ttft_p95_s", "TTFT p95", "{:.2f}"),
    ("itl_p50_s", "ITL p50", "{:.3f}"),
    ("itl_p95_s", "ITL p95", "{:.3f}"),
    ("ratio_vs_hf_fp32", "x hf_fp32", "{:.2f}"),
    ("ratio_vs_hf_bf16", "x hf_bf16", "{:.2f}"),
    ("ratio_vs_no_prefix_cache", "x no_cache", "{:.2f}"),
    ("ratio_vs_engine", "x engine", "{:.2f}"),
    ("ratio_vs_job_one_shard", "x 1 shard", "{:.2f}"),
    ("prefix_cache_hit_rate", "cache hit", "{:.0%}"),
    ("peak_fraction", "of peak", "{:.0%}"),
    ("greedy_match", "greedy=", "{}"),
    ("identical_fraction", "identical", "{:.0%}"),
]


def format_benchmark(result: BenchmarkResult) -> str:
    cells = _cells(result)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", *_settings_lines(result)]
    if result.files:
        lines.append(
            f"written: {posixpath.dirname(result.files[0])}/{result.workload}.{{parquet,png,json}}, "
            f"{result.workload}_runs.parquet"
        )
    return "\n".join(lines)


def markdown_benchmark(result: BenchmarkResult) -> tuple[str, str]:
    """(table, notes) of docs/benchmarks.md's section: the printed table and its settings lines."""
    cells = _cells(result)
    return markdown_table(cells[0], cells[1:]), "\n".join(f"{line}." for line in _settings_lines(result))


def _cells(result: BenchmarkResult) -> list[list[str]]:
    """The header, then one row per system: the printed columns that have a value somewhere."""
    columns = [c for c in _PRINTED if any(r[c[0]] is not None for r in result.rows)]
    cells = [[label for _, label, _ in columns]]
    for r in result.rows:
        cells.append(["-" if r[key] is None else fmt.format(r[key]) for key, _, fmt in columns])
    return cells


def _settings_lines(result: BenchmarkResult) -> list[str]:
    s = result.settings
    engine = s["engine"]
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in s["matmul_peak_flops_per_s"].items())
    load = " -> ".join(f"{la[0]:.2f}" for la in (s["load_average_start"], s["load_average_end"]))
    return [
        f"workload {result.workload}: {result.rows[0]['num_prompts']} prompts, "
        f"{result.rows[0]['mean_prompt_tokens']:.0f} prompt tokens on average, "
        f"{result.rows[0]['max_tokens']} new tokens, "
        f"{result.rows[0]['repeats']} alternating rounds" + "".join(f", {k} {v}" for k, v in s["workload"].items()),
        f"engine: {engine['dtype']} on {engine['device']}, {engine['num_threads']} threads, max_num_seqs "
        f"{engine['max_num_seqs']}, max_num_batched_tokens {engine['max_num_batched_tokens']}, "
        f"{engine['num_kv_blocks']} KV blocks x {engine['block_size']}; planner {s['planner']['order']}"
        f"{'' if s['planner']['enabled'] else ' (off)'}",
        f"matmul peak GFLOP/s ({'x'.join(map(str, s['matmul_shape']))}): {peaks}; "
        f"{s['num_parameters'] / 1e6:.1f}M parameters; load average (1 min) {load} on {s['num_cpus']} CPUs",
        *_kernel_lines(engine),
    ]


def _kernel_lines(engine: dict[str, Any]) -> list[str]:
    """The engine's kernel set (EngineSettings.kernels) in one line: target, binder, tuning."""
    k = engine.get("kernels")
    if not k:
        return []
    native = "on" if k["target"]["native_cpu_kernels"] else "off"
    # a measured CPU set: the linear kinds torch's kernels serve at some row counts
    torch_linears = "".join(f"; {c['kind']}: {c['kernels']}" for c in k["linears"]["float"].get("torch_kernels", []))
    return [
        f"kernels: {k['binder']} set for {k['target']['name']} (native CPU kernels {native}), "
        f"attention {k['kernels']['paged_attention']}, tuning: {k['tuning']['source']}{torch_linears}"
    ]
