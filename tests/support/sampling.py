"""What the sampler tests share (tests/engine/test_sampler.py, tests/engine/test_sampler_warmup.py,
tests/kernels/test_triton_sampling.py): the masks written the plain way, a chi-square check of
sampled frequencies, and the kinds of sampled step with logits that reach every path."""

from __future__ import annotations

import math

import torch

from batchrun.engine.config import SamplingParams
from batchrun.engine.sampler import CANDIDATES


def reference_keep(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The documented masks, written the plain way: full sorts, one row (V,) at a time, masses in
    float64 (the sampler's float64 sums of float32 weights are as exact: even at top_p = 0.999999,
    where a float32 softmax would move the boundary by many tokens).

    top-k keeps s >= the k-th largest s; top-p keeps s >= the last token (in descending order) whose
    mass before it, under the top-k-renormalized softmax, is below top_p."""
    keep = torch.ones_like(scaled, dtype=torch.bool)
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        keep &= scaled >= torch.sort(scaled, descending=True).values[top_k - 1]
    if top_p < 1.0:
        ordered = torch.sort(scaled.masked_fill(~keep, float("-inf")), descending=True).values
        probs = torch.softmax(ordered.double(), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        last = int((before < top_p).sum()) - 1
        keep &= scaled >= ordered[last]
    return keep


def chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at 1 - 1e-4 (z is the normal one), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(Pearson's statistic of `counts` against `probs`, degrees of freedom over the cells probs allows)."""
    n = counts.sum().item()
    expected = probs.double() * n
    live = expected > 0
    stat = (((counts.double() - expected) ** 2)[live] / expected[live]).sum().item()
    return stat, int(live.sum()) - 1


STEP_KINDS = {
    "greedy": [SamplingParams(temperature=0.0)],
    "temperature": [SamplingParams(temperature=0.7)],
    "top_k": [SamplingParams(temperature=0.7, top_k=5)],
    "top_p": [SamplingParams(temperature=1.0, top_p=0.95)],  # flat rows: nuclei wider than the candidates
    "top_k_top_p": [SamplingParams(temperature=0.7, top_k=CANDIDATES, top_p=0.99)],  # ties spill past k
    "mixed": [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.95),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
        SamplingParams(temperature=0.5, top_k=50),
        SamplingParams(temperature=0.7, top_k=CANDIDATES, top_p=0.99),
    ],
}


def step_logits(num_rows: int) -> torch.Tensor:
    """(num_rows, 3 * CANDIDATES): peaked, flat, and rows whose CANDIDATES-th largest value is tied
    with a hundred more."""
    g = torch.Generator().manual_seed(num_rows)
    logits = torch.randn(num_rows, 3 * CANDIDATES, generator=g)
    for i in range(num_rows):
        if i % 3 == 0:
            logits[i] *= 4.0
        elif i % 3 == 1:
            logits[i] *= 0.05
        else:
            logits[i, CANDIDATES - 10 : CANDIDATES + 100] = logits[i].max() - 3.0
    return logits
