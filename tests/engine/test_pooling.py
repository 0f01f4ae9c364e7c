"""embed and score (engine.task): the pooling path against sentence-transformers and HF, float32.

Tiny random models, no network: a Qwen3 saved as a sentence-transformers pipeline twice (last-token
pooling + Normalize over a chat-template tokenizer, which sentence-transformers 6 renders texts
through; mean pooling + Dense over a plain one), and Llama / Qwen2 *ForSequenceClassification heads.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from batchrun.engine import Engine, EngineConfig, EngineConfigError, EngineRequest
from batchrun.engine.tasks import resolve_task
from batchrun.testing import make_tiny_model, sample_texts
from tests.support.pooling_models import make_tiny_classifier

FP32 = dict(dtype="float32", device="cpu", tune_kernels=False)


def _texts() -> list[str]:
    texts = sample_texts()
    # short and long (over the pipelines' max_seq_length), one of one character
    return [texts[1][:40], texts[3][:400], "a", texts[5][:90], texts[7][:200], texts[2][:15]]


def _sentence_model(root: Path, name: str, pooling: str, chat: bool, dense: bool, max_seq_length: int) -> str:
    """A tiny Qwen3 (hidden 64, 2 layers) saved by sentence-transformers with `pooling`."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoTokenizer

    base = make_tiny_model(root / f"{name}-base", "qwen3", num_hidden_layers=2)
    if not chat:  # without a chat template sentence-transformers tokenizes the text as it is
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.chat_template = None
        (base / "chat_template.jinja").unlink(missing_ok=True)
        tokenizer.save_pretrained(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules: list[Any] = [models.Transformer(str(base), max_seq_length=max_seq_length)]
        modules.append(models.Pooling(64, pooling_mode=pooling))
        if dense:
            torch.manual_seed(1)
            modules.append(models.Dense(64, 32))
        else:
            modules.append(models.Normalize())
        out = str(root / name)
        SentenceTransformer(modules=modules, device="cpu").save(out)
    return out


def _classifier(root: Path, family: str, num_labels: int) -> str:
    labels = [f"grade_{i}" for i in range(num_labels)]
    return str(make_tiny_classifier(root / f"{family}-cls", labels, seed=3, family=family, max_position_embeddings=256))


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pooling_models")
    return {
        "last": _sentence_model(root, "qwen3-last", "lasttoken", chat=True, dense=False, max_seq_length=32),
        "mean": _sentence_model(root, "qwen3-mean", "mean", chat=False, dense=True, max_seq_length=24),
        "llama-cls": _classifier(root, "llama", 1),
        "qwen2-cls": _classifier(root, "qwen2", 3),
    }


def _st_encode(directory: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(directory, device="cpu")
        return np.asarray(model.encode(texts, convert_to_numpy=True, batch_size=4))


def _cosines(a: list[np.ndarray], b: np.ndarray) -> list[float]:
    return [float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y))) for x, y in zip(a, b)]


@pytest.mark.parametrize("variant", ["last", "mean"])
def test_embed_equals_sentence_transformers_and_counts_truncation(models_dir, variant, one_torch_thread):
    directory = models_dir[variant]
    texts = _texts()
    engine = Engine(EngineConfig(model=directory, **FP32))
    assert engine.task == "embed" and engine.labels is None
    assert engine.embedding_dim == (64 if variant == "last" else 32)
    assert engine.max_model_len == (32 if variant == "last" else 24)  # sentence-transformers' max_seq_length
    got = engine.embed(texts)
    assert all(v.dtype == np.float32 and v.shape == (engine.embedding_dim,) for v in got)
    assert min(_cosines(got, _st_encode(directory, texts))) >= 0.99999
    full_lengths = [len(engine.pooling.model.tokenizer(t)["input_ids"]) for t in texts] if variant == "mean" else None
    outs = sorted(engine.stream(texts), key=lambda o: o.request_id)
    truncated = [o.metrics.num_truncated_tokens for o in outs]
    assert all(len(o.prompt_token_ids) <= engine.max_model_len for o in outs)
    assert truncated[1] > 0 and truncated[2] == 0  # the long text was cut, the short one not
    if full_lengths is not None:
        assert truncated == [max(0, n - 24) for n in full_lengths]
    else:  # the chat template's end of turn stays the last tokens of a cut prompt, as sentence-transformers keeps it
        assert outs[1].prompt_token_ids[-2:] == outs[2].prompt_token_ids[-2:]


