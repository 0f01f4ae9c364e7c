"""Property tests of the block pool and KV manager under random request traffic (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from batchrun.engine.config import SamplingParams
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request

P = SamplingParams(temperature=0.0)

# An operation: (kind, request slot, prompt pattern, length)
ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "finish"]), st.integers(0, 5), st.integers(0, 2), st.integers(1, 40)),
    min_size=1,
    max_size=60,
)


def check_invariants(kv: KVCacheManager, live: dict[int, Request]) -> None:
    pool = kv.pool
    held: dict[int, int] = {}
    for r in live.values():
        assert len(set(r.block_ids)) == len(r.block_ids), "a request holds a block twice"
        for b in r.block_ids:
            held[b] = held.get(b, 0) + 1
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] >= 0
        assert pool.ref_counts[b] == held.get(b, 0), (
            f"block {b}: refcount {pool.ref_counts[b]} vs holders {held.get(b, 0)}"
        )
        assert (b in pool.free) == (pool.ref_counts[b] == 0), f"block {b} both free and in use (or neither)"
    for h, b in pool.hash_to_block.items():
        assert pool.block_hash[b] == h


@settings(max_examples=150, deadline=None)
@given(ops=ops, prefix=st.booleans(), block_size=st.sampled_from([2, 4, 8]))
def test_pool_invariants_hold_under_any_traffic(ops, prefix, block_size):
    kv = KVCacheManager(num_blocks=24, block_size=block_size, enable_prefix_caching=prefix)
    live: dict[int, Request] = {}
    next_id = 0
    for kind, slot, pattern, length in ops:
        if kind == "admit" and slot not in live:
            tokens = [pattern * 100 + (i % 7) for i in range(length)]  # patterns share prefixes
            r = Request(next_id, next_id, tokens, P, 0.0)
            next_id += 1
            held_before = {b for x in live.values() for b in x.block_ids}
            kv.match_prefix(r)
            if kv.allocate(r, r.num_tokens - r.num_computed_tokens):
                r.num_computed_tokens = r.num_tokens
                kv.commit_computed(r)
                live[slot] = r
                # eviction takes only blocks nobody held
                assert not (set(r.block_ids) - {b for b in r.block_ids if kv.pool.ref_counts[b] > 1}) & held_before
            else:
                kv.free(r)
        elif kind == "grow" and slot in live:
            r = live[slot]
            extra = [pattern] * (length % 9 + 1)
            if kv.allocate(r, len(extra)):
                r.token_ids.extend(extra)
                r.num_computed_tokens = r.num_tokens
                kv.commit_computed(r)
        elif kind == "finish" and slot in live:
            kv.free(live.pop(slot))
        check_invariants(kv, live)
    for r in list(live.values()):
        kv.free(r)
    check_invariants(kv, {})
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "every block comes back after all requests finish"
