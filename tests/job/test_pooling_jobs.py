"""Embed and score jobs end to end: real Parquet shards, the real engine over tiny pooling models
(a Qwen3 with a last-token sentence-transformers pipeline, LlamaForSequenceClassification heads)."""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.engine import Engine, EngineConfig, SamplingParams
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, format_summary, run_job
from batchrun.job.config import PlannerConfig
from batchrun.job.launch.dry_run import plan_run
from batchrun.job.operate.report import write_report
from batchrun.job.operate.status import main as status_main
from tests.support.pooling_models import make_tiny_classifier, make_tiny_sentence_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

EMBED_COLUMNS = [
    "id",
    "embedding",
    "finish_reason",
    "error_type",
    "error_message",
    "num_prompt_tokens",
    "num_truncated_tokens",
    "latency_s",
]


def pooling_engine(path) -> Engine:
    """engine.task auto: the model directory says embed or score."""
    return Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", tune_kernels=False))


@pytest.fixture(scope="module")
def embed_engine(tmp_path_factory):
    return pooling_engine(make_tiny_sentence_model(tmp_path_factory.mktemp("st") / "qwen3_st"))


@pytest.fixture(scope="module")
def classifier_engine(tmp_path_factory):
    labels = ["negative", "neutral", "positive"]
    return pooling_engine(make_tiny_classifier(tmp_path_factory.mktemp("cls") / "llama_cls", labels))


@pytest.fixture(scope="module")
def reward_engine(tmp_path_factory):
    return pooling_engine(make_tiny_classifier(tmp_path_factory.mktemp("rm") / "llama_rm", seed=1))


