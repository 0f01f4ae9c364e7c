"""Turns the last-position logits of a step into tokens: greedy, temperature, top-k, top-p.

The whole batch is sampled at once with tensor ops on the logits' device; only token ids (and
requested logprobs) come back to the host. Greedy rows are an exact argmax of the raw logits.

Masks work on the temperature-scaled logits s = logits / temperature:
  top-k keeps every token with s at least the k-th largest s (ties with the k-th all survive);
  top-p keeps, in descending order, each token whose mass before it (under the top-k-renormalized
  distribution) is below top_p, then every token tied with the last one kept.
So a mask is a threshold on s and never depends on how a sort orders ties: it is the same on
every device and in every batch. The most likely token always survives. A token's mass is its
weight exp(s - max s), in float32, over the weight of the set renormalized over, with sums that
round no decision a float32 rounding of the weights would not (kernels/sampling.py: kept_prefix).

Neither mask sorts the vocabulary, and neither reads a device value on the host (`thresholds`):
torch.topk takes max(CANDIDATES, largest top_k) candidates per truncated row, which hold the
threshold unless the row's kept set may reach past them (a nucleus that keeps them all, or ties at
the k-th value running past them while top-p renormalizes over the top-k set). Those rows are
flagged on the device, and a spill kernel redoes them over the whole row: on a GPU one Triton
launch in which unflagged rows return at once, on the CPU the flagged rows picked out and widened
on the host (the same thresholds: kernels/sampling.py: spill_thresholds_reference). So a GPU
decode step can be launched before the previous one's tokens are read (engine/runners/gpu.py),
sampled and truncated rows included.

Every sampled row draws by the Gumbel-max race (kernels/sampling.py): argmax of s - log E over the
kept tokens, with one exponential variate per token hashed from (its request's seed, the position
of the token being sampled, the token id), greedy rows exact argmaxes in the same launch. A draw
therefore depends on nothing else in the batch, nor on how many steps the request was split over,
and it is the same algorithm on every device: the Triton kernel on a GPU, the native kernel on the
CPU (the torch reference where it is not built), which round every float32 operation alike. For the
same logits a seeded request samples the same tokens on the CPU and on a GPU except where the two
best race keys of a row are within the last bit of `log`, or a top-p mass within float rounding of
top_p (exp's last bit, float64 sum order); docs/design.md says how rare. The kernels come from the
caller (`Sampler(seed, race=..., spill=...)`: engine start-up hands it the kernel set's), else the
torch references.

Speculative decoding draws from explicit probability vectors (draft proposals, acceptance tests,
residual resampling: engine/speculative.py, engine/drafter.py) by inverse CDF with uniforms hashed
from (seed, position, stream): computed on the host, the same on every device, independent of the
sampler's race and of each other. The bonus token after accepted drafts is a plain race draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from batchrun.engine.config import SamplingParams
from batchrun.kernels.sampling import (
    RaceFn,
    SpillFn,
    gumbel_sample_reference,
    kept_prefix,
    pack_rows,
    spill_thresholds_reference,
    weight_past,
)

CANDIDATES = 128  # candidates per truncated row (at least its top_k); rows whose kept set spills are redone
_MASK64 = (1 << 64) - 1

# Streams of one request's uniforms: each (seed, position, stream) is one independent draw.
STREAM_SAMPLE = 0  # unused by the engine since plain steps race; kept so the other streams' keys stay
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
    if stream != STREAM_SAMPLE:  # stream 0 keeps the key it always had
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


def thresholds(
    s: torch.Tensor,  # (R, V) float32 scaled logits of truncated rows
    top_k: Sequence[int],  # per row; outside (0, V) is off
    top_p: Sequence[float],  # per row; >= 1 is off
    spill: SpillFn,  # finishes the rows whose kept set reaches past the candidates
) -> torch.Tensor:
    """(R,) float32: the smallest s each row keeps (module doc), without reading a device value on
    the host: the per-row settings are host values, the rest tensor ops and the spill kernel."""
    vocab = s.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    width = min(vocab, max(CANDIDATES, *ks))
    vals, idx = torch.topk(s, width, dim=-1)  # (R, W) descending
    k_rows = upload(ks, torch.int64, s.device)
    has_k = k_rows > 0
    kth = vals.gather(1, (k_rows - 1).clamp_min(0)[:, None]).squeeze(1)
    kth = torch.where(has_k, kth, float("-inf"))  # (R,): the k-th largest s, -inf where top-k is off
    if all(p >= 1.0 for p in top_p):  # top-k alone: every such row has a k
        return kth
    # off is above any mass a rounded sum can reach
    p_rows = upload([p if p < 1.0 else 2.0 for p in top_p], torch.float64, s.device)
    # The weight top-p renormalizes over past the candidates: none for a top-k row (its top-k set
    # is among them unless the row spills), the rest of the row without top-k.
    without_k = [i for i, k in enumerate(ks) if k == 0]
    if len(without_k) == len(ks):
        past = weight_past(s, idx)
    else:
        past = torch.zeros(len(ks), dtype=torch.float64, device=s.device)
        if without_k:
            rows = upload(without_k, torch.int64, s.device)
            sub = weight_past(s.index_select(0, rows), idx.index_select(0, rows))
            past = past.index_copy(0, rows, sub)
    num = kept_prefix(vals, kth, p_rows, past)
    threshold = vals.gather(1, (num - 1)[:, None]).squeeze(1)
    if width == vocab:
        return threshold
    # Past the candidates: a nucleus that kept every candidate, or (top-p over top-k) ties at the
    # k-th value running past them, whose weight the renormalization above missed.
    spilled = torch.where(has_k, (vals[:, -1] >= kth) & (p_rows < 1.0), num == width)
    return spill(s, kth, p_rows, spilled, threshold)


def draw_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over the vocabulary in id order: probs (B, V) non-negative, each row with
    positive mass (need not sum to 1), u (B,) in [0, 1) -> (B,) int64; never a zero-mass token."""
    cdf = probs.cumsum(dim=-1)  # non-decreasing; flat exactly at zero-mass tokens
    total = cdf[:, -1:]
    # Strictly below the total, so the first cdf above it always exists and adds positive mass.
    target = torch.minimum(u.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. On CUDA through pinned memory and a non-blocking copy: the copy
    queues behind the forward still running instead of making the host wait for it (a pageable
    copy synchronizes), so the sampler's host work overlaps the GPU."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def upload(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row host values as a (len(values),) tensor on `device` (`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _is_truncated(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0


def _masked(s: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """s (B, V) float32 scaled logits with -inf below each truncated row's threshold (a new tensor
    where any row is truncated). On the host's spill path: for callers that read the result anyway."""
    vocab = s.shape[-1]
    truncated = [i for i, p in enumerate(params) if _is_truncated(p, vocab)]
    if not truncated:
        return s
    idx = upload(truncated, torch.int64, s.device)
    rows = s.index_select(0, idx)
    threshold = thresholds(
        rows, [params[i].top_k for i in truncated], [params[i].top_p for i in truncated], spill_thresholds_reference
    )
    return s.index_copy(0, idx, rows.masked_fill(rows < threshold[:, None], float("-inf")))


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the logits outside the top-k and outside the top-p nucleus (see the module doc).

    logits: (vocab_size,) or (batch, vocab_size), float32, already temperature-scaled."""
    rows = logits.reshape(-1, logits.shape[-1])
    params = SamplingParams(top_k=top_k, top_p=top_p)
    if not _is_truncated(params, rows.shape[-1]):
        return logits
    return _masked(rows, [params] * rows.shape[0]).reshape(logits.shape)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: logits (vocab_size,) -> (vocab_size,) float32."""
    return sampling_probs_rows(logits[None], [params])[0]


def sampling_probs_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`sampling_probs` of every row at once, each with its own (sampled, not greedy) params:
    logits (B, V) -> (B, V) float32 on the logits' device."""
    assert not any(p.is_greedy for p in params), "greedy rows have no distribution to sample"
    temperature = upload([p.temperature for p in params], torch.float32, logits.device)
    return torch.softmax(_masked(logits.float() / temperature[:, None], params), dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, race: Optional[RaceFn] = None, spill: Optional[SpillFn] = None) -> None:
        # Rows sampled without a seed draw their race seeds (and speculation its uniforms) from here,
        # in row order.
        self._generator = torch.Generator().manual_seed(seed)
        # The device kernels of a step (the kernel set's, KernelSet.sample and .spill), bound by the
        # caller (engine start-up); None: the torch references, which run on any device.
        self._race = race or gumbel_sample_reference
        self._spill = spill or spill_thresholds_reference

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
        """`sample`'s tokens as a (num_rows,) int64 tensor on the logits' device, without a host
        sync: the tokens may be read later (engine/runners/gpu.py). Every row in one race launch,
        greedy rows inside it exact argmaxes, after the thresholds of the truncated rows."""
        num_rows, vocab = logits.shape
        assert num_rows == len(params) == len(seeds) == len(positions)
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1)
        race, spill = self._race, self._spill
        temperatures = [p.temperature for p in params]
        host = torch.from_numpy(pack_rows(self.row_seeds(params, seeds), positions, temperatures))
        rows = to_device(host, logits.device)  # (3, B)
        truncated = [i for i, p in enumerate(params) if not p.is_greedy and _is_truncated(p, vocab)]
        threshold = None
        if truncated:
            # (B,) float32: the smallest scaled logit each truncated row keeps, -inf elsewhere; the
            # rows scaled by the very temperature bits the race divides by.
            temperature = rows[2].to(torch.int32).view(torch.float32)
            top_k, top_p = [params[i].top_k for i in truncated], [params[i].top_p for i in truncated]
            if len(truncated) == num_rows:
                threshold = thresholds(logits.float() / temperature[:, None], top_k, top_p, spill)
            else:
                idx = upload(truncated, torch.int64, logits.device)
                s = logits.index_select(0, idx).float() / temperature.index_select(0, idx)[:, None]
                threshold = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=logits.device)
                threshold = threshold.index_copy(0, idx, thresholds(s, top_k, top_p, spill))
        return race(logits, rows, threshold)

    def row_seeds(self, params: Sequence[SamplingParams], seeds: Sequence[Optional[int]]) -> list[int]:
        """Each row's seed for the race: its request's, or for an unseeded sampled row one drawn
        from this sampler's generator (in row order, one generator call per step); 0 for greedy rows."""
        unseeded = sum(1 for p, seed in zip(params, seeds) if seed is None and not p.is_greedy)
        fresh = iter(
            torch.randint(-(2**63), 2**63 - 1, (unseeded,), generator=self._generator).tolist() if unseeded else ()
        )
        return [(0 if p.is_greedy else next(fresh)) if seed is None else seed for p, seed in zip(params, seeds)]

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
