"""report.html: written at the end of a real run and by `python -m batchrun report`, from the committed
files only, self-contained, and rendered by a real headless browser (Chromium) with every figure."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun import cli
from batchrun.job import run_job
from batchrun.job.operate import report as report_module
from batchrun.job.operate.report import FIGURE_IDS, REPORT_NAME
from tests.support import REPO

HOSTILE_ID = '<script>alert("x")</script>&'


class _Page(HTMLParser):
    """Every element's tag and id, which elements lie inside which id, and what would load from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[str, str] = {}  # id -> tag
        self.inside: dict[str, set[str]] = {}  # id -> tags of the elements inside it
        self.rows: dict[str, list[list[str]]] = {}  # table id -> its body rows' cell texts
        self.tags: set[str] = set()
        self.external: list[str] = []
        self._open: list[tuple[str, str | None]] = []
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        for name in ("src", "href"):
            value = attrs.get(name) or ""
            if value and not value.startswith("#"):
                self.external.append(f"{tag} {name}={value}")
        for _, owner in self._open:
            if owner is not None:
                self.inside.setdefault(owner, set()).add(tag)
        # matplotlib's own element ids are prefixed with their figure's id; keep the page's own
        element_id = attrs.get("id")
        if element_id and not any(element_id.startswith(f"{f}-") for f in FIGURE_IDS):
            self.ids[element_id] = tag
        if tag == "table":
            self._table = element_id
            self.rows[element_id] = []
        elif tag == "tr" and self._table and self._open and self._open[-1][0] == "tbody":
            self.rows[self._table].append([])
        elif tag == "td" and self._table:
            self._cell = []
        if tag not in ("meta", "br", "img", "path", "use", "rect", "line", "polyline"):
            self._open.append((tag, element_id))

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None and self._table and self.rows[self._table]:
            self.rows[self._table][-1].append("".join(self._cell))
            self._cell = None
        if tag == "table":
            self._table = None
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


