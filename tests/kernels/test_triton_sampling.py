"""The GPU's sampling kernels (kernels/triton_sampling.py) in Triton's interpreter.

The Gumbel race (kernels/sampling.py) picks the same tokens as its torch reference (mixed greedy and
sampled rows, ties, NaN and -inf logits, thresholds, bf16 and strided logits, seeds past 2**63,
positions near 2**31, a vocabulary not a multiple of the block), greedy rows are exactly argmax,
the int32 hash equals the int64 one, and the reference's frequencies follow the masked softmax. The
spilled rows' top-p thresholds are the host's, bit for bit (wide nuclei, ties, -inf, top-k ties
past the candidates). Sampler.draw on the GPU dispatch path (simulated sm_90) reads no device
value on the host for any kind of batch (tests/support/host_sync.py) and picks the CPU path's tokens, and
what one Sampler.sample issues there is counted (one Triton launch for a temperature batch, one
upload, no host sync but the tokens' copy). On a GPU (`-m gpu`): greedy rows exact, sampled rows
the reference's, the spill thresholds the host's, and the engine sampler's frequencies follow the
masked softmax.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.engines import make_tiny_engine
from tests.support.interpreted import interpreted_and_on_gpu, report_cases

pytest.importorskip("triton")

_SEEDS = [1, -5, 2**63 + 7, 3, 4, 2**40, 0, 9, 2**64 - 1, 11, 12, 13]
_POSITIONS = [0, 1, 2, 3, 100, 5, 2**31 - 1, 7, 8, 9, 10, 11]
_TEMPS = [0.7, 1.0, 0.0, 0.0, 0.5, 1.3, 0.6, 0.0, 2.0, 0.9, 0.3, 1.0]

CASES: dict[str, dict[str, Any]] = {
    "mixed-float32": dict(dtype="float32", vocab=3000),
    "mixed-float32-threshold": dict(dtype="float32", vocab=3000, threshold=True),
    "mixed-bfloat16-strided": dict(dtype="bfloat16", vocab=2500, strided=True, threshold=True),
    "tiny-vocab": dict(dtype="float32", vocab=5),
    "one-token": dict(dtype="float32", vocab=1),
    "sampler-ops": dict(op="ops"),
    "engine-seeded": dict(op="engine"),
    "gather-in-place": dict(op="gather"),
    "engine-async": dict(op="engine-async"),
    "spill-thresholds": dict(op="spill"),
    "no-host-sync": dict(op="no-sync"),
}


def _inputs(spec: dict[str, Any], device: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    from batchrun.kernels.sampling import pack_rows

    vocab = spec["vocab"]
    rows = len(_SEEDS)
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(rows, vocab + 7, generator=g) * 2
    logits = wide[:, 3 : 3 + vocab] if spec.get("strided") else wide[:, :vocab].contiguous()
    if vocab >= 10:
        logits[3, 5] = logits[3, 9] = 100.0  # a greedy row with a tie: the first index
        logits[7] = 1.0  # a greedy row all tied: index 0
        logits[4, 7] = float("nan")  # a sampled row with a NaN: the first NaN, as argmax
        logits[2, 1] = float("nan")  # a greedy row with a NaN
        logits[1, : vocab // 2] = float("-inf")  # half a sampled row masked (a grammar's -inf)
        logits[5, 2] = float("inf")
    logits = logits.to(device, getattr(torch, spec["dtype"]))
    packed = torch.from_numpy(pack_rows(_SEEDS, _POSITIONS, _TEMPS)).to(device)
    threshold = None
    if spec.get("threshold"):
        s = logits.float() / torch.tensor(_TEMPS, device=device).clamp_min(1e-9)[:, None]
        threshold = torch.full((rows,), float("-inf"), device=device)
        for row, k in ((0, 6), (6, 1), (9, 40), (11, vocab // 2)):
            threshold[row] = s[row].sort(descending=True).values[k - 1]
    return logits, packed, threshold


def _check_kernel(spec: dict[str, Any], device: str) -> None:
    from batchrun.kernels.sampling import gumbel_sample_reference
    from batchrun.kernels.triton_sampling import gumbel_sample

    logits, packed, threshold = _inputs(spec, device)
    want = gumbel_sample_reference(logits, packed, threshold)
    got = gumbel_sample(logits, packed, threshold)
    greedy = [i for i, t in enumerate(_TEMPS) if t == 0.0]
    assert got[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist(), "greedy rows are argmax"
    assert got.tolist() == want.tolist(), (got.tolist(), want.tolist())
    if threshold is not None:
        s = logits.float() / torch.tensor(_TEMPS, device=device).clamp_min(1e-9)[:, None]
        chosen = s.gather(1, got[:, None]).squeeze(1)
        masked = threshold > float("-inf")
        assert bool((chosen[masked] >= threshold[masked]).all()), "a token below its row's threshold"


def _check_ops() -> None:
    """Sampler.sample on CPU tensors taking the GPU path (the race a simulated sm_90's kernel set
    binds, kernels interpreted)."""
    from batchrun.engine.config import SamplingParams
    from batchrun.engine.sampler import Sampler
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import find_target
    from benchmarks.gpu_launches import SM90, count_launches

    kernels = bind_kernels(find_target("cpu", simulate=SM90), torch.float32)

    rows, vocab = 16, 1000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    seeds = [None if i % 3 else 100 + i for i in range(rows)]  # unseeded rows too (nano-vllm's workload)
    counts = {}
    for name, params in (
        ("greedy", SamplingParams(temperature=0.0)),
        ("temp0.6", SamplingParams(temperature=0.6)),
        ("truncated", SamplingParams(temperature=0.6, top_p=0.9, top_k=50)),
    ):
        with count_launches() as launches:
            Sampler(seed=1, race=kernels.sample, spill=kernels.spill).sample(
                logits, [params] * rows, seeds, list(range(rows))
            )
        counts[name] = launches
    print("OPS", {k: (dict(v.kernels), v.syncs) for k, v in counts.items()}, flush=True)
    # Greedy: one argmax, the tokens' copy back.
    assert dict(counts["greedy"].kernels) == {"aten:argmax": 1}, counts
    # Temperature: the race alone on the device. `randint` is the host generator's one call for the
    # unseeded rows' seeds (a CPU op on a GPU run too); the packed rows' upload is a copy only a CUDA
    # tensor makes, and the tokens' copy back is the step's one sync there (`tolist` of CPU tensors here).
    assert dict(counts["temp0.6"].kernels) == {"aten:randint": 1, "triton:_gumbel_sample_kernel": 1}, counts
    # top-k/top-p thresholds are torch ops (candidates, weights, prefix mass) and the spill kernel
    # (whose programs return at once where no row spilled) before the same race.
    truncated = counts["truncated"]
    assert truncated.kernels["triton:_gumbel_sample_kernel"] == 1 and truncated.total <= 40, truncated
    assert truncated.kernels["triton:_spill_threshold_kernel"] == 1, truncated


# Batch limits given (no start-up profile) and no warm-up: each would interpret whole steps.
INTERPRETED_ENGINE = dict(kv_cache_memory=4 << 20, max_num_seqs=4, max_num_batched_tokens=256, warmup=False)


def _check_engine() -> None:
    """The engine on the GPU path (a simulated sm_90's kernel set): a seeded sampled request gives the
    same tokens alone and in a batch with other seeded, unseeded and greedy requests, and every
    sampled step went through the race kernel."""
    import tempfile

    from batchrun import SamplingParams
    from batchrun.testing import make_tiny_model
    from benchmarks.gpu_launches import SM90, count_launches

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, "llama"))
        prompts = ["The quick brown fox", "Lists are mutable", "A tuple is", "Sets hold"]
        params = [
            SamplingParams(temperature=0.9, max_tokens=6, seed=7),
            SamplingParams(temperature=0.9, max_tokens=6),
            SamplingParams(temperature=0.0, max_tokens=6),
            SamplingParams(temperature=1.2, top_p=0.8, top_k=20, max_tokens=6, seed=3),
        ]
        with count_launches() as launches:
            engine = make_tiny_engine(model, simulate=SM90, **INTERPRETED_ENGINE)
            batched = [o.token_ids for o in engine.generate(prompts, params)]
            alone = [engine.generate([prompts[i]], params[i])[0].token_ids for i in (0, 3)]
        assert alone == [batched[0], batched[3]], (alone, batched)
        assert launches.kernels["triton:_gumbel_sample_kernel"] >= 6, launches.kernels


def _check_gather(device: str) -> None:
    """engine.async_scheduling's id gather: ids[i] = src[ids[i]] in place, rows repeated (padding),
    row counts across the kernel's block (1, 7, 128, 300), the same as index_select."""
    from batchrun.kernels.triton_sampling import gather_in_place

    g = torch.Generator().manual_seed(5)
    for n, m in ((1, 1), (7, 3), (128, 200), (300, 512)):
        src = torch.randint(0, 2**40, (m,), generator=g).to(device)
        rows = torch.randint(0, m, (n,), generator=g)
        rows[n // 2 :] = rows[n // 2]  # padding repeats one row
        ids = rows.to(device).clone()
        gather_in_place(ids, src)
        assert ids.tolist() == src.cpu()[rows].tolist(), n


def _check_engine_async() -> None:
    """engine.async_scheduling on the GPU path (a simulated sm_90's kernel set, stand-in graphs): the
    steps run ahead gather their ids with the one Triton launch, and greedy and seeded tokens are
    the synchronous engine's."""
    import tempfile

    from batchrun import SamplingParams
    from batchrun.engine.runners import GpuRunner
    from batchrun.testing import make_tiny_model
    from benchmarks.gpu_launches import SM90, count_launches

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, "llama"))
        prompts = ["The quick brown fox", "Lists are mutable", "A tuple is"]
        params = [
            SamplingParams(temperature=0.9, max_tokens=7, seed=7, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=1.2, top_p=0.8, top_k=20, max_tokens=6, seed=3, ignore_eos=True),
        ]
        outs = {}
        for on in (False, True):
            with count_launches() as launches:
                engine = make_tiny_engine(model, simulate=SM90, async_scheduling=on, **INTERPRETED_ENGINE)
                engine.runner = GpuRunner.stand_in(engine.runner, 4)
                outs[on] = [o.token_ids for o in engine.generate(prompts, params)]
            if on:
                num_ahead = engine.stats().num_async_steps
                assert num_ahead >= 4 and launches.kernels["triton:_gather_in_place_kernel"] == num_ahead, (
                    num_ahead,
                    launches.kernels,
                )
            else:
                assert "triton:_gather_in_place_kernel" not in launches.kernels
        assert outs[True] == outs[False], outs