@pytest.mark.parametrize("variant,num_labels", [("llama-cls", 1), ("qwen2-cls", 3)])
def test_score_equals_hf_logits(models_dir, variant, num_labels, one_torch_thread):
    from transformers import AutoModelForSequenceClassification

    directory = models_dir[variant]
    engine = Engine(EngineConfig(model=directory, **FP32))
    assert engine.task == "score" and engine.embedding_dim is None
    assert engine.labels == [f"grade_{i}" for i in range(num_labels)]
    tokenizer = engine.tokenizer
    pad = tokenizer.pad_token_id
    prompts: list[Any] = _texts()[:4]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    prompts.append(ids[0] + [pad, pad])  # scored at its last token that is not padding, as HF does
    ids.append(prompts[-1])
    got = engine.score(prompts)
    hf = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf(input_ids=torch.tensor([i])).logits[0].numpy() for i in ids]
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and g.shape == (num_labels,)
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got[-1], got[0])
    too_long = list(ids[1]) * (256 // len(ids[1]) + 1)  # max_model_len: max_position_embeddings 256
    (out,) = engine.stream([too_long])
    assert out.finish_reason == "error" and "max_model_len" in (out.error or "") and out.pooled is None


def test_a_prompt_gives_the_same_vector_alone_or_packed_with_any_others(models_dir, one_torch_thread):
    texts = _texts()
    for directory, call in ((models_dir["last"], "embed"), (models_dir["qwen2-cls"], "score")):
        together = getattr(Engine(EngineConfig(model=directory, **FP32)), call)(texts)
        # 40 tokens a forward: several forwards, and prompts longer than that run alone
        small = Engine(EngineConfig(model=directory, max_num_batched_tokens=40, **FP32))
        alone = [getattr(small, call)([t])[0] for t in texts]
        packed = getattr(small, call)(texts)
        for a, b, c in zip(together, alone, packed):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
            np.testing.assert_allclose(a, c, atol=1e-5, rtol=0)
    assert small.stats().num_steps > len(texts)  # the packed call took more than one forward


def test_stream_yields_pooled_outputs_and_typed_errors(models_dir, one_torch_thread):
    engine = Engine(EngineConfig(model=models_dir["mean"], max_num_batched_tokens=64, **FP32))
    texts = _texts()
    requests: list[Any] = [EngineRequest(request_id=f"r{i}", prompt=t) for i, t in enumerate(texts)]
    requests[2:2] = [EngineRequest("empty", ""), EngineRequest("no-ids", []), EngineRequest("bad", [1, 10**9])]
    requests.insert(4, None)  # nothing to admit right now: the window runs with what it has
    before = engine.stats()
    outs = {o.request_id: o for o in engine.stream(requests, max_in_flight=3)}
    assert set(outs) == {f"r{i}" for i in range(len(texts))} | {"empty", "no-ids", "bad"}
    for key in ("empty", "no-ids", "bad"):
        o = outs[key]
        assert o.finish_reason == "error" and o.error and o.pooled is None
    assert "empty" in (outs["empty"].error or "")
    for i in range(len(texts)):
        o = outs[f"r{i}"]
        assert o.finish_reason == "pooled" and o.error is None and o.token_ids == [] and o.text == ""
        assert o.pooled is not None and o.pooled.dtype == np.float32 and o.pooled.shape == (32,)
        m = o.metrics
        assert m.first_scheduled_s is not None and m.finished_s is not None and m.latency_s is not None
        assert m.arrival_s <= m.first_scheduled_s <= m.finished_s and m.ttft_s is None
    stats = engine.stats()
    assert stats.num_kv_blocks_total == 0 and stats.num_generated_tokens == 0
    assert stats.num_prompt_tokens - before.num_prompt_tokens == sum(
        len(outs[f"r{i}"].prompt_token_ids) for i in range(6)
    )
    with pytest.raises(ValueError, match="empty"):
        engine.embed(["fine", ""])
    settings = engine.settings.as_dict()
    assert settings["task"] == "embed" and settings["num_kv_blocks"] == 0 and settings["max_model_len"] == 24
    profile = engine.throughput_profile()
    assert profile.prefill_tok_s[64] > 0
    engine.reset_peak_stats()
    engine.close()


def test_numpy_integer_token_ids_run_as_python_ints(models_dir, one_torch_thread):
    # ids a caller got from numpy (a tokenizer's return_tensors="np", an array slice) are ids
    engine = Engine(EngineConfig(model=models_dir["mean"], **FP32))
    ids = [int(t) for t in engine.tokenizer("a short text")["input_ids"]]
    want = engine.embed([ids])[0]
    for prompt in ([np.int64(t) for t in ids], np.asarray(ids, dtype=np.int32), tuple(np.asarray(ids))):
        np.testing.assert_array_equal(engine.embed([prompt])[0], want)
    outs = list(engine.stream([EngineRequest("f", [1.0, 2.0]), EngineRequest("b", [True, 2])]))
    assert all(o.finish_reason == "error" and "token ids" in (o.error or "") for o in outs)
    engine.close()


def test_the_decoder_scratch_cache_is_not_held_at_an_oversized_rows_size(models_dir, one_torch_thread):
    # a row over the token budget runs as one forward; its scratch KV cache goes with it, and the
    # engine holds at most what a forward within the budget needs
    engine = Engine(EngineConfig(model=models_dir["llama-cls"], max_num_batched_tokens=32, **FP32))
    scratch = engine.pooling.model.scratch
    assert scratch is not None and scratch.held_bytes == 0
    short = [[5, 6, 7, 8]] * 8  # 32 tokens: one forward at the budget
    engine.score(short)
    within = scratch.held_bytes
    assert within > 0
    long_row = [5 + i % 50 for i in range(200)]  # 200 tokens, six times the budget
    want = engine.score([long_row])[0]
    assert scratch.held_bytes <= within
    engine.score(short)
    assert scratch.held_bytes == within  # regrown to the budget's forward, no larger
    np.testing.assert_array_equal(engine.score([long_row])[0], want)
    engine.close()


def test_a_text_over_the_tokenizers_length_is_truncated_without_transformers_warning(models_dir, one_torch_thread):
    # transformers warns "Token indices sequence length is longer than the specified maximum" when
    # a text tokenizes past model_max_length; the engine truncates after tokenizing, so it must not
    import logging

    engine = Engine(EngineConfig(model=models_dir["mean"], **FP32))
    engine.tokenizer.model_max_length = 16
    text = " ".join(_texts())
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        engine.embed([text])
        list(engine.stream([EngineRequest("long", text)]))
        assert not [r.getMessage() for r in records if "Token indices sequence length" in r.getMessage()]
        engine.tokenizer(text)  # the handler does see the warning where a caller tokenizes verbosely
        assert any("Token indices sequence length" in r.getMessage() for r in records)
    finally:
        hf_logger.removeHandler(handler)
    engine.close()


def test_the_task_is_detected_from_the_model_directory(models_dir, tiny_llama_dir):
    assert resolve_task(EngineConfig(model=models_dir["last"])).task == "embed"
    assert resolve_task(EngineConfig(model=models_dir["last"])).renders_chat
    assert not resolve_task(EngineConfig(model=models_dir["mean"])).renders_chat
    assert resolve_task(EngineConfig(model=models_dir["llama-cls"])).task == "score"
    assert resolve_task(EngineConfig(model=tiny_llama_dir)).task == "generate"
    # a decoder with a sentence-transformers pipeline may still generate when asked
    assert resolve_task(EngineConfig(model=models_dir["last"], task="generate")).task == "generate"


@pytest.mark.parametrize(
    "which,config,match",
    [
        ("llama", dict(task="embed"), r"engine\.task=embed: .*no modules\.json.*model_type 'llama' is not an encoder"),
        ("llama", dict(task="score"), r"engine\.task=score: .*architectures \['LlamaForCausalLM'\].*classification"),
        ("last", dict(task="score"), r"engine\.task=score: .*classification head"),
        ("qwen2-cls", dict(task="generate"), r"engine\.task=generate: .*classification head"),
        ("last", dict(tensor_parallel_size=2), r"engine\.task=auto \(resolved to embed\).*tensor_parallel_size=2"),
        ("qwen2-cls", dict(quantization="int8"), r"engine\.task=auto \(resolved to score\).*engine\.quantization=int8"),
        ("last", dict(speculative={"method": "ngram"}), r"engine\.speculative\.method=ngram"),
    ],
)
def test_refusals_name_engine_task_and_what_was_found(models_dir, tiny_llama_dir, which, config, match):
    directory = tiny_llama_dir if which == "llama" else models_dir[which]
    with pytest.raises(EngineConfigError, match=match) as info:
        Engine(EngineConfig(model=directory, **FP32, **config))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "family,flag,value",
    [("gemma3_text", "use_bidirectional_attention", True), ("qwen2", "is_causal", False)],
)
@pytest.mark.parametrize("task", ["auto", "embed", "generate"])
def test_a_decoder_configured_for_bidirectional_attention_is_refused(models_dir, tmp_path, family, flag, value, task):
    # EmbeddingGemma (use_bidirectional_attention) and GTE-Qwen-style configs (is_causal: false)
    # attend both ways; the decoder path attends causally only, which would embed them wrongly
    import shutil

    directory = make_tiny_model(tmp_path / family, family, **{flag: value})
    for name in ("modules.json", "sentence_bert_config.json"):
        shutil.copy(os.path.join(models_dir["last"], name), directory / name)
    shutil.copytree(os.path.join(models_dir["last"], "1_Pooling"), directory / "1_Pooling")
    with pytest.raises(EngineConfigError, match=rf"engine\.task={task}.*{flag}.*is not supported") as info:
        resolve_task(EngineConfig(model=str(directory), task=task))
    assert "\n" not in str(info.value)
    config = json.loads((directory / "config.json").read_text())
    config[flag] = not value  # the causal setting (the families' default) runs
    (directory / "config.json").write_text(json.dumps(config))
    assert resolve_task(EngineConfig(model=str(directory), task=task)).task == (
        "generate" if task == "generate" else "embed"
    )


