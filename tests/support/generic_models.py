"""Tiny random-weight HF causal LMs of any architecture transformers builds from a config (the
generic path's oracles: tests/model/test_generic.py, tests/job/test_generic_job.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_tiny(directory: Path, tokenizer: Any, model_type: str, **config: Any) -> str:
    """A random-weight HF model of `model_type` (2 layers, hidden 64, the test tokenizer's 512-token
    vocabulary) saved with its tokenizer. Weights are drawn wide enough that attention and the
    positions decide the tokens (not the embedding alone)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    hf_config = AutoConfig.for_model(model_type, **{**fields, **config})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if p.shape[0] == len(tokenizer) and "head" not in name else 0.2)
            elif "norm" in name or "ln" in name:
                p.normal_(0.0 if model_type == "gemma2" else 1.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
