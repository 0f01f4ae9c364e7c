"""run_job end to end on real Parquet shards with the real engine over a tiny random model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.engine import EngineConfig, RequestMetrics, RequestOutput, SamplingParams
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, format_summary, run_job
from batchrun.job.formats.writer import METRICS_SCHEMA, RESULT_COLUMNS, ResultWriter, output_result, result_schema
from tests.support.engines import make_tiny_engine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def run_config(data_uri, output_uri, tiny_llama_dir, *, job: JobConfig | None = None, **kwargs) -> RunConfig:
    sampling = kwargs.pop("sampling", SamplingParams(temperature=0.0, max_tokens=8))
    data = kwargs.pop("data", {})
    return RunConfig(
        job=job or JobConfig(name="summarize", prompt_template="Summarize:\n{text}", system_prompt="Be brief."),
        model=ModelConfig(path=tiny_llama_dir),
        engine=EngineConfig(model=tiny_llama_dir, max_num_seqs=4),
        sampling=sampling,
        data=DataConfig(uri=str(data_uri), **data),
        output=OutputConfig(uri=str(output_uri), **kwargs.pop("output", {})),
        quiet=True,
        **kwargs,
    )


def read_rows(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_local_run_writes_every_row_once_in_input_order(tmp_path, make_shards, tiny_engine, tiny_llama_dir):
    ids = make_shards(tmp_path / "in", num_shards=2, rows_per_shard=5)
    out = tmp_path / "out"
    cfg = run_config(tmp_path / "in", out, tiny_llama_dir, output={"keep_columns": ("title",)})
    result = run_job(cfg, engine=tiny_engine)

    assert (result.exit_code, result.status) == (0, "completed")
    for s, shard in enumerate(["part-00", "part-01"]):
        rows = read_rows(out / "results" / f"{shard}.parquet")
        assert [r["id"] for r in rows] == ids[s]
        assert [r["title"] for r in rows] == [f"doc {i}" for i in ids[s]]
        for r in rows:
            assert r["error_type"] is None and r["finish_reason"] in ("stop", "length") and isinstance(r["output"], str)
            assert 1 <= r["num_output_tokens"] <= 8 and r["num_prompt_tokens"] > 20
            assert r["ttft_s"] > 0 and r["latency_s"] >= r["ttft_s"]
        assert pq.read_schema(out / "results" / f"{shard}.parquet").names == [*RESULT_COLUMNS, "title"]
        metrics = pq.read_table(out / "metrics" / f"{shard}.parquet")
        assert metrics.schema.equals(METRICS_SCHEMA)
        m = metrics.to_pylist()[0]
        assert (m["shard"], m["worker"], m["num_rows"], m["num_ok"], m["num_errors"]) == (shard, 0, 5, 5, 0)
        assert m["num_output_tokens"] == sum(r["num_output_tokens"] for r in rows)
        assert m["ttft_p50_s"] <= m["ttft_p95_s"] <= m["ttft_p99_s"]
        assert 0 < m["peak_kv_blocks_used"] <= m["num_kv_blocks_total"]
        # A dense model without speculation: those columns exist and are null.
        assert m["spec_acceptance_rate"] is None and m["num_spec_proposed"] is None and m["expert_token_counts"] is None
        assert (out / "_commits" / f"{shard}.json").exists()

    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert [(s["name"], s["status"], s["num_rows"]) for s in manifest["shards"]] == [
        ("part-00", "committed", 5),
        ("part-01", "committed", 5),
    ]
    assert manifest["model"]["fingerprint"] == tiny_engine.model_fingerprint
    assert manifest["engine_settings"]["max_num_seqs"] == 8
    assert manifest["config"]["sampling"]["max_tokens"] == 8 and manifest["versions"]["pyarrow"]
    assert manifest["engine_stats"]["num_generated_tokens"] > 0
    assert not (out / "_attempts").exists()
    table = format_summary(result)
    assert "part-00  committed" in table and "total" in table and str(out) in table


def test_rerun_skips_committed_shards_and_redoes_the_rest(tmp_path, make_shards, tiny_engine, tiny_llama_dir):
    ids = make_shards(tmp_path / "in", num_shards=3, rows_per_shard=3)
    out = tmp_path / "out"
    cfg = run_config(tmp_path / "in", out, tiny_llama_dir)
    first = run_job(cfg, engine=tiny_engine)
    assert first.exit_code == 0
    before = {p.name: p.read_bytes() for p in (out / "results").iterdir()}
    kept_marker = (out / "_commits" / "part-00.json").stat().st_mtime_ns
    # As if part-01 had never been committed (its marker lost, an un-committed file left where its
    # results go), and an attempt at it had been killed part way.
    (out / "_commits" / "part-01.json").unlink()
    pq.write_table(pa.table({"id": ["stale"]}), out / "results" / "part-01.parquet")
    crashed = out / "_attempts" / "part-01" / "20261201T000000-deadbeef0000"
    crashed.mkdir(parents=True)
    (crashed / "results.parquet").write_bytes(b"partial")

    second = run_job(cfg, engine=tiny_engine)
    assert second.exit_code == 0
    assert [(s.name, s.status) for s in second.shards] == [
        ("part-00", "skipped"),
        ("part-01", "committed"),
        ("part-02", "skipped"),
    ]
    assert (out / "_commits" / "part-00.json").stat().st_mtime_ns == kept_marker
    after = {p.name: p.read_bytes() for p in (out / "results").iterdir()}
    assert after["part-00.parquet"] == before["part-00.parquet"]
    redone = read_rows(out / "results" / "part-01.parquet")
    assert [r["id"] for r in redone] == ids[1]
    # Greedy: the redone shard says exactly what it said the first time.
    first_time = pq.read_table(pa.BufferReader(before["part-01.parquet"])).to_pylist()
    assert [r["output"] for r in redone] == [r["output"] for r in first_time]
    # Another attempt's files are never touched (it might be a frozen worker's), only never read.
    assert (crashed / "results.parquet").read_bytes() == b"partial"
    assert [p.name for p in (out / "_attempts").iterdir()] == ["part-01"]
    assert "skipped" in format_summary(second)


def _write(path: Path, columns: dict, schema: pa.Schema | None = None) -> None:
    pq.write_table(pa.table(columns, schema=schema), path)


def test_hostile_shards_every_row_gets_a_result_or_a_typed_error(tmp_path, short_texts, tiny_engine, tiny_llama_dir):
    src = tmp_path / "in"
    src.mkdir()
    t = short_texts
    _write(
        src / "a-mixed.parquet",
        {
            "id": ["ok1", "null", "empty", "blank", "long", "ok1", None, "notag", "ok2"],
            "text": [t[0], None, "", " \n\t ", " ".join(t[:12]), t[1], t[2], t[3], t[4]],
            "tags": [["x"], ["x"], ["x"], ["x"], ["x"], ["x"], ["x"], [], ["y"]],
        },
    )
    _write(src / "b-wrong-type.parquet", {"id": ["n1", "n2"], "text": [1, 2], "tags": [["x"], ["x"]]})
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    _write(
        src / "c-messages.parquet",
        {
            "id": ["m1", "m2", "m3"],
            "text": [[{"role": "user", "content": t[5]}], [{"role": "user", "content": None}], []],
            "tags": [["x"], ["x"], ["x"]],
        },
        pa.schema([("id", pa.string()), ("text", pa.list_(message)), ("tags", pa.list_(pa.string()))]),
    )
    _write(
        src / "d-empty.parquet",
        {
            "id": pa.array([], pa.string()),
            "text": pa.array([], pa.string()),
            "tags": pa.array([], pa.list_(pa.string())),
        },
    )
    _write(src / "e-no-text-column.parquet", {"id": ["z"], "body": ["hello"], "tags": [["x"]]})
    noise = bytes(random.Random(0).randrange(256) for _ in range(500))
    (src / "f-corrupt.parquet").write_bytes(b"PAR1" + noise + b"PAR1")
    good = src / "a-mixed.parquet"
    (src / "g-truncated.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    _write(src / "h-fine.parquet", {"id": ["h1"], "text": [t[6]], "tags": [["x"]]})

    out = tmp_path / "out"
    job = JobConfig(name="tagged", prompt_template="Tag {tags[0]}: {text}")
    result = run_job(run_config(src, out, tiny_llama_dir, job=job), engine=tiny_engine)

    status = {s.name: s.status for s in result.shards}
    assert status == {
        "a-mixed": "committed",
        "b-wrong-type": "committed",
        "c-messages": "committed",
        "d-empty": "committed",
        "e-no-text-column": "failed",
        "f-corrupt": "failed",
        "g-truncated": "failed",
        "h-fine": "committed",
    }
    assert result.exit_code == 1 and result.status == "failed"
    assert "3 of 8 shards failed" in result.message

    def errors(shard):
        return [(r["id"], r["error_type"]) for r in read_rows(out / "results" / f"{shard}.parquet")]

    assert errors("a-mixed") == [
        ("ok1", None),
        ("null", "null_prompt"),
        ("empty", "empty_prompt"),
        ("blank", "empty_prompt"),
        ("long", "prompt_too_long"),
        ("ok1", "duplicate_id"),
        (None, "null_id"),
        ("notag", "template_error"),
        ("ok2", None),
    ]
    assert errors("b-wrong-type") == [("n1", "wrong_type"), ("n2", "wrong_type")]
    assert errors("c-messages") == [("m1", None), ("m2", "template_error"), ("m3", "empty_prompt")]
    assert errors("d-empty") == [] and errors("h-fine") == [("h1", None)]
    mixed = read_rows(out / "results" / "a-mixed.parquet")
    assert all(
        r["output"] is None and r["finish_reason"] == "error" and r["error_message"] for r in mixed if r["error_type"]
    )
    assert mixed[4]["num_prompt_tokens"] > 500  # known even though it was refused
    m = pq.read_table(out / "metrics" / "a-mixed.parquet").to_pylist()[0]
    assert (m["num_rows"], m["num_ok"], m["num_errors"]) == (9, 2, 7)

    manifest = json.loads((out / "_manifest.json").read_text())
    failed = {s["name"]: s["error"] for s in manifest["shards"] if s["status"] == "failed"}
    assert "missing column 'text'" in failed["e-no-text-column"]
    assert failed["f-corrupt"].startswith("cannot read") and failed["g-truncated"].startswith("cannot read")
    for name in failed:
        assert not (out / "results" / f"{name}.parquet").exists() and not (out / "_commits" / f"{name}.json").exists()


def test_a_shard_that_breaks_part_way_commits_nothing(tmp_path, short_texts, tiny_engine, tiny_llama_dir):
    src = tmp_path / "in"
    src.mkdir()
    rng = random.Random(0)
    noise = ["".join(rng.choice("abcdefghij klmnop") for _ in range(2000)) for _ in range(8)]
    path = src / "broken.parquet"
    pq.write_table(
        pa.table({"id": [str(i) for i in range(8)], "text": noise}), path, row_group_size=4, compression="snappy"
    )
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(1)
    data = bytearray(path.read_bytes())
    data[chunk.data_page_offset + 200 : chunk.data_page_offset + 2200] = bytes(2000)  # second row group's text
    path.write_bytes(bytes(data))
    _write(src / "ok.parquet", {"id": ["a"], "text": [short_texts[0]]})

    out = tmp_path / "out"
    cfg = run_config(src, out, tiny_llama_dir, job=JobConfig(name="raw"), data={"batch_size": 2})
    result = run_job(cfg, engine=tiny_engine)
    assert [(s.name, s.status) for s in result.shards] == [("broken", "failed"), ("ok", "committed")]
    assert "at row 4" in result.shards[0].error
    assert not (out / "results" / "broken.parquet").exists() and not (out / "_attempts").exists()
    assert read_rows(out / "results" / "ok.parquet")[0]["error_type"] is None


def test_truncate_policy_keeps_long_rows(tmp_path, short_texts, tiny_engine, tiny_llama_dir):
    src = tmp_path / "in"
    src.mkdir()
    _write(src / "s.parquet", {"id": ["long", "short"], "text": [" ".join(short_texts[:12]), short_texts[0]]})
    out = tmp_path / "out"
    cfg = run_config(src, out, tiny_llama_dir, data={"on_too_long": "truncate"})
    assert run_job(cfg, engine=tiny_engine).exit_code == 0
    long, short = read_rows(out / "results" / "s.parquet")
    assert long["error_type"] is None and long["error_message"].startswith("truncated from ")
    assert long["num_prompt_tokens"] + 8 <= tiny_engine.max_model_len and long["output"] is not None
    assert short["error_message"] is None


def test_sampling_with_a_seed_is_reproducible_per_row(tmp_path, make_shards, tiny_engine, tiny_llama_dir):
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=4)
    sampling = SamplingParams(temperature=1.0, seed=7, max_tokens=8)
    one_at_a_time = make_tiny_engine(tiny_llama_dir, max_num_seqs=1, kv_cache_memory=16 << 20)
    outputs = []
    for name, engine in (("batched", tiny_engine), ("one", one_at_a_time)):
        cfg = run_config(tmp_path / "in", tmp_path / name, tiny_llama_dir, sampling=sampling)
        assert run_job(cfg, engine=engine).exit_code == 0
        outputs.append([r["output"] for r in read_rows(tmp_path / name / "results" / "part-00.parquet")])
    assert outputs[0] == outputs[1]
    assert len(set(outputs[0])) == 4  # distinct rows, distinct seeds


def test_memory_filesystem_in_and_out(make_shards, tmp_path, tiny_engine, tiny_llama_dir):
    ids = make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2)
    fs = fsspec.filesystem("memory")
    for p in sorted((tmp_path / "in").iterdir()):
        fs.pipe_file(f"/job-mem/in/{p.name}", p.read_bytes())
    try:
        result = run_job(run_config("memory://job-mem/in", "memory://job-mem/out", tiny_llama_dir), engine=tiny_engine)
        assert result.exit_code == 0
        with fs.open("/job-mem/out/results/part-01.parquet", "rb") as f:
            assert pq.read_table(f).column("id").to_pylist() == ids[1]
        assert fs.exists("/job-mem/out/_commits/part-00.json") and fs.exists("/job-mem/out/_manifest.json")
        assert not fs.exists("/job-mem/out/_attempts/part-00")
        assert (
            run_job(run_config("memory://job-mem/in", "memory://job-mem/out", tiny_llama_dir), engine=tiny_engine)
            .shards[0]
            .status
            == "skipped"
        )
    finally:
        fs.rm("/job-mem", recursive=True)


def test_outputs_load_with_datasets_and_pandas(tmp_path, make_shards, tiny_engine, tiny_llama_dir, monkeypatch):
    import datasets
    import pandas as pd

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ids = make_shards(tmp_path / "in", num_shards=2, rows_per_shard=3)
    out = tmp_path / "out"
    assert run_job(run_config(tmp_path / "in", out, tiny_llama_dir), engine=tiny_engine).exit_code == 0
    results = datasets.load_dataset("parquet", data_files=str(out / "results" / "*.parquet"), split="train")
    assert sorted(results["id"]) == sorted(i for part in ids for i in part)
    assert results.column_names == RESULT_COLUMNS
    metrics = pd.read_parquet(out / "metrics")
    assert sorted(metrics["shard"]) == ["part-00", "part-01"] and metrics["num_rows"].sum() == 6


def test_result_writer_restores_input_order_and_writes_as_it_goes(tmp_path, monkeypatch):
    monkeypatch.setattr("batchrun.job.formats.writer.ROWS_PER_ROW_GROUP", 3)
    fs = fsspec.filesystem("file")
    path = str(tmp_path / "r.parquet")
    writer = ResultWriter(fs, path, result_schema([]))
    written_so_far = []
    for i in [1, 0, 3, 2, 5, 4, 9, 8, 7, 6]:  # pairs finish swapped
        writer.put(i, {"id": str(i), **{c: None for c in RESULT_COLUMNS[1:]}})
        written_so_far.append(writer.num_rows)
    # Rows reach the file once they and all rows before them are done, not only at close.
    assert written_so_far == [0, 0, 0, 4, 4, 4, 4, 4, 4, 10]
    assert writer.close() == 10
    assert pq.read_table(path).column("id").to_pylist() == [str(i) for i in range(10)]


def test_an_engine_error_output_becomes_an_engine_error_row():
    out = RequestOutput(
        request_id=3,
        prompt_token_ids=[1, 2, 3],
        token_ids=[],
        text="",
        finish_reason="error",
        error="prompt has 3 tokens but max_model_len is 2",
        metrics=RequestMetrics(latency_s=0.1),
    )
    row = output_result("r3", out, None, {"title": "t"})
    assert (row["id"], row["error_type"], row["output"], row["finish_reason"]) == ("r3", "engine_error", None, "error")
    assert row["error_message"] == out.error and row["num_prompt_tokens"] == 3 and row["title"] == "t"


def test_progress_bar_unless_quiet_and_ids_from_row_index_without_an_id_column(
    tmp_path, short_texts, tiny_engine, tiny_llama_dir, capsys
):
    src = tmp_path / "in"
    src.mkdir()
    _write(src / "noid.parquet", {"text": short_texts[:3]})
    cfg = run_config(src, tmp_path / "out", tiny_llama_dir, data={"id_column": None})
    loud = RunConfig(**{**cfg.__dict__, "quiet": False})
    assert run_job(loud, engine=tiny_engine).exit_code == 0
    err = capsys.readouterr().err
    assert "3/3" in err and "tok/s" in err and "shards 1/1" in err
    assert [r["id"] for r in read_rows(tmp_path / "out" / "results" / "noid.parquet")] == ["noid-0", "noid-1", "noid-2"]

    quiet = run_config(src, tmp_path / "out-quiet", tiny_llama_dir, data={"id_column": None})
    assert run_job(quiet, engine=tiny_engine).exit_code == 0
    err = capsys.readouterr().err
    assert "3/3" not in err and "shards 1/1" not in err  # no bar (the per-shard log line may remain)
    assert "Logging error" not in err


def test_two_workers_split_the_shards_and_match_one_worker(tmp_path, make_shards, tiny_engine, tiny_llama_dir):
    from batchrun.job import LauncherConfig

    make_shards(tmp_path / "in", num_shards=3, rows_per_shard=2)
    single = run_config(tmp_path / "in", tmp_path / "one", tiny_llama_dir)
    assert run_job(single, engine=tiny_engine).exit_code == 0
    for rank in (1, 0):
        cfg = RunConfig(
            **{
                **run_config(tmp_path / "in", tmp_path / "two", tiny_llama_dir).__dict__,
                # Run one after the other: with stealing on, rank 1 would take all.
                "launcher": LauncherConfig(rank=rank, world_size=2, work_stealing=False),
            }
        )
        result = run_job(cfg, engine=tiny_engine)
        assert [s.name for s in result.shards] == (["part-00", "part-02"] if rank == 0 else ["part-01"])
        manifest = json.loads((tmp_path / "two" / f"_manifest.rank{rank}.json").read_text())
        assert manifest["worker"]["rank"] == rank and manifest["worker"]["world_size"] == 2
    merged = json.loads((tmp_path / "two" / "_manifest.json").read_text())  # the last finisher merges
    assert merged["status"] == "completed" and [s["status"] for s in merged["shards"]] == ["committed"] * 3
    assert pq.read_table(tmp_path / "two" / "metrics" / "part-01.parquet").column("worker").to_pylist() == [1]
    for shard in ("part-00", "part-01", "part-02"):
        # Greedy output does not depend on which worker ran the shard.
        assert read_rows(tmp_path / "one" / "results" / f"{shard}.parquet") != [] and [
            r["output"] for r in read_rows(tmp_path / "one" / "results" / f"{shard}.parquet")
        ] == [r["output"] for r in read_rows(tmp_path / "two" / "results" / f"{shard}.parquet")]
