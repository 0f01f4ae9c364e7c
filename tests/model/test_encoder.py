"""The BERT encoder over packed rows against HF BertModel / BertForSequenceClassification (float32),
and a tiny sentence-transformers directory through read_pipeline + encoder + pool + finish against
SentenceTransformer.encode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from batchrun.kernels import cpu_linear as ck
from batchrun.kernels.varlen_attention import varlen_attention
from batchrun.model.encoder import BertClassifier, BertEncoder, build_encoder
from batchrun.model.loader import load_model
from batchrun.model.sentence import SentencePipeline, pool, read_pipeline
from batchrun.testing import make_tiny_bert, sample_texts

LENS = [7, 3, 12, 3, 3, 1, 9]  # equal lengths apart and together: both paths of the attention grouping


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("bert") / "m")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # gelu_new: the tanh-approximated GELU HF maps that name to
    return make_tiny_bert(tmp_path_factory.mktemp("cls") / "m", seed=1, num_labels=3, hidden_act="gelu_new")


def _packed(lens: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(5, vocab, (n,), generator=g) for n in lens]
    types = torch.randint(0, 2, (sum(lens),), generator=g)  # (num_tokens,)
    return torch.cat(rows), types, rows


def _rows(t: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    return list(t.split(lens))


def test_varlen_attention_equals_sdpa_per_row() -> None:
    g = torch.Generator().manual_seed(0)
    lens = [5, 3, 5, 0, 3, 2]
    qkv = torch.randn(sum(lens), 3, 2, 8, generator=g)  # (num_tokens, 3, heads, head_dim)
    q, k, v = qkv.unbind(1)  # strided views, as the encoder passes them
    for causal in (False, True):
        out = varlen_attention(q, k, v, lens, 0.3, causal)
        for qr, kr, vr, o in zip(*(_rows(t, lens) for t in (q, k, v, out))):
            if qr.shape[0]:
                ref = F.scaled_dot_product_attention(
                    qr.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1), is_causal=causal, scale=0.3
                ).transpose(0, 1)
                torch.testing.assert_close(o, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("with_types", [False, True])
def test_encoder_equals_hf_bert_model(bert_dir: Path, tmp_path: Path, with_types: bool) -> None:
    loaded = load_model(str(bert_dir), cache_dir=str(tmp_path))
    encoder = build_encoder(loaded.config, loaded.state_dict, torch.float32)
    assert isinstance(encoder, BertEncoder)
    hf = transformers.BertModel.from_pretrained(bert_dir, local_files_only=True).eval()
    input_ids, types, rows = _packed(LENS, loaded.config.vocab_size)
    hidden = encoder(input_ids, types if with_types else None, LENS)  # (num_tokens, hidden)
    assert hidden.shape == (sum(LENS), 32)
    with torch.no_grad():
        for row, row_types, got in zip(rows, _rows(types, LENS), _rows(hidden, LENS)):
            kwargs: dict[str, Any] = {"token_type_ids": row_types[None]} if with_types else {}
            want = hf(input_ids=row[None], **kwargs).last_hidden_state[0]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if with_types:  # the types matter: all-zero types give other states
        assert not torch.allclose(hidden, encoder(input_ids, None, LENS), atol=1e-3)


def test_classifier_equals_hf_sequence_classification(classifier_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(str(classifier_dir), cache_dir=str(tmp_path))
    assert all(k.startswith(("bert.", "classifier.")) for k in loaded.state_dict)
    model = build_encoder(loaded.config, loaded.state_dict, torch.float32)
    assert isinstance(model, BertClassifier) and model.num_labels == 3
    hf = transformers.BertForSequenceClassification.from_pretrained(classifier_dir, local_files_only=True).eval()
    input_ids, types, rows = _packed(LENS, loaded.config.vocab_size, seed=1)
    logits = model(input_ids, types, LENS)  # (num_rows, num_labels)
    assert logits.dtype == torch.float32 and logits.shape == (len(LENS), 3)
    with torch.no_grad():
        pairs = zip(rows, _rows(types, LENS))
        want = torch.cat([hf(input_ids=r[None], token_type_ids=t[None]).logits for r, t in pairs])
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
    # The same checkpoint as a bare encoder: the head's tensors are ignored, not an error.
    encoder = build_encoder(loaded.config, loaded.state_dict, torch.float32, classifier=False)
    assert isinstance(encoder, BertEncoder)
    # bf16 runs and stays close to float32 (the head computes in float32)
    low = build_encoder(loaded.config, loaded.state_dict, torch.bfloat16)
    assert low.classifier.weight.dtype == torch.bfloat16
    torch.testing.assert_close(low(input_ids, types, LENS), logits, atol=0.1, rtol=0)


@pytest.mark.skipif(not ck.packing_available(), reason="this torch lacks oneDNN's packing ops")
def test_onednn_packed_bf16_matches_plain_bf16(classifier_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(str(classifier_dir), cache_dir=str(tmp_path))
    input_ids, types, _ = _packed(LENS, loaded.config.vocab_size, seed=2)
    plain = build_encoder(loaded.config, loaded.state_dict, torch.bfloat16)
    packed = build_encoder(loaded.config, loaded.state_dict, torch.bfloat16, pack_onednn=True)
    assert isinstance(packed, BertClassifier) and packed.encoder.layers[0].act is None  # GELU (tanh) fused
    torch.testing.assert_close(packed(input_ids, types, LENS), plain(input_ids, types, LENS), atol=0.05, rtol=0)
    with pytest.raises(ValueError, match="pack_onednn needs bf16"):
        build_encoder(loaded.config, loaded.state_dict, torch.float32, pack_onednn=True)


@pytest.mark.parametrize(
    "field, value",
    [
        ("position_embedding_type", "relative_key"),
        ("is_decoder", True),
        ("add_cross_attention", True),
        ("hidden_act", "swish"),
        ("model_type", "roberta"),
    ],
)
def test_unsupported_configs_are_refused_by_field(field: str, value: object) -> None:
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        BertEncoder(config)


def test_state_dict_gaps_and_strangers_are_refused(bert_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(str(bert_dir), cache_dir=str(tmp_path))
    prefixed = {f"bert.{k}": v for k, v in loaded.state_dict.items()}
    prefixed["pooler.dense.weight"] = torch.zeros(32, 32)  # ignored by a bare encoder
    encoder = build_encoder(loaded.config, prefixed, torch.float32)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        encoder(torch.zeros(129, dtype=torch.long), None, [129])
    missing = dict(loaded.state_dict)
    del missing["encoder.layer.1.attention.self.key.bias"]
    with pytest.raises(ValueError, match=r"lacks .*key\.bias"):
        build_encoder(loaded.config, missing, torch.float32)
    stranger = {**loaded.state_dict, "encoder.layer.0.attention.self.distance_embedding.weight": torch.zeros(3, 32)}
    with pytest.raises(ValueError, match="distance_embedding"):
        build_encoder(loaded.config, stranger, torch.float32)
    with pytest.raises(ValueError, match="classification head"):
        build_encoder(loaded.config, loaded.state_dict, torch.float32, classifier=True)


# ---------------------------------------------------------------------------------------------
# sentence-transformers directories


def _embed(directory: Path, cache: Path, texts: list[str]) -> tuple[torch.Tensor, SentencePipeline]:
    """What the embed task computes: tokenize as sentence-transformers does, encode packed, pool, finish."""
    pipeline = read_pipeline(str(directory))
    assert pipeline is not None
    loaded = load_model(str(directory), cache_dir=str(cache))
    encoder = build_encoder(loaded.config, loaded.state_dict, torch.float32)
    limit = pipeline.max_seq_length or min(loaded.tokenizer.model_max_length, loaded.config.max_position_embeddings)
    prompts = [pipeline.prompt + t for t in texts]
    if pipeline.do_lower_case:
        prompts = [p.lower() for p in prompts]
    encoded = loaded.tokenizer(prompts, truncation=True, max_length=limit)
    lens = [len(ids) for ids in encoded["input_ids"]]
    input_ids = torch.tensor([i for ids in encoded["input_ids"] for i in ids])  # (num_tokens,)
    hidden = encoder(input_ids, None, lens)
    return pipeline.project(pool(hidden, lens, pipeline.pooling)), pipeline


def _cosines(ours: torch.Tensor, theirs: Any) -> torch.Tensor:
    return F.cosine_similarity(ours, torch.as_tensor(theirs, dtype=torch.float32), dim=1)


def test_sentence_transformers_saved_pipeline_mean_dense_normalize(bert_dir: Path, tmp_path: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(0)
    modules = [
        Transformer(str(bert_dir), max_seq_length=40),
        Pooling(32, pooling_mode="mean"),
        Dense(32, 16, activation_function=torch.nn.Tanh()),
        Normalize(),
    ]
    model = st.SentenceTransformer(modules=modules, device="cpu")
    model.prompts = {"query": "query: "}
    model.default_prompt_name = "query"
    model.save(str(tmp_path / "st"))
    texts = [t[:300] for t in sample_texts()[40:46]] + ["A short one."]
    ours, pipeline = _embed(tmp_path / "st", tmp_path / "cache", texts)
    assert pipeline.pooling == "mean" and pipeline.normalize and pipeline.dense_out == 16
    assert pipeline.prompt == "query: "
    theirs = st.SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(texts, convert_to_numpy=True)
    assert ours.shape == (len(texts), 16)
    assert _cosines(ours, theirs).min() >= 0.99999


def test_sentence_transformers_cls_lowercase_and_max_seq_length(tmp_path: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    # A cased tokenizer whose vocabulary is lowercase: only lowercasing the text keeps words whole.
    directory = make_tiny_bert(
        tmp_path / "m", seed=2, pooling="cls", max_seq_length=12, do_lower_case=True, tokenizer_lower_case=False
    )
    texts = ["The Python Language Reference", sample_texts()[3][:400], "OK"]
    ours, pipeline = _embed(directory, tmp_path / "cache", texts)
    assert (pipeline.pooling, pipeline.max_seq_length, pipeline.do_lower_case) == ("cls", 12, True)
    theirs = st.SentenceTransformer(str(directory), device="cpu").encode(texts, convert_to_numpy=True)
    assert _cosines(ours, theirs).min() >= 0.99999
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(texts)))
