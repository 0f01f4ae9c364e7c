"""Command line: `python -m batchrun job=summarize [group=option ...] [key=value ...]`, and
`python -m batchrun status OUTPUT_URI [--json] [--watch [SECONDS]] [--data URI]`
(job/operate/status.py: reads a run's state from its store, before Hydra sees the arguments).

The only module that imports Hydra or OmegaConf. It composes conf/, turns the result into the
plain frozen dataclasses of batchrun.job (which check every key and type), runs the job and prints
where the results are. Expected failures end as one line on stderr, never a traceback:

    exit 0  every shard of this worker is committed
    exit 1  some shard failed (the others are committed), or the job could not start
    exit 2  configuration error (unknown key, wrong type, bad override)
    exit 130 / 143  stopped by SIGINT / SIGTERM; rerun the same command to resume

`python -m batchrun report OUTPUT_URI [--out PATH]` writes a run's report page (job/operate/report.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import hydra
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from batchrun.job import ConfigError, JobError, RunConfig, build_run_config, format_summary, run_job
from batchrun.job.config import JOB_GROUPS, unknown_key
from batchrun.job.launch.dry_run import format_plan, plan_run, write_plan_json
from batchrun.job.operate.report import write_report
from batchrun.job.operate.status import main as status_main
from batchrun.utils.private_dir import private_dir
from batchrun.utils.redact import redact_query

if TYPE_CHECKING:
    from batchrun.benchmark.config import BenchmarkConfig

PACKAGE_DIR = Path(__file__).resolve().parent
# In the source tree (and editable installs) batchrun/conf is a symlink to the repository's conf/;
# a wheel carries a copy as package data. Either way it sits next to this file.
CONF_DIR = (PACKAGE_DIR / "conf").resolve()


def package_path(relative: str) -> str:
    """`${batchrun_path:data/sample}` in YAML: a path inside the installed package."""
    return str(PACKAGE_DIR / relative)


def submitit_dir(output_uri: str) -> str:
    """`${batchrun_submitit_dir:${output.uri}}` in YAML (the Slurm preset): where submitit keeps
    the run's pickles and logs. The compute node unpickles what is there, and the pickled config
    holds the storage credentials, so it is a private local directory (0700, refused when others
    could write it; utils/private_dir.py), one per output.uri, under $BATCHRUN_SUBMITIT_DIR or
    ~/.cache/batchrun/submitit: never inside output.uri, which others may be able to write (and
    which, as an s3:// URL, would become a local folder named 's3:'). Compute nodes must see it,
    as they see $HOME on most clusters."""
    base = os.environ.get("BATCHRUN_SUBMITIT_DIR") or os.path.join(
        os.environ.get("BATCHRUN_CACHE") or "~/.cache/batchrun", "submitit"
    )
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", output_uri.rstrip("/").rsplit("/", 1)[-1]).strip("._-")[:60] or "run"
    digest = hashlib.sha256(output_uri.encode()).hexdigest()[:12]
    path = Path(base).expanduser() / f"{slug}-{digest}"
    return str(private_dir(path, "submitit folder", "BATCHRUN_SUBMITIT_DIR"))


OmegaConf.register_new_resolver("batchrun_path", package_path, replace=True)
OmegaConf.register_new_resolver("batchrun_submitit_dir", submitit_dir, replace=True)


def _split_config(cfg: DictConfig) -> tuple[RunConfig, dict[str, Any]]:
    """The RunConfig, and the group that only this job composes ({} when none): job=benchmark's
    `benchmark` group, which the benchmark checks itself (benchmark/config.py)."""
    raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(raw, dict)
    raw.pop("hydra", None)
    plain = {str(k): v for k, v in raw.items()}
    job = plain.get("job")
    job_name = job.get("name") if isinstance(job, dict) else None
    group = next((g for g, name in JOB_GROUPS.items() if name == job_name), None)
    values = plain.pop(group, None) if group is not None else None
    return build_run_config(plain), values or {}


def to_run_config(cfg: DictConfig) -> RunConfig:
    return _split_config(cfg)[0]


def load_config(overrides: Sequence[str] = ()) -> RunConfig:
    """Compose conf/ with `overrides` (as on the command line) into a RunConfig, without running."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


def load_benchmark_config(overrides: Sequence[str] = ()) -> tuple[RunConfig, BenchmarkConfig]:
    """Compose conf/ for job=benchmark: the RunConfig and the checked `benchmark` group."""
    from batchrun.benchmark.config import benchmark_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config, values = _split_config(compose(config_name="config", overrides=list(overrides)))
    return config, benchmark_config(values)


_exit_codes: list[int] = []  # one per job (several under --multirun)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _run(cfg: DictConfig) -> None:
    # Expected failures are reported here: raised through Hydra they would gain an extra line.
    try:
        config, job_group = _split_config(cfg)
        if config.job.name == "benchmark":  # job=benchmark measures instead of writing results
            _run_benchmark(config, job_group)
            _exit_codes.append(0)
            return None
        if config.dry_run:  # plan only: nothing is run, nothing written to output.uri
            plan = plan_run(config)
            print(redact_query(format_plan(plan)), flush=True)
            if config.dry_run_json:
                write_plan_json(plan, config.dry_run_json, config.output.uri)
            _exit_codes.append(1 if plan.num_failed_shards else 0)
            return None
        result = run_job(config)
    except ConfigError as e:
        return _report(2, f"config error: {e}")
    except MissingMandatoryValue as e:
        return _report(2, f"config error: {e.full_key}: missing value; set {e.full_key}=...")
    except OmegaConfBaseException as e:
        return _report(2, f"config error: {_hydra_message(e)}")
    except JobError as e:
        return _report(1, f"error: {e}")
    print(redact_query(format_summary(result)), flush=True)
    if result.exit_code:
        print(f"batchrun: {redact_query(result.message)}", file=sys.stderr, flush=True)
    _exit_codes.append(result.exit_code)


def _run_benchmark(config: RunConfig, values: dict[str, Any]) -> None:
    """The benchmark and its HF baselines are imported here only: every other job starts without them."""
    from batchrun.benchmark.config import benchmark_config
    from batchrun.benchmark.report import format_benchmark
    from batchrun.benchmark.throughput import run_benchmark

    print(format_benchmark(run_benchmark(config, benchmark_config(values))), flush=True)


def _leave(code: int) -> NoReturn:
    """Exit `status` without the interpreter's teardown. `status` only reads and prints; its process
    has been seen to abort (SIGABRT, "terminate called without an active exception") after printing,
    in a native library's teardown at interpreter exit, which turns a correct answer into exit code
    134 for the scripts that poll it. Nothing it opened needs closing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of `python -m batchrun` and the `batchrun` script; exits with the codes above."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if sys.argv[1:2] == ["status"]:
        _leave(status_main(sys.argv[2:]))
    if sys.argv[1:2] == ["report"]:  # a subcommand, not a Hydra override: dispatched before Hydra sees argv
        sys.exit(report_main(sys.argv[2:]))
    _exit_codes.clear()
    if os.environ.get("HYDRA_FULL_ERROR") == "1":  # the user asked for full tracebacks
        _run()
        sys.exit(max(_exit_codes, default=0))
    # Hydra prints its own errors (bad override, unknown option) as a few lines plus a hint and
    # exits 1; with HYDRA_FULL_ERROR it re-raises instead, and we report one line and exit 2.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _run()
    except (HydraException, OmegaConfBaseException) as e:
        _report(2, f"config error: {_hydra_message(e)}")
    except KeyboardInterrupt:  # Ctrl-C before the run installed its stop handler (while composing)
        _report(130, "interrupted; nothing partial was committed")
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    sys.exit(max(_exit_codes, default=0))


def report_main(argv: Sequence[str]) -> int:
    """`python -m batchrun report OUTPUT_URI [--out PATH]`: (re)write a run's report.html."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m batchrun report", description="Write the HTML report of a run from its committed files."
    )
    parser.add_argument("output_uri", help="the run's output.uri (a local path or any fsspec URL)")
    parser.add_argument("--out", help="where to write the page instead of OUTPUT_URI/report.html")
    args = parser.parse_args(argv)  # a usage error exits 2, like a configuration error
    try:
        url = write_report(args.output_uri, out=args.out)
    except JobError as e:
        _report(1, f"error: {e}")
        return 1
    except Exception as e:  # an unreadable store or file: one line, not a traceback
        _report(1, f"error: cannot write the report of {args.output_uri}: {type(e).__name__}: {e}")
        return 1
    print(redact_query(url), flush=True)
    return 0


