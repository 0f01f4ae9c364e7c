"""Speculative decoding: proposers, lossless verification, and the policy that decides when to speculate.

A step carries, after a decoding request's pending token, k proposed tokens; one target forward
scores them all, and verification keeps the longest acceptable prefix plus one token from the
target. Greedy requests accept a draft exactly when it equals the target's argmax, so output is
identical with speculation on or off. Sampled requests use rejection sampling (accept with
min(1, p/q), on rejection draw from normalize(max(0, p - q))), so tokens follow the target's
distribution whatever the proposer (n-gram lookup is a point-mass proposal q).

Verification handles every drafted request of a step at once, as tensor ops on the logits' device.
Its randomness is counter-based like the sampler's, keyed by (the request's sample seed, the
position, a stream per purpose: draft, acceptance, residual), so a request's tokens never depend
on what else is in the batch. They do depend on whether it carried drafts at a step (a different
stream decides its token), which is why a seeded request speculates only under a policy that
decides per request (drafter.is_eligible).

Policy (adaptive): speculation costs a wider forward; it pays when the expected accepted tokens
outweigh the cost of the extra rows. Each request keeps a running per-token acceptance rate a; with
k drafts it expects E = a(1 - a^k)/(1 - a) extra tokens. The policy adds requests in order of E
while (B + sum E) / (t_spec(B + sum k) + drafting) beats B / t_plain(B), so at full batch on a
compute-bound machine it stands aside, and at small batches it speculates. Requests below a floor
rate rest and are probed again every few steps so a rate can recover.

Step costs (StepCostModel) are learned on the device the engine runs on: the engine times every
pure decode step (wall time, host clock; the step ends with the host sync that brings its tokens
back) and reports its width and kind, plain or speculative, and the drafting time apart. A
speculative step is a differently shaped forward from the plain decode steps the start-up profile
timed (on a GPU those are CUDA-graphed, verification may not be), so the profile alone can price
it far too low. The model keeps, per (kind, width bucket), the median of the recent observed /
profiled ratios and prices a width as profile(width) x ratio; an unmeasured speculative width takes
the nearest measured bucket's ratio, else the plain one's times a conservative prior. When the
priced choice is to stand aside but the profile alone would speculate, the policy probes
speculation on a bounded share of steps (the gap doubles after each probe that did not pay), so it
learns that speculation pays, or stops paying, from steps it actually ran.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from batchrun.engine.config import SpeculativeConfig
from batchrun.engine.request import Request
from batchrun.engine.sampler import STREAM_ACCEPT, STREAM_RESIDUAL, Sampler, draw_from_probs, sampling_probs_rows

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
            proposal: list[int] = arr[start : start + k].tolist()
            return proposal
    return []


def expected_accepted(rate: float, k: int) -> float:
    if rate >= 1.0:
        return float(k)
    return rate * (1 - rate**k) / (1 - rate)


SPEC_PRIOR = 1.5  # an unmeasured speculative step: this many times a plain step of its width
COST_WINDOW = 5  # observations per (kind, width bucket) whose median prices it
PROBE_GAP = 16  # at least this many steps between two probes ...
PROBE_GAP_MAX = 512  # ... and at most this many once probes keep losing

PLAIN, SPEC, DRAFT = "plain", "spec", "draft"  # step kinds: plain decode, verification, one draft pass


def width_bucket(width: int) -> int:
    """Widths bucketed by powers of two: 1, 2-3, 4-7, ... -> the bucket's smallest width."""
    return 1 << (max(1, width).bit_length() - 1)


