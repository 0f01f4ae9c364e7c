"""A model directory's sentence-transformers pipeline (modules.json and the folders it names), read
without importing sentence-transformers, and the pooling steps it asks for over packed rows.

Two generations of files are read: sentence-transformers 2-5 (`pooling_mode_mean_tokens: true`,
`max_seq_length` in sentence_bert_config.json, module types `sentence_transformers.models.X`) and 6
(`pooling_mode: "mean"`, the limit as the tokenizer's `model_max_length`, module types under
`sentence_transformers.base.modules`). A module this reader does not know is refused by name, so a
pipeline is never run with a step silently left out.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

POOLING_MODES = ("cls", "mean", "lasttoken")
# The activation names Dense configs carry (torch's class path) -> the function it applies.
_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": torch.tanh,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.ReLU": torch.relu,
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.modules.activation.GELU": F.gelu,
}


class SentencePipelineError(ValueError):
    """The directory's sentence-transformers files name a step this reader cannot run."""


@dataclass
class DenseStep:
    weight: torch.Tensor  # (out_features, in_features) float32
    bias: Optional[torch.Tensor]  # (out_features,) float32
    activation: str  # a key of _ACTIVATIONS


@dataclass
class SentencePipeline:
    """What sentence-transformers does after the transformer: pool, then Dense layers, then Normalize."""

    pooling: str  # one of POOLING_MODES
    dense: list[DenseStep] = field(default_factory=list)
    normalize: bool = False
    # Longest input in tokens (special tokens included); longer ones are truncated as the tokenizer
    # truncates them (its own special tokens kept). None: the model's position limit.
    max_seq_length: Optional[int] = None
    do_lower_case: bool = False  # sentence_bert_config.json: lowercase the text before tokenizing
    # config_sentence_transformers.json's prompts[default_prompt_name]: encode() puts it before every
    # text (string concatenation, before lowercasing and tokenizing); "" when the model names none.
    prompt: str = ""

    @property
    def dense_out(self) -> Optional[int]:
        return int(self.dense[-1].weight.shape[0]) if self.dense else None

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        """(num_rows, dim) pooled float32 -> the embeddings: Dense layers, then Normalize."""
        x = pooled.float()
        for step in self.dense:
            # The steps are read onto the CPU; the copy is a no-op there and (num_rows x dim) cheap elsewhere.
            bias = step.bias.to(x.device) if step.bias is not None else None
            x = _ACTIVATIONS[step.activation](F.linear(x, step.weight.to(x.device), bias))
        return F.normalize(x, p=2, dim=1) if self.normalize else x


def _kind(module_type: str) -> str:
    """'sentence_transformers.models.Pooling' or '...modules.pooling.Pooling' -> 'Pooling'."""
    return module_type.rsplit(".", 1)[-1]


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise SentencePipelineError(f"{path}: expected a JSON object")
    return data


def _pooling_mode(config: dict[str, Any], where: str) -> str:
    mode = config.get("pooling_mode")
    if isinstance(mode, list):
        if len(mode) != 1:
            raise SentencePipelineError(f"{where}: pooling modes {mode} combined; one mode is supported")
        mode = mode[0]
    if mode is None:  # sentence-transformers < 6: one boolean per mode
        on = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
        if len(on) != 1:
            raise SentencePipelineError(f"{where}: expected exactly one pooling mode switched on, got {on}")
        mode = {
            "pooling_mode_cls_token": "cls",
            "pooling_mode_mean_tokens": "mean",
            "pooling_mode_lasttoken": "lasttoken",
        }.get(on[0], on[0])
    mode = {"mean_tokens": "mean", "cls_token": "cls", "last_token": "lasttoken"}.get(str(mode), str(mode))
    if mode not in POOLING_MODES:
        raise SentencePipelineError(f"{where}: pooling mode {mode!r} is not supported (supported: {POOLING_MODES})")
    if config.get("include_prompt", True) is False:
        raise SentencePipelineError(f"{where}: include_prompt=false is not supported")
    return mode


