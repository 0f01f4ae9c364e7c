"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step, running requests are served first (oldest first), each getting the tokens it still
lacks up to the remaining budget, so a long prompt is prefilled in chunks beside running decodes.
When blocks run out, the newest running request is preempted: its blocks are freed and it goes
back to the front of the queue to be recomputed later. Waiting requests are admitted only in a
step that preempted nobody.

Several samples of one prompt (SamplingParams.n) are admitted as one request, sample 0, whose
siblings wait aside until its prompt is computed; they then take references on its full prompt
blocks (KVCacheManager.fork_prefix) and go to the front of the queue, so the prompt is prefilled
once whether or not the prefix cache is on, and they start decoding one step behind sample 0.

LoRA adapters (engine.lora_adapters): a request with an adapter runs only while its adapter holds
one of the resident slots (model/lora.py: LoraSlots), pinned from its admission until it finishes
or is preempted. A waiting request whose adapter has no slot and cannot get one (every slot is
pinned by running requests) is passed over, keeping its place, and the requests behind it are
admitted as usual, so rows of one adapter run together rather than taking turns one by one. Once
max_num_seqs requests with adapters have overtaken the oldest passed-over request, only base
requests may pass it: the slots' users drain and it gets its slot (no starvation). When nothing
runs no slot is pinned, so the first waiting request can always load its adapter: no deadlock.

`update` takes a step's `StepResult` (what the runner produced): it appends each request's tokens
and ends the requests the stop rule ends (engine/stop.py), the one place a request ends but abort.
It is also the one place a reasoning request's trace state moves (engine/reasoning.py), token by
token as they are appended.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request, RequestStatus
from batchrun.engine.stop import StopRule

# The token id a held place (Scheduler.hold_places) has until its token is read from the device.
PENDING_TOKEN = -1


