"""Runs the proposers of speculative decoding around a scheduled batch.

`plan` (before scheduling) says which decoding requests carry how many drafts; `fill` (after the
scheduler reserved their KV slots) produces the drafts: n-gram lookup, the target's first layers
(self), or a separate draft model. The self draft shares the target's KV cache for its layers: the
target's verification forward rewrites those entries with the same values, so nothing needs
undoing. A draft model keeps its own cache under the same block ids and slot mapping, and `sync`
runs it over every scheduled token so its cache always covers what the target's does.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from batchrun.engine.config import SpeculativeConfig
from batchrun.engine.request import Request
from batchrun.engine.runner import ModelRunner
from batchrun.engine.sampler import sampling_probs
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.engine.speculative import SpeculationPolicy, ngram_propose

log = logging.getLogger(__name__)


def is_eligible(req: Request) -> bool:
    """A request that may carry drafts: decoding, no logprobs asked, not a seeded sample (the
    policy's on/off choices depend on the batch, and a seeded request must not), and not constrained
    (verification would need the grammar's mask at every draft position)."""
    p = req.params
    return (
        req.num_computed_tokens == req.num_tokens - 1
        and p.logprobs is None
        and (p.is_greedy or p.seed is None)
        and not p.is_constrained
    )


class Drafter:
    def __init__(
        self,
        config: SpeculativeConfig,
        policy: SpeculationPolicy,
        runner: ModelRunner,
        num_layers: Optional[int] = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.runner = runner  # the target's runner (self) or the draft model's (draft)
        self.num_layers = num_layers  # self: how many target layers make the draft

    def plan(self, running: list[Request]) -> tuple[dict[int, int], dict[int, list[int]]]:
        k = self.config.num_speculative_tokens
        candidates: list[tuple[Request, int]] = []
        proposals: dict[int, list[int]] = {}
        num_decodes = 0
        for r in running:
            if r.num_computed_tokens != r.num_tokens - 1:
                continue
            num_decodes += 1
            if not is_eligible(r):
                continue
            if self.config.method == "ngram":
                drafts = ngram_propose(r.token_ids, k, self.config.ngram_min, self.config.ngram_max)
                if not drafts:
                    continue
                proposals[r.seq_id] = drafts
                candidates.append((r, len(drafts)))
            else:
                candidates.append((r, k))
        return self.policy.choose(candidates, num_decodes), proposals

    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch, proposals: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Put the drafts into the batch; return draft distributions of sampled requests (seq_id ->
        (num_drafts, vocab_size)); point-mass proposals (n-gram, greedy) need none."""
        if self.config.method == "ngram":
            batch.spec_token_ids = {s: proposals[s][:n] for s, n in batch.num_spec.items()}
            return {}
        reqs = [r for r in batch.requests if r.seq_id in batch.num_spec]
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in reqs}
        probs: dict[int, list[torch.Tensor]] = {r.seq_id: [] for r in reqs if not r.params.is_greedy}
        for j in range(max(batch.num_spec.values(), default=0)):
            active = [r for r in reqs if batch.num_spec[r.seq_id] > j]
            step = ScheduledBatch(active, [1] * len(active))
            step.spec_token_ids = drafts
            out = self.runner.execute(
                step, num_layers=self.num_layers, num_computed=[r.num_tokens - 1 + j for r in active]
            )
            greedy = out.logits.argmax(dim=-1).tolist()
            for row, r in enumerate(active):
                if r.params.is_greedy:
                    drafts[r.seq_id].append(greedy[row])
                else:
                    q = sampling_probs(out.logits[row], r.params)
                    probs[r.seq_id].append(q)
                    drafts[r.seq_id].append(int(torch.multinomial(q, 1, generator=r.generator)))
        batch.spec_token_ids = drafts
        return {s: torch.stack(p) for s, p in probs.items() if p}

    def sync(self, batch: ScheduledBatch) -> None:
        """Draft model only: compute its KV for every token the target computed this step."""
        if self.config.method == "draft":
            self.runner.execute(batch)
