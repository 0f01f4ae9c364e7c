"""The start-up batch-limit profile (engine/profiler.py) on injected step rates: a size measured
slower per token than a smaller size contradicts its neighbours and is timed again before it is
believed (a shared machine only ever slows a step). Nothing here is timed."""

from __future__ import annotations

from batchrun.engine import profiler


class _Runner:
    def forward(self, batch):  # the profile's warm-up step
        pass


def _script(monkeypatch, rates: dict[tuple[str, int], list[float]]) -> list[tuple[str, int]]:
    """Patch the profile's timed step: each (kind, size) returns its rates in turn (the last one
    again past the end). Returns the log of the steps timed."""
    timed: list[tuple[str, int]] = []

    def rate(runner, batch):
        new = batch.num_new_tokens
        key = ("prefill", new[0]) if len(new) == 1 and new[0] > 1 else ("decode", len(new))
        timed.append(key)
        queue = rates[key]
        r = queue.pop(0) if len(queue) > 1 else queue[0]
        return r, batch.num_tokens / r

    monkeypatch.setattr(profiler, "_rate", rate)
    return timed


def _limits(**given):
    # room for every profiled size: 256 sequences of 1.5 x 257 tokens, a 4096-token chunk
    return profiler.pick_batch_limits(_Runner(), 8192, 16, 8192, given.get("seqs"), given.get("tokens"))


def test_a_larger_batch_measured_slower_is_timed_again_and_the_faster_rate_believed(monkeypatch):
    timed = _script(
        monkeypatch,
        {
            ("decode", 1): [10.0],
            ("decode", 8): [60.0],
            ("decode", 16): [100.0],
            ("decode", 32): [50.0, 150.0],  # slower than 16 (a descheduled step), then its real rate
            ("decode", 64): [160.0],
            ("decode", 128): [100.0, 110.0, 105.0],  # past the knee: slower every time, so believed
            ("decode", 256): [1.0],
        },
    )
    limits = _limits(tokens=4096)
    assert limits.profile["decode_tok_s"] == {1: 10.0, 8: 60.0, 16: 100.0, 32: 150.0, 64: 160.0, 128: 110.0}
    assert timed.count(("decode", 32)) == 2  # timed again once: the second rate no longer contradicts
    assert timed.count(("decode", 128)) == 1 + profiler.RECHECKS  # believed after every recheck
    assert ("decode", 256) not in timed  # the profile ended at 128, past the knee
    # 90% of the best (160) first reached at 32; believing the first 50 would have ended the profile
    # there and picked 16
    assert limits.max_num_seqs == 32


def test_a_longer_chunk_measured_slower_is_timed_again_before_it_ends_the_prefill_profile(monkeypatch):
    timed = _script(
        monkeypatch,
        {
            ("prefill", 256): [10000.0],
            ("prefill", 512): [8000.0, 13000.0],  # 8000 believed would have ended the profile (< 90% of 10000)
            ("prefill", 1024): [14000.0],
            ("prefill", 2048): [9000.0, 9500.0, 10000.0],  # attention's cost: slower each time, believed
            ("prefill", 4096): [1.0],
            **{("decode", b): [10.0 * b] for b in profiler.DECODE_SIZES},
        },
    )
    limits = _limits(seqs=8)
    assert limits.profile["prefill_tok_s"] == {256: 10000.0, 512: 13000.0, 1024: 14000.0, 2048: 10000.0}
    assert timed.count(("prefill", 512)) == 2 and timed.count(("prefill", 2048)) == 3
    assert ("prefill", 4096) not in timed
    assert limits.max_num_batched_tokens == 1024  # the smallest within 95% of the best (14000)


def test_a_rate_at_least_its_smaller_neighbours_is_believed_at_once(monkeypatch):
    timed = _script(monkeypatch, {("decode", b): [float(b)] for b in profiler.DECODE_SIZES})
    _limits(tokens=4096)
    assert len(timed) == len(set(timed))  # every size timed once