def _make_run(tmp_path: Path, make_shards, job_overrides, tiny_engine, *extra: str, corrupt: bool = False):
    """A real run over 2 good shards, one shard with hostile rows (a null prompt whose id is markup, an
    empty prompt) and, with `corrupt`, an unreadable shard that fails."""
    data = tmp_path / "in"
    make_shards(data, num_shards=2, rows_per_shard=3)
    texts = pq.read_table(data / "part-00.parquet").column("text").to_pylist()
    pq.write_table(
        pa.table({"id": [HOSTILE_ID, "blank", "fine"], "title": ["a", "b", "c"], "text": [None, "  ", texts[0]]}),
        data / "part-hostile.parquet",
    )
    if corrupt:
        (data / "part-zcorrupt.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 2 + b"PAR1")
    out = tmp_path / "run"
    result = run_job(cli.load_config(job_overrides(data, out, *extra)), engine=tiny_engine)
    return out, result


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no chromium binary on PATH (.ci/run installs Debian's chromium when run as root)")


def _browse(page: Path, tmp_path: Path, *mode: str) -> subprocess.CompletedProcess:
    """Chromium, headless and offline, on the local file: a fresh profile, nothing fetched."""
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1200,2400",
    ]
    return subprocess.run(
        [_chromium(), *flags, *mode, page.as_uri()], capture_output=True, text=True, timeout=180, check=True
    )


def _png_pixels(path: Path) -> tuple[int, int, np.ndarray]:
    """(width, height, the distinct pixel values): PIL when installed, else the PNG decoded by hand
    (8-bit RGB/RGBA, which is what Chromium writes)."""
    try:
        from PIL import Image
    except ImportError:
        Image = None
    if Image is not None:
        with Image.open(path) as image:
            rgb = np.asarray(image.convert("RGB")).reshape(-1, 3)
            return image.width, image.height, rgb
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(raw):
        (length,) = struct.unpack(">I", raw[pos : pos + 4])
        kind, body = raw[pos + 4 : pos + 8], raw[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color = header[:4]
    assert depth == 8 and color in (2, 6), header
    channels = 3 if color == 2 else 4
    data = zlib.decompress(idat)
    stride = width * channels
    # the filter byte of each scanline is left in; distinct (row, byte) values still tell blank from drawn
    rows = np.frombuffer(data, np.uint8).reshape(height, stride + 1)[:, 1:]
    return width, height, rows.reshape(-1, channels)[:, :3]


def test_a_run_writes_its_report_and_chromium_renders_every_figure(tmp_path, make_shards, job_overrides, tiny_engine):
    out, result = _make_run(tmp_path, make_shards, job_overrides, tiny_engine)
    assert result.exit_code == 0
    page_path = out / REPORT_NAME
    text = page_path.read_text()
    page = _parse(text)

    for figure in FIGURE_IDS:
        assert page.ids.get(figure) == "figure" and "svg" in page.inside[figure], figure
    assert {"shard-table", "error-rows", "overview"} <= set(page.ids)
    # self-contained: no script at all, nothing loaded from anywhere
    assert "script" not in page.tags and "link" not in page.tags and page.external == []
    # the hostile id is text, escaped, not markup
    assert HOSTILE_ID not in text and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;" in text

    shards = {row[0]: row for row in page.rows["shard-table"]}
    assert sorted(shards) == ["part-00", "part-01", "part-hostile"]
    assert shards["part-hostile"][2:5] == ["3", "1", "2"]  # rows, ok, errors
    errors = sorted((row[1], row[2]) for row in page.rows["error-rows"])
    assert errors == [(HOSTILE_ID, "null_prompt"), ("blank", "empty_prompt")]
    assert "failed-shards" not in page.ids

    # Only committed files are read: a stray results file, as a crash before the marker leaves,
    # and an attempt's leftovers change nothing.
    (out / "results" / "part-zz.parquet").write_bytes((out / "results" / "part-00.parquet").read_bytes())
    again = subprocess.run(
        [sys.executable, "-m", "batchrun", "report", str(out), "--out", str(tmp_path / "again.html")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().endswith("again.html")
    assert (tmp_path / "again.html").read_text() == text  # the same page, byte for byte

    screenshot = tmp_path / "report.png"
    _browse(page_path, tmp_path, f"--screenshot={screenshot}")
    width, height, pixels = _png_pixels(screenshot)
    assert (width, height) == (1200, 2400)
    distinct = np.unique(pixels, axis=0)
    assert len(distinct) > 20, "the screenshot is (nearly) one colour"
    assert (pixels != 255).any(axis=1).mean() > 0.02, "the screenshot is (nearly) blank"
    if os.environ.get("BATCHRUN_KEEP_REPORT_SCREENSHOT"):
        shutil.copy(screenshot, os.environ["BATCHRUN_KEEP_REPORT_SCREENSHOT"])

    dom = _parse(_browse(page_path, tmp_path, "--dump-dom").stdout)
    for figure in FIGURE_IDS:
        assert dom.ids.get(figure) == "figure" and "svg" in dom.inside[figure], figure
    assert "script" not in dom.tags
    assert sorted(row[0] for row in dom.rows["shard-table"]) == ["part-00", "part-01", "part-hostile"]


def test_a_run_with_a_failed_shard_still_gets_its_report(tmp_path, make_shards, job_overrides, tiny_engine):
    out, result = _make_run(tmp_path, make_shards, job_overrides, tiny_engine, corrupt=True)
    assert result.exit_code == 1
    (out / REPORT_NAME).unlink()  # the run wrote one; the command writes it again
    done = subprocess.run(
        [sys.executable, "-m", "batchrun", "report", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    page = _parse((out / REPORT_NAME).read_text())
    for figure in FIGURE_IDS:
        assert "svg" in page.inside[figure], figure
    [failed] = page.rows["failed-shards"]
    assert failed[:2] == ["part-zcorrupt", "failed"] and failed[3].startswith("cannot read")
    assert sorted(row[0] for row in page.rows["shard-table"]) == ["part-00", "part-01", "part-hostile"]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "failed"

    dom = _parse(_browse(out / REPORT_NAME, tmp_path, "--dump-dom").stdout)
    assert [row[:2] for row in dom.rows["failed-shards"]] == [["part-zcorrupt", "failed"]]


def test_the_last_of_several_workers_writes_the_report(tmp_path, make_shards, job_overrides, tiny_engine):
    data, out = tmp_path / "in", tmp_path / "run"
    make_shards(data, num_shards=2, rows_per_shard=2)
    for rank in (0, 1):
        overrides = job_overrides(data, out, f"launcher.rank={rank}", "launcher.world_size=2")
        assert run_job(cli.load_config(overrides), engine=tiny_engine).exit_code == 0
        # rank 0 ends first: rank 1 has no manifest yet, so the run has not ended
        assert (out / REPORT_NAME).exists() == (rank == 1)
    page = _parse((out / REPORT_NAME).read_text())
    assert sorted(row[0] for row in page.rows["shard-table"]) == ["part-00", "part-01"]


def test_a_report_that_cannot_be_written_is_a_warning(
    tmp_path, make_shards, job_overrides, tiny_engine, monkeypatch, caplog
):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(report_module, "write_report", broken)
    data, out = tmp_path / "in", tmp_path / "run"
    make_shards(data, num_shards=1, rows_per_shard=2)
    with caplog.at_level(logging.WARNING, logger="batchrun.job.operate.report"):
        result = run_job(cli.load_config(job_overrides(data, out)), engine=tiny_engine)
    assert result.exit_code == 0 and result.status == "completed"
    assert not (out / REPORT_NAME).exists()
    assert any("could not write the run report: OSError: disk full" in r.getMessage() for r in caplog.records)


def test_report_command_on_no_run_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["report", str(tmp_path / "nothing")])
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("batchrun: error: no batchrun run at") and "\n" not in err


def test_latency_sample_is_bounded_and_uniform():
    sample = report_module._Sample(100, seed=0)
    for start in range(0, 10_000, 250):
        sample.add(np.arange(start, start + 250, dtype=float))
    values = sample.values
    assert sample.seen == 10_000 and len(values) == 100 and len(set(values)) == 100
    # every part of the stream is represented, early and late alike
    assert 30 < (values < 5_000).sum() < 70