def _dense(directory: str) -> DenseStep:
    from safetensors.torch import load_file

    config = _read_json(os.path.join(directory, "config.json"))
    activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    if activation not in _ACTIVATIONS:
        raise SentencePipelineError(f"{directory}: Dense activation {activation!r} is not supported")
    if config.get("use_residual"):
        raise SentencePipelineError(f"{directory}: Dense with use_residual is not supported")
    st_path = os.path.join(directory, "model.safetensors")
    if os.path.isfile(st_path):
        weights = load_file(st_path)
    else:  # older sentence-transformers wrote a pickle; weights only, never arbitrary objects
        weights = torch.load(os.path.join(directory, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    return DenseStep(
        weight=weights["linear.weight"].float(),
        bias=weights["linear.bias"].float() if "linear.bias" in weights else None,
        activation=activation,
    )


def _default_prompt(directory: str) -> str:
    path = os.path.join(directory, "config_sentence_transformers.json")
    if not os.path.isfile(path):
        return ""
    config = _read_json(path)
    name = config.get("default_prompt_name")
    if not name:
        return ""
    prompts = config.get("prompts") or {}
    if name not in prompts:
        raise SentencePipelineError(f"{path}: default_prompt_name {name!r} is not one of prompts {sorted(prompts)}")
    return str(prompts[name] or "")


def read_pipeline(directory: str) -> Optional[SentencePipeline]:
    """The pipeline of a sentence-transformers directory; None when it has no modules.json.

    A Normalize entry whose folder is missing counts (all-MiniLM-L6-v2's packaged copy lists
    2_Normalize without the folder; the step has no parameters)."""
    modules_path = os.path.join(directory, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    with open(modules_path, encoding="utf-8") as f:
        modules = json.load(f)
    pooling: Optional[str] = None
    dense: list[DenseStep] = []
    normalize = False
    for entry in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = _kind(str(entry.get("type", "")))
        path = os.path.join(directory, str(entry.get("path", "")))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _pooling_mode(_read_json(os.path.join(path, "config.json")), path)
        elif kind == "Dense":
            if pooling is None:
                raise SentencePipelineError(f"{modules_path}: a Dense step before pooling is not supported")
            dense.append(_dense(path))
        elif kind == "Normalize":
            normalize = True
        else:
            raise SentencePipelineError(f"{modules_path}: module {entry.get('type')!r} is not supported")
    if pooling is None:
        raise SentencePipelineError(f"{modules_path}: no Pooling module")
    bert_config_path = os.path.join(directory, "sentence_bert_config.json")
    bert_config = _read_json(bert_config_path) if os.path.isfile(bert_config_path) else {}
    max_seq_length = bert_config.get("max_seq_length")
    return SentencePipeline(
        prompt=_default_prompt(directory),
        pooling=pooling,
        dense=dense,
        normalize=normalize,
        max_seq_length=int(max_seq_length) if max_seq_length is not None else None,
        do_lower_case=bool(bert_config.get("do_lower_case", False)),
    )


def pool(hidden: torch.Tensor, seq_lens: list[int], mode: str) -> torch.Tensor:
    """(num_tokens, hidden) packed rows, back to back -> (num_rows, hidden) float32, one per row."""
    assert sum(seq_lens) == hidden.shape[0], "seq_lens must cover the packed tokens exactly"
    lens = torch.tensor(seq_lens, dtype=torch.long, device=hidden.device)  # (num_rows,)
    ends = torch.cumsum(lens, 0)  # (num_rows,)
    if mode == "cls":
        return hidden.index_select(0, ends - lens).float()
    if mode == "lasttoken":
        return hidden.index_select(0, ends - 1).float()
    assert mode == "mean", mode
    row_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)
    sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, row_of_token, hidden.float())
    return sums / lens[:, None].to(torch.float32)