def config(engine, data_uri, out, task, *, data=None, output=None, job=None) -> RunConfig:
    path = engine.model_path
    return RunConfig(
        job=JobConfig(name=task, task=task, chat_template="never", **(job or {})),
        model=ModelConfig(path=path),
        engine=EngineConfig(model=path, dtype="float32", device="cpu"),
        sampling=SamplingParams(temperature=0.0, max_tokens=8),
        data=DataConfig(uri=str(data_uri), **(data or {})),
        output=OutputConfig(uri=str(out), **(output or {})),
        quiet=True,
    )


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embed_job_writes_the_engines_embeddings_typed_error_rows_and_resumes(
    tmp_path, make_shards, short_texts, embed_engine, capsys
):
    data = tmp_path / "in"
    ids = make_shards(data, num_shards=2, rows_per_shard=3)
    long_text = " ".join(short_texts[:4])  # over the pipeline's max_seq_length of 200 tokens
    pq.write_table(
        pa.table({"id": ["n", "e", "long"], "title": ["t"] * 3, "text": [None, "  ", long_text]}),
        data / "part-02.parquet",
    )
    out = tmp_path / "out"
    prom = tmp_path / "embed.prom"
    cfg = config(embed_engine, data, out, "embed", output={"keep_columns": ("title",), "metrics_textfile": str(prom)})
    plan = plan_run(cfg, engine=embed_engine)  # the dry run: no prompt_too_long for embed, no output tokens
    assert (plan.num_rows, plan.num_ok, plan.max_output_tokens) == (9, 7, 0)
    assert plan.error_counts == {"empty_prompt": 1, "null_prompt": 1}
    result = run_job(cfg, engine=embed_engine)
    assert (result.exit_code, result.status) == (0, "completed")

    for s, shard in enumerate(["part-00", "part-01"]):
        path = out / "results" / f"{shard}.parquet"
        assert pq.read_schema(path).names == [*EMBED_COLUMNS, "title"]
        assert pq.read_schema(path).field("embedding").type == pa.list_(pa.float32())
        rows = pq.read_table(path).to_pylist()
        assert [r["id"] for r in rows] == ids[s]
        texts = [short_texts[s * 3 + r] for r in range(3)]
        expected = embed_engine.embed(texts)
        for row, vector in zip(rows, expected, strict=True):
            assert row["error_type"] is None and row["finish_reason"] == "pooled"
            assert len(row["embedding"]) == vector.shape[0] and cosine(row["embedding"], vector) >= 0.99999
            assert row["num_prompt_tokens"] > 0 and row["num_truncated_tokens"] == 0 and row["latency_s"] > 0

    odd = pq.read_table(out / "results" / "part-02.parquet").to_pylist()
    assert [(r["id"], r["error_type"]) for r in odd] == [("n", "null_prompt"), ("e", "empty_prompt"), ("long", None)]
    assert odd[0]["embedding"] is None and odd[1]["embedding"] is None
    assert (
        odd[2]["num_truncated_tokens"] > 0 and cosine(odd[2]["embedding"], embed_engine.embed([long_text])[0]) > 0.99999
    )

    metrics = pq.read_table(out / "metrics" / "part-02.parquet").to_pylist()[0]
    assert (metrics["num_rows"], metrics["num_errors"], metrics["num_output_tokens"]) == (3, 2, 0)
    assert metrics["num_truncated_rows"] == 1 and metrics["rows_per_s"] > 0 and metrics["prompt_tokens_per_s"] > 0
    assert "rows/s:" in format_summary(result)

    # Operating the run: status and the report read the pooled files without their token columns.
    assert status_main([str(out), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["num_rows_done"], status["num_errors"], status["num_output_tokens"]) == (9, 2, 0)
    write_report(str(out), out=str(tmp_path / "report.html"))
    prom_values = {
        line.split("{")[0]: line.rsplit(" ", 1)[1] for line in prom.read_text().splitlines() if line[0] != "#"
    }
    assert prom_values["batchrun_rows_done_total"] == "9" and float(prom_values["batchrun_rows_per_second"]) > 0

    # A rerun finds every shard committed and runs nothing.
    before = embed_engine.stats().num_prompt_tokens
    again = run_job(cfg, engine=embed_engine)
    assert again.exit_code == 0 and embed_engine.stats().num_prompt_tokens == before


def test_score_job_scores_prompt_response_pairs_as_conversations(tmp_path, classifier_engine):
    prompts = ["What is a list?", "Name a keyword.", "Why tuples?", "What is None?"]
    responses = ["A mutable sequence.", "def", None, "The null object."]
    data = tmp_path / "in"
    data.mkdir()
    pq.write_table(pa.table({"id": [1, 2, 3, 4], "prompt": prompts, "response": responses}), data / "qa.parquet")
    out = tmp_path / "out"
    cfg = config(
        classifier_engine,
        data,
        out,
        "score",
        data={"text_column": "prompt", "response_column": "response"},
        job={"system_prompt": "Judge the answer."},
    )
    assert run_job(cfg, engine=classifier_engine).exit_code == 0

    path = out / "results" / "qa.parquet"
    assert pq.read_schema(path).names[:4] == ["id", "score", "label", "finish_reason"]
    assert "embedding" not in pq.read_schema(path).names and "output" not in pq.read_schema(path).names
    rows = pq.read_table(path).to_pylist()
    tok = classifier_engine.tokenizer
    ok = [i for i, r in enumerate(responses) if r is not None]
    conversations = [
        tok.apply_chat_template(
            [
                {"role": "system", "content": "Judge the answer."},
                {"role": "user", "content": prompts[i]},
                {"role": "assistant", "content": responses[i]},
            ],
            tokenize=False,
            add_generation_prompt=False,
        )
        for i in ok
    ]
    expected = classifier_engine.score([tok.encode(c, add_special_tokens=False) for c in conversations])
    for i, scores in zip(ok, expected, strict=True):
        row = rows[i]
        assert row["error_type"] is None and len(row["score"]) == 3
        np.testing.assert_allclose(row["score"], scores, atol=1e-4)
        assert row["label"] == ["negative", "neutral", "positive"][int(np.argmax(scores))]
        assert row["num_prompt_tokens"] == len(tok.encode(conversations[ok.index(i)], add_special_tokens=False))
    assert (rows[2]["error_type"], rows[2]["score"], rows[2]["label"]) == ("null_prompt", None, None)
    assert "response" in rows[2]["error_message"]


def test_generate_then_score_reads_the_first_runs_committed_rows_once(
    tmp_path, short_texts, tiny_engine, tiny_llama_dir, reward_engine
):
    data = tmp_path / "prompts"
    data.mkdir()
    for s in range(2):
        prompts = [short_texts[s * 3 + r][:80] for r in range(3)]
        if s == 1:
            prompts[1] = None  # an error row of the first run
        pq.write_table(pa.table({"id": [f"{s}-{r}" for r in range(3)], "prompt": prompts}), data / f"p{s}.parquet")
    answers = tmp_path / "answers"
    generate = RunConfig(
        job=JobConfig(name="generate", task="generate", chat_template="never"),
        model=ModelConfig(path=tiny_llama_dir),
        engine=EngineConfig(model=tiny_llama_dir, max_num_seqs=4),
        sampling=SamplingParams(temperature=0.8, max_tokens=8, n=2, seed=0),  # best-of-2, to pick by reward
        data=DataConfig(uri=str(data), text_column="prompt"),
        output=OutputConfig(uri=str(answers), keep_columns=("prompt",)),
        quiet=True,
    )
    assert run_job(generate, engine=tiny_engine).exit_code == 0
    first = {p.stem: pq.read_table(p).to_pylist() for p in sorted((answers / "results").glob("*.parquet"))}
    assert (answers / "metrics").is_dir()  # never read as input

    scores = tmp_path / "scores"
    cfg = config(reward_engine, answers, scores, "score", data={"text_column": "prompt", "response_column": "output"})
    assert run_job(cfg, engine=reward_engine).exit_code == 0
    second = {p.stem: pq.read_table(p).to_pylist() for p in sorted((scores / "results").glob("*.parquet"))}
    assert sorted(second) == sorted(first) == ["p0", "p1"]
    for shard, rows in second.items():
        # each row (id, sample) once, in order, its sample_index carried along
        assert [(r["id"], r["sample_index"]) for r in rows] == [(r["id"], r["sample_index"]) for r in first[shard]]
        assert len(rows) == 6
        assert "label" not in rows[0]  # one label: a reward, no argmax name
        for before, row in zip(first[shard], rows, strict=True):
            if before["error_type"] is not None:
                assert row["error_type"] == "upstream_error" and before["error_type"] in row["error_message"]
            elif before["output"].strip():
                assert row["error_type"] is None and len(row["score"]) == 1
            else:
                assert row["error_type"] == "empty_prompt"
    assert second["p1"][2]["error_type"] == second["p1"][3]["error_type"] == "upstream_error"


def test_openai_embeddings_lines_are_answered_in_openais_shape(tmp_path, embed_engine, tiny_engine, tiny_llama_dir):
    model = embed_engine.model_path
    tok = embed_engine.tokenizer
    ids = tok.encode("token ids in", add_special_tokens=True)
    lines = [
        {"custom_id": "one", "url": "/v1/embeddings", "body": {"model": model, "input": "A single text."}},
        {
            "custom_id": "many",
            "url": "/v1/embeddings",
            "body": {"model": model, "input": ["First text.", "Second text."], "encoding_format": "base64"},
        },
        {"custom_id": "ids", "url": "/v1/embeddings", "body": {"model": model, "input": ids}},
        {"custom_id": "chat", "url": "/v1/chat/completions", "body": {"model": model, "messages": []}},
    ]
    data = tmp_path / "batch"
    data.mkdir()
    (data / "b.jsonl").write_text("".join(json.dumps({"method": "POST", **line}) + "\n" for line in lines))
    out = tmp_path / "out"
    cfg = config(embed_engine, data, out, "embed", data={"format": "openai_batch"})
    cfg = dataclasses.replace(cfg, job=JobConfig(name="openai_batch"))  # job.task null: the engine's
    assert run_job(cfg, engine=embed_engine).exit_code == 0

    answers = {a["custom_id"]: a for a in map(json.loads, (out / "outputs" / "b.jsonl").read_text().splitlines())}
    errors = {e["custom_id"]: e for e in map(json.loads, (out / "errors" / "b.jsonl").read_text().splitlines())}
    assert sorted(answers) == ["ids", "many", "one"] and sorted(errors) == ["chat"]
    assert errors["chat"]["error"]["code"] == "invalid_request" and "embed" in errors["chat"]["error"]["message"]
    one = answers["one"]["response"]["body"]
    assert one["object"] == "list" and one["model"] == model
    assert [(d["object"], d["index"]) for d in one["data"]] == [("embedding", 0)]
    assert cosine(one["data"][0]["embedding"], embed_engine.embed(["A single text."])[0]) >= 0.99999
    # the text as a user turn through the chat template, as sentence-transformers 6 embeds it
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] > len(tok.encode("A single text."))
    many = answers["many"]["response"]["body"]
    expected = embed_engine.embed(["First text.", "Second text."])
    for d, vector in zip(many["data"], expected, strict=True):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert cosine(decoded, vector) >= 0.99999
    assert [d["index"] for d in many["data"]] == [0, 1]
    assert cosine(answers["ids"]["response"]["body"]["data"][0]["embedding"], embed_engine.embed([ids])[0]) >= 0.99999
    rows = pq.read_table(out / "results" / "b.parquet").to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [
        ("one", 0),
        ("many", 0),
        ("many", 1),
        ("ids", 0),
        ("chat", 0),
    ]
    assert rows[-1]["embedding"] is None and rows[-1]["error_type"] == "invalid_request"

    # The same /v1/embeddings line on a generation engine is that line's error; the others go on.
    gen_lines = [
        {"custom_id": "e", "url": "/v1/embeddings", "body": {"model": tiny_llama_dir, "input": "text"}},
        {
            "custom_id": "c",
            "url": "/v1/completions",
            "body": {"model": tiny_llama_dir, "prompt": "Hi", "max_tokens": 2},
        },
    ]
    gen_data = tmp_path / "gen_batch"
    gen_data.mkdir()
    (gen_data / "g.jsonl").write_text("".join(json.dumps({"method": "POST", **line}) + "\n" for line in gen_lines))
    gen_cfg = RunConfig(
        job=JobConfig(name="openai_batch"),
        model=ModelConfig(path=tiny_llama_dir),
        engine=EngineConfig(model=tiny_llama_dir),
        sampling=SamplingParams(temperature=0.0, max_tokens=4),
        data=DataConfig(uri=str(gen_data), format="openai_batch"),
        output=OutputConfig(uri=str(tmp_path / "gen_out")),
        quiet=True,
    )
    assert run_job(gen_cfg, engine=tiny_engine).exit_code == 0
    gen_errors = (tmp_path / "gen_out" / "errors" / "g.jsonl").read_text().splitlines()
    assert [json.loads(e)["custom_id"] for e in gen_errors] == ["e"]
    assert "/v1/embeddings is for embed models" in json.loads(gen_errors[0])["error"]["message"]
    assert len((tmp_path / "gen_out" / "outputs" / "g.jsonl").read_text().splitlines()) == 1


