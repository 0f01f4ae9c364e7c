"""The Engine facade: tokenize, admit, step (schedule -> run -> sample -> update), detokenize."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import torch

from batchrun.engine.async_steps import AsyncSteps, InFlightStep
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.outputs import EngineRequest, EngineStats, RequestOutput, ThroughputProfile
from batchrun.engine.profiler import measure_rates
from batchrun.engine.request import Request
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.engine.settings import EngineSettings
from batchrun.engine.startup import EngineParts, start_engine, warm_up
from batchrun.engine.step_sampler import SampledTokens, cut_at_stop_string

log = logging.getLogger(__name__)


class Engine:
    """Offline generation over a paged KV cache with continuous batching.

    `generate` returns outputs in input order; `stream` admits requests lazily from any iterable
    and yields each output as soon as it finishes, keeping at most `max_in_flight` in the engine.
    """

    def __init__(self, config: EngineConfig, parts: Optional[EngineParts] = None) -> None:
        """Assign what start-up built: `parts`, or the phases of engine/startup.py run on `config`."""
        parts = parts if parts is not None else start_engine(config)
        self.config = config
        self.device = parts.target.device
        self.dtype = parts.target.dtype
        self.tokenizer = parts.target.tokenizer
        self.model_path = parts.target.path
        self.model_fingerprint = parts.target.fingerprint
        self.hf_config = parts.target.hf_config
        self.model = parts.target.model
        self.quantization = parts.target.quantization
        self.max_model_len = parts.kv_plan.max_model_len
        self.kv = parts.cache.kv
        self.runner = parts.cache.runner
        self.max_num_seqs = parts.limits.max_num_seqs
        self.max_num_batched_tokens = parts.limits.max_num_batched_tokens
        self.scheduler = parts.core.scheduler
        self.sampler = parts.core.sampler
        self.grammars = parts.core.grammars
        self.admission = parts.core.admission
        self.step_sampler = parts.core.step_sampler
        self.drafter = parts.core.drafter
        self.settings: EngineSettings = parts.settings
        self.startup_s = parts.startup_s
        self._profile = parts.limits.profile
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_steps = 0
        # engine.async_scheduling (engine/async_steps.py): steps launched ahead, and the one whose
        # tokens are still on their way to the host between two calls of `step`.
        self.async_steps: Optional[AsyncSteps] = None
        self._in_flight: Optional[InFlightStep] = None
        if config.async_scheduling and not self.set_async_scheduling(True):
            log.warning(
                "engine.async_scheduling is off with speculative decoding: each step needs the last one's tokens"
            )
        # Times the decode steps the speculation policy prices (a test may put a fake clock here).
        self.step_clock: Callable[[], float] = time.perf_counter

    # ---- public API ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Union[str, list[int]]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order, a prompt's params.n samples
        one after another by sample_index (so with n=1, one output per prompt)."""
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        assert len(per_prompt) == len(prompts), "one SamplingParams per prompt, or one for all"
        requests = [
            EngineRequest(request_id=i, prompt=p, params=sp) for i, (p, sp) in enumerate(zip(prompts, per_prompt))
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
        its own work is in flight, or it is polled again at once."""
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
                    yield self._to_output(req)
        finally:
            self.abort_all()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_kv_blocks_total=self.kv.num_blocks,
            peak_kv_blocks_used=self.kv.peak_used_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_cached_tokens=self.kv.num_hit_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_steps=self._num_steps,
            expert_token_counts=self.model.expert_token_counts(),  # one device read, not one per step
            num_async_steps=self.async_steps.num_ahead if self.async_steps is not None else None,
            **self._spec_stats(),
        )

    def throughput_profile(self) -> ThroughputProfile:
        """Prefill and decode rates of this model on this machine. The start-up profile's, where it
        measured them; it measures nothing when max_num_seqs and max_num_batched_tokens are both
        configured (and no decode rates when only max_num_seqs is), and then the missing rates are
        timed now, at those limits, as the profile would (a few synthetic steps, once). Needs an
        idle engine; forgets the prefix cache, since those steps write into free blocks."""
        if not self._profile.get("prefill_tok_s") or not self._profile.get("decode_tok_s"):
            assert not self.scheduler.has_unfinished() and not self.scheduler.num_parked, "profile an idle engine only"
            self.kv.reset_prefix_cache()
            measured = measure_rates(
                self.runner,
                self.kv.num_blocks,
                self.config.block_size,
                self.max_model_len,
                self.max_num_batched_tokens,
                self.max_num_seqs,
            )
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

    def _spec_stats(self) -> dict[str, Any]:
        if self.drafter is None:
            return {}
        policy = self.drafter.policy
        return dict(
            num_spec_proposed=self.step_sampler.num_spec_proposed,
            num_spec_accepted=self.step_sampler.num_spec_accepted,
            num_spec_steps=policy.num_steps_on,
            num_spec_switches=policy.num_switches,
            num_spec_probes=policy.num_probes,
            spec_step_s=policy.cost.learned(),
        )

    def warmup(self) -> dict[str, Any]:
        """Run each kind of step this engine will run once, so Triton compiles every kernel variant
        and every CUDA-graph bucket is captured before anything is timed (engine/warmup.py); return
        what ran (also in settings.warmup). Start-up runs it per EngineConfig.warmup.

        It leaves no trace a request could see: no KV block allocated, no request id consumed, the
        sampler's generator untouched. It needs an idle engine, forgets the prefix cache (its steps
        write into free blocks) and zeroes the expert-load counters, as start-up does."""
        assert not self.scheduler.has_unfinished() and not self.scheduler.num_parked, "warm up an idle engine only"
        limits = (self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs)
        summary = warm_up(self.kv, self.runner, self.drafter, self.sampler, *limits)
        self.settings = self.settings.with_warmup(summary)
        return summary

    def set_async_scheduling(self, on: bool) -> bool:
        """Turn engine.async_scheduling on or off on an idle engine (benchmarks compare both on one
        engine); return whether it is on: never with a drafter. Its step count starts again at 0."""
        assert not self.scheduler.has_unfinished() and self._in_flight is None, "switch an idle engine only"
        self.async_steps = None
        if on and self.drafter is None:
            self.async_steps = AsyncSteps(self.scheduler, self.runner, self.sampler)
        return self.async_steps is not None

    def reset_peak_stats(self) -> None:
        self.kv.reset_peak()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefix blocks that no request holds, so the next request starts cold
        (benchmarks that repeat a workload); returns the number of blocks forgotten."""
        return self.kv.reset_prefix_cache()

    def abort_all(self) -> None:
        """Drop every unfinished request and free its blocks (used when a stream is abandoned)."""
        self._drop_in_flight()
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, "abort")

    def _drop_in_flight(self) -> None:
        """Forget a step launched ahead (its requests ended or were aborted): wait for its token
        copy, so its pinned buffer is free before a later step writes there."""
        if self._in_flight is not None:
            self._in_flight.wait()
            self._in_flight = None

    # ---- internals ----------------------------------------------------------------------------

    def _add(self, item: Any, index: int, default_params: SamplingParams) -> list[RequestOutput]:
        """Queue one request (params.n samples); return error outputs instead when it can never run."""
        samples = self.admission.build(item, index, default_params)
        if samples[0].error is not None:
            return [self._to_output(req) for req in samples]
        self._num_prompt_tokens += samples[0].num_prompt_tokens * len(samples)
        self.scheduler.add(samples[0], samples[1:])
        return []

    def step(self) -> list[Request]:
        """One engine iteration; returns the requests that finished in it.

        With engine.async_scheduling a step may be launched here before the current one's tokens
        are read (engine/async_steps.py); the next call starts from it instead of scheduling."""
        cur, self._in_flight = self._in_flight, None
        if cur is None:
            cur_or_finished = self._step_sync()
            if not isinstance(cur_or_finished, InFlightStep):
                return cur_or_finished
            cur = cur_or_finished
        assert self.async_steps is not None
        if self.async_steps.can_run_ahead(cur):
            self._in_flight = self.async_steps.run_ahead(cur)
            self._num_steps += 1
        finished = self._finish_in_flight(cur)
        # The step ahead holds only requests running at its launch: all of them can have ended only
        # in this call, so the scan runs only on steps that finished some.
        if finished and self._in_flight is not None and all(r.is_finished for r in self._in_flight.batch.requests):
            self._drop_in_flight()  # every request of the step ahead ended with cur's tokens
        return finished

    def _finish_in_flight(self, cur: InFlightStep) -> list[Request]:
        """Read cur's tokens and do the bookkeeping a synchronous step does after sampling."""
        tokens = cur.wait()
        sampled: SampledTokens = {
            r.seq_id: (r, [token], None) for r, token in zip(cur.batch.requests, tokens) if not r.is_finished
        }
        finished = self.scheduler.update(cur.batch, {seq: t for seq, (_, t, _) in sampled.items()}, held=cur.held)
        self._record_tokens(sampled)
        return finished + self.step_sampler.stops(sampled)

    def _step_sync(self) -> Union[list[Request], InFlightStep]:
        """A step scheduled now: the requests that finished in it, or, with async scheduling, a
        graphed decode step of plain requests whose tokens are on their way to the host."""
        spec_plan, proposals = self.drafter.plan(self.scheduler.running) if self.drafter else ({}, {})
        batch: ScheduledBatch = self.scheduler.schedule(spec_plan)
        assert not batch.is_empty(), "scheduler produced an empty batch with requests pending"
        self._num_steps += 1
        now = time.perf_counter()
        for req in batch.requests:
            if req.metrics.first_scheduled_s is None:
                req.metrics.first_scheduled_s = now
        drafted_s = self.step_clock()
        draft_probs = None
        if batch.num_spec:
            assert self.drafter is not None, "speculative tokens are scheduled from a drafter's plan only"
            draft_probs = self.drafter.fill(batch, proposals)
        started_s = self.step_clock()
        self.step_sampler.start_masks(batch)  # grammar masks fill while the forward runs
        out = self.runner.execute(batch)
        if self.async_steps is not None and self.async_steps.can_read_back(batch, out):
            return self.async_steps.read_back(batch, out.logits)
        by_seq = {r.seq_id: r for r in batch.requests}
        for seq, (first, entries) in out.prompt_logprobs.items():
            scored = by_seq[seq].prompt_logprobs
            assert scored is not None and len(scored) == first, "prompt tokens are scored once, in order"
            scored.extend(entries)
        if self.drafter is not None:
            self.drafter.sync(batch)
        failed = self.step_sampler.wait_for_grammars(batch, out)
        for req in failed:  # a grammar that failed to compile: the request ends as an error
            self.scheduler.finish(req, "error")
        sampled = self.step_sampler.sample(batch, out, draft_probs)  # ends with the tokens on the host
        if self.drafter is not None:
            self.drafter.observe(batch, self.step_clock() - started_s, started_s - drafted_s)
        finished = failed + self.scheduler.update(batch, {seq: toks for seq, (_, toks, _) in sampled.items()})
        self._record_tokens(sampled)
        return finished + self.step_sampler.stops(sampled)

    def _record_tokens(self, sampled: SampledTokens) -> None:
        now = time.perf_counter()
        for req, tokens, logprob in sampled.values():
            self._num_generated_tokens += len(tokens)
            if req.metrics.first_token_s is None:
                req.metrics.first_token_s = now
            req.metrics.finished_s = now  # last token time until it finishes
            if logprob is not None and req.logprobs is not None:
                req.logprobs.append(logprob)

    def _to_output(self, req: Request) -> RequestOutput:
        m = req.metrics
        out_ids = req.output_token_ids
        text = self.tokenizer.decode(out_ids, skip_special_tokens=True) if out_ids else ""
        if req.params.stop:
            text = cut_at_stop_string(text, req.params.stop)
        if m.finished_s is None:
            m.finished_s = time.perf_counter()
        if m.first_token_s is not None:
            m.ttft_s = m.first_token_s - m.arrival_s
            if len(out_ids) > 1:
                m.itl_s = (m.finished_s - m.first_token_s) / (len(out_ids) - 1)
        m.latency_s = m.finished_s - m.arrival_s
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=out_ids,
            text=text,
            finish_reason=req.finish_reason or "error",
            error=req.error,
            metrics=m,
            logprobs=req.logprobs,
            sample_index=req.sample_index,
            prompt_logprobs=req.prompt_logprobs,
            constrained=req.params.is_constrained,
        )
