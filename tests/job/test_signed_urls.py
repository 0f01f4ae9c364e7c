"""data.uri as a signed http(s) URL (batchrun/job/shards.py: SignedURLFileSystem), against a real
HTTP server that checks a presigned-style signature over the request's exact bytes: a job reads it
through HEAD refusals and Range GETs, a re-signed URL of the same file is the same shard, and no
part of the signature reaches the output directory, the logs or an error line."""

from __future__ import annotations

import base64
import calendar
import contextlib
import hashlib
import hmac
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.engine import SamplingParams
from batchrun.job import JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
from batchrun.job.config import DataConfig
from batchrun.job.errors import ConfigError, ShardError
from batchrun.job.formats.reader import ShardReader
from batchrun.job.shards import discover_shards, open_filesystem, refreshed
from batchrun.utils.redact import REDACTED, redact_query, redact_text

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::UserWarning")

TIMEOUT_S = 300  # a hang guard for subprocesses, never a timing assertion


class SignedServer(http.server.ThreadingHTTPServer):
    """Serves `files` (raw request path -> bytes) only to URLs that `sign` made and that have not
    expired. As S3 presigns, the signature covers the method (a GET URL's HEAD gets 403 unless
    `head_ok`), the path and every other query parameter exactly as sent, so a client that
    re-encodes the URL (`%40` -> `@`) is refused too. GET honours `Range: bytes=a-b` (206)."""

    daemon_threads = True

    def __init__(self, head_ok: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files: dict[str, bytes] = {}
        self.key = b"server-side secret"
        self.head_ok = head_ok
        self.requests: list[tuple[str, str, int]] = []  # (method, Range header or "", status)
        self.public: set[str] = set()  # paths served whatever the query (a signature this server cannot check)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def signature(self, method: str, path: str, query: str) -> str:
        message = f"{'' if self.head_ok else method}\n{path}\n{query}".encode()
        # base64 has '+', '/' and '=': the URL carries them percent-encoded, as presigners do
        return base64.b64encode(hmac.new(self.key, message, hashlib.sha256).digest()).decode()

    def sign(self, path: str, expires_s: int = 3600, issued: float | None = None) -> str:
        """A GET URL for `path` (already percent-encoded) valid `expires_s` seconds from `issued`."""
        date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if issued is None else issued))
        query = f"X-Amz-Credential=tester%40example.com%2F20260101&X-Amz-Date={date}&X-Amz-Expires={expires_s}"
        signature = urllib.parse.quote(self.signature("GET", path, query), safe="")
        return f"{self.url}{path}?{query}&X-Amz-Signature={signature}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: SignedServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # request lines name the signature; the test's own output must not

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path, _, query = self.path.partition("?")
        status = self._check(path, query)
        data = self.server.files.get(path, b"")
        start, end = 0, len(data) - 1
        range_header = self.headers.get("Range") or ""
        if status == 200 and body and range_header.startswith("bytes="):
            first, _, last = range_header[len("bytes=") :].partition("-")
            start, end = int(first), min(int(last) if last else len(data) - 1, len(data) - 1)
            status = 206
        self.server.requests.append((self.command, range_header, status))
        if status >= 400:
            self.send_error(status)
            return
        self.send_response(status)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if body:
            self.wfile.write(data[start : end + 1])

    def _check(self, path: str, query: str) -> int:
        if path in self.server.public:
            return 200
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        unsigned, _, signature = query.rpartition("&X-Amz-Signature=")
        if not signature or "X-Amz-Date" not in params:
            return 403
        expected = self.server.signature(self.command, path, unsigned)
        if not hmac.compare_digest(urllib.parse.unquote(signature), expected):
            return 403
        issued = calendar.timegm(time.strptime(params["X-Amz-Date"], "%Y%m%dT%H%M%SZ"))
        if time.time() > issued + int(params["X-Amz-Expires"]):
            return 403  # expired: S3 answers 403 too
        return 200 if path in self.server.files else 404


@contextlib.contextmanager
def serving(head_ok: bool = False) -> Iterator[SignedServer]:
    srv = SignedServer(head_ok)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def server() -> Iterator[SignedServer]:
    with serving() as srv:
        yield srv


