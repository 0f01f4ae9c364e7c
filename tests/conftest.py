"""Shared pytest fixtures."""
from __future__ import annotations

import os

import pytest

# Tests never reach a hub: everything is built locally or shipped in an installed package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