def test_score_job_on_a_generation_model_exits_2_naming_the_key(tmp_path, make_shards, job_overrides, capsys):
    from batchrun import cli

    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=1)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["job=score", *job_overrides(tmp_path / "in", tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    last = err.strip().splitlines()[-1]  # after the run's start-up log line, one line naming the key
    assert last.startswith("batchrun: config error: engine.task") and "Traceback" not in err, err


def test_config_refuses_keys_a_pooling_job_cannot_use():
    from batchrun.job.errors import ConfigError

    def build(**kw):
        return RunConfig(
            job=JobConfig(name="x", task=kw.pop("task", "embed")),
            engine=EngineConfig(model="smollm2-135m", task=kw.pop("engine_task", "auto")),
            data=DataConfig(uri="/in", **kw.pop("data", {})),
            **kw,
        )

    assert build().engine.task == "embed"  # job.task sets engine.task when that is auto
    with pytest.raises(ConfigError, match="^engine.task: is score but job.task is embed"):
        build(engine_task="score")
    with pytest.raises(ConfigError, match="^sampling.n"):
        build(sampling=SamplingParams(n=2, temperature=1.0))
    with pytest.raises(ConfigError, match="^data.response_column"):
        build(task="generate", data={"response_column": "answer"})


def test_a_stopped_embed_run_resumes_from_its_committed_parts(tmp_path, make_shards, embed_engine, monkeypatch):
    """Checkpoints inside a shard: a stop commits the finished rows as a part; the rerun reads the
    part's pooled rows back (no output-token columns) and embeds only the rest."""
    import os
    import signal

    from batchrun.job.run import flow

    ids = make_shards(tmp_path / "in", num_shards=2, rows_per_shard=3)
    out = tmp_path / "out"
    cfg = dataclasses.replace(
        config(embed_engine, tmp_path / "in", out, "embed", output={"checkpoint_rows": 1}),
        planner=PlannerConfig(max_open_shards=1),
    )
    real_on_output = flow.ShardRun.on_output

    def on_output(self, out):
        real_on_output(self, out)
        if self.key == 1 and len(self.in_flight) == 2:  # the second shard's first row
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(flow.ShardRun, "on_output", on_output)
        stopped = run_job(cfg, engine=embed_engine)
    finally:
        signal.signal(signal.SIGINT, before)
    assert [s.status for s in stopped.shards] == ["committed", "interrupted"]
    assert list((out / "_parts" / "part-01").glob("*.json"))  # its finished rows, committed

    monkeypatch.setattr(flow.ShardRun, "on_output", real_on_output)
    assert run_job(cfg, engine=embed_engine).exit_code == 0
    rows = pq.read_table(out / "results" / "part-01.parquet").to_pylist()
    assert [r["id"] for r in rows] == ids[1] and all(r["embedding"] is not None for r in rows)
    metrics = pq.read_table(out / "metrics" / "part-01.parquet").to_pylist()[0]
    assert metrics["num_rows"] == 3 and metrics["num_prompt_tokens"] == sum(r["num_prompt_tokens"] for r in rows)


def test_pooling_prompts_render_conversations_without_a_generation_prompt():
    from batchrun.job.formats.prompts import PromptBuilder
    from batchrun.job.formats.reader import InputRow
    from batchrun.testing import build_tokenizer

    tok = build_tokenizer()
    messages = [{"role": "user", "content": "Is 2 prime?"}, {"role": "assistant", "content": "Yes."}]
    score = PromptBuilder(JobConfig(task="score"), DataConfig(uri="/in"), tok, 512, task="score")
    expected = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False))
    assert score.build(InputRow(0, "a", {"text": messages})).token_ids == expected
    assert score.build(InputRow(1, "b", {"text": "plain text"})).token_ids == tok.encode("plain text")
    # embed: the text itself goes to the engine, which tokenizes it as sentence-transformers does
    embed = PromptBuilder(JobConfig(task="embed"), DataConfig(uri="/in"), tok, None, task="embed", embed_limit=4)
    prompt = embed.build(InputRow(0, "a", {"text": "a text longer than four tokens"}))
    assert prompt.engine_prompts == ("a text longer than four tokens",) and len(prompt.token_ids or []) == 4
    assert embed.build(InputRow(1, "b", {"text": None})).error_type == "null_prompt"


