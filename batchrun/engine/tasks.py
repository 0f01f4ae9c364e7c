"""What the engine serves a model as (engine.task): generate, embed or score, resolved at start-up.

    auto      modules.json (a sentence-transformers pipeline)  -> embed
              a *ForSequenceClassification architecture         -> score
              an encoder family (BERT) without either           -> embed (mean pooling, as
                                                                   sentence-transformers pools a bare model)
              anything else                                     -> generate
    embed     needs a sentence-transformers pipeline or an encoder family
    score     needs a *ForSequenceClassification head
    generate  needs a decoder with an LM head (not an encoder, not a classifier)

A decoder family whose config asks for bidirectional attention (use_bidirectional_attention: true,
is_causal: false) is refused for every task: its layers run causally here.

Every refusal is an EngineConfigError whose one line names `engine.task` and what the model
directory holds, so a job exits 2 with it before anything runs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from batchrun.engine.config import EngineConfig, EngineConfigError
from batchrun.model.decoder import SUPPORTED_MODEL_TYPES
from batchrun.model.generic import GenericModelError, causal_lm_class, serving_path
from batchrun.model.loader import model_config, resolve_model
from batchrun.model.sentence import SentencePipeline, SentencePipelineError, read_pipeline

log = logging.getLogger(__name__)

POOLING_TASKS = ("embed", "score")
# Model types whose attention adds learned sinks to the softmax (s_aux): batchrun's paged attention
# has no sink term, so the generic path refuses them from config.json, before any weight loads.
SINK_MODEL_TYPES = ("gpt_oss",)
# Encoder families the pooling path runs (batchrun/model/encoder.py): bidirectional, absolute positions.
ENCODER_MODEL_TYPES = ("bert",)


@dataclass(frozen=True)
class ResolvedTask:
    """The task start-up resolved, and what it read from the model directory to decide."""

    task: str  # "generate" | "embed" | "score"
    path: str  # the model directory (or a GGUF file's directory)
    hf_config: Any  # the model's transformers config; None for a GGUF file (not read for generation)
    pipeline: Optional[SentencePipeline]  # the directory's sentence-transformers pipeline; None without one
    is_encoder: bool  # an encoder family (ENCODER_MODEL_TYPES), else a decoder
    # sentence-transformers 6 saved the Transformer with the "message" modality (its tokenizer has a
    # chat template): a text is embedded as a user turn rendered through the chat template
    renders_chat: bool = False

    @property
    def is_pooling(self) -> bool:
        return self.task in POOLING_TASKS

    @property
    def has_classifier(self) -> bool:
        return _has_classifier(self.hf_config)


def _architectures(hf_config: Any) -> list[str]:
    return [str(a) for a in (getattr(hf_config, "architectures", None) or [])]


def _has_classifier(hf_config: Any) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in _architectures(hf_config))


def _found(path: str, hf_config: Any, pipeline: Optional[SentencePipeline]) -> str:
    """What the directory holds, for a refusal's message."""
    st = f"a sentence-transformers pipeline ({pipeline.pooling} pooling)" if pipeline else "no modules.json"
    return (
        f"{path} has {st}, model_type {getattr(hf_config, 'model_type', None)!r}, "
        f"architectures {_architectures(hf_config)}"
    )


