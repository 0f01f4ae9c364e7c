"""KV block pool and the per-request block bookkeeping, with a hashed prefix cache.

Everything here is ints, lists and numpy arrays: no tensors, so it is testable on its own. A full
block is keyed by a hash chained over the token ids of every block before it, so two requests that
share the first N full blocks of tokens share those blocks. A request with a LoRA adapter starts its
chain from the adapter's key (its name and files' hash) instead, so requests of different adapters,
or of an adapter and the base model, never share KV. Blocks no request holds stay cached until
they are needed, and are then evicted least recently freed first.

Work per step is proportional to what changed, not to context length: a request's block ids are
mirrored into a persistent row of `block_tables` as blocks are attached, and only blocks that
became full since the last step are hashed and published.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Optional

from batchrun.engine.block_table import NO_ROW, BlockTables
from batchrun.engine.request import Request


def hash_block(parent_hash: Optional[int], token_ids: Sequence[int]) -> int:
    """The key of a full block: its tokens and (through the parent) every token before them."""
    return hash((parent_hash, tuple(token_ids)))


def adapter_key(name: str, fingerprint: str) -> int:
    """The parent of the first block of an adapter's requests: a changed adapter file is new KV."""
    return hash(("lora", name, fingerprint))


class BlockPool:
    """Fixed set of block ids with ref counts, a free queue in eviction order and a hash index."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks, first = next to hand out. Blocks without a hash go first so that cached
        # content is evicted only when nothing else is free.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free), f"asked for {n} blocks with {len(self.free)} free"
        out = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            h = self.block_hash[block_id]
            if h is not None:  # evict its cached content
                del self.hash_to_block[h]
                self.block_hash[block_id] = None
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def lookup(self, h: int) -> Optional[int]:
        return self.hash_to_block.get(h)

    def touch(self, block_id: int) -> None:
        """Take one more reference on a cached block, pulling it out of the free queue."""
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def register(self, block_id: int, h: int) -> None:
        """Record a full block's hash so later requests can reuse it."""
        if self.block_hash[block_id] is not None or h in self.hash_to_block:
            return  # already cached (here or in an identical block computed concurrently)
        self.block_hash[block_id] = h
        self.hash_to_block[h] = block_id

    def forget_free_blocks(self) -> int:
        """Drop the cached content of every block no request holds; return how many had some."""
        dropped = [block_id for block_id in self.free if self.block_hash[block_id] is not None]
        for block_id in dropped:
            h = self.block_hash[block_id]
            assert h is not None
            del self.hash_to_block[h]
            self.block_hash[block_id] = None
        return len(dropped)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; the given order is the eviction order among them."""
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} released twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
                if self.block_hash[block_id] is None:
                    self.free.move_to_end(block_id, last=False)


class KVCacheManager:
    """Gives requests the blocks they need, reusing cached prefix blocks when enabled."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        adapter_fingerprints: Optional[Mapping[str, str]] = None,
    ) -> None:
        """`adapter_fingerprints`: engine.lora_adapters' names -> the sha256 of their files."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.peak_used_blocks = 0
        self.num_lookup_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens found cached
        self.block_tables = BlockTables()  # a row per request holding blocks, read by the runner
        # adapter name -> the hash its requests' chains start from (adapter_key)
        self.adapter_keys = {name: adapter_key(name, fp) for name, fp in (adapter_fingerprints or {}).items()}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _full_block_hashes(self, req: Request, num_tokens: int) -> list[int]:
        """Chained hashes of the full blocks among the first num_tokens tokens (memoized)."""
        self._extend_hashes(req, num_tokens // self.block_size)
        return req.block_hashes[: num_tokens // self.block_size]

    def _extend_hashes(self, req: Request, num_full_blocks: int) -> None:
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else (None if req.adapter is None else self.adapter_keys[req.adapter])
            hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs]))

    def _attach(self, req: Request, block_ids: list[int]) -> None:
        if req.table_row == NO_ROW:
            req.table_row = self.block_tables.acquire()
        self.block_tables.append(req.table_row, block_ids)
        req.block_ids.extend(block_ids)

    def match_prefix(self, req: Request) -> int:
        """At first admission: attach the longest cached chain of full blocks; return tokens reused.

        At least the last prompt token is always recomputed, since its logits are needed.
        """
        assert not req.block_ids and req.num_computed_tokens == 0
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return 0  # a request scoring its prompt needs the logits of every prompt position
        hashes = self._full_block_hashes(req, req.num_tokens - 1)
        cached = []
        for h in hashes:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            self.pool.touch(block_id)
            cached.append(block_id)
        if cached:
            self._attach(req, cached)
        req.num_committed_blocks = len(cached)  # found through their hashes: published already
        num_cached = len(cached) * self.block_size
        req.num_computed_tokens = num_cached
        self._note_peak()
        return num_cached

    def fork_prefix(self, req: Request, source: Request) -> int:
        """Give a sibling sample of `source` (same prompt, not yet admitted) a reference on each of
        source's computed full prompt blocks; return the tokens shared.

        Works with the prefix cache off too. Shared blocks are never written again: every request
        writes only past its computed tokens, and the last prompt token is always left to recompute
        (its logits are needed), so the partially filled block a sample writes to is its own.
        """
        assert not req.block_ids and req.num_computed_tokens == 0
        assert req.prompt_token_ids == source.prompt_token_ids
        num_blocks = min(source.num_computed_tokens, req.num_prompt_tokens - 1) // self.block_size
        shared = source.block_ids[:num_blocks]
        for block_id in shared:
            self.pool.touch(block_id)
        if shared:
            self._attach(req, shared)
        # What source published to the prefix cache is published for the sibling too.
        req.num_committed_blocks = min(num_blocks, source.num_committed_blocks)
        req.num_computed_tokens = num_blocks * self.block_size
        return req.num_computed_tokens

    def record_admission(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count a first admission's prefix-cache outcome (retries and recomputes are not lookups)."""
        self.num_lookup_tokens += num_prompt_tokens
        self.num_hit_tokens += num_cached_tokens

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        return need <= self.pool.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of req; False (and no change) if it can't."""
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(req.block_ids)
        if need <= 0:  # most steps of a decode: its last block still has room
            return True
        if need > self.pool.num_free_blocks:
            return False
        self._attach(req, self.pool.allocate(need))
        self._note_peak()
        return True

    def commit_computed(self, req: Request) -> None:
        """After a step: publish the blocks that became full and computed to the prefix cache.

        Blocks published in earlier steps are not visited again; a computed count never falls
        while a request holds its blocks (rejected drafts are never counted as computed), so
        `num_committed_blocks` only grows until `free` resets it.
        """
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_committed_blocks or not self.enable_prefix_caching:
            return
        self._extend_hashes(req, num_full)
        block_ids, hashes = req.block_ids, req.block_hashes
        for i in range(req.num_committed_blocks, num_full):
            self.pool.register(block_ids[i], hashes[i])
        req.num_committed_blocks = num_full

    def free(self, req: Request) -> None:
        # Tail blocks first into the queue: they are the least likely to be shared, so evict them first.
        self.pool.release(list(reversed(req.block_ids)))
        req.block_ids = []
        req.num_committed_blocks = 0
        if req.table_row != NO_ROW:
            self.block_tables.release(req.table_row)
            req.table_row = NO_ROW

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget cached blocks no request holds (a benchmark repeats a workload from cold)."""
        return self.pool.forget_free_blocks()

    def reset_peak(self) -> None:
        self.peak_used_blocks = self.pool.num_used_blocks