def test_the_docs_generate_then_score_commands_keep_the_answer_in_the_scores(
    tmp_path, make_shards, job_overrides, reward_engine
):
    """docs/datasets.md's commands, through the CLI: the score run keeps `output` (the answer),
    which only a generation run writes itself."""
    from batchrun import cli

    def run(*args):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(list(args))
        assert exit_info.value.code == 0

    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2)
    answers, scores = tmp_path / "answers", tmp_path / "scores"
    run("job=summarize", "output.keep_columns=[text]", *job_overrides(tmp_path / "in", answers))
    overrides = job_overrides(answers, scores, f"model.path={reward_engine.model_path}")
    run("job=score", *overrides, "data.response_column=output", "output.keep_columns=[text,output]")
    first = pq.read_table(answers / "results" / "part-00.parquet").to_pylist()
    rows = pq.read_table(scores / "results" / "part-00.parquet").to_pylist()
    assert [(r["id"], r["text"], r["output"]) for r in rows] == [(r["id"], r["text"], r["output"]) for r in first]
    assert all(r["error_type"] is None and len(r["score"]) == 1 for r in rows)


def test_keep_columns_are_checked_against_the_jobs_own_result_columns():
    from batchrun.job.errors import ConfigError

    def build(task, keep):
        return RunConfig(
            job=JobConfig(name="x", task=task),
            engine=EngineConfig(model="m"),
            model=ModelConfig(path="m"),
            data=DataConfig(uri="/in", response_column=None if task == "generate" else "output"),
            output=OutputConfig(uri="/out", keep_columns=keep),
        )

    assert build("score", ("text", "output")).output.keep_columns == ("text", "output")
    assert build("embed", ("output",)).output.keep_columns == ("output",)
    with pytest.raises(ConfigError, match="^output.keep_columns: output would overwrite"):
        build("generate", ("output",))
    with pytest.raises(ConfigError, match="^output.keep_columns: score, label would overwrite"):
        build("score", ("score", "label"))
    with pytest.raises(ConfigError, match="^output.keep_columns: embedding would overwrite"):
        build("embed", ("embedding",))


