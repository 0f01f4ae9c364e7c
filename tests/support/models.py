"""Tiny in-memory decoders for the CPU kernel tests: a random-weight Llama with a tied LM head
(the embedding and the head share one table, which packing must keep shared)."""

from __future__ import annotations

from typing import Any

import torch

from batchrun.model.decoder import DecoderLM


def tied_decoder(dtype: torch.dtype = torch.bfloat16, seed: int = 0, **config: Any) -> DecoderLM:
    """A DecoderLM over a random Llama with `tie_word_embeddings`: 2 layers, hidden 64, vocabulary 320,
    GQA (4 heads, 2 KV heads); `config` overrides any LlamaConfig field."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return DecoderLM(LlamaConfig(**{**fields, **config})).to(dtype)
