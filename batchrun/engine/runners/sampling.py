"""One step's logits become tokens inside the runner: grammar masks, draft verification, the sampler.

The forward hands over, per request whose token list was fully computed, the logits row of its
last real token and one row per draft it carried. Requests with drafts go through verification
(they may produce several tokens); the rest are sampled together in one batched sampler call, with
the bitmask of constrained rows applied first. A request whose grammar failed to compile samples
nothing and is reported in the `StepResult` (the stop rule ends it, engine/stop.py).

Grammar masks are off the critical path: `start_masks`, called before the forward pass, fills the
bitmask rows of the batch's constrained requests in a worker thread (the mask of step t + 1 needs
only the token accepted at step t, never the forward's logits), and `sample` waits for them only
where it applies them. Rows whose state admits every token are not masked.

Reasoning requests (engine/reasoning.py): a grammar waits for the answer (no mask in the trace,
its matcher untouched; at the start its mask allows the opening tag too), and a forced token's row
is masked to that one token; a forced row's logprobs are the model's, from the row before forcing.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from batchrun.engine.grammar import GrammarState, apply_bitmask, fill_bitmask
from batchrun.engine.reasoning import START
from batchrun.engine.request import Request
from batchrun.engine.runners.outputs import ForwardOutput
from batchrun.engine.sampler import Sampler
from batchrun.engine.scheduler import ScheduledBatch, StepResult
from batchrun.engine.speculative import DraftProbs, verify


def allow_token(
    bitmask: torch.Tensor, needed: list[bool], rows: Sequence[tuple[int, int]]
) -> tuple[torch.Tensor, list[bool]]:
    """The bitmask with each (row, token) of `rows` allowed as well (a copy where it changes)."""
    bitmask = bitmask.clone()
    for row, token in rows:
        if needed[row]:
            word, bit = divmod(token, 32)
            # int32 words: bit 31 is the sign bit
            bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)
    return bitmask, needed


def force_tokens(logits: torch.Tensor, forced: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The logits with each forced (row, token)'s row -inf but at its token (a new tensor)."""
    rows = torch.tensor([i for i, _ in forced], device=logits.device)
    ids = torch.tensor([t for _, t in forced], device=logits.device)
    kept = logits[rows, ids]
    out = logits.clone()
    out[rows] = float("-inf")
    out[rows, ids] = kept
    return out


class StepSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler  # the engine's, so whoever wraps engine.sampler sees every call
        # Whether requests may carry a trace state (the engine has think tags): forced tokens and
        # a grammar's start (engine/reasoning.py) are looked for only then.
        self.thinking = False
        # False: masks are filled in `sample`, after the forward (the same masks, later).
        self.overlap_masks = True
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        # seq_id -> its row in the bitmask being filled for this step, and the fill's future
        self._pending: tuple[dict[int, int], Future[Any]] = ({}, Future())

    def start_masks(self, batch: ScheduledBatch) -> None:
        """Start filling this step's masks of the constrained requests whose matcher exists, in
        the worker thread, to run while the forward pass does. A matcher only moves in `sample`,
        after the fill was waited for, so the masks are those `sample` would fill itself."""
        ready = [
            (r.seq_id, g)
            for r in batch.requests
            if (g := r.grammar) is not None
            and g.matcher is not None
            and (r.thinking is None or r.thinking.grammar_applies)
        ]
        if not self.overlap_masks or not ready:
            self._pending = ({}, Future())
            return
        rows = {seq: i for i, (seq, _) in enumerate(ready)}
        grammars = [g for _, g in ready]
        self._pending = (rows, self._mask_pool.submit(fill_bitmask, grammars, grammars[0].vocab_size))

    def _masks(self, reqs: Sequence[Request]) -> tuple[torch.Tensor, list[bool]]:
        """(bitmask (len(reqs), ceil(V / 32)) int32, per row whether it blocks any token) of these
        constrained requests: the rows `start_masks` filled, the others (a grammar compiled since)
        filled now."""
        rows, future = self._pending
        self._pending = ({}, Future())
        if not rows or any(r.seq_id not in rows for r in reqs):
            if rows:
                future.result()  # the worker must be done with the matchers before they move
            states: list[GrammarState] = [r.grammar for r in reqs if r.grammar is not None]  # all of them
            return fill_bitmask(states, states[0].vocab_size)
        bitmask, needed = future.result()
        take = [rows[r.seq_id] for r in reqs]
        if take != list(range(len(needed))):
            bitmask, needed = bitmask[take], [needed[i] for i in take]
        return bitmask, needed

    @staticmethod
    def grammar_errors(batch: ScheduledBatch, out: ForwardOutput) -> dict[int, str]:
        """Make the matchers of constrained requests sampling now (waiting for their grammars);
        return seq_id -> the compiler's message for those whose grammar failed to compile."""
        if not any(r.grammar is not None for r in batch.requests):
            return {}
        by_seq = {r.seq_id: r for r in batch.requests}
        errors = {}
        for seq in out.sample_seq_ids:
            grammar = by_seq[seq].grammar
            if grammar is not None and not grammar.ready():
                assert grammar.error is not None, "a grammar that is not ready failed"
                errors[seq] = grammar.error
        return errors

    def sample(self, batch: ScheduledBatch, out: ForwardOutput, draft_probs: Optional[DraftProbs]) -> StepResult:
        """The tokens every sampling request produces this step (a request whose grammar failed to
        compile produces none), their logprobs where asked, and the forward's prompt logprobs."""
        errors = self.grammar_errors(batch, out)
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, dict[int, float]] = {}
        if batch.spec_token_ids:
            plain_reqs, plain_rows = self._verify_drafts(batch, out, draft_probs, errors, tokens)
        else:  # one row per sampled request, in batch order: no per-row bookkeeping
            plain_reqs = self._sampled_requests(batch, out.sample_seq_ids)
            plain_rows = list(range(len(plain_reqs)))
            if errors:  # a grammar failed to compile: nothing to sample for it
                keep = [i for i, r in enumerate(plain_reqs) if r.seq_id not in errors]
                plain_reqs, plain_rows = [plain_reqs[i] for i in keep], keep
        if plain_reqs:
            logits = out.logits if len(plain_rows) == out.logits.shape[0] else out.logits[plain_rows]
            raw = logits
            constrained = [
                i
                for i, r in enumerate(plain_reqs)
                if r.grammar is not None and (r.thinking is None or r.thinking.grammar_applies)
            ]
            starts = self._trace_starts(plain_reqs, constrained) if self.thinking and constrained else []
            if constrained:  # never drafted (drafter.is_eligible), so every one is a plain row
                bitmask, needed = self._masks([plain_reqs[i] for i in constrained])
                if starts:  # a trace may open before the grammar applies: its tag is allowed too
                    bitmask, needed = allow_token(bitmask, needed, starts)
                if all(needed):
                    logits = apply_bitmask(logits, constrained, bitmask)
                elif any(needed):
                    keep = [j for j, n in enumerate(needed) if n]
                    logits = apply_bitmask(logits, [constrained[j] for j in keep], bitmask[keep])
            forced = self._forced(plain_reqs) if self.thinking else []
            if forced:
                logits = force_tokens(logits, forced)
            sampled, sampled_logprobs = self.sampler.sample(
                logits,
                [r.params for r in plain_reqs],
                [r.sample_seed for r in plain_reqs],
                [len(r.token_ids) for r in plain_reqs],  # the position of the token each row samples
            )
            if forced and sampled_logprobs is not None:
                self._raw_logprobs(raw, plain_reqs, forced, sampled, sampled_logprobs)
            opened = {constrained[j] for j, tag in starts if sampled[constrained[j]] == tag}
            for i in constrained:
                grammar = plain_reqs[i].grammar
                assert grammar is not None  # constrained rows are those with a grammar
                if i in opened:  # the trace's opening tag: the grammar waits for the answer
                    continue
                accepted = grammar.accept(sampled[i])
                assert accepted, f"the grammar rejected token {sampled[i]} that its own mask allowed"
            for i, req in enumerate(plain_reqs):
                tokens[req.seq_id] = [sampled[i]]
                if sampled_logprobs is not None and req.params.logprobs is not None:
                    logprobs[req.seq_id] = sampled_logprobs[i]
        return StepResult(batch, tokens, logprobs, out.prompt_logprobs, errors)

    @staticmethod
    def _trace_starts(reqs: Sequence[Request], constrained: Sequence[int]) -> list[tuple[int, int]]:
        """(position in `constrained`, open_id) of the constrained rows whose first token may open a trace."""
        starts = []
        for j, i in enumerate(constrained):
            thinking = reqs[i].thinking
            if thinking is not None and thinking.phase == START:
                starts.append((j, thinking.tags.open_id))
        return starts

    @staticmethod
    def _forced(reqs: Sequence[Request]) -> list[tuple[int, int]]:
        """(row, token) of the rows whose next token is forced (a spent trace budget's closing tag,
        a separator): engine/reasoning.py."""
        return [(i, t.forced[0]) for i, r in enumerate(reqs) if (t := r.thinking) is not None and t.forced]

    def _raw_logprobs(
        self,
        raw: torch.Tensor,
        reqs: Sequence[Request],
        forced: Sequence[tuple[int, int]],
        sampled: list[int],
        logprobs: list[dict[int, float]],
    ) -> None:
        """A forced row's logprobs are the model's (the row before it was forced to one token)."""
        rows = [i for i, _ in forced if reqs[i].params.logprobs is not None]
        if not rows:
            return
        tokens = [sampled[i] for i in rows]
        redone = self.sampler.logprobs(
            raw[rows],
            [reqs[i].params for i in rows],
            torch.tensor(tokens, device=raw.device),
            tokens,
        )
        assert redone is not None
        for i, entry in zip(rows, redone):
            logprobs[i] = entry

    @staticmethod
    def _sampled_requests(batch: ScheduledBatch, sample_seq_ids: list[int]) -> list[Request]:
        if len(sample_seq_ids) == len(batch.requests):  # runners list sampled requests in batch order
            return batch.requests
        by_seq = {r.seq_id: r for r in batch.requests}
        return [by_seq[seq] for seq in sample_seq_ids]

    def _verify_drafts(
        self,
        batch: ScheduledBatch,
        out: ForwardOutput,
        draft_probs: Optional[DraftProbs],
        errors: dict[int, str],
        tokens: dict[int, list[int]],
    ) -> tuple[list[Request], list[int]]:
        """Verify the drafts of every request that carried some, all in one call, into `tokens`;
        return the other sampled requests and their logits rows, for the plain sampler."""
        by_seq = {r.seq_id: r for r in batch.requests}
        plain_rows: list[int] = []
        plain_reqs: list[Request] = []
        spec_rows: list[int] = []
        spec_reqs: list[Request] = []
        row = 0
        for seq, n in zip(out.sample_seq_ids, out.num_rows):
            req = by_seq[seq]
            if seq in errors:  # its grammar failed to compile
                pass
            elif batch.spec_token_ids.get(seq):
                spec_rows.append(row)
                spec_reqs.append(req)
            else:
                plain_rows.append(row)
                plain_reqs.append(req)
            row += n
        if spec_reqs:
            drafts = [batch.spec_token_ids[r.seq_id] for r in spec_reqs]
            verified = verify(out.logits, spec_rows, spec_reqs, drafts, self.sampler, draft_probs)
            for req, produced in zip(spec_reqs, verified):
                tokens[req.seq_id] = produced
        return plain_reqs, plain_rows
