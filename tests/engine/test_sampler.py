"""Sampler: top-k / top-p masks against a sort-based reference, sampled frequencies against the masked
softmax, greedy rows, seeds that make a row's tokens independent of its batch, logprobs, and a
sampled step that reads no device value on the host (every kind of batch, the GPU's kinds of
kernels, tokens equal to the CPU path's)."""

from __future__ import annotations

import pytest
import torch

from batchrun.engine.config import SamplingParams
from batchrun.engine.sampler import CANDIDATES, STREAM_SAMPLE, Sampler, apply_top_k_top_p, sampling_probs, uniform
from batchrun.kernels.sampling import gumbel_sample_reference, spill_thresholds_reference
from tests.support.host_sync import HostSync, NoHostSync
from tests.support.sampling import STEP_KINDS, chi2, chi2_critical, reference_keep, step_logits

V = 1000


def _logit_rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(V, generator=g) * 4,  # peaked: small nuclei
        torch.randn(V, generator=g) * 0.05,  # nearly flat: nuclei far wider than CANDIDATES
        torch.randint(-3, 3, (V,), generator=g).float(),  # many ties, also at the mask edges
        torch.zeros(V),  # all tied
        torch.cat([torch.full((CANDIDATES + 40,), 2.0), torch.randn(V - CANDIDATES - 40, generator=g)]),
    ]


KS = (0, -1, 1, 2, 7, 50, CANDIDATES, CANDIDATES + 1, V - 1, V, V + 5)
PS = (1.0, 0.999999, 0.95, 0.9, 0.5, 0.1, 1e-6)


@pytest.mark.parametrize("row", range(5))
def test_masks_equal_the_sort_based_reference(row):
    scaled = _logit_rows()[row]
    for k in KS:
        for p in PS:
            want = reference_keep(scaled, k, p)
            got = torch.isfinite(apply_top_k_top_p(scaled, k, p))
            assert torch.equal(got, want), (row, k, p, int(got.sum()), int(want.sum()))


def test_batched_masks_equal_single_rows():
    rows = torch.stack(_logit_rows())
    for k, p in ((0, 0.9), (50, 1.0), (50, 0.9), (V + 5, 0.5)):
        batched = apply_top_k_top_p(rows, k, p)
        for i in range(rows.shape[0]):
            assert torch.equal(batched[i], apply_top_k_top_p(rows[i], k, p))


def test_mask_edge_values():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    assert torch.isfinite(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [False, True, False, True, False]
    for off in (0, -1, 5, 6):  # top_k off, or as large as the vocabulary
        assert torch.equal(apply_top_k_top_p(logits, off, 1.0), logits)
    ties = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0])
    assert torch.isfinite(apply_top_k_top_p(ties, 2, 1.0)).tolist() == [True, True, True, True, False]
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    keep = [torch.isfinite(apply_top_k_top_p(probs.log(), 0, p)).tolist() for p in (0.79, 0.81, 0.01)]
    assert keep == [[True, True, False, False], [True, True, True, False], [True, False, False, False]]
    # a tiny top_p keeps the argmax, and whatever is tied with it
    assert torch.isfinite(apply_top_k_top_p(torch.tensor([0.0, 3.0, 3.0, 1.0]), 0, 1e-9)).tolist() == [
        False,
        True,
        True,
        False,
    ]


def test_sampling_probs_renormalize_after_masks():
    logits = torch.tensor([0.0, 0.0, 0.0, -100.0])
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p.sum().item() == pytest.approx(1.0)
    assert (p > 0).sum().item() == 3  # ties with the 2nd largest survive
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert p.tolist()[:3] == pytest.approx([1 / 3] * 3) and p[3] == 0


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seeded: bool) -> torch.Tensor:
    """Token counts over n draws of one row: n rows of the same logits at n positions in one call."""
    seeds = [11] * n if seeded else [None] * n
    tokens, _ = Sampler(seed=5).sample(logits.expand(n, -1), [params] * n, seeds, list(range(n)))
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=6),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=8),
    ],
    ids=["temperature", "top_k", "top_p", "top_k_top_p"],
)
@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_frequencies_follow_the_masked_softmax(params, seeded):
    logits = torch.randn(24, generator=torch.Generator().manual_seed(3)) * 1.5
    want = sampling_probs(logits, params)
    counts = _draws(logits, params, 30_000, seeded)
    assert counts[want == 0].sum() == 0  # never a masked token
    stat, df = chi2(counts, want)
    assert stat < chi2_critical(df), (stat, df)
    # The test has the power to see a wrong temperature or a mask left out.
    wrongs = [SamplingParams(temperature=params.temperature * 1.15, top_k=params.top_k, top_p=params.top_p)]
    if params.top_k or params.top_p < 1.0:
        wrongs.append(SamplingParams(temperature=params.temperature))
    for wrong in wrongs:
        stat, df = chi2(counts, sampling_probs(logits, wrong))
        assert stat > chi2_critical(df), (wrong, stat, df)