def test_a_response_or_schema_column_named_text_is_read():
    data = DataConfig(uri="/in", text_column="prompt", response_column="text")
    assert JobConfig(task="score").input_columns(data) == ["prompt", "text"]
    templated = JobConfig(prompt_template="Q: {text} ({title})")
    assert templated.input_columns(DataConfig(uri="/in", text_column="q", schema_column="text")) == [
        "q",
        "title",
        "text",
    ]


def test_a_run_that_would_read_its_own_output_directory_is_refused(tmp_path, make_shards, embed_engine):
    """A score or embed run over an embed run's directory, written back into it with
    on_change=recompute, overwrote the results it read: data.uri and output.uri may not overlap
    (an output directory inside a plain input directory stays allowed: its files are skipped)."""
    from batchrun.job.errors import ConfigError

    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=2)
    out = tmp_path / "out"
    assert run_job(config(embed_engine, tmp_path / "in", out, "embed"), engine=embed_engine).exit_code == 0
    before = (out / "results" / "part-00.parquet").read_bytes()
    for data_uri, out_uri in [(out, out), (f"{out}/", out), (out / "results", out), (out, out / "again")]:
        cfg = config(embed_engine, data_uri, out_uri, "embed", output={"on_change": "recompute"})
        with pytest.raises(ConfigError, match="^data.uri: ") as e:
            run_job(cfg, engine=embed_engine)
        assert "\n" not in str(e.value) and "output.uri" in str(e.value)
        with pytest.raises(ConfigError, match="^data.uri: "):
            plan_run(cfg, engine=embed_engine)
    assert (out / "results" / "part-00.parquet").read_bytes() == before
    inside = config(embed_engine, tmp_path / "in", tmp_path / "in" / "out", "embed")
    assert run_job(inside, engine=embed_engine).exit_code == 0


