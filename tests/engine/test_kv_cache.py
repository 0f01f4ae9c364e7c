"""Block pool and KV manager: exact block ids, ref counts, prefix reuse and LRU eviction."""

from __future__ import annotations

import pytest

from batchrun.engine.config import SamplingParams
from batchrun.engine.kv_cache import BlockPool, KVCacheManager, hash_block
from batchrun.engine.request import Request

P = SamplingParams(temperature=0.0)


def req(seq_id: int, tokens: list[int]) -> Request:
    return Request(seq_id, seq_id, tokens, P, 0.0)


def test_pool_allocates_in_order_and_reuses_uncached_blocks_first():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    pool.register(1, 111)
    pool.release([2, 1, 0])  # 2 and 0 are uncached: they go to the front of the free queue
    assert list(pool.free) == [0, 2, 3, 4, 5, 1]
    assert pool.allocate(5) == [0, 2, 3, 4, 5]
    assert pool.lookup(111) == 1  # still cached while free
    assert pool.allocate(1) == [1]  # the last free block: its cached content is evicted
    assert pool.lookup(111) is None and pool.num_evictions == 1


def test_pool_refcounts_and_double_release():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.touch(b)
    pool.release([b])
    assert pool.ref_counts[b] == 1 and pool.num_free_blocks == 1
    pool.release([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.release([b])


def test_allocate_grows_by_blocks_and_refuses_without_partial_change():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    r = req(0, list(range(10)))
    assert kv.allocate(r, 10) and r.block_ids == [0, 1, 2]
    r.num_computed_tokens = 10
    assert kv.allocate(r, 2) and r.block_ids == [0, 1, 2]  # 12 tokens still fit in 3 blocks
    assert kv.allocate(r, 3) and r.block_ids == [0, 1, 2, 3]
    other = req(1, [1, 2])
    assert not kv.allocate(other, 2) and other.block_ids == []
    kv.free(r)
    assert kv.pool.num_free_blocks == 4 and r.block_ids == []
    assert kv.peak_used_blocks == 4


def test_prefix_cache_shares_full_blocks_and_recomputes_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req(0, list(range(10)))  # blocks: [0..3] [4..7] [8,9]
    assert kv.match_prefix(a) == 0
    assert kv.allocate(a, 10) and a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.commit_computed(a)  # two full blocks become cached
    b = req(1, list(range(8)) + [50, 51, 52])
    assert kv.match_prefix(b) == 8
    assert b.block_ids == [0, 1] and kv.pool.ref_counts[0] == 2
    # exactly one block long and fully cached: the last token must still be computed
    c = req(2, list(range(4)))
    assert kv.match_prefix(c) == 0
    # a different first block breaks the chain even if the second block's tokens match
    d = req(3, [99, 1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.match_prefix(d) == 0
    assert hash_block(None, [0, 1, 2, 3]) != hash_block(hash_block(None, [9]), [0, 1, 2, 3])


def test_cached_blocks_survive_free_and_are_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = req(0, [1, 2, 3, 4, 5])
    kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.commit_computed(a)
    kv.free(a)  # blocks 0,1 cached, 2 uncached
    assert list(kv.pool.free) == [2, 3, 1, 0]
    b = req(1, [1, 2, 3, 4, 9])
    assert kv.match_prefix(b) == 4 and b.block_ids == [0, 1]
    kv.free(b)
    e = req(2, [7, 7, 7, 7, 7, 7, 7])
    assert kv.allocate(e, 7) and e.block_ids == [2, 3, 1, 0]  # uncached first, then LRU cached (1 before 0)
    assert kv.pool.lookup(hash_block(None, [1, 2])) is None


def test_disabled_prefix_cache_never_matches():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = req(0, [1, 2, 3, 4, 5])
    kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.commit_computed(a)
    kv.free(a)
    assert kv.match_prefix(req(1, [1, 2, 3, 4, 5])) == 0