class AdapterSlots(Protocol):
    """What the scheduler asks of the resident LoRA slots (model/lora.py: LoraSlots)."""

    def can_admit(self, name: str) -> bool: ...  # resident, or a slot no running request pins is there
    def pin(self, name: str) -> int: ...  # loaded if not resident (into the least recently used unpinned slot)
    def unpin(self, name: str) -> None: ...  # as many unpins as pins: its slot may be reused


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    eos_token_ids: frozenset[int] = frozenset()  # end a request unless its params say ignore_eos
    # engine.admission_min_slots: while every running request decodes, waiting requests are admitted
    # only once this many slots are free (or all of the waiting fit), so a graphable decode step is
    # turned into a mixed prefill step once per batch of ends rather than at every end.
    admission_min_slots: int = 1


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)  # in batch order
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed this step, per request
    preempted: list[Request] = field(default_factory=list)  # requests sent back to the queue this step
    # Speculative lookahead: seq_id -> draft tokens scheduled after its pending token (counted in
    # num_new_tokens). Filled with the proposals before the batch runs.
    num_spec: dict[int, int] = field(default_factory=dict)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class StepResult:
    """What one step produced, on the host: a runner's `execute` (engine/runners/), or a pending
    step's once its tokens arrived. `Scheduler.update` hands it to the requests."""

    batch: ScheduledBatch  # the step's batch, as scheduled
    # seq_id -> the tokens it produced: its accepted drafts, then one sampled token. Only requests
    # whose token list was fully computed and whose grammar did not fail, in the order the runner
    # sampled them (on a verification step the drafted requests come first).
    tokens: dict[int, list[int]] = field(default_factory=dict)
    # seq_id -> {token_id: logprob} of its one token and the top-N (SamplingParams.logprobs)
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    # seq_id -> (index of the first prompt token scored this step minus one, per scored token
    # {token_id: logprob} of it and the top-N) (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # seq_id -> the compiler's message: its grammar failed to compile, it produced no token
    grammar_errors: dict[int, str] = field(default_factory=dict)
    # A later step was scheduled on held places before these tokens were read (`hold_places`):
    # each request's one token fills its place.
    held: bool = False


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, tokenizer: Any = None, lora: Optional[AdapterSlots] = None
    ) -> None:
        """`lora`: the LoRA slots (engine.lora_adapters); None: no request names an adapter."""
        self.config = config
        self.kv = kv
        self.lora = lora
        # seq_id of a request passed over for want of an adapter slot -> adapter requests admitted past it
        self._num_overtaken: dict[int, int] = {}
        # Every end of a request but an abort; the tokenizer decodes outputs for stop strings.
        self.stop = StopRule(config.eos_token_ids, config.max_model_len, tokenizer)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_parked = 0  # sibling samples waiting for their sample 0's prompt
        self.num_prompt_tokens = 0  # prompt tokens of the requests added (each sample's), over the engine's life
        self.num_generated_tokens = 0  # tokens handed to requests by `update`, over the engine's life

    def add(self, req: Request, siblings: Sequence[Request] = ()) -> None:
        """Queue a request, and the other samples of its prompt to start once its prompt is computed."""
        assert req.num_tokens + 1 <= self.config.max_model_len, "engine must reject requests that cannot fit"
        assert all(s.prompt_token_ids == req.prompt_token_ids for s in siblings)
        self.waiting.append(req)
        req.followers = list(siblings)
        self.num_parked += len(siblings)
        self.num_prompt_tokens += req.num_prompt_tokens * (1 + len(siblings))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + self.num_parked

    def _release_followers(self, req: Request) -> None:
        """req's prompt is computed: its siblings share its prompt blocks and are admitted next."""
        for follower in reversed(req.followers):
            self.kv.fork_prefix(follower, req)
            if req.prompt_logprobs is not None:
                follower.prompt_logprobs = req.prompt_logprobs  # the same prompt: computed once
            self.waiting.appendleft(follower)
        self.num_parked -= len(req.followers)
        req.followers = []

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        self.running.remove(victim)
        self._unpin(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        batch.preempted.append(victim)

    def schedule(self, spec_plan: Optional[dict[int, int]] = None) -> ScheduledBatch:
        """Pick this step's work. `spec_plan` maps seq_id to draft tokens wanted by a decoding request;
        the scheduler reserves KV slots for them when budget and blocks allow, else fewer or none."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        spec_plan = spec_plan or {}

        # Running requests first, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(len(req.token_ids) - req.num_computed_tokens, budget)
            assert num_new > 0
            num_spec = self._num_spec(req, spec_plan.get(req.seq_id, 0), budget - num_new) if spec_plan else 0
            if num_spec and self.kv.can_allocate(req, num_new + num_spec):
                num_new += num_spec
                batch.num_spec[req.seq_id] = num_spec
            while not self.kv.allocate(req, num_new):
                if self._drop_waiting_blocks():
                    continue
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: everything after it is gone too

        # Then new requests, unless memory was short this step.
        if not self._admission_open(batch):
            return batch
        passed: list[Request] = []  # waiting requests whose adapter gets no slot this step, in queue order
        while self.waiting and not batch.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._waits_for_slot(req, passed):
                passed.append(self.waiting.popleft())
                continue
            # A released sibling sample holds its shared prompt blocks already.
            num_cached = req.num_computed_tokens if req.block_ids else self.kv.match_prefix(req)
            num_new = req.num_tokens - req.num_computed_tokens
            if not self.config.enable_chunked_prefill and num_new > budget and batch.requests:
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            num_new = min(num_new, budget) if self.config.enable_chunked_prefill else num_new
            if not self.kv.allocate(req, num_new):
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self._pin(req)
            if passed and req.adapter is not None:
                self._num_overtaken[passed[0].seq_id] = self._num_overtaken.get(passed[0].seq_id, 0) + 1
            if req.metrics.first_scheduled_s is None:
                req.metrics.first_scheduled_s = time.perf_counter()
                if req.metrics.num_preemptions == 0:
                    req.metrics.num_cached_tokens = num_cached
                    self.kv.record_admission(req.num_prompt_tokens, num_cached)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(passed))
        return batch

    def _waits_for_slot(self, req: Request, passed: list[Request]) -> bool:
        """Whether req (an adapter's) stays waiting this step: its adapter cannot get a slot, or the
        oldest request passed over (`passed[0]`) has been overtaken by enough adapter requests."""
        if self.lora is None or req.adapter is None:
            return False
        if passed and self._num_overtaken.get(passed[0].seq_id, 0) >= self.config.max_num_seqs:
            return True
        return not self.lora.can_admit(req.adapter)

    def _pin(self, req: Request) -> None:
        """req starts running: its adapter is loaded if it is not resident, and kept while req runs."""
        if self.lora is not None and req.adapter is not None:
            self.lora.pin(req.adapter)
            self._num_overtaken.pop(req.seq_id, None)

    def _unpin(self, req: Request) -> None:
        """req stopped running (finished or preempted): its adapter's slot may be reused."""
        if self.lora is not None and req.adapter is not None:
            self.lora.unpin(req.adapter)

    def _admission_open(self, batch: ScheduledBatch) -> bool:
        """Whether waiting requests may be admitted into this step: always where it is not a pure
        decode step anyway (a prefill chunk in it, or nothing running), else as
        `admits_beside_decodes` says."""
        if self.config.admission_min_slots <= 1 or not self.waiting:
            return True  # (the default: no per-step scan)
        return not batch.requests or any(n > 1 for n in batch.num_new_tokens) or self.admits_beside_decodes()

    def admits_beside_decodes(self) -> bool:
        """Whether a step of the running decodes alone would admit a waiting request: a slot is free
        and SchedulerConfig.admission_min_slots allows it (enough slots free for min(that, waiting)
        requests, or the first waiting is a released sibling sample, which holds its prompt's
        blocks and starts at once)."""
        max_seqs = self.config.max_num_seqs
        if not self.waiting or len(self.running) >= max_seqs:
            return False
        want = min(self.config.admission_min_slots, max_seqs, len(self.waiting))
        return want <= 1 or bool(self.waiting[0].block_ids) or max_seqs - len(self.running) >= want

    def _drop_waiting_blocks(self) -> bool:
        """Memory is short: released sibling samples give their shared prompt blocks back before any
        running request is preempted (they match the prefix cache, or recompute, when admitted)."""
        holders = [r for r in self.waiting if r.block_ids]
        for req in holders:
            self.kv.free(req)
            req.num_computed_tokens = 0
        return bool(holders)

    def _num_spec(self, req: Request, wanted: int, budget_left: int) -> int:
        """Draft tokens worth scheduling: only for a decode, within budget, max_tokens and max_model_len."""
        if wanted <= 0 or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        room = min(
            req.params.max_tokens - req.num_output_tokens - 1,
            self.config.max_model_len - req.num_tokens - 1,
            budget_left,
        )
        return max(0, min(wanted, room))

    def can_hold_places(self, seq_ids: Container[int]) -> bool:
        """Whether the running requests' next decode step can be scheduled before the tokens of the
        step in flight are read (`schedule_ahead`): every running request is in that step
        (`seq_ids`), the budget holds them all, nobody would be admitted (such a step runs
        synchronously) and the free blocks cover each request's next slot, so nobody is preempted."""
        running = self.running
        if not running or len(running) > self.config.max_num_batched_tokens or self.admits_beside_decodes():
            return False
        need = 0
        for req in running:
            if req.seq_id not in seq_ids:
                return False
            # the step in flight's token and the next one's slot
            need += max(0, self.kv.blocks_for(req.num_computed_tokens + 2) - len(req.block_ids))
        return need <= self.kv.pool.num_free_blocks

    def schedule_ahead(self) -> ScheduledBatch:
        """The running requests' next decode step, scheduled while the current one's tokens are
        still on the device (`can_hold_places` said it can): their places are held."""
        running = list(self.running)
        self.hold_places(running)
        batch = self.schedule()
        assert batch.requests == running and not batch.preempted, "a step ahead schedules the running decodes"
        assert all(n == 1 for n in batch.num_new_tokens)
        return batch

    def hold_places(self, requests: Sequence[Request]) -> None:
        """A decode step of these requests is still on the device (engine/runners/gpu.py): count its
        one token per request computed now and hold the place of the token it samples with
        PENDING_TOKEN, so the next step can be scheduled; the step's `StepResult.held` makes
        `update` fill the places.

        Nothing reads a held place as a token: the prefix cache publishes only computed positions
        (the held one is not), and the next step's input id for it is gathered on the device."""
        for req in requests:
            assert req.num_computed_tokens == req.num_tokens - 1, "only a decode's place is held"
            req.num_computed_tokens += 1
            req.token_ids.append(PENDING_TOKEN)

    def update(self, result: StepResult) -> list[Request]:
        """Advance computed counts, append each request's tokens (and their logprobs) and end the
        requests the stop rule ends (engine/stop.py); return those, in the rule's order: failed
        grammars, then stop tokens and lengths in batch order, then stop strings and completed
        grammars in the runner's order.

        A request without tokens was mid-prefill. Requests that finished while the step ran (one
        launched before the previous step's tokens were read) are skipped.
        """
        batch = result.batch
        if result.prompt_logprobs:
            by_seq = {r.seq_id: r for r in batch.requests}
            for seq, (first, entries) in result.prompt_logprobs.items():
                scored = by_seq[seq].prompt_logprobs
                assert scored is not None and len(scored) == first, "prompt tokens are scored once, in order"
                scored.extend(entries)
        errors = result.grammar_errors
        finished = [r for r in batch.requests if r.seq_id in errors] if errors else []
        for req in finished:
            self.finish(req, self.stop.failed(req, errors[req.seq_id]))
        now = time.perf_counter()
        checks: dict[int, Request] = {}  # requests a stop string or a grammar may end after their tokens
        for req, num_new in zip(batch.requests, batch.num_new_tokens):
            if req.is_finished:
                continue
            tokens = result.tokens.get(req.seq_id, ())
            if result.held:
                assert len(tokens) == 1 and req.token_ids[-1] in (PENDING_TOKEN, tokens[0]), "one held place"
                req.token_ids.pop()
            else:
                req.num_computed_tokens += num_new
            reason = None
            thinking = req.thinking
            for token in tokens:
                req.token_ids.append(token)
                # The trace's state moves first: max_tokens inside it is "thinking_length". Once
                # tokens are forced, a verification step's later tokens are dropped.
                dropped = thinking is not None and thinking.append(token, req.num_output_tokens - 1)
                reason = self.stop.after_token(req, token)
                if reason is not None or dropped:
                    break
            if tokens:
                # Rejected drafts leave KV past the accepted tokens: it is simply not counted as
                # computed, and the slots are overwritten by the next tokens at those positions.
                req.num_computed_tokens = min(req.num_computed_tokens, len(req.token_ids) - 1)
                self._record(req, len(tokens), result.logprobs.get(req.seq_id), now)
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
                continue
            self.kv.commit_computed(req)
            if req.followers and req.num_computed_tokens >= req.num_prompt_tokens:
                self._release_followers(req)
            if tokens and (req.params.stop or req.grammar is not None):
                checks[req.seq_id] = req
        for seq in result.tokens if checks else ():
            checked = checks.get(seq)
            if checked is not None and (reason := self.stop.after_step(checked)) is not None:
                self.finish(checked, reason)
                finished.append(checked)
        return finished

    def _record(self, req: Request, num_tokens: int, logprob: Optional[dict[int, float]], now: float) -> None:
        self.num_generated_tokens += num_tokens  # all of a verification step's, even past a stop token
        if req.metrics.first_token_s is None:
            req.metrics.first_token_s = now
        req.metrics.finished_s = now  # last token time until it finishes
        if logprob is not None and req.logprobs is not None:
            req.logprobs.append(logprob)

    def finish(self, req: Request, reason: str) -> None:
        """End a request now (as the stop rule says, or aborted by the engine); frees its blocks."""
        if req.followers:
            if reason == "abort":
                followers, req.followers = req.followers, []
                self.num_parked -= len(followers)
                for follower in followers:
                    follower.status, follower.finish_reason = RequestStatus.FINISHED, reason
            else:  # it ended at its first token: its prompt blocks are still held until the free below
                self._release_followers(req)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._unpin(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self._num_overtaken.pop(req.seq_id, None)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
