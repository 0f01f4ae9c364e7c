"""What a committed shard was computed from, so that a rerun never silently mixes outputs.

Every commit marker records a fingerprint: flat `key -> value` pairs of everything that changes a
result row, in three parts:

- settings (known before the model loads): the job's prompt template, system prompt, chat
  template mode and variables (enable_thinking, chat_template_kwargs), all sampling parameters
  (max_thinking_tokens too), the data keys that pick columns (and the input format), output.keep_columns,
  and the engine settings that change numbers (dtype, quantization and its knobs, kv_cache_dtype,
  max_model_len, seed, batch_invariant, speculative method, and every speculative setting when seeded rows
  speculate); the LoRA adapters' names and their files' sha256 (hashed here, before the engine
  loads: a changed adapter file is a changed run even where no shard is left to run);
- model (known once the engine is loaded): the model file's sha256, the tokenizer's and chat
  template's hash, the dtype `auto` resolved to, the think tags the engine resolved (and their
  separator);
- input: the shard file's size and version (ETag on object stores, mtime elsewhere).

A rerun compares its own fingerprint with the committed markers before it runs anything (the model
part once the engine is loaded, which happens only when there is work to do). A difference stops
the run with one line naming what changed, unless output.on_change=recompute, which redoes the
shards whose fingerprint differs and keeps the others.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any, Optional

from batchrun.job.config import RunConfig
from batchrun.job.shards import Shard
from batchrun.utils.redact import redact

# Engine settings that change what a row says; the rest (batch sizes, threads, caches, which kernels
# serve: engine.tune_kernels, BATCHRUN_CPU_KERNELS; engine.tensor_parallel_size, whose all-reduces add
# in another order) only change speed (and in bf16 the last bits of a logit, so an occasional near-tied
# token, which any batching engine does; the manifest names the kernels).
_ENGINE_KEYS = (
    "dtype",
    "quantization",
    "quant_group_size",
    "w8a8_outlier_channels",
    "kv_cache_dtype",
    "max_model_len",
    "seed",
    # bf16 rows computed with and without it may differ by a near-tied token; a run that turns it on
    # promises every row the same reduction order, so rows of both kinds must not mix
    "batch_invariant",
    "task",  # an embedding and a generation from one model directory are different rows
)


def settings_fingerprint(config: RunConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    job = {k: v for k, v in dataclasses.asdict(config.job).items() if k not in ("name", "chat_template_kwargs")}
    _flatten("job", job, out)
    # One key, whole: a variable added to an empty mapping is a change too (a flattened key the
    # committed side lacks would not count as one).
    out["job.chat_template_kwargs"] = dict(config.job.chat_template_kwargs)
    _flatten("sampling", dataclasses.asdict(config.sampling), out)
    data_keys = (
        "id_column",
        "text_column",
        "on_too_long",
        "format",
        "openai_model_name",
        "schema_column",
        "response_column",
        "adapter_column",
    )
    _flatten("data", {k: getattr(config.data, k) for k in data_keys}, out)
    out["output.keep_columns"] = list(config.output.keep_columns)
    _flatten("engine", {k: getattr(config.engine, k) for k in _ENGINE_KEYS}, out)
    out["engine.speculative.method"] = config.engine.speculative.method
    spec = config.engine.speculative
    # Without the adaptive policy seeded sampled rows speculate (engine/drafter.is_eligible), and then
    # the drafts decide which random draws pick their tokens; null where speculation leaves them alone.
    seeded_drafts = None
    if spec.method != "none" and not spec.adaptive:
        seeded_drafts = {k: v for k, v in dataclasses.asdict(spec).items() if k != "adaptive"}
    out["engine.speculative.seeded_drafts"] = seeded_drafts
    # The names as one key (an adapter added or removed changes rows that name it), then each
    # adapter's files, so that a difference names the adapter whose files changed.
    adapters = config.model.lora_adapters
    out["model.lora_adapters"] = sorted(adapters)
    for name in sorted(adapters):
        out[f"model.lora_adapters.{name}.sha256"] = adapter_sha256(adapters[name])
    # Markers hold it redacted (directory._encode): compare like with like.
    redacted: dict[str, Any] = redact(out)
    return redacted


# What PEFT writes that decides an adapter's numbers (its README and the like do not).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_sha256(directory: str) -> str:
    """sha256 over the sha256 of a PEFT adapter's config and weights files: the engine's
    Engine.adapter_fingerprints value for it, computed here before the engine loads."""
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):  # a missing one stops the engine with a line naming the adapter
            stat = os.stat(path)
            digest.update(_file_sha256(os.path.realpath(path), stat.st_size, stat.st_mtime_ns).encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """Memoized by size and mtime: a run computes its settings fingerprint several times."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_fingerprint(model_sha256: str, tokenizer: Any, resolved_dtype: str, think_tags: Any = None) -> dict[str, Any]:
    """`think_tags`: the engine's (engine/reasoning.ThinkTags, None: no trace is recognised), which
    decide how an output splits into reasoning and answer and when a budget closes a trace."""
    tags = None if think_tags is None else [think_tags.open, think_tags.close, think_tags.separator]
    return {
        "model.sha256": model_sha256,
        "tokenizer.sha256": tokenizer_sha256(tokenizer),
        "engine.resolved_dtype": resolved_dtype,
        "engine.think_tags": tags,
    }


def input_fingerprint(shard: Shard) -> dict[str, Any]:
    return {"input.size": shard.size, "input.version": shard.version}


def tokenizer_sha256(tokenizer: Any) -> str:
    """Hash of what turns text into ids and back: the fast tokenizer's full definition (vocab,
    merges, normalizer, special tokens) where there is one, else the vocabulary; plus the chat
    template, which decides every chat prompt."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(b"\0chat_template\0")
    digest.update(json.dumps(getattr(tokenizer, "chat_template", None), default=str).encode())
    return digest.hexdigest()


def fingerprint_changes(
    committed: Mapping[str, Any], current: Mapping[str, Any], parts: tuple[str, ...] = ("settings", "model", "input")
) -> list[str]:
    """differences() over the named parts of two fingerprints ({"settings", "model", "input"} ->
    flat pairs); a part either side lacks compares as empty."""
    return [c for part in parts for c in differences(committed.get(part) or {}, current.get(part) or {})]


def differences(committed: Mapping[str, Any], current: Mapping[str, Any], keys: Optional[set[str]] = None) -> list[str]:
    """'key: old -> new' for each key both sides know (or `keys`) whose value differs. A key the
    committed side lacks (a marker of an older version) is not a difference."""
    out = []
    for key in sorted(keys if keys is not None else current):
        if key in committed and key in current and _norm(committed[key]) != _norm(current[key]):
            out.append(f"{key}: {_short(committed[key])} -> {_short(current[key])}")
    return out


def _flatten(prefix: str, values: Mapping[str, Any], out: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, Mapping):
            _flatten(f"{prefix}.{key}", value, out)
        else:
            out[f"{prefix}.{key}"] = list(value) if isinstance(value, tuple) else value


def _norm(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value, sort_keys=True, default=str)


def _short(value: Any) -> str:
    text = _norm(value)
    return text if len(text) <= 40 else text[:37] + "..."
