"""Sampler: top-k / top-p masks, greedy rows, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from batchrun.engine.config import SamplingParams
from batchrun.engine.sampler import Sampler, apply_top_k_top_p, sampling_probs


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    out = apply_top_k_top_p(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(out).tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    keep = torch.isfinite(apply_top_k_top_p(logits, 0, 0.8)).tolist()
    assert keep == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    keep = torch.isfinite(apply_top_k_top_p(logits, 0, 0.81)).tolist()
    assert keep == [True, True, True, False]
    keep = torch.isfinite(apply_top_k_top_p(logits, 0, 0.01)).tolist()
    assert keep == [True, False, False, False]  # the top token always survives


def test_sampling_probs_renormalize_after_masks():
    logits = torch.tensor([0.0, 0.0, 0.0, -100.0])
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p.sum().item() == pytest.approx(1.0)
    assert (p > 0).sum().item() == 2


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=7)
    s = Sampler()
    alone = [s.sample(logits[1:2], [p], [torch.Generator().manual_seed(7)])[0][0] for _ in range(1)]
    g = torch.Generator().manual_seed(7)
    batched, _ = s.sample(
        logits,
        [SamplingParams(temperature=0.0), p, SamplingParams(temperature=1.0)],
        [None, g, torch.Generator().manual_seed(99)],
    )
    assert batched[1] == alone[0]
    assert batched[0] == int(logits[0].argmax())


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.1)]])
    s = Sampler()
    g = torch.Generator().manual_seed(1)
    p = SamplingParams(temperature=1.0)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[s.sample(logits, [p], [g])[0][0]] += 1
    assert abs(counts[0] / 3000 - 0.6) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_logprobs_report_chosen_and_top_n():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    toks, lps = Sampler().sample(logits, [SamplingParams(temperature=0.0, logprobs=2)], [None])
    assert toks == [0] and set(lps[0]) == {0, 1}
    assert lps[0][0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))
