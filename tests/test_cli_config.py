"""conf/ composes into the dataclasses for every preset, and bad input ends as one line, exit 2."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import yaml

from batchrun import cli
from batchrun.engine import EngineConfig, SamplingParams
from batchrun.job import DataConfig, LauncherConfig, ModelConfig, OutputConfig, RunConfig, config_fields
from tests.support import REPO

CONF = Path(cli.CONF_DIR)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_conf_dir_is_the_repository_conf():
    assert (CONF / "config.yaml").is_file()
    assert CONF == (REPO / "conf").resolve()


@pytest.mark.parametrize("job", _options("job"))
@pytest.mark.parametrize("model", _options("model"))
@pytest.mark.parametrize("launcher", _options("launcher"))
def test_every_preset_composes_into_the_dataclasses(job, model, launcher):
    overrides = [f"job={job}", f"model={model}", f"launcher={launcher}"]
    if job != "summarize":  # only summarize has bundled input
        overrides.append("data.uri=/some/prompts")
    cfg = cli.load_config(overrides)
    assert isinstance(cfg, RunConfig)
    assert cfg.job.name == job
    assert cfg.engine.model == cfg.model.path
    assert cfg.output.uri == f"runs/{job}"


def test_default_run_is_greedy_summarize_of_the_bundled_sample_on_the_gpu_else_the_cpu():
    from batchrun.engine.device import resolve_device

    cfg = cli.load_config([])
    assert cfg.job.name == "summarize" and cfg.model.path == "smollm2-135m"
    assert cfg.engine.device == "auto" and cfg.sampling.is_greedy and cfg.sampling.max_tokens == 64
    assert resolve_device(cfg.engine.device).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cfg.job.prompt_template and "{text}" in cfg.job.prompt_template
    sample = Path(cfg.data.uri)
    assert sorted(p.name for p in sample.glob("*.parquet")) == [f"topics-0{i}.parquet" for i in range(4)]


def test_generate_needs_data_uri():
    with pytest.raises(cli.ConfigError, match="data.uri: missing"):
        cli.load_config(["job=generate"])


def _yaml_keys(node: dict, cls: type) -> None:
    """Every dataclass field appears in the YAML and nothing else, nested groups included."""
    hints = typing.get_type_hints(cls)
    fields = [
        f.name for f in dataclasses.fields(cls) if not (cls is EngineConfig and f.name in ("model", "lora_adapters"))
    ]
    assert sorted(node) == sorted(fields), cls.__name__
    for name in fields:
        if dataclasses.is_dataclass(hints[name]):
            _yaml_keys(node[name], hints[name])


@pytest.mark.parametrize(
    "group, option, cls",
    [
        ("engine", "default", EngineConfig),
        ("sampling", "default", SamplingParams),
        ("data", "sample", DataConfig),
        ("output", "default", OutputConfig),
        ("launcher", "local", LauncherConfig),
        ("launcher", "ray", LauncherConfig),
        ("model", "smollm2_135m", None),
    ],
)
def test_group_yaml_lists_every_dataclass_key(group, option, cls):
    """The YAML is the documented surface: a field added to a dataclass must appear there too."""
    node = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    if cls is None:  # a _global_ package file
        node, cls = node[group], ModelConfig
    assert sorted(node) == sorted(config_fields(group))
    _yaml_keys(node, cls)


def test_hydra_writes_nothing_in_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["data.uri=" + str(tmp_path / "missing")])
    assert exit_info.value.code == 2  # a config error: nothing to read at data.uri
    assert "data.uri: nothing found" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


UNKNOWN_KEY = "batchrun: config error: engine.max_num_seqz: unknown key (did you mean max_num_seqs?)"


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["engine.max_num_seqz=3"], 2, UNKNOWN_KEY),
        (["+engine.max_num_seqz=3"], 2, UNKNOWN_KEY),
        (
            ["engine.max_num_seqs=many"],
            2,
            "batchrun: config error: engine.max_num_seqs: expected int or null, got str 'many'",
        ),
        (["job=nope"], 2, "batchrun: config error: In 'config': Could not find 'job/nope'"),
        (["sampling.max_tokens=="], 2, "batchrun: config error: Error parsing override 'sampling.max_tokens=='"),
        (["output.uri=${nope}"], 2, "batchrun: config error: output.uri: Interpolation key 'nope' not found"),
        (["job=generate"], 2, "batchrun: config error: data.uri: missing"),
        (["engine.model=/x"], 2, "batchrun: config error: engine.model: set model.path instead"),
        (  # a signed URL unquoted: the hint to quote it, and its signature stays out of the line
            ["job=generate", "data.uri=https://h/p/f.parquet?X-Amz-Signature=s3cr3t&X-Amz-Expires=60"],
            2,
            "batchrun: config error: data.uri: cannot parse the override (a URL's query holds '=' and '&'): "
            "quote the value, e.g. 'data.uri=\"<url>\"'",
        ),
    ],
)
def test_cli_errors_are_one_line(argv, code, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == code
    assert err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_error_in_a_real_process_is_one_line_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "batchrun", "job=summarize", "sampling.temprature=0.5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        ("batchrun: config error: sampling.temprature: unknown key (did you mean temperature?)")
    ]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_log_lines_follow_a_replaced_stderr(monkeypatch):
    # The CLI's log handler (conf/hydra/job_logging) must not keep the stream it first saw: in a
    # notebook or test, sys.stderr is swapped and the old one closed between calls.
    import io
    import logging

    from batchrun.utils.logs import StderrHandler

    handler = StderrHandler()
    logger = logging.getLogger("batchrun.test_stderr_handler")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        first, second = io.StringIO(), io.StringIO()
        monkeypatch.setattr("sys.stderr", first)
        logger.warning("one")
        first.close()
        monkeypatch.setattr("sys.stderr", second)
        logger.warning("two")
        assert second.getvalue() == "two\n"
    finally:
        logger.removeHandler(handler)
