"""The dataclasses the engine hands across its public seam."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


@dataclass
class RequestMetrics:
    arrival_s: float = 0.0  # time.perf_counter() when the request was admitted
    first_scheduled_s: Optional[float] = None  # when its first prefill step ran
    first_token_s: Optional[float] = None  # when its first output token was sampled
    finished_s: Optional[float] = None  # when it finished
    ttft_s: Optional[float] = None  # first token time minus arrival
    itl_s: Optional[float] = None  # mean gap between output tokens (None with fewer than 2 tokens)
    latency_s: Optional[float] = None  # finish minus arrival
    # prompt tokens not computed for it at first scheduling: served from the prefix cache, or
    # shared with sample 0 of its prompt (SamplingParams.n)
    num_cached_tokens: int = 0
    num_preemptions: int = 0  # times the request was evicted and recomputed
    num_spec_proposed: int = 0  # draft tokens proposed for it
    num_spec_accepted: int = 0  # of those, accepted by verification
    num_spec_steps: int = 0  # steps in which it carried drafts
    # embed/score: prompt tokens cut off because the prompt was longer than the model's input limit
    # (max_seq_length), as sentence-transformers truncates (the tokenizer's special tokens kept)
    num_truncated_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: Any  # the caller's id (or the index in `generate`)
    prompt_token_ids: list[int]  # the prompt as tokenized
    token_ids: list[int]  # generated tokens only (after stop-string trimming)
    text: str  # decoded generated text, without stop strings
    # "stop" | "length" | "thinking_length" (max_tokens reached inside an open trace) | "error" |
    # "pooled" (embed/score)
    finish_reason: str
    error: Optional[str] = None  # message when finish_reason == "error"
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Per generated token: {token_id: logprob} of the token itself and the top-N candidates (N or
    # N + 1 entries), from the model's raw distribution, when SamplingParams.logprobs is set.
    logprobs: Optional[list[dict[int, float]]] = None
    sample_index: int = 0  # which of the prompt's SamplingParams.n samples (0..n-1)
    # Per prompt token after the first: {token_id: logprob} of it and the top-N, given the tokens
    # before it, when SamplingParams.prompt_logprobs is set.
    prompt_logprobs: Optional[list[dict[int, float]]] = None
    # Its params had a json_schema, regex or choice: with finish_reason "length" the output is cut
    # inside its grammar, so it does not satisfy the constraint.
    constrained: bool = False
    # engine.task embed: the embedding, (dim,) float32; score: the head's logits, (num_labels,)
    # float32. None for generation (token_ids and text are empty and finish_reason "pooled" here).
    pooled: Optional[np.ndarray] = None
    # Reasoning models (engine/reasoning.py), when the engine recognises think tags: the trace's
    # text (between the tags, whitespace stripped; None: the output has no trace) and `text` is the
    # answer only (after the closing tag and separator). num_reasoning_tokens: tokens between the
    # tags; num_answer_tokens: tokens after the closing tag (all output tokens without a trace).
    reasoning: Optional[str] = None
    num_reasoning_tokens: int = 0
    num_answer_tokens: int = 0


@dataclass
class EngineRequest:
    """What `Engine.stream` accepts besides bare prompts: a prompt with its own id and params."""

    request_id: Any  # echoed back in RequestOutput.request_id
    prompt: Any  # str (tokenized as is) or list[int] of token ids
    params: Optional[Any] = None  # SamplingParams; None uses the stream's default
    adapter: Optional[str] = None  # a name in engine.lora_adapters; None: the base model


@dataclass(frozen=True)
class EngineStats:
    """Cumulative counters since the engine was built (per-shard figures are differences)."""

    num_kv_blocks_total: int  # blocks in the KV pool
    peak_kv_blocks_used: int  # most blocks held at once since construction or reset_peak_stats()
    num_preemptions: int  # requests evicted and later recomputed
    num_prompt_tokens: int  # prompt tokens of admitted requests
    num_cached_tokens: int  # of those, tokens served from the prefix cache
    num_generated_tokens: int  # tokens sampled
    num_steps: int  # model forward passes
    num_spec_proposed: Optional[int] = None  # speculative tokens proposed (None: speculation off)
    num_spec_accepted: Optional[int] = None  # of those, accepted
    # MoE models only (None for dense): per MoE layer (in layer order), the tokens routed to each
    # expert, cumulative; each token counts once per expert it is routed to, so a layer's row sums
    # to tokens computed x top_k. Recomputed tokens (preemption) count again: this is work done.
    expert_token_counts: Optional[list[list[int]]] = None
    num_spec_steps: Optional[int] = None  # steps in which the policy let requests speculate
    num_spec_switches: Optional[int] = None  # times the policy turned speculation on or off
    num_spec_probes: Optional[int] = None  # steps speculated only to measure a speculative step
    # What the adaptive policy measured on this device: "kind/width" -> seconds of one step of that
    # kind (plain decode, spec = verification, draft = one draft pass) at that width (a power of two)
    spec_step_s: Optional[dict[str, float]] = None
    # engine.async_scheduling (None: off): decode steps launched before the previous step's
    # tokens were read (the rest ran synchronously: prefills, admissions, grammar/logprob rows)
    num_async_steps: Optional[int] = None


@dataclass(frozen=True)
class ThroughputProfile:
    """How fast this model runs on this machine, as the engine measured it (engine/profiler.py):
    what a dry run estimates a run's time from."""

    # prefill chunk size (tokens in one step) -> prompt tokens per second
    prefill_tok_s: dict[int, float]
    # running sequences -> output tokens per second (one token per sequence per step)
    decode_tok_s: dict[int, float]
    max_num_seqs: int  # the engine's batch limits, at which a run's steps run
    max_num_batched_tokens: int
    startup_s: float  # seconds the engine took to build (load, size the cache, profile)
    device: str  # "cpu" or "cuda"
    num_threads: int  # torch threads (CPU)