def test_a_response_the_score_job_cuts_is_counted_as_truncated(tmp_path, short_texts, classifier_engine):
    data = tmp_path / "in"
    data.mkdir()
    long_answer = " ".join(short_texts)  # far over the tiny classifier's 512 positions
    table = pa.table({"id": [1, 2], "text": ["Explain.", "Short?"], "answer": [long_answer, "Yes."]})
    pq.write_table(table, data / "qa.parquet")
    out = tmp_path / "out"
    cfg = config(classifier_engine, data, out, "score", data={"response_column": "answer", "on_too_long": "truncate"})
    assert run_job(cfg, engine=classifier_engine).exit_code == 0
    cut, fitted = pq.read_table(out / "results" / "qa.parquet").to_pylist()
    assert cut["error_type"] is None and cut["num_prompt_tokens"] <= 512
    assert cut["num_truncated_tokens"] > 0 and "truncated" in cut["error_message"]
    assert fitted["num_truncated_tokens"] == 0
    metrics = pq.read_table(out / "metrics" / "qa.parquet").to_pylist()[0]
    assert (metrics["num_truncated_rows"], metrics["num_truncated_tokens"]) == (1, cut["num_truncated_tokens"])


def test_a_response_column_on_a_model_without_a_chat_template_exits_2(tmp_path, make_shards, job_overrides, capsys):
    """A BERT-style classifier has no chat template: every row would be a template_error."""
    from batchrun import cli

    model = make_tiny_classifier(tmp_path / "cls")
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    make_shards(tmp_path / "in", num_shards=1, rows_per_shard=1)
    overrides = job_overrides(tmp_path / "in", tmp_path / "out", f"model.path={model}", "data.response_column=title")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["job=score", *overrides])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("batchrun: config error: data.response_column") and "no chat template" in last, err
    assert not (tmp_path / "out" / "results").exists() or not list((tmp_path / "out" / "results").iterdir())


def test_a_previous_run_without_the_text_column_exits_2_suggesting_keep_columns(
    tmp_path, make_shards, embed_engine, classifier_engine
):
    """The first run did not keep its text: every shard of the second would fail alike (exit 1)."""
    from batchrun.job.errors import ConfigError

    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=1)
    first = tmp_path / "first"
    assert run_job(config(embed_engine, tmp_path / "in", first, "embed"), engine=embed_engine).exit_code == 0
    cfg = config(embed_engine, first, tmp_path / "second", "embed")
    with pytest.raises(ConfigError, match=r"^data.text_column: no column 'text' .*output.keep_columns=\[text\]"):
        run_job(cfg, engine=embed_engine)
    with pytest.raises(ConfigError, match="^data.text_column: "):
        plan_run(cfg, engine=embed_engine)
    cfg = config(
        classifier_engine, first, tmp_path / "third", "score", data={"text_column": "id", "response_column": "answer"}
    )
    with pytest.raises(ConfigError, match=r"^data.response_column: no column 'answer' .*keep_columns=\[answer\]"):
        run_job(cfg, engine=classifier_engine)
