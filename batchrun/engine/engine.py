"""The Engine facade: tokenize, admit, step (plan -> schedule -> execute -> update), detokenize."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch

from batchrun.engine.config import EngineConfig, EngineConfigError, SamplingParams
from batchrun.engine.outputs import EngineRequest, EngineStats, RequestOutput, ThroughputProfile
from batchrun.engine.pooling import Pooling
from batchrun.engine.profiler import measure_rates
from batchrun.engine.reasoning import ThinkTags
from batchrun.engine.request import Request
from batchrun.engine.runners import PendingStep
from batchrun.engine.scheduler import ScheduledBatch, StepResult
from batchrun.engine.settings import EngineSettings
from batchrun.engine.startup import EngineParts, start_engine, warm_up
from batchrun.engine.tasks import resolve_task
from batchrun.model.quant import QuantizationSummary

log = logging.getLogger(__name__)


class Engine:
    """Offline generation over a paged KV cache with continuous batching, or (engine.task embed or
    score, engine/tasks.py) one pooled vector per prompt (engine/pooling.py: `pooling`).

    `generate` (`embed`, `score`) returns outputs in input order; `stream` admits requests lazily
    from any iterable and yields each output as soon as it finishes, keeping at most
    `max_in_flight` in the engine.
    """

    pooling: Optional[Pooling] = None  # engine.task embed/score: the pooling engine every call goes to
    task = "generate"  # what it serves: "generate", "embed" or "score" (engine.task resolved: engine/tasks.py)
    labels: Optional[list[str]] = None  # score: the head's label names (id2label) in label order
    embedding_dim: Optional[int] = None  # embed: the length of every embedding

    def __init__(self, config: EngineConfig, parts: Optional[EngineParts] = None) -> None:
        """Assign what start-up built: `parts`, or the phases of engine/startup.py run on `config`
        (for embed/score, the pooling engine: no KV cache, scheduler or sampler)."""
        self.config = config
        # engine.lora_adapters' names -> the sha256 of each adapter's files (what a run fingerprints); {} without
        self.adapter_fingerprints: dict[str, str] = {}
        if parts is None:
            resolved = resolve_task(config)
            if resolved.is_pooling and config.lora_adapters:
                raise EngineConfigError(
                    f"engine.lora_adapters cannot run with engine.task={config.task} (resolved to "
                    f"{resolved.task}): adapters are applied to generation only"
                )
            if resolved.is_pooling:
                self._assign_pooling(Pooling(config, resolved))
                return
            parts = start_engine(config)
        target, core = parts.target, parts.core
        self.device, self.dtype, self.tokenizer = target.device, target.dtype, target.tokenizer
        self.model_path, self.model_fingerprint, self.hf_config = target.path, target.fingerprint, target.hf_config
        self.model, self.quantization = target.model, target.quantization
        self.max_model_len = parts.kv_plan.max_model_len
        self.kv, self.runner = parts.cache.kv, parts.cache.runner
        self.max_num_seqs, self.max_num_batched_tokens = parts.limits.max_num_seqs, parts.limits.max_num_batched_tokens
        self.scheduler, self.sampler, self.grammars = core.scheduler, core.sampler, core.grammars
        self.admission, self.drafter = core.admission, core.drafter
        if target.lora is not None:
            self.adapter_fingerprints = dict(target.lora.fingerprints)
        self.settings: EngineSettings = parts.settings
        self.startup_s, self._profile = parts.startup_s, parts.limits.profile
        # engine.tensor_parallel_size > 1: the followers this process leads (engine/group.py); `close` ends them.
        self.group = parts.group
        self._num_steps = 0
        # engine.async_scheduling (engine/runners/gpu.py): the step launched ahead in one call of
        # `step`, its tokens still on their way to the host, and how many were.
        self._ahead: Optional[PendingStep] = None
        self._num_ahead = 0
        if config.async_scheduling and not self.set_async_scheduling(True):
            log.warning(
                "engine.async_scheduling is off with speculative decoding: each step needs the last one's tokens"
            )
        # Times the decode steps the speculation policy prices (a test may put a fake clock here).
        self.step_clock: Callable[[], float] = time.perf_counter

    @property
    def think_tags(self) -> Optional[ThinkTags]:
        """The tags around a reasoning model's trace (engine.think_tags, found at start-up:
        engine/reasoning.py); None: outputs are not split (no tags, or embed/score)."""
        return self.admission.think_tags if self.pooling is None else None

    @think_tags.setter
    def think_tags(self, tags: Optional[ThinkTags]) -> None:
        """Other tags on an idle engine (requests admitted from now on follow them)."""
        assert self.pooling is None and not self.scheduler.has_unfinished(), "retag an idle generate engine only"
        self.admission.think_tags = tags
        assert self.runner.step_sampler is not None
        self.runner.step_sampler.thinking = tags is not None

    def _assign_pooling(self, pooling: Pooling) -> None:
        model = pooling.model
        self.pooling, self.task = pooling, pooling.task
        self.labels, self.embedding_dim = model.labels, model.embedding_dim
        self.device, self.dtype, self.tokenizer = model.device, model.dtype, model.tokenizer
        self.model_path, self.model_fingerprint, self.hf_config = model.path, model.fingerprint, model.hf_config
        self.model = model.model  # type: ignore[assignment]
        self.quantization = QuantizationSummary("none", self.config.quant_group_size)
        self.max_model_len, self.max_num_seqs = pooling.max_model_len, pooling.max_num_seqs
        self.max_num_batched_tokens = pooling.max_num_batched_tokens
        self.settings, self.startup_s, self.group = pooling.settings, pooling.startup_s, None

    def embed(self, prompts: Sequence[Union[str, list[int]]]) -> list[np.ndarray]:
        """One (embedding_dim,) float32 embedding per prompt (text or token ids), in input order.
        ValueError for a prompt that cannot run (empty, bad ids) and on an engine not serving embed."""
        return self._pooled("embed", prompts)

    def score(self, prompts: Sequence[Union[str, list[int]]]) -> list[np.ndarray]:
        """One (num_labels,) float32 array of the head's logits per prompt, in input order.
        ValueError for a prompt that cannot run (empty, over max_model_len) and on an engine not serving score."""
        return self._pooled("score", prompts)

    def _pooled(self, task: str, prompts: Sequence[Union[str, list[int]]]) -> list[np.ndarray]:
        if self.pooling is None or self.pooling.task != task:
            raise ValueError(
                f"Engine.{task} needs engine.task={task}, and this engine serves engine.task={self.task} "
                f"(model {self.model_path})"
            )
        return self.pooling.run(prompts)

    def generate(
        self,
        prompts: Sequence[Union[str, list[int]]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        adapters: Optional[Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order, a prompt's params.n samples
        one after another by sample_index (so with n=1, one output per prompt). `adapters`: per
        prompt a name in engine.lora_adapters, or None for the base model."""
        if self.pooling is not None:
            raise ValueError(
                f"Engine.generate needs engine.task=generate, and this engine serves engine.task={self.task} "
                f"(use Engine.{self.task} or Engine.stream)"
            )
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        assert len(per_prompt) == len(prompts), "one SamplingParams per prompt, or one for all"
        per_adapter = list(adapters) if adapters is not None else [None] * len(prompts)
        assert len(per_adapter) == len(prompts), "one adapter (or None) per prompt"
        requests = [
            EngineRequest(request_id=i, prompt=p, params=sp, adapter=a)
            for i, (p, sp, a) in enumerate(zip(prompts, per_prompt, per_adapter))
        ]
        results: list[dict[int, RequestOutput]] = [{} for _ in prompts]
        for out in self.stream(requests, max_in_flight=max(len(requests), 1)):
            results[out.request_id][out.sample_index] = out
        for samples, sp in zip(results, per_prompt):
            assert sorted(samples) == list(range((sp or SamplingParams()).n))
        return [samples[i] for samples in results for i in sorted(samples)]

    def stream(
        self,
        requests: Iterable[Union[EngineRequest, str, list[int], None]],
        params: Optional[SamplingParams] = None,
        max_in_flight: Optional[int] = None,
    ) -> Iterator[RequestOutput]:
        """Admit requests lazily and yield each output as it finishes (completion order). A request
        with params.n > 1 yields n outputs, one per sample (RequestOutput.sample_index), each as
        it finishes; `max_in_flight` counts samples.

        A `None` from `requests` means "nothing to admit right now": admission pauses until the
        next step (the job's source yields it while it waits for rows in flight to finish before
        it opens another shard). A source must not yield None while the engine is idle and none of
        its own work is in flight, or it is polled again at once.

        embed/score: `params` is not read; outputs carry `pooled` (engine/pooling.py)."""
        if self.pooling is not None:
            yield from self.pooling.stream(requests, max_in_flight)
            return
        default_params = params or SamplingParams()
        limit = max_in_flight or 4 * self.max_num_seqs
        source = iter(requests)
        index = 0
        exhausted = False
        ready: deque[RequestOutput] = deque()
        try:
            while True:
                while not exhausted and self.scheduler.num_unfinished < limit:
                    try:
                        item = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    if item is None:
                        break
                    ready.extend(self._add(item, index, default_params))
                    index += 1
                while ready:
                    yield ready.popleft()
                if not self.scheduler.has_unfinished():
                    if exhausted:
                        return
                    continue
                for req in self.step():
                    yield req.to_output(self.tokenizer)
        finally:
            self.abort_all()

    def stats(self) -> EngineStats:
        if self.pooling is not None:
            return self.pooling.stats()
        return EngineStats(
            num_kv_blocks_total=self.kv.num_blocks,
            peak_kv_blocks_used=self.kv.peak_used_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.scheduler.num_prompt_tokens,
            num_cached_tokens=self.kv.num_hit_tokens,
            num_generated_tokens=self.scheduler.num_generated_tokens,
            num_steps=self._num_steps,
            expert_token_counts=self.model.expert_token_counts(),  # one device read, not one per step
            num_async_steps=self._num_ahead if self.runner.run_ahead else None,
            **(self.drafter.stats() if self.drafter is not None else {}),
        )

    def throughput_profile(self) -> ThroughputProfile:
        """Prefill and decode rates of this model on this machine. The start-up profile's, where it
        measured them; it measures nothing when max_num_seqs and max_num_batched_tokens are both
        configured (and no decode rates when only max_num_seqs is), and then the missing rates are
        timed now, at those limits, as the profile would (a few synthetic steps, once). Needs an
        idle engine; forgets the prefix cache, since those steps write into free blocks."""
        if self.pooling is not None:
            return self.pooling.throughput_profile()
        if not self._profile.get("prefill_tok_s") or not self._profile.get("decode_tok_s"):
            assert not self.scheduler.has_unfinished() and not self.scheduler.num_parked, "profile an idle engine only"
            self.kv.reset_prefix_cache()
            limits = (self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs)
            measured = measure_rates(self.runner, self.kv.num_blocks, self.config.block_size, *limits)
            self._profile = {**measured, **{k: v for k, v in self._profile.items() if v}}
        return ThroughputProfile(
            prefill_tok_s=dict(self._profile["prefill_tok_s"]),
            decode_tok_s=dict(self._profile["decode_tok_s"]),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            startup_s=self.startup_s,
            device=self.device.type,
            num_threads=torch.get_num_threads(),
        )

    def warmup(self) -> dict[str, Any]:
        """Run each kind of step this engine will run once, so Triton compiles every kernel variant
        and every CUDA-graph bucket is captured before anything is timed (engine/warmup.py); return
        what ran (also in settings.warmup). Start-up runs it per EngineConfig.warmup. It leaves no
        trace a request could see (no KV block allocated, no request id consumed, the sampler's
        generator untouched); on an idle engine only, it forgets the prefix cache (its steps write
        into free blocks) and zeroes the expert-load counters, as start-up does."""
        if self.pooling is not None:
            summary = self.pooling.warmup()
            self.settings = self.settings.with_warmup(summary)
            return summary
        assert not self.scheduler.has_unfinished() and not self.scheduler.num_parked, "warm up an idle engine only"
        limits = (self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs)
        summary = warm_up(self.kv, self.runner, self.drafter, self.sampler, *limits)
        self.settings = self.settings.with_warmup(summary)
        return summary

    def set_async_scheduling(self, on: bool) -> bool:
        """Turn engine.async_scheduling on or off on an idle engine (benchmarks compare both on one
        engine); return whether it is on: never with a drafter. Its step count starts again at 0."""
        if self.pooling is not None:
            return False  # a pooling engine runs no decode steps to launch ahead
        assert not self.scheduler.has_unfinished() and self._ahead is None, "switch an idle engine only"
        self.runner.run_ahead = on and self.drafter is None
        self._num_ahead = 0
        return self.runner.run_ahead

    def close(self) -> None:
        """End a tensor-parallel group's followers (a no-op for a one-process engine; idempotent).
        A job closes its engine when it ends; the followers also end when this process does."""
        if self.group is not None:
            self.group.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def reset_peak_stats(self) -> None:
        if self.pooling is None:
            self.kv.reset_peak()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefix blocks that no request holds, so the next request starts cold
        (benchmarks that repeat a workload); returns the number of blocks forgotten."""
        if self.pooling is not None:
            return 0
        return self.kv.reset_prefix_cache()

    def abort_all(self) -> None:
        """Drop every unfinished request and free its blocks (used when a stream is abandoned)."""
        if self.pooling is not None:
            return  # a pooling engine holds nothing between forwards
        self._drop_ahead()
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, "abort")

    def _drop_ahead(self) -> None:
        """Forget the step launched ahead (its requests ended or were aborted): wait for its token
        copy, so its pinned buffer is free before a later step writes there."""
        if self._ahead is not None:
            self._ahead.wait()
            self._ahead = None

    def _add(self, item: Any, index: int, default_params: SamplingParams) -> list[RequestOutput]:
        """Queue one request (params.n samples); return error outputs instead when it can never run."""
        samples = self.admission.build(item, index, default_params)
        if samples[0].error is not None:
            return [req.to_output(self.tokenizer) for req in samples]
        self.scheduler.add(samples[0], samples[1:])
        return []

    def step(self) -> list[Request]:
        """One engine iteration: plan, schedule, execute, update; returns the requests that ended.
        A step launched ahead by the last call (engine.async_scheduling) was planned then."""
        if self._ahead is None:
            plan, proposals = self.drafter.plan(self.scheduler.running) if self.drafter else ({}, {})
            batch = self.scheduler.schedule(plan)
            executed = self._execute(batch, proposals)
        else:
            executed, self._ahead = self._ahead, None
        self._ahead = self._launch_ahead(executed)
        return self._update(executed)

    def _execute(self, batch: ScheduledBatch, proposals: dict[int, list[int]]) -> Union[StepResult, PendingStep]:
        """Run and sample the batch (its drafts first, where the plan gave it some)."""
        assert not batch.is_empty(), "scheduler produced an empty batch with requests pending"
        self._num_steps += 1
        if self.drafter is None:
            return self.runner.execute(batch)
        return self.drafter.execute(batch, proposals, self.runner, self.step_clock)

    def _launch_ahead(self, executed: Union[StepResult, PendingStep]) -> Optional[PendingStep]:
        """The decode step after `executed`, launched before executed's tokens are read, where its
        tokens are still on the device, the scheduler can hold the running requests' places and the
        runner can replay their next step (engine/runners/gpu.py), and no reasoning request may need
        a forced token in it (engine/reasoning.py: `runs_blind`); else None."""
        running = self.scheduler.running
        if not isinstance(executed, PendingStep) or not self.runner.can_replay_next(running):
            return None
        # A trace whose next token may spend its budget forces the token after it: not blind.
        if self.admission.think_tags is not None and not all(
            r.thinking is None or r.thinking.runs_blind for r in running
        ):
            return None
        if not self.scheduler.can_hold_places(executed.rows):
            return None
        executed.held = True
        batch = self.scheduler.schedule_ahead()
        self._num_steps += 1
        self._num_ahead += 1
        return self.runner.execute_ahead(batch, executed)

    def _update(self, executed: Union[StepResult, PendingStep]) -> list[Request]:
        """Hand the step's tokens to the scheduler (waiting for them if they are on their way);
        return the requests that ended."""
        finished = self.scheduler.update(executed.result() if isinstance(executed, PendingStep) else executed)
        # The step ahead holds requests running at its launch: only this call can have ended them all.
        if finished and self._ahead is not None and all(r.is_finished for r in self._ahead.batch.requests):
            self._drop_ahead()  # every request of the step ahead ended with the tokens just read
        return finished