class StepCostModel:
    """Seconds per step by kind and token width: the start-up decode profile's interpolated time
    (tokens/s by width), scaled by what the engine measured for that kind near that width."""

    def __init__(self, decode_tok_s: dict[int, float], spec_prior: float = SPEC_PRIOR) -> None:
        pts = sorted((int(b), b / r) for b, r in decode_tok_s.items() if r > 0)
        self.widths = [w for w, _ in pts] or [1]
        self.seconds = [t for _, t in pts] or [1.0]
        self.spec_prior = spec_prior
        # (kind, bucket) -> recent observed seconds / profile(width), newest last
        self._ratios: dict[tuple[str, int], list[float]] = {}
        self._median: dict[tuple[str, int], float] = {}  # ... and their median

    def __call__(self, width: int) -> float:
        """The profile's seconds for a plain decode step of `width` tokens."""
        w, t = self.widths, self.seconds
        if width <= w[0]:
            return t[0]
        if width >= w[-1]:
            return t[-1] * width / w[-1]  # beyond the profile: linear in width (compute bound)
        i = bisect.bisect_left(w, width)
        frac = (width - w[i - 1]) / (w[i] - w[i - 1])
        return t[i - 1] + frac * (t[i] - t[i - 1])

    def observe(self, kind: str, width: int, seconds: float) -> None:
        if width < 1 or seconds <= 0:
            return
        recent = self._ratios.setdefault((kind, width_bucket(width)), [])
        recent.append(seconds / self(width))
        del recent[:-COST_WINDOW]
        self._median[(kind, width_bucket(width))] = float(np.median(recent))

    def _ratio(self, kind: str, width: int) -> Optional[float]:
        """The median measured ratio of `kind` in the bucket of `width`, else in the nearest
        measured bucket of that kind; None when that kind was never measured."""
        exact = self._median.get((kind, width_bucket(width)))
        if exact is not None:
            return exact
        buckets = [b for k, b in self._median if k == kind]
        if not buckets:
            return None
        target = width_bucket(width).bit_length()
        return self._median[(kind, min(buckets, key=lambda b: (abs(b.bit_length() - target), -b)))]

    def plain(self, width: int) -> float:
        return self(width) * (self._ratio(PLAIN, width) or 1.0)

    def spec(self, width: int, measured: bool = True) -> float:
        """A verification step of `width` tokens; measured=False: as the profile alone prices it."""
        ratio = self._ratio(SPEC, width) if measured else None
        if ratio is None:
            plain_ratio = (self._ratio(PLAIN, width) or 1.0) if measured else 1.0
            ratio = plain_ratio * (self.spec_prior if measured else 1.0)
        return self(width) * ratio

    def draft(self, width: int, fraction: float) -> float:
        """One draft pass over `width` requests; unmeasured, `fraction` of a plain step's time."""
        return self(width) * (self._ratio(DRAFT, width) or fraction)

    def learned(self) -> dict[str, float]:
        """'kind/bucket' -> measured seconds of a step at the bucket's smallest width."""
        return {f"{k}/{b}": round(self(b) * ratio, 6) for (k, b), ratio in sorted(self._median.items())}


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig, cost: StepCostModel, draft_cost_fraction: float) -> None:
        self.config = config
        self.cost = cost
        self.draft_cost_fraction = draft_cost_fraction  # one draft pass relative to one target step
        self.num_steps_on = 0
        self.num_steps_off = 0
        self.num_switches = 0
        self.num_probes = 0  # steps that speculated only to measure a speculative step
        self._was_on: Optional[bool] = None
        self._probe_gap = PROBE_GAP
        self._since_probe = 0
        self._probe_pending = False

    def choose(self, candidates: list[tuple[Request, int]], num_decodes: int) -> dict[int, int]:
        """candidates: (request, drafts available) -> {seq_id: drafts to schedule}."""
        chosen: dict[int, int] = {}
        self._since_probe += 1
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
            chosen = self._pick(scored, num_decodes, measured=True)
            if self._probe_pending:  # the last probe's step is measured now: did it pay?
                self._probe_pending = False
                self._probe_gap = PROBE_GAP if chosen else min(2 * self._probe_gap, PROBE_GAP_MAX)
            if not chosen and self._since_probe >= self._probe_gap:
                chosen = self._pick(scored, num_decodes, measured=False)
                if chosen:
                    self.num_probes += 1
                    self._since_probe = 0
                    self._probe_pending = True
        is_on = bool(chosen)
        if self._was_on is not None and is_on != self._was_on:
            self.num_switches += 1
        self._was_on = is_on
        if is_on:
            self.num_steps_on += 1
        else:
            self.num_steps_off += 1
        return chosen

    def _pick(self, scored: list[tuple[float, Request, int]], num_decodes: int, measured: bool) -> dict[int, int]:
        """The prefix of `scored` (best expected gain first) whose step makes the most tokens per
        second, if that beats not speculating. Prefixes are tried at about 2 log2(n) sizes, so a
        step of hundreds of requests prices a few dozen widths. measured=False prices as the
        profile alone does (the probes' choice)."""
        cost = self.cost
        base = num_decodes / (cost.plain(num_decodes) if measured else cost(num_decodes))
        gains = np.cumsum([e for e, _, _ in scored])
        widths = num_decodes + np.cumsum([n for _, _, n in scored])
        passes = np.maximum.accumulate([n for _, _, n in scored])  # draft passes: the most drafts of any
        best, best_m = base, 0
        for m in _prefix_sizes(len(scored)):
            draft = 0.0  # passes over the m requests (n-gram drafting: free)
            if self.draft_cost_fraction:
                f = self.draft_cost_fraction
                draft = int(passes[m - 1]) * (cost.draft(m, f) if measured else f * cost(m))
            rate = (num_decodes + gains[m - 1]) / (cost.spec(int(widths[m - 1]), measured) + draft)
            if rate > best:
                best, best_m = rate, m
        return {r.seq_id: n for _, r, n in scored[:best_m]}

    def observe(self, num_tokens: int, num_requests: int, num_drafts: int, seconds: float) -> bool:
        """One step the engine ran: `num_tokens` computed for `num_requests` requests, `num_drafts`
        of them drafts. Only pure decode steps (one pending token per request plus its drafts)
        price decoding; a step with prefill chunks is ignored. Returns whether it was counted."""
        if num_tokens != num_requests + num_drafts:
            return False
        self.cost.observe(SPEC if num_drafts else PLAIN, num_tokens, seconds)
        return True

    def observe_draft(self, num_requests: int, num_passes: int, seconds: float) -> None:
        """The draft passes of one step (self or draft model): `num_passes` of up to `num_requests` rows."""
        if num_passes > 0 and self.draft_cost_fraction:
            self.cost.observe(DRAFT, num_requests, seconds / num_passes)


