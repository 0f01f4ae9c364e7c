"""A request's state inside the engine: its tokens, how many are computed, its KV blocks."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Optional

from batchrun.engine.config import SamplingParams
from batchrun.engine.detokenizer import IncrementalDetokenizer, output_text
from batchrun.engine.outputs import RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from batchrun.engine.grammar import GrammarState
    from batchrun.engine.reasoning import ThinkingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """There is no prefill or decode phase: `num_computed_tokens` catches up with `token_ids`.

    A preempted request keeps its generated tokens and recomputes their KV later, so it goes on
    to produce the same tokens it would have produced without the interruption.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
        sample_seed: Optional[int] = None,
        sample_index: int = 0,
        adapter: Optional[str] = None,
    ) -> None:
        self.seq_id = seq_id  # engine-internal, unique, increasing: the admission order
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt then generated tokens
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids, filled lazily
        self.num_committed_blocks = 0  # leading blocks of block_ids already published to the prefix cache
        self.table_row = -1  # row of the KV manager's BlockTables mirroring block_ids; -1: none
        # Per-request randomness, so sampling does not depend on batch composition: the sampler, the
        # drafter and verification key their draws on (sample_seed, position, stream); None (greedy,
        # or a hand-made request) draws from the engine sampler's generator.
        self.sample_seed = sample_seed
        self.metrics = RequestMetrics(arrival_s=arrival_s)
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.sample_index = sample_index  # which of its prompt's params.n samples this is
        # Its LoRA adapter's name (engine.lora_adapters), None: the base model. Its samples share it;
        # the scheduler pins its slot while it runs (engine/scheduler.py).
        self.adapter = adapter
        # Sibling samples of this prompt waiting for its prefill, to share its prompt's KV blocks
        # (held by sample 0 only; the scheduler releases them, see Scheduler.add).
        self.followers: list[Request] = []
        self.logprobs: Optional[list[dict[int, float]]] = [] if params.logprobs is not None else None
        # Per prompt token after the first: {token_id: logprob} of it and the top-N; filled as the
        # prompt is computed (a recompute after preemption does not append again).
        self.prompt_logprobs: Optional[list[dict[int, float]]] = [] if params.prompt_logprobs is not None else None
        # Its output text as far back as a stop string can begin (engine/stop.py), made at the first check.
        self.detokenizer: Optional[IncrementalDetokenizer] = None
        self.spec_acceptance: Optional[float] = None  # running per-token draft acceptance rate
        self.spec_steps_seen = 0  # decode steps the speculation policy has looked at this request
        self.grammar: Optional[GrammarState] = None  # structured output: its matcher (engine/grammar.py)
        # Its trace's phase, budget and forced tokens (engine/reasoning.py); None: the engine has no think tags.
        self.thinking: Optional[ThinkingState] = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def to_output(self, tokenizer: Any) -> RequestOutput:
        """What the caller gets for this request (ended): its text decoded once and cut before a
        stop string; its metrics' derived times (TTFT, inter-token latency, latency) filled in now.
        With a trace (engine/reasoning.py) the text is the answer's and the trace is `reasoning`."""
        m = self.metrics
        if m.finished_s is None:
            m.finished_s = time.perf_counter()
        num_output = self.num_output_tokens
        if m.first_token_s is not None:
            m.ttft_s = m.first_token_s - m.arrival_s
            if num_output > 1:
                m.itl_s = (m.finished_s - m.first_token_s) / (num_output - 1)
        m.latency_s = m.finished_s - m.arrival_s
        output = self.output_token_ids
        reasoning, num_reasoning, num_answer = None, 0, len(output)
        thinking = self.thinking
        if thinking is not None and thinking.has_trace and output:
            # The trace's text and the answer's apart; the answer without the separator's whitespace.
            end = thinking.trace_end if thinking.trace_end >= 0 else len(output)
            num_reasoning = thinking.num_trace_tokens
            if thinking.trace_end < 0 and self.finish_reason == "stop" and end > thinking.trace_start:
                # ended inside the open trace by a stop token id or EOS (the only "stop" there): that
                # token is no more the trace's than a stop token is an answer's
                end -= 1
                num_reasoning -= 1
            trace = output[thinking.trace_start : end]
            reasoning = tokenizer.decode(trace, skip_special_tokens=True).strip() if trace else ""
            answer = output[thinking.answer_start :] if thinking.trace_end >= 0 else []
            num_answer = len(answer)
            at = thinking.text_start(output) if thinking.trace_end >= 0 else None
            text = output_text(tokenizer, output[at:], self.params.stop).lstrip() if at is not None else ""
        else:
            text = output_text(tokenizer, output, self.params.stop)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=output,
            text=text,
            finish_reason=self.finish_reason or "error",
            error=self.error,
            metrics=m,
            logprobs=self.logprobs,
            sample_index=self.sample_index,
            prompt_logprobs=self.prompt_logprobs,
            constrained=self.params.is_constrained,
            reasoning=reasoning,
            num_reasoning_tokens=num_reasoning,
            num_answer_tokens=num_answer,
        )