def parquet_bytes(ids: list[str], texts: list[str]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": ids, "prompt": texts}), sink)
    return sink.getvalue().to_pybytes()


def signature_of(url: str) -> tuple[str, str]:
    """The signature as sent (percent-encoded) and decoded: neither may appear anywhere."""
    raw = url.rpartition("X-Amz-Signature=")[2]
    return raw, urllib.parse.unquote(raw)


def assert_no_signature(text: str, *urls: str) -> None:
    for url in urls:
        for form in signature_of(url):
            assert form not in text


def discover(url: str, data_format: str = "parquet"):
    fs, path = open_filesystem(url, {})
    return fs, discover_shards(fs, path, url, None, data_format)


def test_redact_query_hides_the_whole_query_of_every_http_url():
    text = "403, message='Forbidden', url='https://h:9/p/f.parquet?q-signature=abc&q-ak=AK#x' and http://u:pw@h/p?s=1"
    expected = (
        f"403, message='Forbidden', url='https://h:9/p/f.parquet?{REDACTED}#x' and http://u:{REDACTED}@h/p?{REDACTED}"
    )
    assert redact_query(text) == expected
    assert redact_query(expected) == expected  # idempotent
    assert redact_query("s3://bucket/key.parquet and https://h/p") == "s3://bucket/key.parquet and https://h/p"


@pytest.mark.parametrize(
    "name", ["q-signature", "x-oss-signature", "x-oss-security-token", "Authorization", "verify", "hdnts", "__token__"]
)
def test_redact_text_knows_the_signature_parameters_of_other_stores(name):
    assert redact_text(f"https://h/f.parquet?a=1&{name}=SECRET") == f"https://h/f.parquet?a=1&{name}={REDACTED}"


def test_a_signed_url_is_one_shard_named_by_its_path_and_a_resigned_url_is_the_same_shard(server):
    data = parquet_bytes(["a", "b"], ["x", "y"])
    # percent-encoded characters in the path: decoded for the name, sent as written
    server.files["/bucket/in/my%20part%2B1.parquet"] = data
    server.files["/bucket/in/part-00.parquet"] = data
    url = server.sign("/bucket/in/part-00.parquet")
    fs, (shard,) = discover(url)
    assert (shard.name, shard.path, shard.size) == ("part-00", url, len(data))
    assert shard.url == f"{server.url}/bucket/in/part-00.parquet?{REDACTED}"
    assert shard.version == f'ETag="{hashlib.md5(data).hexdigest()}"'
    # S3-like: HEAD is refused (the URL signs GET), then one GET of the first byte gives the size
    assert server.requests[:2] == [("HEAD", "", 403), ("GET", "bytes=0-0", 206)]

    resigned = server.sign("/bucket/in/part-00.parquet", issued=time.time() - 60)
    assert resigned != url
    _, (again,) = discover(resigned)
    assert (again.name, again.url, again.size, again.version) == (shard.name, shard.url, shard.size, shard.version)

    _, (encoded,) = discover(server.sign("/bucket/in/my%20part%2B1.parquet"))
    assert encoded.name.startswith("my_part_1-") and encoded.size == len(data)  # "my part+1": a slug and hash
    reader = ShardReader(encoded, fs, DataConfig(uri="-", text_column="prompt"), ["prompt"])
    assert [(r.id, r.values["prompt"]) for r in reader.rows()] == [("a", "x"), ("b", "y")]
    reader.close()
    assert all(status in (206, 403) for method, _, status in server.requests if method == "GET" or status != 403)


def test_a_server_that_answers_head_is_sized_by_head_alone():
    with serving(head_ok=True) as server:
        data = parquet_bytes(["a"], ["x"])
        server.files["/p/f.parquet"] = data
        _, (shard,) = discover(server.sign("/p/f.parquet"))
        assert (shard.name, shard.size, shard.version) == ("f", len(data), f'ETag="{hashlib.md5(data).hexdigest()}"')
        assert server.requests == [("HEAD", "", 200)]


def test_refusals_are_one_config_error_line_naming_the_status_without_the_signature(server):
    server.files["/p/f.parquet"] = parquet_bytes(["a"], ["x"])
    expired = server.sign("/p/f.parquet", expires_s=60, issued=time.time() - 3600)
    with pytest.raises(ConfigError) as e:
        discover(expired)
    line = str(e.value)
    assert line == f"data.uri: {server.url}/p/f.parquet?{REDACTED}: HTTP 403 Forbidden (expired or revoked signature?)"
    assert_no_signature(line, expired)

    with pytest.raises(ConfigError, match=r"^data\.uri: .*/p/gone\.parquet\?<redacted>: HTTP 404 Not Found$"):
        discover(server.sign("/p/gone.parquet"))

    # a path without the format's extension: said before any request
    download = server.sign("/download")
    before = len(server.requests)
    with pytest.raises(ConfigError) as e:
        discover(download)
    assert "'download' (its path's last part) does not end in .parquet" in str(e.value)
    assert REDACTED in str(e.value) and len(server.requests) == before
    assert_no_signature(str(e.value), download)
    with pytest.raises(ConfigError, match=r"does not end in \.jsonl \(data\.format=openai_batch\)"):
        discover(server.sign("/p/f.parquet"), "openai_batch")


def test_a_signature_revoked_after_listing_fails_the_shard_without_naming_it(server):
    # rows well past the footer read (pyarrow reads the last 64 KiB first), so reading them is a request
    texts = [base64.b64encode(os.urandom(150_000)).decode() for _ in range(2)]
    server.files["/p/f.parquet"] = parquet_bytes(["a", "b"], texts)
    url = server.sign("/p/f.parquet")
    fs, (shard,) = discover(url)
    reader = ShardReader(shard, fs, DataConfig(uri="-", text_column="prompt"), ["prompt"])  # footer read
    server.key = b"rotated"  # the signing key is rotated: every URL signed before is revoked
    # aiohttp's ClientResponseError names the full URL it was refused
    with pytest.raises(ShardError) as e:
        list(reader.rows())
    reader.close()
    assert "403" in str(e.value) and f"{server.url}/p/f.parquet?{REDACTED}" in str(e.value)
    assert_no_signature(str(e.value), url)
    with pytest.raises(ShardError) as e:
        refreshed(shard, fs)  # the next attempt's look at the input
    assert str(e.value).endswith("HTTP 403 Forbidden (expired or revoked signature?)")
    assert_no_signature(str(e.value), url)


def test_a_job_over_a_signed_openai_batch_file_answers_every_line(server, tmp_path, tiny_engine, tiny_llama_dir):
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": f"{i}"}}
        for i in range(3)
    ]
    server.files["/batch/requests.jsonl"] = "".join(json.dumps(line) + "\n" for line in lines).encode()
    url = server.sign("/batch/requests.jsonl")
    config = RunConfig(
        job=JobConfig(name="openai_batch"),
        model=ModelConfig(path=tiny_llama_dir),
        sampling=SamplingParams(max_tokens=2),
        data=DataConfig(uri=url, format="openai_batch", openai_model_name="tiny"),
        output=OutputConfig(uri=str(tmp_path / "out")),
        quiet=True,
    )
    result = run_job(config, engine=tiny_engine)
    assert (result.exit_code, [(s.name, s.status) for s in result.shards]) == (0, [("requests", "committed")])
    outputs = (tmp_path / "out" / "outputs" / "requests.jsonl").read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in outputs] == ["r0", "r1", "r2"]
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert_no_signature(file_text(path), url)


