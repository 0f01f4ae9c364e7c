"""What the engine resolved at start-up: `Engine.settings`, read by run manifests and benchmarks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

# Keys `as_dict` leaves out while their value is None: they exist only for an engine that has them.
_PRESENT_ONLY = ("speculative", "draft_model", "warmup", "lora")
# Keys `as_dict` leaves out at this value: a generation engine's manifest reads as it always has.
_LEFT_OUT_AT = {"task": "generate", "model_path": "native"}


@dataclass(frozen=True)
class EngineSettings:
    """Start-up's resolved settings. `as_dict` is the JSON form the manifest records, in this field
    order; fields that only some engines have (speculation, a draft model, a warm-up) are left out
    of it while None, and `task` while it is "generate"."""

    model_type: str  # the decoder family (llama, qwen3_moe, ...)
    device: str  # "cpu" or "cuda[:i]"
    dtype: str  # the resolved compute dtype, e.g. "bfloat16"
    num_threads: int  # torch intra-op threads
    block_size: int  # tokens per KV block
    num_kv_blocks: int  # KV blocks in the cache
    kv_cache_bytes: int  # num_kv_blocks x bytes per block (a draft model's entries included)
    max_model_len: int  # prompt + output tokens a request may reach
    max_num_seqs: int  # requests running in one step
    max_num_batched_tokens: int  # token budget of one step
    # What the start-up profile measured: {"prefill_tok_s": {tokens: tok/s}, "decode_tok_s": {seqs: tok/s}}
    batch_limits_profile: Mapping[str, Any]
    # csrc/ kernels (attention, elementwise, linears, W8A8/W4A8 quantization) built and on (CPU)
    native_cpu_kernels: bool
    packed_linears: int  # bf16 CPU linears whose weights were packed at load
    native_linears: int  # of those, the ones csrc/linear.cpp runs (the others: oneDNN)
    # Weights and KV format: also what the benchmark table shows.
    quantization: str  # engine.quantization
    quant_group_size: int  # engine.quant_group_size
    w8a8_outlier_channels: Optional[int]  # engine.w8a8_outlier_channels under w8a8, else None
    quant_formats: Mapping[str, int]  # weight format key -> number of linears in it
    weight_bytes: int  # bytes of the target model's weights as loaded
    kv_cache_dtype: str  # engine.kv_cache_dtype
    async_scheduling: bool  # engine.async_scheduling
    admission_min_slots: int  # engine.admission_min_slots
    # The kernel set bound at start-up (kernels/kernel_set.py: KernelSet.describe): the target, the
    # function serving each kernel and linear format, and the tuning's choices (source "table" or
    # "measured"); docs/kernels.md says how to read it
    kernels: Mapping[str, Any]
    tensor_parallel_size: int = 1  # engine.tensor_parallel_size: ranks (devices) of this worker's group
    # bytes of the weights each rank holds, rank 0 first (weight_bytes: the whole model's, each tensor once)
    rank_weight_bytes: tuple[int, ...] = ()
    # What the engine serves (engine/tasks.py): generate, embed or score. An embed/score engine has
    # no KV cache (num_kv_blocks and kv_cache_bytes 0), and its max_num_seqs is the prompts it packs
    # from (a window), max_num_batched_tokens the tokens of one forward.
    task: str = "generate"
    speculative: Optional[Mapping[str, Any]] = None  # the drafter's method, k, self_layers, adaptive
    draft_model: Optional[str] = None  # speculative.method=draft: the draft model's path
    # How the model is run (model/generic.py: serving_path): "native" (batchrun's own decoder for its
    # family) or "generic" (the model's transformers implementation over batchrun's paged attention)
    model_path: str = "native"
    # LoRA: {"adapters": {name: sha256 of its files}, "max_loras": engine.max_loras, "slots": resident
    # slots allocated (at most one per adapter), "max_rank": r}; None without
    lora: Optional[Mapping[str, Any]] = None
    warmup: Optional[Mapping[str, Any]] = None  # the last warm-up's {"num_steps", "graph_buckets", "seconds"}

    def as_dict(self) -> dict[str, Any]:
        """A plain dict for JSON (copies: changing it changes nothing here)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            k: _plain(v)
            for k, v in fields.items()
            if not (k in _PRESENT_ONLY and v is None) and not (k in _LEFT_OUT_AT and v == _LEFT_OUT_AT[k])
        }

    def with_warmup(self, summary: Mapping[str, Any]) -> EngineSettings:
        return dataclasses.replace(self, warmup=summary)


def _plain(value: Any) -> Any:
    """Mappings as dicts and lists as lists, all the way down."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
