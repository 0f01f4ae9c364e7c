"""The host path of a step does work proportional to what changed: persistent block tables and
incremental prefix-cache registration give exactly what rebuilding and re-registering everything
every step gives, under traffic with admission, growth, preemption, finishes and prefix-cache hits."""

from __future__ import annotations

import numpy as np
import torch

from batchrun.engine.block_table import NO_ROW, BlockTables, tables_from_lists
from batchrun.engine.config import SamplingParams
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request
from batchrun.engine.runners import ModelRunner
from batchrun.engine.runners.cuda_graphs import NUM_FIXED, pack_decode_inputs, packed_views
from batchrun.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, StepResult


class FullReregistration(KVCacheManager):
    """The reference: every step hashes and registers every full computed block of the request."""

    def commit_computed(self, req: Request) -> None:
        if self.enable_prefix_caching:
            for block_id, h in zip(req.block_ids, self._full_block_hashes(req, req.num_computed_tokens)):
                self.pool.register(block_id, h)


def _prompts(rng: np.random.Generator, num: int) -> list[list[int]]:
    """Prompts over three shared prefixes (so later admissions hit the prefix cache), varied tails."""
    prefixes = [rng.integers(0, 50, n).tolist() for n in (20, 33, 9)]
    return [prefixes[i % 3] + rng.integers(0, 50, int(rng.integers(1, 30))).tolist() for i in range(num)]


def _simulate(kv: KVCacheManager, seed: int, on_step) -> Scheduler:
    """Run 40 requests through a scheduler over `kv` with tokens drawn from the step count, calling
    on_step(sched, batch, is_scheduled) after each schedule() (True) and each update() (False)."""
    rng = np.random.default_rng(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48, max_model_len=96), kv)
    for i, prompt in enumerate(_prompts(rng, 40)):
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 60)))
        sched.add(Request(i, i, prompt, params, 0.0))
    step = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        on_step(sched, batch, True)
        sampled = {
            r.seq_id: [(r.seq_id * 7 + step) % 50]
            for r, n in zip(batch.requests, batch.num_new_tokens)
            if r.num_computed_tokens + n >= r.num_tokens
        }
        sched.update(StepResult(batch, sampled))
        on_step(sched, batch, False)
        step += 1
    return sched


def _check_tables(kv: KVCacheManager, sched: Scheduler) -> None:
    tables = kv.block_tables
    holders = [r for r in sched.running if r.block_ids]
    assert all(r.table_row == NO_ROW for r in sched.waiting), "a waiting request holds no blocks and no row"
    assert len({r.table_row for r in holders}) == len(holders) == tables.num_rows_used
    rows = np.array([r.table_row for r in holders], dtype=np.int64)
    if holders:
        got = tables.gather(rows)
        assert got.dtype == np.int64
        assert np.array_equal(got, tables_from_lists([r.block_ids for r in holders]))
    # rows nobody holds are all padding, so a row handed out next starts clean
    unused = np.setdiff1d(np.arange(tables.table.shape[0]), rows)
    assert not tables.table[unused].any() and not tables.num_blocks[unused].any()