def test_a_job_over_a_signed_url_commits_resumes_resigned_and_reports_expiry_in_one_line(
    server, tmp_path, short_texts, job_overrides, capsys, monkeypatch
):
    ids = ["r0", "r1", "r2"]
    server.files["/bucket/prompts/part-00.parquet"] = parquet_bytes(ids, short_texts[:3])
    out = tmp_path / "out"

    def overrides(url: str) -> list[str]:
        # Hydra's grammar: a value with '=' and '&' is quoted
        base = [o for o in job_overrides("-", out, "sampling.max_tokens=4") if not o.startswith("data.uri=")]
        return ["job=generate", f'data.uri="{url}"', *base]

    url = server.sign("/bucket/prompts/part-00.parquet")
    first = subprocess.run(
        [sys.executable, "-m", "batchrun", *overrides(url)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert first.returncode == 0, first.stderr
    rows = pq.read_table(out / "results" / "part-00.parquet").to_pylist()
    assert [r["id"] for r in rows] == ids and all(r["error_type"] is None for r in rows)
    assert ("HEAD", "", 403) in server.requests  # the signed GET URL refused HEAD; the job read on

    # The reruns in this process (no engine loads for them): a re-signed URL finds its shard done,
    # an expired one is refused in one line.
    monkeypatch.chdir(tmp_path)
    resigned = server.sign("/bucket/prompts/part-00.parquet", issued=time.time() - 120)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(overrides(resigned))
    again = capsys.readouterr()
    assert exit_info.value.code == 0, again.err
    manifest = json.loads((out / "_manifest.json").read_text())
    assert [(s["name"], s["status"]) for s in manifest["shards"]] == [("part-00", "skipped")]

    # a dry run's plan file names the input without its signature
    plan_path = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*overrides(resigned), "dry_run=true", f"dry_run_json={plan_path}"])
    planned = capsys.readouterr()
    assert exit_info.value.code == 0, planned.err
    assert_no_signature(plan_path.read_text() + planned.out + planned.err, url, resigned)

    expired = server.sign("/bucket/prompts/part-00.parquet", expires_s=60, issued=time.time() - 3600)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(overrides(expired))
    refused = capsys.readouterr()
    assert exit_info.value.code == 2
    assert refused.err.splitlines() == [
        f"batchrun: config error: data.uri: {server.url}/bucket/prompts/part-00.parquet?{REDACTED}: "
        "HTTP 403 Forbidden (expired or revoked signature?)"
    ]

    logs = "".join(p.out + p.err for p in (again, refused)) + first.stdout + first.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"_manifest.json", "report.html", "part-00.parquet"} <= {p.name for p in files}
    for text in [logs, *(file_text(p) for p in files)]:
        assert_no_signature(text, url, resigned, expired)