def test_each_engine_refuses_the_other_tasks_calls(models_dir, tiny_engine):
    embedder = Engine(EngineConfig(model=models_dir["mean"], **FP32))
    with pytest.raises(ValueError, match=r"engine\.task=generate.*engine\.task=embed"):
        embedder.generate(["hi"])
    with pytest.raises(ValueError, match=r"Engine\.score needs engine\.task=score.*engine\.task=embed"):
        embedder.score(["hi"])
    with pytest.raises(ValueError, match=r"Engine\.embed needs engine\.task=embed.*engine\.task=generate"):
        tiny_engine.embed(["hi"])
    assert tiny_engine.task == "generate" and tiny_engine.labels is None and tiny_engine.embedding_dim is None
    assert "task" not in tiny_engine.settings.as_dict()  # a generation manifest reads as before
    assert os.path.isdir(embedder.model_path) and embedder.model_fingerprint and embedder.max_num_seqs > 0


def test_encoders_embed_and_score_through_the_engine(tmp_path, one_torch_thread):
    """A tiny BERT (model/encoder.py) as sentence-transformers pipelines (mean and lowercased cls,
    [SEP] kept at a cut), bare (mean pooling) and as BertForSequenceClassification."""
    pytest.importorskip("batchrun.model.encoder")
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    import batchrun.testing as testing

    texts = _texts() + ["Mixed CASE Words"]
    for pooling, lower in (("mean", False), ("cls", True)):
        directory = str(
            testing.make_tiny_bert(
                tmp_path / pooling, pooling=pooling, max_seq_length=48, do_lower_case=lower, tokenizer_lower_case=False
            )
        )
        engine = Engine(EngineConfig(model=directory, **FP32))
        assert engine.task == "embed" and engine.max_model_len == 48 and engine.embedding_dim == 32
        outs = sorted(engine.stream(texts), key=lambda o: o.request_id)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = SentenceTransformer(directory, device="cpu").encode(texts)
        assert min(_cosines([o.pooled for o in outs], want)) >= 0.99999
        assert (
            outs[1].metrics.num_truncated_tokens > 0 and outs[1].prompt_token_ids[-1] == engine.tokenizer.sep_token_id
        )
    bare = str(testing.make_tiny_bert(tmp_path / "bare"))
    engine = Engine(EngineConfig(model=bare, **FP32))
    assert engine.task == "embed"  # an encoder without a pipeline: mean pooling
    hf, tokenizer = AutoModel.from_pretrained(bare).eval(), AutoTokenizer.from_pretrained(bare)
    with torch.no_grad():
        rows = [tokenizer(t, truncation=True, max_length=engine.max_model_len)["input_ids"] for t in texts]
        want = [hf(torch.tensor([r])).last_hidden_state[0].mean(0).numpy() for r in rows]
    assert min(_cosines(engine.embed(texts), np.asarray(want))) >= 0.99999
    classifier = str(testing.make_tiny_bert(tmp_path / "classifier", num_labels=3))
    engine = Engine(EngineConfig(model=classifier, **FP32))
    assert engine.task == "score" and engine.labels == ["LABEL_0", "LABEL_1", "LABEL_2"]
    hf = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    with torch.no_grad():
        want = [hf(torch.tensor([tokenizer(t)["input_ids"]])).logits[0].numpy() for t in texts[2:]]
    for got, w in zip(engine.score(texts[2:]), want):
        np.testing.assert_allclose(got, w, atol=1e-4, rtol=0)
    with pytest.raises(EngineConfigError, match=r"engine\.task=generate: .*encoder"):
        Engine(EngineConfig(model=bare, task="generate", **FP32))
