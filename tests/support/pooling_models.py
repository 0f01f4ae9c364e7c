"""Tiny pooling model directories for the embed and score job tests: a random Qwen3 with a
sentence-transformers pipeline (last-token pooling, Normalize), and a random
LlamaForSequenceClassification (a classifier with id2label, or a one-label reward model), both
with the tiny ChatML tokenizer of batchrun.testing."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from batchrun.testing import build_tokenizer, make_tiny_model


def make_tiny_sentence_model(out_dir: str | Path, pooling: str = "lasttoken", max_seq_length: int = 200) -> Path:
    """A tiny Qwen3 (2 layers) saved by sentence-transformers: Transformer -> Pooling -> Normalize.
    Its tokenizer has a chat template, so sentence-transformers 6 embeds a text as a user turn
    rendered through it (the "message" modality): what the job's own tokenizing must match."""
    import warnings

    from sentence_transformers import SentenceTransformer, models

    out = Path(out_dir)
    base = make_tiny_model(out.parent / f"{out.name}-base", "qwen3", num_hidden_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules: list[Any] = [models.Transformer(str(base), max_seq_length=max_seq_length)]
        modules += [models.Pooling(64, pooling_mode=pooling), models.Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def make_tiny_classifier(
    out_dir: str | Path, labels: Optional[list[str]] = None, seed: int = 0, family: str = "llama", **overrides: Any
) -> Path:
    """A random *ForSequenceClassification directory of `family` (llama, qwen2, ...: 2 layers,
    hidden 64); `labels` its id2label (None: one label, a reward model)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    names = labels or ["LABEL_0"]
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
    )
    config = AutoConfig.for_model(family, **{**fields, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # biases too: a zero bias would hide a missed one
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 1.0 if "embed" in name else 0.08)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