def file_text(path: Path) -> str:
    """A file's bytes as text; a Parquet file's values and metadata too (its pages may be compressed)."""
    text = path.read_bytes().decode("latin-1")
    if path.suffix == ".parquet":
        text += repr(pq.read_table(path).to_pylist()) + repr(pq.read_metadata(path).metadata)
    return text


def test_an_s3_path_with_a_version_query_is_that_version_as_one_shard(s3):
    fs, bucket, _ = s3
    fs.make_bucket_versioned(bucket)
    fs.pipe_file(f"{bucket}/in/part-00.parquet", parquet_bytes(["old"], ["x"]))
    old = fs.info(f"{bucket}/in/part-00.parquet")["VersionId"]
    fs.pipe_file(f"{bucket}/in/part-00.parquet", parquet_bytes(["new"], ["y"]))
    uri = f"s3://{bucket}/in/part-00.parquet?versionId={old}"
    data_fs, (shard,) = discover(uri)
    assert (shard.name, shard.url) == ("part-00", uri)  # a version id is no credential: kept
    reader = ShardReader(shard, data_fs, DataConfig(uri="-", text_column="prompt"), ["prompt"])
    assert [r.id for r in reader.rows()] == ["old"]
    reader.close()


def test_a_question_mark_without_a_query_is_still_a_glob(tmp_path):
    for name in ("part-01.parquet", "part-02.parquet", "part-10.parquet"):
        (tmp_path / name).write_bytes(parquet_bytes([name], ["x"]))
    _, shards = discover(str(tmp_path / "part-0?.parquet"))
    assert [s.name for s in shards] == ["part-01", "part-02"]


