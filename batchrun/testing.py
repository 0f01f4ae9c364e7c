"""Tiny random-weight models for tests and examples: no network, built from transformers configs.

Lives in the package (not tests/) so notebooks, benchmarks and worker subprocesses can build the
same models. The tokenizer is a small byte-level BPE trained on CPython's own documentation text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Per family: the config overrides that make a tiny model exercise that family's features.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", num_key_value_heads=2),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=24),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=24),
    "gemma3_text": dict(
        model_type="gemma3_text",
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=16,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # Mixture of experts: 4 experts, top-2. Qwen3-MoE also keeps layer 1 dense (mlp_only_layers).
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_key_value_heads=2,
        head_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
}

_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def sample_texts() -> list[str]:
    """Real English text shipped with CPython: the pydoc topic documents, in a stable order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on pydoc text, with ChatML-style special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample_texts()[:40], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(out_dir: str | os.PathLike, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight HF model directory (config.json, model.safetensors, tokenizer files)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    kw = {**_BASE, **FAMILIES[family], **overrides}
    model_type = kw.pop("model_type")
    kw.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves small logits; widen them so greedy argmax is not decided by float noise.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                # MoE router: wide logits so no token sits on a top-k boundary where float noise
                # between implementations could pick a different expert.
                p.normal_(0.0, 0.5)
            elif p.dim() >= 2:  # 3D: fused expert weights (num_experts, out, in)
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            elif "norm" in name and family == "gemma3_text":
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "batchrun_family.json").write_text(json.dumps({"family": family}))
    return out