def test_frequencies_with_a_nucleus_wider_than_the_candidates():
    logits = torch.randn(400, generator=torch.Generator().manual_seed(4)) * 0.3
    params = SamplingParams(temperature=1.0, top_p=0.7)
    want = sampling_probs(logits, params)
    assert (want > 0).sum() > CANDIDATES
    counts = _draws(logits, params, 40_000, True)
    assert counts[want == 0].sum() == 0
    stat, df = chi2(counts, want)
    assert stat < chi2_critical(df), (stat, df)


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3 * CANDIDATES, generator=g) * torch.tensor([[3.0], [0.1], [2.0], [1.0], [0.2], [4.0]])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.95, seed=7),  # nucleus wider than the candidates
        SamplingParams(temperature=0.7, seed=8),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=9),
        SamplingParams(temperature=1.2),  # unseeded
        SamplingParams(temperature=0.5, top_k=50, seed=10),
    ]
    seeds = [None, 7, 8, 9, None, 10]
    s = Sampler()
    for position in range(20):
        mixed, _ = s.sample(logits, params, seeds, [position] * 6)
        assert mixed[0] == int(logits[0].argmax())
        for i in (1, 2, 3, 5):
            alone, _ = Sampler(seed=123).sample(logits[i : i + 1], [params[i]], [seeds[i]], [position])
            assert alone[0] == mixed[i]
        order = [5, 3, 1, 0, 2]  # other neighbours, other rows
        shuffled, _ = s.sample(logits[order], [params[i] for i in order], [seeds[i] for i in order], [position] * 5)
        assert [shuffled[order.index(i)] for i in (1, 2, 3, 5)] == [mixed[i] for i in (1, 2, 3, 5)]


def test_seeded_draws_depend_on_seed_and_position():
    logits = torch.zeros(1, 50)
    p = SamplingParams(temperature=1.0)
    s = Sampler()
    by_position = [s.sample(logits, [p], [1], [i])[0][0] for i in range(30)]
    assert len(set(by_position)) > 10
    by_seed = [s.sample(logits, [p], [i], [0])[0][0] for i in range(30)]
    assert len(set(by_seed)) > 10
    u = [uniform(seed, pos) for seed in range(-3, 30) for pos in range(30)]
    assert all(0.0 <= x < 1.0 for x in u) and abs(sum(u) / len(u) - 0.5) < 0.03


def test_low_precision_logits_and_greedy_rows():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=50)] * 2
    tokens, _ = Sampler().sample(logits, params, [None, 1, None, 2], [0] * 4)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    for i in (1, 3):
        assert sampling_probs(logits[i].float(), params[i])[tokens[i]] > 0


def test_logprobs_report_chosen_and_top_n():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0)]
    toks, lps = Sampler().sample(logits, params, [None, None], [0, 0])
    assert toks == [0, 1] and set(lps[0]) == {0, 1} and lps[1] == {}
    assert lps[0][0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))
    toks, lps = Sampler().sample(logits, [SamplingParams(temperature=1.0, top_k=1, logprobs=0)] * 2, [1, 2], [0, 0])
    assert toks == [0, 1] and list(lps[1]) == [1]
    assert Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None], [0, 0])[1] is None


def test_unseeded_uniforms_are_the_generators_draws_in_row_order():
    """Unseeded rows take the generator's draws in row order, whatever their number and however the
    seeded rows sit between them: the same values as one scalar draw per row, so a run's unseeded
    samples do not change with how the sampler fetches them."""
    seeds = [None, 7, None, None, 3, None]
    positions = [5, 9, 2, 0, 1, 4]
    sampler = Sampler(seed=11)
    got = [sampler.uniforms(seeds, positions, STREAM_SAMPLE, torch.device("cpu")).tolist() for _ in range(3)]
    generator = torch.Generator().manual_seed(11)
    for step in got:
        want = [
            uniform(seed, position)
            if seed is not None
            else float(torch.rand((), generator=generator, dtype=torch.float64))
            for seed, position in zip(seeds, positions)
        ]
        assert step == want
    assert Sampler(seed=11).uniforms([1, 2], [0, 0], STREAM_SAMPLE, torch.device("cpu")).tolist() == [
        uniform(1, 0),
        uniform(2, 0),
    ]


# ---- no host sync on the sampled step path ---------------------------------------------------------


@pytest.mark.parametrize("num_rows", [1, 5, 17])
@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_a_sampled_step_reads_no_device_value_on_the_host(kind, num_rows):
    """Sampler.draw with the GPU's kinds of kernels (here the torch references, run as opaque device
    kernels) on CPU tensors standing for device tensors: no op would wait for a GPU (tests/support/host_sync.py),
    and the tokens are the CPU path's (native race, host spill)."""
    logits = step_logits(num_rows)
    params = [STEP_KINDS[kind][i % len(STEP_KINDS[kind])] for i in range(num_rows)]
    seeds = [None if i % 4 == 3 else 50 + i for i in range(num_rows)]  # unseeded rows too
    positions = [3 + i for i in range(num_rows)]
    spilled = []

    def spill(s, kth, top_p, flags, threshold):
        spilled.append(int(flags.sum()))
        return spill_thresholds_reference(s, kth, top_p, flags, threshold)

    mode = NoHostSync(logits)
    with mode:
        tokens = Sampler(3, race=mode.kernel(gumbel_sample_reference), spill=mode.kernel(spill)).draw(
            logits, params, seeds, positions
        )
    assert tokens.tolist() == Sampler(3).draw(logits, params, seeds, positions).tolist()
    if kind in ("top_p", "top_k_top_p", "mixed") and num_rows > 1:
        assert sum(spilled) > 0, "the case never reached the spill kernel"


def test_the_host_spill_path_would_wait_for_the_device():
    """The mode fails where the GPU path would sync: the host's spill (the CPU's kernel), used as
    the GPU's, is caught."""
    logits = step_logits(5)
    params = STEP_KINDS["top_p"] * 5
    mode = NoHostSync(logits)
    with pytest.raises(HostSync, match="nonzero"), mode:
        Sampler(3, race=mode.kernel(gumbel_sample_reference), spill=spill_thresholds_reference).draw(
            logits, params, [1] * 5, [0] * 5
        )