def test_a_signature_under_any_parameter_name_stays_out_of_the_manifest_status_and_report(
    server, tmp_path, tiny_engine, tiny_llama_dir, capsys
):
    """A signed URL's query is a grant whatever its parameters are called (nginx secure_link's
    md5/expires, a CDN's own names): the manifest's copy of the config redacts all of it, as the
    shard list does, and so do `status` and `report` over the run."""
    from batchrun.cli import report_main, status_main

    server.files["/pub/part-00.parquet"] = parquet_bytes(["a", "b"], ["x", "y"])
    server.public.add("/pub/part-00.parquet")
    secret = "s3cr3tValue0123"
    url = f"{server.url}/pub/part-00.parquet?expires=4102444800&md5={secret}#frag"
    config = RunConfig(
        job=JobConfig(name="generate"),
        model=ModelConfig(path=tiny_llama_dir),
        sampling=SamplingParams(max_tokens=2),
        data=DataConfig(uri=url, text_column="prompt"),
        output=OutputConfig(uri=str(tmp_path / "out")),
        quiet=True,
    )
    result = run_job(config, engine=tiny_engine)
    assert (result.exit_code, [(s.name, s.status) for s in result.shards]) == (0, [("part-00", "committed")])
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["config"]["data"]["uri"] == f"{server.url}/pub/part-00.parquet?{REDACTED}#frag"
    capsys.readouterr()
    assert status_main([str(tmp_path / "out")]) == 0
    assert status_main([str(tmp_path / "out"), "--json"]) == 0
    assert report_main([str(tmp_path / "out")]) == 0
    printed = capsys.readouterr()
    texts = [printed.out + printed.err, *(file_text(p) for p in (tmp_path / "out").rglob("*") if p.is_file())]
    assert not [t for t in texts if secret in t]


def test_an_uppercase_scheme_is_named_once_in_the_shard_url(server):
    server.files["/p/f.parquet"] = parquet_bytes(["a"], ["x"])
    url = server.sign("/p/f.parquet").replace("http://", "HTTP://", 1)
    _, (shard,) = discover(url)
    assert shard.name == "f" and shard.url == f"{url.partition('?')[0]}?{REDACTED}"


def test_a_dry_run_names_a_signed_url_under_any_parameter_name_without_its_query(
    server, tmp_path, job_overrides, capsys, monkeypatch
):
    server.files["/pub/part-00.parquet"] = parquet_bytes(["a", "b"], ["x", "y"])
    server.public.add("/pub/part-00.parquet")
    secret = "s3cr3tValue0456"
    url = f"{server.url}/pub/part-00.parquet?expires=4102444800&md5={secret}"
    base = [o for o in job_overrides("-", tmp_path / "out", "sampling.max_tokens=2") if not o.startswith("data.uri=")]
    plan_path = tmp_path / "plan.json"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["job=generate", f'data.uri="{url}"', *base, "dry_run=true", f"dry_run_json={plan_path}"])
    printed = capsys.readouterr()
    assert exit_info.value.code == 0, printed.err
    assert f"{server.url}/pub/part-00.parquet?{REDACTED}" in printed.out
    assert secret not in plan_path.read_text() + printed.out + printed.err


def test_the_shared_plan_of_workers_without_stealing_keeps_a_signature_under_any_name_out(server, tmp_path):
    """Workers with launcher.work_stealing=false share `_plan.json`, which lists every shard with its
    `path`: for an http(s) input that is the signed URL itself, so its query must be redacted whole
    there (as Shard.url is), whatever its parameters are called."""
    from batchrun.job.commit.store import RunStore
    from batchrun.job.run.plan import shared_shards

    server.files["/pub/part-00.parquet"] = parquet_bytes(["a"], ["x"])
    server.public.add("/pub/part-00.parquet")
    secret = "s3cr3tValue0789"
    _, listed = discover(f"{server.url}/pub/part-00.parquet?expires=4102444800&md5={secret}")
    store = RunStore(str(tmp_path / "out"), {})
    assert [s.path for s in shared_shards(store, listed)] == [listed[0].path]  # the listing's own, to read
    assert shared_shards(store, listed) == listed  # the plan read back again
    assert secret not in (tmp_path / "out" / "_plan.json").read_text()