def _prefix_sizes(n: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 11, 16, ... up to n, and n."""
    sizes = {n} if n else set()
    i = 0
    while (size := round(2 ** (i / 2))) < n:
        sizes.add(size)
        i += 1
    return sorted(sizes)


def record_acceptance(req: Request, num_proposed: int, num_accepted: int) -> None:
    req.metrics.num_spec_proposed += num_proposed
    req.metrics.num_spec_accepted += num_accepted
    req.metrics.num_spec_steps += 1
    rate = num_accepted / num_proposed
    req.spec_acceptance = rate if req.spec_acceptance is None else (1 - EMA) * req.spec_acceptance + EMA * rate


@dataclass
class DraftProbs:
    """The distributions sampled drafts were drawn from (greedy and n-gram drafts have none: point
    masses), one tensor for the whole step so verification reads them with one gather."""

    probs: torch.Tensor  # (num_rows, vocab_size) float32 on the logits' device
    rows: dict[int, list[int]]  # seq_id -> the rows of `probs` of its drafts, in draft order


@torch.inference_mode()
def verify(
    logits: torch.Tensor,  # (num_rows, vocab_size) target logits, on any device
    first_rows: Sequence[int],  # per request: its row at the pending token; one row per draft follows
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],  # per request: the tokens proposed after its pending token (>= 1)
    sampler: Sampler,  # unseeded requests draw their uniforms from its generator
    draft_probs: Optional[DraftProbs] = None,  # None, or a request missing from it: point-mass drafts
) -> list[list[int]]:
    """Per request, the tokens this step produces: its accepted drafts, then one token from the
    target. Every request of the step at once, as tensor ops on the logits' device; only the
    number accepted and the next token of each request come back to the host.

    A draft proposed for position i (i = len(token_ids) + j for draft j) is accepted with
    probability min(1, p_i(d) / q_i(d)) using uniform (seed, i, STREAM_ACCEPT); the first rejected
    one is replaced by a draw from normalize(max(0, p_i - q_i)) with uniform (seed, i,
    STREAM_RESIDUAL). When all are accepted the target's token after them is drawn exactly as the
    plain sampler draws it (its race at (seed, i)). Greedy requests accept a draft exactly when it
    is the argmax."""
    assert len(first_rows) == len(requests) == len(drafts) and all(drafts)
    greedy = [j for j, r in enumerate(requests) if r.params.is_greedy]
    sampled = [j for j, r in enumerate(requests) if not r.params.is_greedy]
    parts = []  # per group: (2, group size) int64 [number accepted, next token]
    for group, is_greedy in ((greedy, True), (sampled, False)):
        if group:
            rows = _DraftRows(logits.device, [first_rows[j] for j in group], [len(drafts[j]) for j in group])
            group_requests = [requests[j] for j in group]
            group_drafts = torch.tensor([t for j in group for t in drafts[j]], dtype=torch.int64, device=logits.device)
            if is_greedy:
                is_accepted, replacement, bonus = _greedy_rows(logits, rows, group_drafts)
            else:
                is_accepted, replacement, bonus = _sampled_rows(
                    logits, rows, group_requests, group_drafts, sampler, draft_probs
                )
            parts.append(rows.select(is_accepted, replacement, bonus))
    num_accepted_and_next = torch.cat(parts, dim=1).tolist()  # the one device-to-host copy
    out: list[list[int]] = [[] for _ in requests]
    for col, j in enumerate(greedy + sampled):
        n = num_accepted_and_next[0][col]
        out[j] = [*drafts[j][:n], num_accepted_and_next[1][col]]
    return out


class _DraftRows:
    """The draft rows of one group of G requests, flattened request after request: flat row r is
    draft `index[r]` of request `request[r]`. Draft k of a request, proposed for the position k
    after its pending token, is scored by the target row k after the pending token's row (the row
    of the token before it); the row after its last draft scores the bonus token."""

    def __init__(self, device: torch.device, first_rows: list[int], num_drafts: list[int]) -> None:
        counts = np.array(num_drafts, dtype=np.int64)  # (G,)
        starts = np.array(first_rows, dtype=np.int64)  # (G,)
        self.num_drafts = num_drafts
        self.num_requests = len(num_drafts)
        self.max_drafts = int(counts.max())
        self.flat_start = np.cumsum(counts) - counts  # (G,) first flat draft row of each request
        # (num_draft_rows,): the request and draft index of each flat draft row
        self.request_np = np.repeat(np.arange(len(counts)), counts)
        self.index_np = np.arange(int(counts.sum())) - np.repeat(self.flat_start, counts)
        to = functools.partial(torch.as_tensor, device=device)
        self.request = to(self.request_np)
        self.index = to(self.index_np)
        # The target row scoring draft k's position is the one before it: the pending token's row + k.
        self.logits_rows = to(starts[self.request_np] + self.index_np)  # (num_draft_rows,)
        self.bonus_rows = to(starts + counts)  # (G,) the row after the last draft
        self.counts = to(counts)

    def select(self, is_accepted: torch.Tensor, replacement: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """(2, G) int64: per request the number of leading accepted drafts and the token after them:
        the replacement at the first rejected draft, else the bonus token."""
        g, k = self.num_requests, self.max_drafts
        accepted = torch.zeros((g, k), dtype=torch.int64, device=bonus.device)  # padding counts as rejected
        accepted[self.request, self.index] = is_accepted.to(torch.int64)
        num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # (G,)
        candidates = torch.zeros((g, k + 1), dtype=torch.int64, device=bonus.device)
        candidates[self.request, self.index] = replacement
        candidates[torch.arange(g, device=bonus.device), self.counts] = bonus
        return torch.stack([num_accepted, candidates.gather(1, num_accepted[:, None]).squeeze(1)])


def _greedy_rows(
    logits: torch.Tensor, rows: _DraftRows, drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    targets = logits.index_select(0, rows.logits_rows).argmax(dim=-1)  # (num_draft_rows,)
    return drafts == targets, targets, logits.index_select(0, rows.bonus_rows).argmax(dim=-1)


def _sampled_rows(
    logits: torch.Tensor,
    rows: _DraftRows,
    requests: list[Request],
    drafts: torch.Tensor,  # (num_draft_rows,) int64
    sampler: Sampler,
    draft_probs: Optional[DraftProbs],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(is_accepted, replacement token, per request the bonus token) of rejection sampling."""
    device = logits.device
    row_requests = [requests[g] for g in rows.request_np.tolist()]
    row_positions = [len(r.token_ids) + k for r, k in zip(row_requests, rows.index_np.tolist())]
    row_seeds = [r.sample_seed for r in row_requests]
    p = sampling_probs_rows(logits.index_select(0, rows.logits_rows), [r.params for r in row_requests])  # (R, V)
    # q: the proposal of every draft row; a point mass at the draft unless the drafter sampled it.
    q = torch.zeros_like(p).scatter_(1, drafts[:, None], 1.0)  # (R, V)
    if draft_probs is not None:
        flat: list[int] = []  # flat draft rows whose draft was sampled ...
        prob_rows: list[int] = []  # ... and their rows of draft_probs.probs
        for r, first, n in zip(requests, rows.flat_start.tolist(), rows.num_drafts):
            if r.seq_id in draft_probs.rows:
                flat.extend(range(first, first + n))
                prob_rows.extend(draft_probs.rows[r.seq_id][:n])
        if flat:
            source = draft_probs.probs.index_select(0, torch.tensor(prob_rows, device=device))
            q.index_copy_(0, torch.tensor(flat, device=device), source.to(q.dtype))
    p_draft = p.gather(1, drafts[:, None]).squeeze(1).double()
    q_draft = q.gather(1, drafts[:, None]).squeeze(1).double()
    u_accept = sampler.uniforms(row_seeds, row_positions, STREAM_ACCEPT, device)
    is_accepted = (q_draft > 0) & (u_accept < p_draft / q_draft.clamp_min(torch.finfo(torch.float64).tiny))
    residual = (p - q).clamp_min(0.0).double()
    # All mass at most q's (p == q up to rounding): a rejection then has nothing left; draw from p.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p.double())
    replacement = draw_from_probs(residual, sampler.uniforms(row_seeds, row_positions, STREAM_RESIDUAL, device))
    bonus = sampler.draw(
        logits.index_select(0, rows.bonus_rows),
        [r.params for r in requests],
        [r.sample_seed for r in requests],
        [len(r.token_ids) + n for r, n in zip(requests, rows.num_drafts)],
    )
    return is_accepted, replacement, bonus