def resolve_task(config: EngineConfig) -> ResolvedTask:
    """engine.task resolved against the model directory; refusals raise EngineConfigError."""
    requested = config.task
    directory, gguf_file = resolve_model(config.model, config.cache_dir)
    if gguf_file is not None:  # a GGUF file holds a causal LM: no pooling config, no classification head
        if requested in POOLING_TASKS:
            raise EngineConfigError(
                f"engine.task={requested}: {directory}/{gguf_file} is a GGUF file (a causal LM); "
                "embed and score need a model directory (sentence-transformers files or a "
                "*ForSequenceClassification checkpoint)"
            )
        return ResolvedTask("generate", directory, None, None, False)
    hf_config = model_config(directory, config.cache_dir)
    try:
        pipeline = read_pipeline(directory)
    except SentencePipelineError as e:
        if requested == "generate":
            pipeline = None  # the pipeline is not run when generating
        else:
            raise EngineConfigError(f"engine.task={requested}: {e}") from None
    model_type = str(getattr(hf_config, "model_type", ""))
    is_encoder = model_type in ENCODER_MODEL_TYPES
    has_classifier = _has_classifier(hf_config)
    task = requested
    if requested == "auto":
        if pipeline is not None:
            task = "embed"
        elif has_classifier:
            task = "score"
        elif is_encoder:
            task = "embed"
        else:
            task = "generate"
        log.info("engine.task=auto resolved to %s: %s", task, _found(directory, hf_config, pipeline))
    resolved = ResolvedTask(
        task, directory, hf_config, pipeline, is_encoder, pipeline is not None and _renders_chat(directory)
    )
    _check(config, resolved, requested)
    if task == "embed" and pipeline is None:
        log.info(
            "%s has no sentence-transformers pipeline: embeddings are mean-pooled (as sentence-transformers does)",
            directory,
        )
    return resolved