def _reference_prepare(batch: ScheduledBatch, block_size: int) -> dict:
    """ModelRunner.prepare's outputs computed one request and one token at a time."""
    ids, pos, slots, rows, seq_ids, num_rows, qsl = [], [], [], [], [], [], [0]
    for r, n in zip(batch.requests, batch.num_new_tokens):
        for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
            ids.append(r.token_ids[p])
            pos.append(p)
            slots.append(r.block_ids[p // block_size] * block_size + p % block_size)
        if r.num_computed_tokens + n >= r.num_tokens:
            seq_ids.append(r.seq_id)
            rows.append(len(ids) - 1)
            num_rows.append(1)
        qsl.append(len(ids))
    return dict(input_ids=ids, positions=pos, slots=slots, rows=rows, seq_ids=seq_ids, num_rows=num_rows, qsl=qsl)


def test_persistent_block_tables_equal_rebuilt_ones_through_scheduler_traffic():
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=True)
    runner = ModelRunner.__new__(ModelRunner)  # prepare() needs only these
    runner.block_size, runner.device, runner.block_tables = 4, torch.device("cpu"), kv.block_tables
    rebuilt = ModelRunner.__new__(ModelRunner)
    rebuilt.block_size, rebuilt.device = 4, torch.device("cpu")
    seen = {"growth": 0, "decode_steps": 0}

    def on_step(sched: Scheduler, batch: ScheduledBatch, is_scheduled: bool) -> None:
        _check_tables(kv, sched)
        if not is_scheduled or batch.is_empty():  # empty: the only running request preempted itself
            return
        ids, pos, meta, rows, seq_ids, num_rows = runner.prepare(batch)
        ids2, pos2, meta2, rows2, seq_ids2, num_rows2 = rebuilt.prepare(batch)
        assert torch.equal(meta.block_tables, meta2.block_tables)
        assert torch.equal(meta.slot_mapping, meta2.slot_mapping)
        want = _reference_prepare(batch, 4)
        assert ids.tolist() == ids2.tolist() == want["input_ids"]
        assert pos.tolist() == pos2.tolist() == want["positions"]
        assert meta.slot_mapping.tolist() == want["slots"]
        assert meta.query_start_loc == want["qsl"]
        assert rows == rows2 == want["rows"]
        assert seq_ids == seq_ids2 == want["seq_ids"]
        assert num_rows == num_rows2 == want["num_rows"]
        seen["growth"] += sum(len(r.block_ids) > 1 for r in batch.requests)
        if all(n == 1 for n in batch.num_new_tokens):
            seen["decode_steps"] += 1
            width = max(len(r.block_ids) for r in batch.requests)
            bucket = len(batch.requests) + 1
            host = np.full(bucket * (NUM_FIXED + width), -7, dtype=np.int64)
            host2 = host.copy()
            sample = pack_decode_inputs(batch.requests, 4, *packed_views(host, bucket, width), kv.block_tables)
            from_lists = pack_decode_inputs(batch.requests, 4, *packed_views(host2, bucket, width))
            assert sample == from_lists == list(range(len(batch.requests)))
            assert np.array_equal(host, host2)

    sched = _simulate(kv, 0, on_step)
    assert sched.num_preemptions > 0, "the traffic must preempt"
    assert kv.num_hit_tokens > 0, "the traffic must hit the prefix cache"
    assert seen["growth"] > 0 and seen["decode_steps"] > 0
    assert kv.block_tables.num_rows_used == 0 and not kv.block_tables.table.any()


def test_incremental_registration_registers_what_full_reregistration_does():
    """Same traffic through the incremental manager and the re-register-everything reference: after
    every schedule and update the prefix cache (hash per block, block per hash) and every request's
    blocks are the same."""
    incremental = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=True)
    reference = FullReregistration(num_blocks=24, block_size=4, enable_prefix_caching=True)
    states: dict[str, list] = {"incremental": [], "reference": []}

    def recorder(name: str, kv: KVCacheManager):
        def on_step(sched: Scheduler, batch: ScheduledBatch, is_scheduled: bool) -> None:
            states[name].append(
                (
                    list(kv.pool.block_hash),
                    dict(kv.pool.hash_to_block),
                    {r.seq_id: list(r.block_ids) for r in sched.running},
                    list(kv.pool.free),
                )
            )

        return on_step

    a = _simulate(incremental, 1, recorder("incremental", incremental))
    b = _simulate(reference, 1, recorder("reference", reference))
    assert len(states["incremental"]) == len(states["reference"]) > 0
    for i, (got, want) in enumerate(zip(states["incremental"], states["reference"])):
        assert got == want, f"prefix cache differs after call {i}"
    assert a.num_preemptions == b.num_preemptions > 0
    assert incremental.num_hit_tokens == reference.num_hit_tokens > 0
    assert len(incremental.pool.hash_to_block) > 0


def test_commit_computed_hashes_only_blocks_filled_since_the_last_step(monkeypatch):
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    r = Request(0, 0, list(range(9)), SamplingParams(temperature=0.0), 0.0)
    assert kv.allocate(r, 9)
    registered: list[int] = []
    register = kv.pool.register
    monkeypatch.setattr(kv.pool, "register", lambda b, h: registered.append(b) or register(b, h))
    r.num_computed_tokens = 9
    kv.commit_computed(r)
    assert registered == r.block_ids[:2]  # two full blocks of the nine tokens
    for token in range(9, 40):  # decode: one token a step
        r.token_ids.append(token)
        assert kv.allocate(r, 1)
        r.num_computed_tokens += 1
        kv.commit_computed(r)
    assert registered == r.block_ids[:10], "each block registered once, when it became full"
    kv.free(r)
    assert r.num_committed_blocks == 0 and r.table_row == NO_ROW


def test_block_tables_grow_in_rows_and_width_and_reuse_released_rows():
    tables = BlockTables(num_rows=2, width=2)
    lists: dict[int, list[int]] = {}
    rng = np.random.default_rng(0)
    for _ in range(200):
        if lists and rng.random() < 0.2:
            row = int(rng.choice(list(lists)))
            tables.release(row)
            del lists[row]
        elif lists and rng.random() < 0.6:
            row = int(rng.choice(list(lists)))
            new = rng.integers(0, 1000, int(rng.integers(1, 5))).tolist()
            tables.append(row, new)
            lists[row] += new
        else:
            row = tables.acquire()
            assert row not in lists
            lists[row] = []
        assert tables.num_rows_used == len(lists)
        rows = np.array(sorted(lists), dtype=np.int64)
        if len(rows):
            assert np.array_equal(tables.gather(rows), tables_from_lists([lists[r] for r in rows.tolist()]))
    assert tables.table.shape[0] > 2 and tables.table.shape[1] > 2
