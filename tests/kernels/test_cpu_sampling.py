"""The CPU's Gumbel race (csrc/sampling.cpp, kernels/sampling.py: gumbel_sample_native) against the torch reference.

Every race key the kernel computes is bitwise the reference's arithmetic with a correctly rounded
`log` (the reference itself takes torch's log, whose last bit differs on a small share of inputs:
the native keys are checked bit for bit against the reference run with the correctly rounded log),
so the hash, u, the series, the division by the temperature and the absence of fused multiply-adds
are all checked exactly. The kernel computes only the keys that can win (a bound from each
token's u), so its tokens are checked against the argmax of every key, and against the reference's
tokens: greedy rows with ties, NaN and +-inf logits, thresholds, bf16 and strided logits, seeds past
2**63, positions near 2**31, vocabularies not a multiple of its block, one thread and two.
"""

from __future__ import annotations

import pytest
import torch

from batchrun.kernels import cpu_native
from batchrun.kernels.sampling import (
    cpu_race,
    gumbel_sample_native,
    gumbel_sample_reference,
    pack_rows,
    race_keys,
    row_keys,
)

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler: the native kernels are not built")

SEEDS = [1, -5, 2**63 + 7, 3, 4, 2**40, 0, 9, 2**64 - 1, 11, 12, 13]
POSITIONS = [0, 1, 2, 3, 100, 5, 2**31 - 1, 7, 8, 9, 10, 11]
TEMPS = [0.7, 1.0, 0.0, 0.0, 0.5, 1.3, 0.6, 0.0, 2.0, 0.05, 0.3, 1.0]
GREEDY = [i for i, t in enumerate(TEMPS) if t == 0.0]


def _log_correctly_rounded(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).float()


def _inputs(vocab: int, dtype: torch.dtype, strided: bool = False, threshold: bool = False):
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(len(SEEDS), vocab + 7, generator=g) * 3
    logits = wide[:, 3 : 3 + vocab] if strided else wide[:, :vocab].contiguous()
    if vocab >= 10:
        logits[3, 5] = logits[3, 9] = 100.0  # a greedy row with a tie: the first index
        logits[7] = 1.0  # a greedy row all tied: index 0
        logits[4, 7] = float("nan")  # a sampled row with a NaN: its first NaN, as argmax
        logits[2, 1] = float("nan")  # a greedy row with a NaN
        logits[1, : vocab // 2] = float("-inf")  # half a sampled row masked (a grammar's -inf)
        logits[5, 2] = float("inf")  # +inf: its key is +inf, or NaN where E is inf
        logits[11, vocab // 3] = float("-inf")
    logits = logits.to(dtype)
    rows = torch.from_numpy(pack_rows(SEEDS, POSITIONS, TEMPS))
    cut = None
    if threshold:
        s = logits.float() / torch.tensor(TEMPS).clamp_min(1e-9)[:, None]
        cut = torch.full((len(SEEDS),), float("-inf"))
        for row, k in ((0, 6), (6, 1), (9, min(40, vocab)), (11, max(1, vocab // 2))):
            cut[row] = s[row].sort(descending=True).values[k - 1]
    return logits, rows, cut


def _oracle_keys(logits: torch.Tensor, rows: torch.Tensor, threshold) -> tuple[list[int], torch.Tensor]:
    """The sampled rows without NaN and their reference keys with a correctly rounded log, masked
    tokens -inf (the reference masks them so)."""
    temperature = rows[2].to(torch.int32).view(torch.float32)
    x = logits.float()
    race = [i for i in range(x.shape[0]) if temperature[i] != 0 and not torch.isnan(x[i]).any()]
    s = x[race] / temperature[race][:, None]
    if threshold is not None:
        s = s.masked_fill(s < threshold[race][:, None], float("-inf"))
    keys = race_keys(s, row_keys(rows)[race], log=_log_correctly_rounded)
    return race, keys.masked_fill(s == float("-inf"), float("-inf"))


CASES = [
    dict(vocab=3000, dtype=torch.float32),
    dict(vocab=3000, dtype=torch.float32, threshold=True),
    dict(vocab=2500, dtype=torch.bfloat16, strided=True, threshold=True),
    dict(vocab=49152, dtype=torch.float32),
    dict(vocab=257, dtype=torch.float32),  # one past the kernel's block
    dict(vocab=5, dtype=torch.float32),
    dict(vocab=1, dtype=torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_native_keys_and_tokens_are_the_references(case):
    logits, rows, threshold = _inputs(case["vocab"], case["dtype"], case.get("strided", False), case.get("threshold"))
    keys = torch.full((len(SEEDS), case["vocab"]), float("nan"))
    got = gumbel_sample_native(logits, rows, threshold, keys_out=keys)
    race, want_keys = _oracle_keys(logits, rows, threshold)
    same = (keys[race].view(torch.int32) == want_keys.view(torch.int32)) | (keys[race].isnan() & want_keys.isnan())
    assert bool(same.all()), f"{int((~same).sum())} keys differ from the reference's bits"
    # The pruned race picks the argmax of all its keys (first index, NaN first), as the reference does.
    assert got[race].tolist() == keys[race].argmax(dim=-1).tolist()
    assert got[GREEDY].tolist() == logits[GREEDY].float().argmax(dim=-1).tolist()
    assert got.tolist() == gumbel_sample_reference(logits, rows, threshold).tolist()
    if case["vocab"] >= 10:
        assert got[4] == 7 and got[2] == 1  # the first NaN, sampled row or greedy


def test_many_rows_agree_with_the_reference_at_both_thread_counts():
    """Enough rows and vocabulary for the bound to skip whole blocks and most tokens; a flat row and
    a peaked one; thresholds on some rows; the same tokens with one thread and with two."""
    n, vocab = 64, 20000
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(n // 4)[:, None]
    logits = torch.randn(n, vocab, generator=g) * scale
    temps = [0.0 if i % 9 == 0 else 0.4 + (i % 5) * 0.3 for i in range(n)]
    rows = torch.from_numpy(pack_rows([1000 + i for i in range(n)], [i * 7 for i in range(n)], temps))
    s = logits / torch.tensor(temps).clamp_min(1e-9)[:, None]
    threshold = torch.where(torch.arange(n) % 3 == 0, s.topk(30, dim=-1).values[:, -1], float("-inf"))
    want = gumbel_sample_reference(logits, rows, threshold)
    threads = torch.get_num_threads()
    try:
        for num in (1, 2):
            torch.set_num_threads(num)
            assert gumbel_sample_native(logits, rows, threshold).tolist() == want.tolist(), num
    finally:
        torch.set_num_threads(threads)


def test_cpu_race_is_native_unless_switched_off(monkeypatch):
    assert cpu_race() is gumbel_sample_native
    monkeypatch.setenv("BATCHRUN_CPU_KERNELS", "0")
    assert cpu_race() is gumbel_sample_reference


def test_fp16_logits_are_widened():
    logits, rows, _ = _inputs(700, torch.float32)
    logits = torch.nan_to_num(logits).to(torch.float16)
    assert gumbel_sample_native(logits, rows).tolist() == gumbel_sample_reference(logits, rows).tolist()


def test_tiny_temperatures():
    """1 / t overflows for a subnormal t: the kernel computes every key there, no bound."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 1e-38
    rows = torch.from_numpy(pack_rows([1, 2, 3, 4], [0, 1, 2, 3], [1e-40, 1e-30, 1e-45, 3e-39]))
    assert gumbel_sample_native(logits, rows).tolist() == gumbel_sample_reference(logits, rows).tolist()
