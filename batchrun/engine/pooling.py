"""The pooling engine (engine.task embed or score): prompts in, one float32 vector per prompt out.

No KV cache is kept, no scheduler or sampler runs: a window of up to max_in_flight prompts is
tokenized (truncated as the tokenizer truncates, for embed), sorted by length and packed without
padding into forwards of at most max_num_batched_tokens tokens (a longer prompt runs alone), and
each prompt's output is yielded as its forward finishes. `Engine` delegates to this class when the
task resolved at start-up is embed or score (engine/tasks.py); the model side is
engine/pooling_model.py.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch

from batchrun.engine.config import EngineConfig
from batchrun.engine.outputs import EngineRequest, EngineStats, RequestMetrics, RequestOutput, ThroughputProfile
from batchrun.engine.pooling_model import DEFAULT_TOKEN_BUDGET, PoolingModel, load_pooling_model
from batchrun.engine.settings import EngineSettings
from batchrun.engine.tasks import ResolvedTask
from batchrun.model.prepare import module_weight_bytes

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 256  # prompts packed from at once when engine.max_num_seqs is not set
_PROBE_TEXT = "hello world"  # tokenized with and without special tokens to find the trailing ones


@dataclass
class _Pending:
    """One admitted prompt waiting for its forward."""

    request_id: Any
    token_ids: list[int]  # as it runs: truncated to max_model_len where it was longer
    metrics: RequestMetrics


def _is_token_id(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool: what a prompt's token ids may be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def encode_text(tokenizer: Any, text: str, renders_chat: bool, prompt: str = "") -> list[int]:
    """A text's token ids as sentence-transformers makes them: `prompt` + text through the tokenizer
    with its special tokens, or (`renders_chat`) the text as a user turn rendered through the chat
    template, after `prompt` as a system turn."""
    if renders_chat:
        system = [{"role": "system", "content": prompt}] if prompt else []
        rendered = tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": text}], tokenize=False, add_generation_prompt=False
        )
        return list(tokenizer(rendered, add_special_tokens=False, verbose=False)["input_ids"])
    return list(tokenizer(prompt + text, add_special_tokens=True, verbose=False)["input_ids"])


def special_suffix(tokenizer: Any, renders_chat: bool = False) -> list[int]:
    """The token ids `encode_text` appends after every text ([SEP], an EOS, a chat template's end of
    turn, or none): what truncation keeps at the end of a cut prompt, as the tokenizer's own
    truncation (and sentence-transformers' chat-template suffix restore) does."""
    with_special = encode_text(tokenizer, _PROBE_TEXT, renders_chat)
    plain = list(tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"])
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            return with_special[start + len(plain) :]
    return []


def input_limit(config: EngineConfig, resolved: ResolvedTask, model: PoolingModel) -> int:
    """max_model_len of a pooling engine: the longest input. embed: sentence-transformers'
    max_seq_length, else min(tokenizer.model_max_length, max_position_embeddings); score: the
    model's positions. engine.max_model_len lowers either."""
    limit = model.position_limit
    if resolved.task == "embed":
        st_limit = resolved.pipeline.max_seq_length if resolved.pipeline is not None else None
        if st_limit is None:
            st_limit = int(min(getattr(model.tokenizer, "model_max_length", limit) or limit, limit))
        limit = min(st_limit, limit)
    return min(limit, config.max_model_len) if config.max_model_len else limit


class Pooling:
    """Embed or score prompts with a pooling model (what `Engine` runs for engine.task embed/score)."""

    def __init__(self, config: EngineConfig, resolved: ResolvedTask, model: Optional[PoolingModel] = None) -> None:
        t0 = time.perf_counter()
        assert resolved.is_pooling, resolved.task
        self.config, self.task = config, resolved.task
        self.model = model if model is not None else load_pooling_model(config, resolved)
        self.do_lower_case = resolved.pipeline.do_lower_case if resolved.pipeline is not None else False
        self.renders_chat = resolved.renders_chat
        # the pipeline's default prompt (config_sentence_transformers.json), put before every text
        self.text_prompt = str(getattr(resolved.pipeline, "prompt", "") or "")
        self.max_model_len = input_limit(config, resolved, self.model)
        self.max_num_seqs = config.max_num_seqs or DEFAULT_WINDOW
        self.max_num_batched_tokens = config.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET.get(
            self.model.device.type, DEFAULT_TOKEN_BUDGET["cpu"]
        )
        self.suffix_ids = special_suffix(self.model.tokenizer, self.renders_chat)
        self.vocab_size = int(getattr(self.model.hf_config, "vocab_size", 0) or len(self.model.tokenizer))
        self.num_prompt_tokens = 0  # tokens run (after truncation)
        self.num_steps = 0  # forwards
        self._profile: dict[str, dict[int, float]] = {}
        self.settings = self._describe()
        if config.warmup or (config.warmup is None and self.model.device.type == "cuda"):
            self.settings = self.settings.with_warmup(self.warmup())
        self.startup_s = time.perf_counter() - t0
        log.info(
            "pooling engine ready in %.1fs: %s (%s, task %s) on %s/%s, max_model_len %d, window %d, "
            "%d tokens a forward",
            self.startup_s,
            self.model.path,
            self.model.model_type,
            self.task,
            self.model.device,
            self.model.dtype,
            self.max_model_len,
            self.max_num_seqs,
            self.max_num_batched_tokens,
        )

    def _describe(self) -> EngineSettings:
        config, model = self.config, self.model
        weight_bytes = module_weight_bytes(model.model)
        return EngineSettings(
            model_type=model.model_type,
            device=str(model.device),
            dtype=str(model.dtype).replace("torch.", ""),
            num_threads=torch.get_num_threads(),
            block_size=config.block_size,
            num_kv_blocks=0,
            kv_cache_bytes=0,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            batch_limits_profile={},
            native_cpu_kernels=model.kernels.target.native_cpu_kernels if model.kernels is not None else False,
            packed_linears=model.num_packed_linears,
            native_linears=model.num_native_linears,
            quantization="none",
            quant_group_size=config.quant_group_size,
            w8a8_outlier_channels=None,
            quant_formats={},
            weight_bytes=weight_bytes,
            kv_cache_dtype=config.kv_cache_dtype,
            async_scheduling=False,
            admission_min_slots=config.admission_min_slots,
            kernels=model.kernels.describe() if model.kernels is not None else {},
            tensor_parallel_size=1,
            rank_weight_bytes=(weight_bytes,),
            task=self.task,
        )

    # ------------------------------------------------------------------------------------------
    # admission

    def _tokenize(self, prompt: Any) -> tuple[list[int], int, Optional[str]]:
        """(token ids as they run, tokens truncated, None), or (ids, 0, why the prompt cannot run)."""
        if isinstance(prompt, str):
            text, before = (
                (prompt.lower(), self.text_prompt.lower()) if self.do_lower_case else (prompt, self.text_prompt)
            )
            token_ids = encode_text(self.model.tokenizer, text, self.renders_chat, before) if text else []
        elif isinstance(prompt, (list, tuple, np.ndarray)) and all(_is_token_id(t) for t in prompt):
            token_ids = [int(t) for t in prompt]  # numpy integers (an array, its items) as Python ints
            if any(t < 0 or t >= self.vocab_size for t in token_ids):
                return token_ids, 0, f"prompt token ids must be in [0, {self.vocab_size})"
        else:
            return [], 0, f"prompt must be a str or int token ids, got {type(prompt).__name__}"
        if not token_ids:
            return token_ids, 0, "prompt is empty (no tokens)"
        limit = self.max_model_len
        if len(token_ids) <= limit:
            return token_ids, 0, None
        if self.task == "score":  # a cut conversation is not the one scored: refused, never truncated
            return token_ids, 0, f"prompt has {len(token_ids)} tokens but max_model_len is {limit}"
        suffix = self.suffix_ids if token_ids[len(token_ids) - len(self.suffix_ids) :] == self.suffix_ids else []
        if len(suffix) >= limit:
            suffix = []
        return token_ids[: limit - len(suffix)] + suffix, len(token_ids) - limit, None

    def _admit(self, item: Any, index: int) -> Union[_Pending, RequestOutput]:
        if isinstance(item, EngineRequest):
            request_id, prompt = item.request_id, item.prompt
        else:
            request_id, prompt = index, item
        metrics = RequestMetrics(arrival_s=time.perf_counter())
        token_ids, num_truncated, error = self._tokenize(prompt)
        if error is not None:
            metrics.finished_s = time.perf_counter()
            metrics.latency_s = metrics.finished_s - metrics.arrival_s
            return RequestOutput(request_id, token_ids, [], "", "error", error=error, metrics=metrics)
        metrics.num_truncated_tokens = num_truncated
        return _Pending(request_id, token_ids, metrics)

    # ------------------------------------------------------------------------------------------
    # running

    def stream(
        self, requests: Iterable[Union[EngineRequest, str, list[int], None]], max_in_flight: Optional[int] = None
    ) -> Iterator[RequestOutput]:
        """Admit up to `max_in_flight` prompts (a window), run them packed, yield each output as its
        forward ends; then the next window. An error output is yielded at admission. A None from
        `requests` ends the window early (nothing more to admit now)."""
        limit = max_in_flight or self.max_num_seqs
        source = iter(requests)
        index = 0
        exhausted = False
        while True:
            window: list[_Pending] = []
            while not exhausted and len(window) < limit:
                try:
                    item = next(source)
                except StopIteration:
                    exhausted = True
                    break
                if item is None:
                    break
                admitted = self._admit(item, index)
                index += 1
                if isinstance(admitted, RequestOutput):
                    yield admitted
                else:
                    window.append(admitted)
            if window:
                yield from self._run_window(window)
            elif exhausted:
                return

    def pack(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices into `lengths` grouped into forwards: sorted by length, each group's tokens within
        max_num_batched_tokens (a prompt longer than that alone)."""
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        groups: list[list[int]] = []
        group: list[int] = []
        num_tokens = 0
        for i in order:
            if group and num_tokens + lengths[i] > self.max_num_batched_tokens:
                groups.append(group)
                group, num_tokens = [], 0
            group.append(i)
            num_tokens += lengths[i]
        if group:
            groups.append(group)
        return groups

    def _run_window(self, window: list[_Pending]) -> Iterator[RequestOutput]:
        for group in self.pack([len(p.token_ids) for p in window]):
            pendings = [window[i] for i in group]
            started = time.perf_counter()
            vectors = self.model.run([p.token_ids for p in pendings]).cpu().numpy()  # (num_rows, dim) float32
            finished = time.perf_counter()
            self.num_steps += 1
            for pending, vector in zip(pendings, vectors):
                self.num_prompt_tokens += len(pending.token_ids)
                m = pending.metrics
                m.first_scheduled_s, m.finished_s = started, finished
                m.latency_s = finished - m.arrival_s
                yield RequestOutput(
                    pending.request_id, pending.token_ids, [], "", "pooled", metrics=m, pooled=vector.copy()
                )

    def run(self, prompts: Sequence[Union[str, list[int]]]) -> list[np.ndarray]:
        """One float32 vector per prompt, in input order; ValueError naming the first prompt that
        cannot run (empty, bad ids, a score prompt over max_model_len)."""
        results: list[Optional[np.ndarray]] = [None] * len(prompts)
        for out in self.stream(list(prompts), max_in_flight=max(len(prompts), 1)):
            if out.pooled is None:
                raise ValueError(f"prompt {out.request_id}: {out.error}")
            results[out.request_id] = out.pooled
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    # ------------------------------------------------------------------------------------------
    # what the engine reports

    def stats(self) -> EngineStats:
        return EngineStats(
            num_kv_blocks_total=0,
            peak_kv_blocks_used=0,
            num_preemptions=0,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=0,
            num_generated_tokens=0,
            num_steps=self.num_steps,
        )

    def _synthetic_rows(self) -> list[list[int]]:
        """Rows of real token ids filling one forward's budget: what warm-up and the profile run."""
        row_len = max(1, min(256, self.max_model_len, self.max_num_batched_tokens))
        probe = list(self.model.tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]) or [0]
        row = (probe * (row_len // len(probe) + 1))[:row_len]
        return [row] * max(1, self.max_num_batched_tokens // row_len)

    def warmup(self) -> dict[str, Any]:
        """One forward at the token budget (Triton compiles its kernels here, not in a timed forward)."""
        t0 = time.perf_counter()
        self.model.run(self._synthetic_rows())
        return {"num_steps": 1, "graph_buckets": [], "seconds": round(time.perf_counter() - t0, 3)}

    def throughput_profile(self) -> ThroughputProfile:
        """Prompt tokens per second of a full forward, timed once (after one untimed forward). A
        pooling engine decodes nothing: that rate stands in for decode too, so a planner dividing
        a run's (zero) output tokens by it holds."""
        if not self._profile:
            rows = self._synthetic_rows()
            self.model.run(rows)
            t0 = time.perf_counter()
            self.model.run(rows)
            rate = sum(len(r) for r in rows) / max(time.perf_counter() - t0, 1e-9)
            self._profile = {"prefill_tok_s": {self.max_num_batched_tokens: rate}, "decode_tok_s": {1: rate}}
        return ThroughputProfile(
            prefill_tok_s=dict(self._profile["prefill_tok_s"]),
            decode_tok_s=dict(self._profile["decode_tok_s"]),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            startup_s=getattr(self, "startup_s", 0.0),
            device=self.model.device.type,
            num_threads=torch.get_num_threads(),
        )