def _renders_chat(directory: str) -> bool:
    """Whether sentence_bert_config.json lists the "message" modality (sentence-transformers 6:
    texts go through the chat template as a user turn)."""
    path = os.path.join(directory, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    modalities = config.get("modality_config") if isinstance(config, dict) else None
    return isinstance(modalities, dict) and "message" in modalities


# Decoder config fields that make a decoder family attend both ways (EmbeddingGemma's
# use_bidirectional_attention, GTE-Qwen-style is_causal: false), with the value that does it.
_BIDIRECTIONAL_FLAGS = (("use_bidirectional_attention", True), ("is_causal", False))


def _bidirectional_flags(hf_config: Any) -> list[tuple[str, Any]]:
    """The (flag, value) pairs of `hf_config` that ask a decoder for bidirectional attention."""
    found = []
    for flag, bidirectional in _BIDIRECTIONAL_FLAGS:
        value = getattr(hf_config, flag, None)
        if value is not None and bool(value) == bidirectional:
            found.append((flag, value))
    return found


def _check(config: EngineConfig, resolved: ResolvedTask, requested: str) -> None:
    """The refusals: a task the model cannot serve, and settings a pooling engine does not run."""
    task, hf_config, pipeline = resolved.task, resolved.hf_config, resolved.pipeline
    key = f"engine.task={requested}" if requested != "auto" else f"engine.task=auto (resolved to {task})"
    found = _found(resolved.path, hf_config, pipeline)
    model_type = str(getattr(hf_config, "model_type", ""))
    is_decoder = model_type in SUPPORTED_MODEL_TYPES
    bidirectional = _bidirectional_flags(hf_config) if is_decoder else []
    if bidirectional:
        flag, value = bidirectional[0]
        raise EngineConfigError(
            f"{key}: {found}; {flag} is not supported ({flag}: {json.dumps(value)} asks for bidirectional "
            "attention, and batchrun's decoders attend causally only)"
        )
    if task == "generate":
        check_serving_path(config, hf_config)
        if resolved.is_encoder:
            raise EngineConfigError(f"{key}: {found}; an encoder has no LM head to generate with (use embed or score)")
        if resolved.has_classifier:
            raise EngineConfigError(
                f"{key}: {found}; a classification head has no LM head to generate with (use score)"
            )
        return
    if task == "embed" and pipeline is None and not resolved.is_encoder:
        raise EngineConfigError(
            f"{key}: {found}; embed needs a sentence-transformers pipeline (modules.json with a Pooling "
            f"module) or an encoder family ({', '.join(ENCODER_MODEL_TYPES)}), and model_type "
            f"{model_type!r} is not an encoder"
        )
    if task == "score" and not resolved.has_classifier:
        raise EngineConfigError(
            f"{key}: {found}; score needs a classification head (a *ForSequenceClassification architecture)"
        )
    if not (is_decoder or resolved.is_encoder):
        families = ", ".join((*SUPPORTED_MODEL_TYPES, *ENCODER_MODEL_TYPES))
        raise EngineConfigError(f"{key}: {found}; model_type {model_type!r} is not a family batchrun runs ({families})")
    refused = (
        (config.tensor_parallel_size > 1, f"engine.tensor_parallel_size={config.tensor_parallel_size}"),
        (config.speculative.method != "none", f"engine.speculative.method={config.speculative.method}"),
        (config.quantization != "none", f"engine.quantization={config.quantization}"),
    )
    for is_set, setting in refused:
        if is_set:
            raise EngineConfigError(f"{key} cannot run with {setting}: the pooling path runs one process, unquantized")


def check_serving_path(config: EngineConfig, hf_config: Any = None) -> None:
    """The generic path's refusals (model/generic.py), one EngineConfigError line naming the key:
    a model its transformers class cannot serve over the paged cache, and the settings it does not
    run. Nothing for a native family. `hf_config`: None reads the model's."""
    if hf_config is None:
        hf_config = model_config(config.model, config.cache_dir)
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "phi3" and config.tensor_parallel_size > 1:
        # its fused qkv_proj/gate_up_proj would need slicing per head and per half: not done
        raise EngineConfigError(
            f"engine.tensor_parallel_size={config.tensor_parallel_size} is not supported for phi3 "
            "(its fused qkv_proj/gate_up_proj are not sliced per rank)"
        )
    if serving_path(hf_config) != "generic":
        return
    try:
        causal_lm_class(hf_config)
    except GenericModelError as e:
        raise EngineConfigError(f"engine.model={config.model}: {e}") from None
    if model_type in SINK_MODEL_TYPES:
        raise EngineConfigError(
            f"engine.model={config.model}: model_type {model_type!r} attends with attention sinks (s_aux), "
            "which batchrun's paged attention does not add; not supported on the generic path"
        )
    if getattr(hf_config, "attn_temperature_tuning", False):
        # Llama 4: below floor_scale (8192) positions the temperature is 1, so start-up's few-token
        # self-check (model/generic.py: check_positions) cannot see it
        raise EngineConfigError(
            f"engine.model={config.model}: config.json attn_temperature_tuning: true (model_type {model_type!r}) "
            "computes positions from its own token count, not position_ids; not supported on the generic path"
        )
    bidirectional = _bidirectional_flags(hf_config)
    if bidirectional:
        flag, value = bidirectional[0]
        raise EngineConfigError(
            f"engine.model={config.model}: config.json {flag}: {json.dumps(value)} asks for bidirectional attention, "
            "and batchrun's paged attention is causal"
        )
    refused = (
        (config.tensor_parallel_size > 1, f"engine.tensor_parallel_size={config.tensor_parallel_size}"),
        (config.quantization != "none", f"engine.quantization={config.quantization}"),
        (config.speculative.method == "self", "engine.speculative.method=self"),
        (config.batch_invariant, "engine.batch_invariant=true"),
        (config.task in POOLING_TASKS, f"engine.task={config.task}"),
    )
    for is_set, setting in refused:
        if is_set:
            raise EngineConfigError(
                f"{setting} is not supported on the generic path, which serves model_type {model_type!r} "
                f"(batchrun's native families: {', '.join(SUPPORTED_MODEL_TYPES)}, phi3 with a plain rope)"
            )


def generic_turned_off(on_gpu: bool) -> list[str]:
    """What the generic path turns off rather than refuses on a target (`on_gpu`: a GPU's, where
    the runner would capture CUDA graphs), each with its reason (the start-up log)."""
    off = ["CUDA graphs (the GPU runner runs every step eagerly)"] if on_gpu else []
    return off + ["fused projections and per-row-count linear tuning (HF's modules run their own projections)"]
