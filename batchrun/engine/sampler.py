"""Turns the last-position logits of a step into tokens: greedy, temperature, top-k, top-p.

The whole batch is sampled at once with tensor ops on the logits' device; only token ids (and
requested logprobs) come back to the host. Greedy rows are an exact argmax of the raw logits.

Masks work on the temperature-scaled logits s = logits / temperature:
  top-k keeps every token with s at least the k-th largest s (ties with the k-th all survive);
  top-p keeps, in descending order, each token whose mass before it (under the top-k-renormalized
  distribution) is below top_p, then every token tied with the last one kept.
So a mask is a threshold on s and never depends on how a sort orders ties: it is the same on
every device and in every batch. The most likely token always survives. Neither mask sorts the
vocabulary: torch.topk takes a bounded candidate set, widened only for rows whose kept set may
reach past it (a wide nucleus, or ties at its edge).

Randomness is counter-based: a sampled row draws one uniform from a hash of (its request's seed,
the position of the token being sampled) and inverts the CDF of its masked distribution. A draw
therefore depends on nothing else in the batch, nor on how many steps the request was split over.
Speculative decoding draws from the same hash with a stream id (draft proposals, acceptance tests,
residual resampling), so its draws are independent of the sampler's and of each other's.

On a GPU a sampled row draws by the Gumbel-max race instead (kernels/sampling.py: argmax of
s - log E over the kept tokens, one exponential variate per token hashed from (seed, position,
token id)): one fused kernel pass per row, no sort or prefix sum over the vocabulary, the per-row
settings in one pinned upload and no per-row host work. Same distribution, same independence from
the batch; a seeded request reproduces on the same kind of device, and its tokens differ between a
CPU run and a GPU run (they did before too: the logits differ in their last bits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch

from batchrun.engine.config import SamplingParams
from batchrun.kernels.sampling import pack_rows

CANDIDATES = 128  # first candidate width for a top-p nucleus; rows it cannot hold retry 8x wider
_MASK64 = (1 << 64) - 1

# Streams of one request's uniforms: each (seed, position, stream) is one independent draw.
STREAM_SAMPLE = 0  # the token sampled at a position (plain steps, and verification's bonus token)
STREAM_DRAFT = 1  # a draft proposed for a position (drafter)
STREAM_ACCEPT = 2  # the acceptance test of the draft at a position (verification)
STREAM_RESIDUAL = 3  # the token drawn from the residual where that draft was rejected (verification)


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit ints that spreads every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int, stream: int = STREAM_SAMPLE) -> float:
    """A uniform in [0, 1) with 53 random bits, a pure function of (seed, position, stream)."""
    key = _mix64(seed & _MASK64)
    if stream != STREAM_SAMPLE:  # the sampler's own stream keeps the key it always had
        key = _mix64(key ^ (stream * 0xD1B54A32D192ED03 & _MASK64))
    z = _mix64((key + (position & _MASK64) * 0x9E3779B97F4A7C15) & _MASK64)
    return (z >> 11) * 2.0**-53


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request seeded with `seed` (SamplingParams.n):
    sample 0 keeps the seed itself, so it samples what a lone request with that seed samples;
    the others get independent streams, a pure function of (seed, index), never of the batch."""
    if sample_index == 0:
        return seed
    return _mix64((seed & _MASK64) ^ _mix64(sample_index * 0x9E3779B97F4A7C15 & _MASK64)) >> 1


