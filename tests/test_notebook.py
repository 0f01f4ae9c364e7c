"""notebooks/analyze_run.ipynb really runs (nbclient, python3 kernel) on a run made here."""

from __future__ import annotations

import nbclient
import nbformat
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.engine import SamplingParams
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
from batchrun.job.formats.writer import METRICS_SCHEMA
from tests.support import REPO

NOTEBOOK = REPO / "notebooks" / "analyze_run.ipynb"


def test_notebook_is_saved_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_notebook_runs_on_a_real_run(tmp_path, make_shards, short_texts, tiny_engine, tiny_llama_dir, monkeypatch):
    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=3)
    pq.write_table(
        pa.table({"id": ["e1", "e2"], "title": ["x", "y"], "text": [None, "  "]}),
        tmp_path / "in" / "part-errors.parquet",
    )
    out = tmp_path / "run"
    config = RunConfig(
        job=JobConfig(prompt_template="Summarize:\n{text}"),
        model=ModelConfig(path=tiny_llama_dir),
        # two samples per row with logprobs, so the notebook's samples and logprobs cell runs too
        sampling=SamplingParams(temperature=0.8, seed=0, max_tokens=8, n=2, logprobs=2),
        data=DataConfig(uri=str(tmp_path / "in")),
        output=OutputConfig(uri=str(out)),
        quiet=True,
    )
    assert run_job(config, engine=tiny_engine).exit_code == 0
    # Pretend one shard ran an MoE model with speculation, so the notebook's optional plots run too.
    metrics_path = out / "metrics" / "part-01.parquet"
    row = pq.read_table(metrics_path).to_pylist()[0]
    row.update(
        num_spec_proposed=40,
        num_spec_accepted=30,
        spec_acceptance_rate=0.75,
        expert_token_counts=[[3, 1, 0, 4], [2, 2, 2, 2]],
    )
    pq.write_table(pa.Table.from_pylist([row], schema=METRICS_SCHEMA), metrics_path)
    # An uncommitted results file (as a crash before the marker leaves) must not be read.
    pq.write_table(pq.read_table(out / "results" / "part-00.parquet"), out / "results" / "part-zz.parquet")
    # A committed shard whose committer died before publishing its files must be read all the same.
    import json

    attempt = out / json.loads((out / "_commits" / "part-errors.json").read_text())["attempt_dir"]
    attempt.mkdir(parents=True)
    for kind in ("results", "metrics"):
        (out / kind / "part-errors.parquet").rename(attempt / f"{kind}.parquet")

    monkeypatch.setenv("BATCHRUN_RUN_DIR", str(out))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )  # the kernel's cwd
    client.execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # latency histograms, throughput per shard, outcomes, logprobs, expert load
    text = "\n".join(o.get("text", "") for o in outputs)
    assert "3 committed shards: part-00, part-01, part-errors" in text
    assert "16 rows, 4 errors" in text  # 8 input rows, 2 samples each
    assert "2 samples per row" in text and "mean logprob per output token: median" in text
    spec_line = next(line for line in text.splitlines() if line.startswith("part-01 "))
    assert spec_line.split() == ["part-01", "40.0", "30.0", "0.75"]