def _hydra_message(error: BaseException) -> str:
    """One line from Hydra/OmegaConf's multi-line messages, naming the key where one is known."""
    cause: Any = error.__cause__ or error
    if isinstance(error, OverrideParseException) and "://" in error.override and "?" in error.override:
        # A URL with a query (a signed URL) unquoted: Hydra's grammar reads its '=' and '&'
        key = error.override.split("=", 1)[0].lstrip("+~")
        return (
            f"{key}: cannot parse the override (a URL's query holds '=' and '&'): quote the value, "
            f"e.g. '{key}=\"<url>\"'"
        )
    full_key = getattr(cause, "full_key", None)
    text = str(cause)
    if full_key and ("not in struct" in text or "Key '" in text and "is not in" in text):
        return str(unknown_key(str(full_key)))
    lines = [f"{full_key}:"] if full_key else []
    for line in str(error).splitlines():
        if full_key and line.strip().startswith(("full_key:", "object_type=")):
            break
        if line.startswith(("Config search path", "See https://hydra.cc")):
            break
        if line.strip():
            lines.append(line.strip())
    message = " ".join(lines) or type(error).__name__
    return message if len(message) <= 400 else message[:397] + "..."


def _report(code: int, message: str) -> None:
    print(f"batchrun: {redact_query(' '.join(message.split()))}", file=sys.stderr, flush=True)
    _exit_codes.append(code)
