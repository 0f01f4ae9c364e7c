"""Credentials never reach the output directory or the logs (batchrun/utils/redact.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid

import fsspec
import pytest

from batchrun.engine import EngineConfig, SamplingParams
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
from batchrun.job.commit.fingerprint import settings_fingerprint
from batchrun.job.config import LauncherConfig
from batchrun.utils.logs import StderrHandler
from batchrun.utils.redact import REDACTED, RedactFilter, redact, redact_text

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SECRET = "s3cr3tVALUE"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"s3://AKIA:{SECRET}@bucket/in", f"s3://AKIA:{REDACTED}@bucket/in"),
        (f"https://user:{SECRET}@host:8443/p?x=1", f"https://user:{REDACTED}@host:8443/p?x=1"),
        (f"memory:///user:{SECRET}@h/in/a.parquet", f"memory:///user:{REDACTED}@h/in/a.parquet"),
        (f"AKIA:{SECRET}@bucket/in/a.parquet", f"AKIA:{REDACTED}@bucket/in/a.parquet"),  # a path fsspec made
        ("see a:b@c/d", "see a:b@c/d"),
        (
            f"https://b.s3.amazonaws.com/k.parquet?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA/20260101/"
            f"us-east-1/s3/aws4_request&X-Amz-Date=20260101T000000Z&X-Amz-Signature={SECRET}"
            f"&X-Amz-Security-Token={SECRET}",
            "https://b.s3.amazonaws.com/k.parquet?X-Amz-Algorithm=AWS4-HMAC-SHA256"
            f"&X-Amz-Credential={REDACTED}&X-Amz-Date=20260101T000000Z&X-Amz-Signature={REDACTED}"
            f"&X-Amz-Security-Token={REDACTED}",
        ),
        (
            f"https://a.blob.core.windows.net/c/x.parquet?sv=2022-11-02&se=2026-01-02&sp=r&sig={SECRET}",
            f"https://a.blob.core.windows.net/c/x.parquet?sv=2022-11-02&se=2026-01-02&sp=r&sig={REDACTED}",
        ),
        (f"https://h/x?Signature={SECRET}&Expires=1", f"https://h/x?Signature={REDACTED}&Expires=1"),
        (f"https://h/x?token={SECRET}", f"https://h/x?token={REDACTED}"),
        (f"https://h/x?a=1&access_token={SECRET}#frag", f"https://h/x?a=1&access_token={REDACTED}#frag"),
        (
            f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={SECRET};EndpointSuffix=core.windows.net",
            f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={REDACTED};EndpointSuffix=core.windows.net",
        ),
        (
            f"BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature=sv=2022&sig={SECRET}",
            f"BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature={REDACTED}",
        ),
        (f"Authorization: Bearer {SECRET}", f"Authorization: Bearer {REDACTED}"),
        (f"{{'Cookie': 'session={SECRET}', 'Accept': '*/*'}}", f"{{'Cookie': '{REDACTED}', 'Accept': '*/*'}}"),
        # Nothing to redact: left exactly as it was.
        ("s3://bucket/runs/2026-01-02", "s3://bucket/runs/2026-01-02"),
        ("https://h/x?versionId=3&prefix=a/b", "https://h/x?versionId=3&prefix=a/b"),
        ("max_num_batched_tokens=1024 user@example.com", "max_num_batched_tokens=1024 user@example.com"),
    ],
)
def test_redact_text_removes_each_credential_form_and_keeps_the_rest(text, expected):
    assert redact_text(text) == expected
    assert redact_text(expected) == expected  # idempotent: a document may pass several writers


def test_redact_document_redacts_option_keys_at_any_depth_and_every_string():
    doc = {
        "data": {
            "uri": f"s3://AKIA:{SECRET}@bucket/in",
            "storage_options": {
                "key": "AKIA",
                "secret": SECRET,
                "anon": False,
                "endpoint_url": f"http://u:{SECRET}@minio:9000",
                "connection_string": f"AccountName=a;AccountKey={SECRET}",
                "passphrase": SECRET,
                "client_kwargs": {"headers": {"Authorization": f"Bearer {SECRET}", "Cookie": SECRET, "X-Trace": "1"}},
            },
        },
        "shards": [{"url": f"https://h/a.parquet?sig={SECRET}"}],
        "engine": {"max_num_batched_tokens": 1024},  # a "token" key outside storage_options is no secret
    }
    out = redact(doc)
    assert SECRET not in json.dumps(out)
    options = out["data"]["storage_options"]
    assert options["anon"] is False and options["endpoint_url"] == f"http://u:{REDACTED}@minio:9000"
    assert options["passphrase"] == options["connection_string"] == options["secret"] == REDACTED
    assert options["client_kwargs"]["headers"] == {"Authorization": REDACTED, "Cookie": REDACTED, "X-Trace": "1"}
    assert out["engine"] == {"max_num_batched_tokens": 1024}
    assert redact(out) == out
    assert "secret" in doc["data"]["storage_options"] and doc["data"]["storage_options"]["secret"] == SECRET


def test_the_log_filter_redacts_messages_arguments_and_tracebacks(capsys):
    logger = logging.getLogger(f"batchrun.test_redact.{uuid.uuid4().hex}")
    handler = StderrHandler()
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("output %s (%d shards)", f"s3://k:{SECRET}@b/out", 3)
        try:
            raise OSError(f"cannot open https://h/x?X-Amz-Signature={SECRET}")
        except OSError:
            logger.exception("listing failed")
        try:  # a signed URL's query under names no rule knows (aiohttp's errors name the URL whole)
            raise OSError(f"403, message='Forbidden', url='https://h/x.parquet?expires=9&md5={SECRET}'")
        except OSError:
            logger.exception("listing failed")
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert SECRET not in err
    assert f"output s3://k:{REDACTED}@b/out (3 shards)" in err and f"https://h/x?{REDACTED}" in err
    assert any(isinstance(f, RedactFilter) for f in handler.filters)


# Each form of credential, where a user puts it. Those in a URL also name the input files and the
# output directory, so they reach every marker, the plan, the manifest's shard list and log lines.
FORMS = {
    "url userinfo": {"data": f"reader:{SECRET}@{{run}}/in", "out": f"writer:{SECRET}@{{run}}/out"},
    "presigned s3 query": {
        "data": f"{{run}}/in&X-Amz-Signature={SECRET}",
        "out": f"{{run}}/out&X-Amz-Credential={SECRET}",
    },
    "security token query": {"data": f"{{run}}/in&X-Amz-Security-Token={SECRET}"},
    "sas sig query": {"data": f"{{run}}/in&sv=2022-11-02&se=2026-01-02&sig={SECRET}"},
    "signature query": {"out": f"{{run}}/out&Signature={SECRET}"},
    "token query": {"data": f"{{run}}/in&token={SECRET}", "out": f"{{run}}/out&access_token={SECRET}"},
    "endpoint_url userinfo": {"options": {"endpoint_url": f"http://minio:{SECRET}@127.0.0.1:9"}},
    "connection string": {"options": {"connection_string": f"AccountName=a;AccountKey={SECRET};EndpointSuffix=x"}},
    "sas connection string": {"options": {"conn": f"BlobEndpoint=https://a/;SharedAccessSignature=sv=1&sig={SECRET}"}},
    "sftp passphrase": {"options": {"passphrase": SECRET}},
    "cookie and authorization headers": {
        "options": {"client_kwargs": {"headers": {"Cookie": f"session={SECRET}", "Authorization": f"Basic {SECRET}"}}}
    },
    "header list": {"options": {"headers": [f"Authorization: Bearer {SECRET}", f"Cookie: id={SECRET}"]}},
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_no_credential_reaches_a_marker_the_plan_the_manifest_or_a_log_line(
    form, make_shards, tmp_path, tiny_engine, tiny_llama_dir, capsys
):
    case = FORMS[form]
    run = f"redact-{uuid.uuid4().hex[:8]}"
    data_path = "/" + case.get("data", "{run}/in").format(run=run)
    out_path = "/" + case.get("out", "{run}/out").format(run=run)
    options = case.get("options", {})
    fs = fsspec.filesystem("memory")
    make_shards(tmp_path / "in", num_shards=2, rows_per_shard=2)
    for p in sorted((tmp_path / "in").iterdir()):
        fs.pipe_file(f"{data_path}/{p.name}", p.read_bytes())
    config = RunConfig(
        job=JobConfig(name="summarize", prompt_template="Summarize:\n{text}", system_prompt="Be brief."),
        model=ModelConfig(path=tiny_llama_dir),
        engine=EngineConfig(model=tiny_llama_dir, max_num_seqs=4),
        sampling=SamplingParams(temperature=0.0, max_tokens=4),
        data=DataConfig(uri=f"memory:/{data_path}", storage_options=options),
        output=OutputConfig(uri=f"memory:/{out_path}", storage_options=options),
        # Two workers without work stealing share a _plan.json; this is worker 0 of them.
        launcher=LauncherConfig(rank=0, world_size=2, work_stealing=False),
        quiet=True,
    )
    handler = StderrHandler()  # the handler the CLI (conf/hydra/job_logging) and local workers log through
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        capsys.readouterr()
        result = run_job(config, engine=tiny_engine)
        assert result.exit_code == 0, result.message
        written = {p: fs.cat_file(p) for p in fs.find(out_path)}
        # A second worker (and any rerun) reads the redacted plan back and still finds its inputs.
        other = run_job(
            dataclasses.replace(config, launcher=LauncherConfig(rank=1, world_size=2, work_stealing=False)),
            engine=tiny_engine,
        )
        assert other.exit_code == 0, other.message
        rerun = run_job(config, engine=tiny_engine)
        assert rerun.exit_code == 0 and {s.status for s in rerun.shards} == {"skipped"}, rerun.message
        written.update({p: fs.cat_file(p) for p in fs.find(out_path)})
        logs = capsys.readouterr().err
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        for path in {data_path.split("/")[1], out_path.split("/")[1]}:
            fs.rm(f"/{path}", recursive=True)

    names = {p[len(out_path) + 1 :] for p in written}
    assert {"_plan.json", "_manifest.rank0.json", "_commits/part-00.json", "_commits/part-01.json"} <= names
    assert "report.html" in names  # written by the last worker to finish
    for path, data in written.items():
        if path.endswith((".json", ".html")):
            assert SECRET.encode() not in data, (form, path, data.decode()[:2000])
    manifest = json.loads(written[f"{out_path}/_manifest.rank0.json"])
    assert REDACTED in json.dumps(manifest["config"]) or REDACTED in manifest["output_uri"]
    assert "worker 0 of 2" in logs and SECRET not in logs, logs


def test_settings_fingerprint_is_redacted_like_the_marker_that_stores_it():
    config = RunConfig(
        job=JobConfig(name="t", prompt_template="Fetch https://u:" + SECRET + "@h/{text}"),
        model=ModelConfig(path="m"),
        engine=EngineConfig(model="m"),
        sampling=SamplingParams(),
        data=DataConfig(uri="d"),
        output=OutputConfig(uri="o"),
    )
    fingerprint = settings_fingerprint(config)
    assert SECRET not in json.dumps(fingerprint) and redact(fingerprint) == fingerprint
