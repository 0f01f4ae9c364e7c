"""Speculative decoding: proposers, lossless verification, and the policy that decides when to speculate.

A step carries, after a decoding request's pending token, k proposed tokens; one target forward
scores them all, and verification keeps the longest acceptable prefix plus one token from the
target. Greedy requests accept a draft exactly when it equals the target's argmax, so output is
identical with speculation on or off. Sampled requests use rejection sampling (accept with
min(1, p/q), on rejection draw from normalize(max(0, p - q))), so tokens follow the target's
distribution whatever the proposer (n-gram lookup is a point-mass proposal q).

Policy (adaptive): speculation costs a wider forward; it pays when the expected accepted tokens
outweigh the cost of the extra rows. Each request keeps a running per-token acceptance rate a; with
k drafts it expects E = a(1 - a^k)/(1 - a) extra tokens. The step's cost comes from the decode
profile measured at start-up (tokens/s by batch width). The policy adds requests in order of E
while (B + sum E) / t(B + sum k) beats B / t(B), so at full batch on a compute-bound machine it
stands aside, and at small batches it speculates. Requests below a floor rate rest and are probed
again every few steps so a rate can recover.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from batchrun.engine.config import SamplingParams, SpeculativeConfig
from batchrun.engine.request import Request
from batchrun.engine.sampler import sampling_probs

log = logging.getLogger(__name__)

PRIOR_ACCEPTANCE = 0.5  # a new request's assumed per-token acceptance rate
EMA = 0.3  # weight of the latest step in the running acceptance rate
FLOOR = 0.15  # below this a request rests from speculation ...
PROBE_EVERY = 8  # ... except every PROBE_EVERY of its steps


def ngram_propose(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (longest n first) and
    propose the k tokens that followed it."""
    arr = np.asarray(token_ids, dtype=np.int64)
    length = len(arr)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = arr[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)  # starts 0..length-1-n
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


def expected_accepted(rate: float, k: int) -> float:
    if rate >= 1.0:
        return float(k)
    return rate * (1 - rate**k) / (1 - rate)


class StepCostModel:
    """Seconds per step as a function of its token width, from the start-up decode profile."""

    def __init__(self, decode_tok_s: dict[int, float]) -> None:
        pts = sorted((int(b), b / r) for b, r in decode_tok_s.items() if r > 0)
        self.widths = [w for w, _ in pts] or [1]
        self.seconds = [t for _, t in pts] or [1.0]

    def __call__(self, width: int) -> float:
        w, t = self.widths, self.seconds
        if width <= w[0]:
            return t[0]
        if width >= w[-1]:
            return t[-1] * width / w[-1]  # beyond the profile: linear in width (compute bound)
        i = bisect.bisect_left(w, width)
        frac = (width - w[i - 1]) / (w[i] - w[i - 1])
        return t[i - 1] + frac * (t[i] - t[i - 1])


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig, cost: StepCostModel, draft_cost_fraction: float) -> None:
        self.config = config
        self.cost = cost
        self.draft_cost_fraction = draft_cost_fraction  # one draft pass relative to one target step
        self.num_steps_on = 0
        self.num_steps_off = 0
        self.num_switches = 0
        self._was_on: Optional[bool] = None

    def choose(self, candidates: list[tuple[Request, int]], num_decodes: int) -> dict[int, int]:
        """candidates: (request, drafts available) -> {seq_id: drafts to schedule}."""
        chosen: dict[int, int] = {}
        if candidates and not self.config.adaptive:
            chosen = {r.seq_id: n for r, n in candidates}
        elif candidates:
            scored = []
            for r, n in candidates:
                rate = r.spec_acceptance if r.spec_acceptance is not None else PRIOR_ACCEPTANCE
                resting = rate < FLOOR and r.spec_steps_seen % PROBE_EVERY != 0
                r.spec_steps_seen += 1
                if not resting:
                    scored.append((expected_accepted(max(rate, FLOOR), n), r, n))
            scored.sort(key=lambda x: -x[0])
            base = num_decodes / self.cost(num_decodes)
            gain, width = 0.0, num_decodes
            for e, r, n in scored:
                new_width = width + n
                draft = self.draft_cost_fraction * n * self.cost(max(1, len(chosen) + 1))
                if (num_decodes + gain + e) / (self.cost(new_width) + draft) > base:
                    chosen[r.seq_id] = n
                    gain, width = gain + e, new_width
        is_on = bool(chosen)
        if self._was_on is not None and is_on != self._was_on:
            self.num_switches += 1
        self._was_on = is_on
        if is_on:
            self.num_steps_on += 1
        else:
            self.num_steps_off += 1
        return chosen


def record_acceptance(req: Request, num_proposed: int, num_accepted: int) -> None:
    req.metrics.num_spec_proposed += num_proposed
    req.metrics.num_spec_accepted += num_accepted
    req.metrics.num_spec_steps += 1
    rate = num_accepted / num_proposed
    req.spec_acceptance = rate if req.spec_acceptance is None else (1 - EMA) * req.spec_acceptance + EMA * rate


def verify(
    logits: torch.Tensor,  # (1 + num_drafts, vocab_size): target logits at the pending token and each draft
    drafts: list[int],
    params: SamplingParams,
    generator: Optional[torch.Generator],
    draft_probs: Optional[torch.Tensor] = None,  # (num_drafts, vocab_size); None: point-mass proposals
) -> list[int]:
    """The tokens this step produces: accepted drafts, then one token from the target."""
    if params.is_greedy:
        targets = logits.argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            if d != targets[i]:
                break
            out.append(d)
        out.append(targets[len(out)])
        return out
    out = []
    for i, d in enumerate(drafts):
        p = sampling_probs(logits[i], params)
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u < min(1.0, float(p[d]) / q_d):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[i], min=0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    p = sampling_probs(logits[len(drafts)], params)
    out.append(int(torch.multinomial(p, 1, generator=generator)))
    return out