def _truncate(
    s: torch.Tensor,  # (B, V) float32 scaled logits
    top_k: torch.Tensor,  # (B,) int64 in [0, V): 0 is off
    top_p: torch.Tensor,  # (B,) float64: >= 1 is off
    u: Optional[torch.Tensor],  # (B,) float64 in [0, 1): draw a token when given
    width: int,  # candidates per row, at least the largest top_k (host-side, so no device sync)
    any_without_k: bool,  # whether some row has top-k off (then top-p needs the full softmax)
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(threshold (B,): the smallest s each row keeps; token (B,) int64 drawn from the kept set, or None).

    Works on the `width` largest s of each row; rows whose kept set may extend past them are redone
    with a wider candidate set, up to the whole vocabulary."""
    vocab = s.shape[-1]
    width = min(vocab, width)
    vals, idx = torch.topk(s, width, dim=-1)  # (B, W), descending
    has_k = top_k > 0
    kth = vals.gather(1, (torch.where(has_k, top_k, width) - 1)[:, None])  # off: the last candidate
    in_k = vals >= kth
    # Probabilities of the candidates under the distribution top-p truncates: renormalized over the
    # top-k set where top-k applies (all of it is among the candidates unless the row spills), else
    # the full softmax (a per-row kernel, so the same bits whatever the batch).
    probs = torch.softmax(vals.masked_fill(~in_k, float("-inf")), dim=-1)
    if any_without_k:
        probs = torch.where(has_k[:, None], probs, torch.softmax(s, dim=-1).gather(1, idx))
    probs = probs.double()  # float64 sums: top_p near 1 compares masses to well below 1e-7
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each candidate
    # in_k and before < top_p are both prefixes of the candidates, and the first is always in both.
    num = (in_k & (before < top_p[:, None])).sum(dim=-1)
    threshold = vals.gather(1, (num - 1)[:, None]).squeeze(1)
    keep = vals >= threshold[:, None]  # a prefix again: ties with the last kept token join it
    token = None
    if u is not None:
        weights = torch.where(keep, (vals - vals[:, :1]).exp(), 0.0).double()
        cdf = weights.cumsum(dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
        pick = torch.minimum(pick, keep.sum(dim=-1, keepdim=True) - 1)  # u * total rounded up to total
        token = idx.gather(1, pick).squeeze(1)
    if width < vocab:
        # The kept set (or, for top-k, the set top-p renormalizes over) may go on past the candidates.
        spill = (keep[:, -1] | (has_k & in_k[:, -1])).nonzero().squeeze(1)
        if spill.numel():
            sub_u = u[spill] if u is not None else None
            sub_threshold, sub_token = _truncate(s[spill], top_k[spill], top_p[spill], sub_u, width * 8, any_without_k)
            threshold = threshold.index_copy(0, spill, sub_threshold)
            if token is not None:
                assert sub_token is not None, "the rows redone draw too: u was given"
                token = token.index_copy(0, spill, sub_token)
    return threshold, token


def draw_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over the vocabulary in id order: probs (B, V) non-negative, each row with
    positive mass (need not sum to 1), u (B,) in [0, 1) -> (B,) int64; never a zero-mass token."""
    cdf = probs.cumsum(dim=-1)  # non-decreasing; flat exactly at zero-mass tokens
    total = cdf[:, -1:]
    # Strictly below the total, so the first cdf above it always exists and adds positive mass.
    target = torch.minimum(u.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _draw_full(s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from softmax(s) over the whole vocabulary: s (B, V), u (B,) -> (B,) int64."""
    return draw_from_probs(torch.softmax(s, dim=-1), u)


def upload(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row host values as a (len(values),) tensor on `device`. On CUDA through pinned memory
    and a non-blocking copy: the copy queues behind the forward still running instead of making the
    host wait for it (a pageable copy synchronizes), so the sampler's host work overlaps the GPU."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _scaled(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    temperature = upload([p.temperature for p in params], torch.float32, logits.device)
    return logits.float() / temperature[:, None]


def _truncate_rows(
    s: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], u: Optional[torch.Tensor]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`_truncate` with per-row settings given on the host; top_k outside (0, vocab) is off."""
    vocab = s.shape[-1]
    top_k = [k if 0 < k < vocab else 0 for k in top_k]
    return _truncate(
        s,
        upload(top_k, torch.int64, s.device),
        # off is above any mass a rounded cumulative sum can reach
        upload([p if p < 1.0 else 2.0 for p in top_p], torch.float64, s.device),
        u,
        max(CANDIDATES, *top_k),
        not all(top_k),
    )


def _is_truncated(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the logits outside the top-k and outside the top-p nucleus (see the module doc).

    logits: (vocab_size,) or (batch, vocab_size), float32, already temperature-scaled."""
    rows = logits.reshape(-1, logits.shape[-1])
    vocab = rows.shape[-1]
    if not _is_truncated(SamplingParams(top_k=top_k, top_p=top_p), vocab):
        return logits
    threshold, _ = _truncate_rows(rows, [top_k] * rows.shape[0], [top_p] * rows.shape[0], None)
    return rows.masked_fill(rows < threshold[:, None], float("-inf")).reshape(logits.shape)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: logits (vocab_size,) -> (vocab_size,) float32."""
    return sampling_probs_rows(logits[None], [params])[0]


def sampling_probs_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`sampling_probs` of every row at once, each with its own (sampled, not greedy) params:
    logits (B, V) -> (B, V) float32 on the logits' device."""
    assert not any(p.is_greedy for p in params), "greedy rows have no distribution to sample"
    s = _scaled(logits, params)  # (B, V) float32, a new tensor: masked in place
    vocab = s.shape[-1]
    truncated = [i for i, p in enumerate(params) if _is_truncated(p, vocab)]
    if truncated:
        rows = s if len(truncated) == s.shape[0] else s[torch.tensor(truncated, device=s.device)]
        threshold, _ = _truncate_rows(
            rows, [params[i].top_k for i in truncated], [params[i].top_p for i in truncated], None
        )
        masked = rows.masked_fill(rows < threshold[:, None], float("-inf"))
        if len(truncated) == s.shape[0]:
            s = masked
        else:
            s[torch.tensor(truncated, device=s.device)] = masked
    return torch.softmax(s, dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, race: Optional[Callable[..., torch.Tensor]] = None) -> None:
        # Rows sampled without a seed draw their uniforms from here, in row order.
        self._generator = torch.Generator().manual_seed(seed)
        # The Gumbel race (KernelSet.sample: (logits, rows, threshold) -> tokens) the sampled rows
        # take, bound at start-up where the kernel set races on the device (the GPU's); None: the
        # inverse-CDF draws.
        self.race = race

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,  # (num_rows, vocab_size), any float dtype, on any device
        params: Sequence[SamplingParams],
        seeds: Sequence[Optional[int]],  # per row: its request's sampling seed (ignored for greedy rows)
        positions: Sequence[int],  # per row: the index in its request's tokens of the token sampled
    ) -> tuple[list[int], Optional[list[dict[int, float]]]]:
        """Return one token per row, and per-row top-N logprobs when any row asks for them."""
        tokens = self.draw(logits, params, seeds, positions)
        token_list = tokens.tolist()
        return token_list, self.logprobs(logits, params, tokens, token_list)

    def uniforms(
        self, seeds: Sequence[Optional[int]], positions: Sequence[int], stream: int, device: torch.device
    ) -> torch.Tensor:
        """(len(seeds),) float64 on `device`: a seeded row's uniform is `uniform(seed, position,
        stream)`; an unseeded row's comes from this sampler's generator, in row order."""
        # The unseeded rows' uniforms in one generator call: the CPU generator fills a tensor
        # serially, so row i gets exactly the i-th scalar draw, without a host loop per row that a
        # GPU step would wait on.
        num_unseeded = sum(seed is None for seed in seeds)
        drawn = iter(
            torch.rand(num_unseeded, generator=self._generator, dtype=torch.float64).tolist() if num_unseeded else ()
        )
        u = [
            uniform(seed, position, stream) if seed is not None else next(drawn)
            for seed, position in zip(seeds, positions)
        ]
        return upload(u, torch.float64, device)

    @torch.inference_mode()
    def draw(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[Optional[int]],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """`sample`'s tokens as a (num_rows,) int64 tensor on the logits' device (no host copy)."""
        num_rows, vocab = logits.shape
        assert num_rows == len(params) == len(seeds) == len(positions)
        device = logits.device
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sampled:
            tokens = logits.argmax(dim=-1)
        elif self.race is not None:
            tokens = self._race(logits, params, seeds, positions, self.race)
        else:
            tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
            greedy = [i for i, p in enumerate(params) if p.is_greedy]
            if greedy:
                rows = upload(greedy, torch.int64, device)
                tokens[rows] = logits[rows].argmax(dim=-1)
            for group in (
                [i for i in sampled if _is_truncated(params[i], vocab)],
                [i for i in sampled if not _is_truncated(params[i], vocab)],
            ):
                if group:
                    tokens[upload(group, torch.int64, device)] = self._draw(logits, group, params, seeds, positions)
        return tokens

    def _race(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[Optional[int]],
        positions: Sequence[int],
        race: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """The GPU's draw (module doc): every row in one Gumbel-race launch, greedy rows inside it
        exact argmaxes, after the top-k/top-p thresholds of the rows that ask for them."""
        vocab = logits.shape[-1]
        host = torch.from_numpy(pack_rows(self.row_seeds(params, seeds), positions, [p.temperature for p in params]))
        rows = host.pin_memory().to(logits.device, non_blocking=True) if logits.is_cuda else host  # (3, B)
        truncated = [i for i, p in enumerate(params) if not p.is_greedy and _is_truncated(p, vocab)]
        threshold = None
        if truncated:
            # (B,) float32: the smallest scaled logit each truncated row keeps, -inf elsewhere; the
            # rows scaled by the very temperature bits the race divides by.
            idx = upload(truncated, torch.int64, logits.device)
            temperature = rows[2].to(torch.int32).view(torch.float32)
            s = logits.index_select(0, idx).float() / temperature.index_select(0, idx)[:, None]
            sub, _ = _truncate_rows(s, [params[i].top_k for i in truncated], [params[i].top_p for i in truncated], None)
            threshold = torch.full((logits.shape[0],), float("-inf"), dtype=torch.float32, device=logits.device)
            threshold = threshold.index_copy(0, idx, sub.float())
        return race(logits, rows, threshold)

    def row_seeds(self, params: Sequence[SamplingParams], seeds: Sequence[Optional[int]]) -> list[int]:
        """Each row's seed for the race: its request's, or for an unseeded sampled row one drawn
        from this sampler's generator (in row order, one generator call per step); 0 for greedy rows."""
        unseeded = sum(1 for p, seed in zip(params, seeds) if seed is None and not p.is_greedy)
        fresh = iter(
            torch.randint(-(2**63), 2**63 - 1, (unseeded,), generator=self._generator).tolist() if unseeded else ()
        )
        return [(0 if p.is_greedy else next(fresh)) if seed is None else seed for p, seed in zip(params, seeds)]

    def _draw(
        self,
        logits: torch.Tensor,
        group: list[int],
        params: Sequence[SamplingParams],
        seeds: Sequence[Optional[int]],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """Tokens (len(group),) for sampled rows that are all truncated or all untruncated."""
        device = logits.device
        sub = [params[i] for i in group]
        rows = logits if len(group) == logits.shape[0] else logits[upload(group, torch.int64, device)]
        s = _scaled(rows, sub)
        u = self.uniforms([seeds[i] for i in group], [positions[i] for i in group], STREAM_SAMPLE, device)
        if not _is_truncated(sub[0], s.shape[-1]):
            return _draw_full(s, u)
        _, token = _truncate_rows(s, [p.top_k for p in sub], [p.top_p for p in sub], u)
        assert token is not None, "a token is drawn whenever u is given"
        return token

    @staticmethod
    def logprobs(
        logits: torch.Tensor,  # (num_rows, vocab_size)
        params: Sequence[SamplingParams],
        tokens: torch.Tensor,  # (num_rows,) int64 on the logits' device: the token each row chose
        token_list: list[int],  # the same tokens on the host
        top_n: Optional[Sequence[Optional[int]]] = None,  # per row N; None: each row's params.logprobs
    ) -> Optional[list[dict[int, float]]]:
        """Per row: {chosen token: logprob} plus the top-N, from the raw (unscaled) logits; rows
        whose N is None get {} (None when no row has an N)."""
        top_n = [p.logprobs for p in params] if top_n is None else top_n
        want = [i for i, n in enumerate(top_n) if n is not None]
        if not want:
            return None
        rows = torch.tensor(want, device=logits.device)
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen = lp.gather(1, tokens[rows][:, None]).squeeze(1).tolist()
        top = torch.topk(lp, min(max(n for n in top_n if n is not None), lp.shape[-1]), dim=-1)
        top_vals, top_idx = top.values.tolist(), top.indices.tolist()
        out: list[dict[int, float]] = [{} for _ in params]
        for j, i in enumerate(want):
            n = top_n[i]
            out[i] = {token_list[i]: chosen[j], **dict(zip(top_idx[j][:n], top_vals[j][:n]))}
        return out