def _check_spill(device: str) -> None:
    """The Triton spill kernel's thresholds equal the host's on every spilled row (V past the host's
    first width, so it widens; -0.0 and 0.0 are the same threshold), the rows not spilled keep
    theirs, and each is the documented mask's."""
    from batchrun.kernels.sampling import spill_thresholds_reference
    from batchrun.kernels.triton_sampling import spill_thresholds
    from tests.support.sampling import reference_keep

    vocab = 2500
    g = torch.Generator().manual_seed(7)
    rows = [  # (scaled logits, top_k (0: off), top_p)
        (torch.randn(vocab, generator=g) * 0.05, 0, 0.9),  # a nucleus of most of the row
        (torch.randn(vocab, generator=g) * 0.3, 0, 0.5),
        (torch.randint(-3, 3, (vocab,), generator=g).float(), 0, 0.7),  # ties at the edge
        (torch.zeros(vocab), 0, 0.3),  # all tied
        (torch.randn(vocab, generator=g) * 4, 0, 0.999999),  # a far tail
        (torch.cat([torch.full((vocab // 2,), float("-inf")), torch.randn(vocab - vocab // 2, generator=g)]), 0, 0.95),
        (torch.cat([torch.full((300,), 2.0), torch.randn(vocab - 300, generator=g)]), 200, 0.99),  # top-k ties
        (torch.cat([torch.full((300,), 2.0), torch.randn(vocab - 300, generator=g)]), 200, 0.3),
        (torch.randn(vocab, generator=g), 0, 0.9),  # not spilled: keeps its threshold
    ]
    s = torch.stack([r for r, _, _ in rows]).to(device)
    kth = torch.tensor(
        [float(torch.sort(r, descending=True).values[k - 1]) if k else float("-inf") for r, k, _ in rows]
    ).to(device)
    top_p = torch.tensor([p for _, _, p in rows], dtype=torch.float64, device=device)
    spill = torch.tensor([True] * (len(rows) - 1) + [False], device=device)
    threshold = torch.full((len(rows),), 1.25, device=device)
    want = spill_thresholds_reference(s, kth, top_p, spill, threshold)
    got = spill_thresholds(s, kth, top_p, spill, threshold)
    assert torch.equal(got.cpu(), want.cpu()), (got, want)
    assert got[-1].item() == 1.25
    for i, (r, k, p) in enumerate(rows[:-1]):  # the documented mask, sorted in float64
        assert torch.equal(r >= got[i].item(), reference_keep(r, k, p)), i


def _check_no_host_sync() -> None:
    """Sampler.draw on the GPU path (a simulated sm_90's kernel set: both Triton kernels) reads no
    device value on the host for any kind of batch, and picks the CPU path's tokens."""
    from batchrun.engine.sampler import Sampler
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import find_target
    from benchmarks.gpu_launches import SM90, count_launches
    from tests.support.host_sync import NoHostSync, opaque_triton_launches
    from tests.support.sampling import STEP_KINDS, step_logits

    gpu = bind_kernels(find_target("cpu", simulate=SM90), torch.float32)
    cpu = bind_kernels(find_target("cpu"), torch.float32)

    for kind, kinds in STEP_KINDS.items():
        for num_rows in (1, 7):
            logits = step_logits(num_rows)
            params = [kinds[i % len(kinds)] for i in range(num_rows)]
            seeds = [None if i % 4 == 3 else 50 + i for i in range(num_rows)]
            positions = [3 + i for i in range(num_rows)]
            mode = NoHostSync(logits)
            with count_launches() as launches, opaque_triton_launches(mode), mode:
                tokens = Sampler(3, race=gpu.sample, spill=gpu.spill).draw(logits, params, seeds, positions)
            is_sampled = any(not p.is_greedy for p in params)
            assert launches.kernels["triton:_gumbel_sample_kernel"] == is_sampled, (kind, launches)
            want = Sampler(3, race=cpu.sample, spill=cpu.spill).draw(logits, params, seeds, positions)
            assert tokens.tolist() == want.tolist(), (kind, num_rows)


def run_case(spec: dict[str, Any], device: str = "cpu") -> None:
    if spec.get("op") == "spill":
        return _check_spill(device)
    if spec.get("op") == "no-sync":
        return _check_no_host_sync()
    if spec.get("op") == "ops":
        return _check_ops()
    if spec.get("op") == "engine":
        return _check_engine()
    if spec.get("op") == "gather":
        return _check_gather(device)
    if spec.get("op") == "engine-async":
        return _check_engine_async()
    _check_kernel(spec, device)


def test_int32_hash_equals_the_int64_words():
    from batchrun.kernels.sampling import _mix32_, mix32

    words = torch.randint(0, 2**32, (100_000,), generator=torch.Generator().manual_seed(0))
    words[:4] = torch.tensor([0, 2**31, 2**32 - 1, 2**31 - 1])
    got = _mix32_(words.to(torch.int32)).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got, mix32(words))
    assert len(set(mix32(words).tolist())) == len(set(words.tolist()))  # a bijection


def test_reference_greedy_rows_are_argmax_and_sampled_rows_keep_their_draw():
    from batchrun.kernels.sampling import gumbel_sample_reference, pack_rows

    spec = dict(dtype="float32", vocab=700, threshold=True)
    logits, packed, threshold = _inputs(spec, "cpu")
    got = gumbel_sample_reference(logits, packed, threshold)
    greedy = [i for i, t in enumerate(_TEMPS) if t == 0.0]
    assert got[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist()
    assert got[4] == 7 and got[2] == 1  # the first NaN, sampled row or greedy
    # A row alone draws what it drew in the batch; another seed or position draws otherwise somewhere.
    for row in (0, 5, 9, 11):
        alone = gumbel_sample_reference(logits[row : row + 1], packed[:, row : row + 1], threshold[row : row + 1])
        assert alone.item() == got[row]
    row = 10
    others = {
        gumbel_sample_reference(logits[row : row + 1], torch.from_numpy(pack_rows([s], [p], [1.0]))).item()
        for s, p in ((1, 0), (2, 0), (1, 1), (1, 2), (3, 3), (4, 4))
    }
    assert len(others) > 2


@pytest.mark.parametrize(
    "params",
    [dict(temperature=0.7), dict(temperature=0.7, top_p=0.9, top_k=8), dict(temperature=1.3, top_p=0.6)],
    ids=["temperature", "top-k-top-p", "top-p"],
)
def test_race_frequencies_follow_the_masked_softmax(params):
    """The race over the sampler's thresholds draws from `sampling_probs`: one logits row at 30,000
    positions."""
    from batchrun.engine.config import SamplingParams
    from batchrun.engine.sampler import sampling_probs, thresholds
    from batchrun.kernels.sampling import gumbel_sample_reference, pack_rows, spill_thresholds_reference
    from tests.support.sampling import chi2, chi2_critical

    sp = SamplingParams(**params)
    logits = torch.randn(24, generator=torch.Generator().manual_seed(3)) * 1.5
    n = 30_000
    rows = torch.from_numpy(pack_rows([11] * n, list(range(n)), [sp.temperature] * n))
    s = logits[None].float() / torch.tensor([sp.temperature])[:, None]
    threshold = thresholds(s, [sp.top_k], [sp.top_p], spill_thresholds_reference) if sp.top_k or sp.top_p < 1 else None
    tokens = gumbel_sample_reference(logits.expand(n, -1), rows, None if threshold is None else threshold.expand(n))
    counts = torch.bincount(tokens, minlength=24)
    want = sampling_probs(logits, sp)
    assert counts[want == 0].sum() == 0, "a token outside the kept set"
    stat, df = chi2(counts, want)
    assert stat < chi2_critical(df), (params, stat, df)


# On a GPU the kernel cases compiled: log may differ from torch's in its last bit, so greedy rows
# are exact and the sampled rows the reference's but where two race keys are that close (none in
# these cases); exp may too, which moves a spilled row's threshold only where a mass is that close
# to its limit (none here).
test_triton_sampling_interpreted, test_triton_sampling_on_gpu = interpreted_and_on_gpu(
    CASES,
    lambda spec: run_case(spec, "cuda"),
    gpu_cases={c: spec for c, spec in CASES.items() if spec.get("op") in (None, "gather", "spill")},
)


@pytest.mark.gpu
def test_kernel_frequencies_follow_the_masked_softmax_on_gpu():
    from batchrun.engine.config import SamplingParams
    from batchrun.engine.sampler import Sampler, sampling_probs
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import find_target
    from tests.support.sampling import chi2, chi2_critical

    kernels = bind_kernels(find_target("cuda"), torch.float32)
    sampler = Sampler(race=kernels.sample, spill=kernels.spill)
    logits = torch.randn(24, generator=torch.Generator().manual_seed(3)) * 1.5
    n = 30_000
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9, top_k=8)):
        tokens = sampler.draw(logits.cuda().expand(n, -1).contiguous(), [params] * n, [11] * n, list(range(n)))
        counts = torch.bincount(tokens.cpu(), minlength=24)
        want = sampling_probs(logits, params)
        assert counts[want == 0].sum() == 0
        stat, df = chi2(counts, want)
        assert stat < chi2_critical(df), (params, stat, df)


if __name__ == "__main__":
    report_cases(CASES, run_case)
