"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model is dozens of tiny kernels per layer; launching them one by one from
Python costs more than running them. So a pure decode step (every request computes one token, no
drafts) is padded up to a bucket size and replayed from a graph captured once for that bucket.

Inputs live in a static device buffer the graphs were captured on. For a bucket of B rows the host
packs into a pinned buffer B token ids, B positions, B cache slots and B sequence lengths (each
position + 1), then the block tables (B, width), width the step's widest; the step starts with one
host-to-device copy of exactly those bytes. The first four are read in place: a bucket's graph was
captured on views of the device buffer at those offsets, so no kernel unpacks them. Only the
tables, whose row stride (width) changes from step to step, are copied on the device into the
(max_batch, max_blocks_per_seq) table the graphs read: one kernel per step. The step's output
(the final norm's hidden states) stays where the graph wrote it: the tensor the capture returned,
held per bucket, which keeps its block in the graphs' pool from being reused.
Padding rows repeat the last real row: they recompute the same K/V into the same slot and their
outputs are dropped, so padding needs no special case in any kernel or in the torch reference.

Graphs are captured lazily, the first time a bucket is seen, with that step's real inputs already in
the buffers (so the eager warm-up run before the capture computes the real step: writing the same
K/V twice is harmless). `capture_all` captures every bucket up front with dummy rows whose cache
slot is -1 (skipped by the Triton KV writes and by an int8/fp8 cache's torch write), so it is safe
at any time on the GPU. Float, int8 and fp8 caches capture alike: on the GPU all three take the
Triton kernels, which never sync with the host (kernels/attention.py).

Only `DecodeGraphs(..., capture=...)` knows about CUDA: the CPU tests pass `EagerReplay`, which
"replays" by running the step again, and so exercise the buckets, padding, packing and buffers (a
stand-in capture: no pinned memory and no CUDA events). The GPU runner (runners/gpu.py) owns them.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch

from batchrun.engine.block_table import NO_ROW, BlockTables, tables_from_lists
from batchrun.engine.request import Request
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.quant.kv import QuantizedKVCache

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512  # decode batches above this run eagerly (nano-vllm's limit too)
NUM_FIXED = 4  # packed arrays before the block tables: token ids, positions, slots, sequence lengths

Capture = Callable[[Callable[[], None], Any], Any]  # (step, pool) -> object with .replay()


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def pick_bucket(buckets: list[int], num_seqs: int) -> Optional[int]:
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


def packed_views(flat: np.ndarray, bucket: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(fixed (NUM_FIXED, bucket), tables (bucket, width)): the packed layout of one step's inputs
    in the first bucket * (NUM_FIXED + width) entries of `flat`."""
    split = NUM_FIXED * bucket
    return flat[:split].reshape(NUM_FIXED, bucket), flat[split : split + bucket * width].reshape(bucket, width)


def pack_decode_inputs(
    requests: list[Request],
    block_size: int,
    fixed: np.ndarray,
    tables: np.ndarray,
    block_tables: Optional[BlockTables] = None,
    token_rows: Optional[Sequence[int]] = None,
) -> list[int]:
    """Fill fixed (NUM_FIXED, bucket) with the requests' token ids, positions, slots and sequence
    lengths (position + 1), and tables (bucket, width) with their block tables, width the widest;
    padded to the bucket by repeating the last request. Block ids come from the KV manager's
    persistent rows when every request holds one, else from the requests' lists. `token_rows`: the
    input ids are still on the device (a step launched ahead): the ids' row holds, per request, the
    row of the device tensor its id is gathered from instead. Returns the batch indices of the
    requests that sample."""
    n = len(requests)
    bucket = fixed.shape[1]
    assert 0 < n <= bucket and tables.shape[0] == bucket
    positions = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=n)
    if token_rows is not None:
        fixed[0, :n] = token_rows
    else:
        fixed[0, :n] = np.fromiter((r.token_ids[r.num_computed_tokens] for r in requests), dtype=np.int64, count=n)
    fixed[1, :n] = positions
    rows = np.fromiter((r.table_row for r in requests), dtype=np.int64, count=n)
    if block_tables is not None and rows.min() != NO_ROW:
        tables[:n] = block_tables.gather(rows)  # (n, widest), 0-padded as the runner pads them
    else:
        tables[:n] = tables_from_lists([r.block_ids for r in requests])
    fixed[2, :n] = tables[np.arange(n), positions // block_size] * block_size + positions % block_size
    fixed[3, :n] = positions + 1
    fixed[:, n:] = fixed[:, n - 1 : n]
    tables[n:] = tables[n - 1]
    # A one-token chunk of a prompt is a decode-shaped step too, but samples nothing yet.
    return [i for i, r in enumerate(requests) if r.num_computed_tokens + 1 >= r.num_tokens]


class EagerReplay:
    """The CPU stand-in for a captured graph: replaying runs the step again on the same buffers."""

    def __init__(self, step: Callable[[], None], pool: Any = None) -> None:
        self.step = step

    def replay(self) -> None:
        self.step()


def capture_cuda_graph(step: Callable[[], None], pool: Any) -> torch.cuda.CUDAGraph:
    step()  # warm-up: compiles the Triton kernels and settles the allocator before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph


class DecodeGraphs:
    # The KV manager's persistent block tables, set by the runner; None: packed from the requests' lists.
    host_tables: Optional[BlockTables] = None

    def __init__(
        self,
        model: Any,
        kv_caches: Sequence[tuple[Union[torch.Tensor, QuantizedKVCache], ...]],  # one (K, V) pair per layer
        block_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        dtype: torch.dtype,
        max_batch: int = MAX_GRAPH_BATCH,
        capture: Optional[Capture] = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = max_batch
        self.capture = capture or capture_cuda_graph
        # A capture given is a stand-in on the CPU (EagerReplay): no pinned memory, no CUDA events.
        self.is_stand_in = capture is not None
        pin = not self.is_stand_in
        # One step's packed inputs (`packed_views`), flat so one copy moves exactly the bytes used:
        # (max_batch * (NUM_FIXED + max_blocks_per_seq),), pinned on the host, and where they land.
        self.host = torch.zeros(max_batch * (NUM_FIXED + max_blocks_per_seq), dtype=torch.int64, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.staged = torch.zeros_like(self.host, device=device)
        # The static block tables the graphs read, and the sequence index of each row.
        self.seq_ids = torch.arange(max_batch, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.int64, device=device)
        # Per bucket: the step's output (bucket, hidden_size), where its graph writes it.
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.pool: Any = None
        self.copied: Optional[torch.cuda.Event] = None
        self.is_broken = False  # a capture failed (some layer syncs with the host): run eagerly from then on

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (
            not self.is_broken
            and 0 < len(batch.requests) <= self.max_batch
            and not batch.spec_token_ids
            and all(n == 1 for n in batch.num_new_tokens)
            and max(len(r.block_ids) for r in batch.requests) <= self.block_tables.shape[1]
        )

    def _inputs(self, bucket: int) -> torch.Tensor:
        """(NUM_FIXED, bucket): a bucket's token ids, positions, slots and sequence lengths, read in
        place from the upload."""
        return self.staged[: NUM_FIXED * bucket].view(NUM_FIXED, bucket)

    def _step_fn(self, bucket: int) -> Callable[[], None]:
        input_ids, positions, slot_mapping, seq_lens = self._inputs(bucket)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=list(range(bucket + 1)),
            seq_lens=[1] * bucket,  # read only by prefill code, which a decode step never reaches
            block_tables=self.block_tables[:bucket],
            block_size=self.block_size,
            decode_seq_ids=self.seq_ids[:bucket],
            decode_seq_lens=seq_lens,
            prefill_seq_ids=[],
        )

        def step() -> None:
            meta._memo.clear()  # the torch path memoizes masks from values; a replay has new values
            # On a GPU the last call is the capture's: its output is where every replay writes.
            self.outputs[bucket] = self.model(input_ids, positions, self.kv_caches, meta)

        return step

    def _upload(self, bucket: int, width: int) -> None:
        """One host-to-device copy of the packed inputs, then the block tables into the static table."""
        n = bucket * (NUM_FIXED + width)
        self.staged[:n].copy_(self.host[:n], non_blocking=True)
        if not self.is_stand_in:
            self.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
            self.copied.record()
        self.block_tables[:bucket, :width].copy_(self.staged[NUM_FIXED * bucket : n].view(bucket, width))

    def _graph(self, bucket: int) -> Any:
        if bucket not in self.graphs:
            graph = self.capture(self._step_fn(bucket), self.pool)
            if self.pool is None and hasattr(graph, "pool"):
                self.pool = graph.pool()  # every bucket shares one memory pool: replays never overlap
            self.graphs[bucket] = graph
        return self.graphs[bucket]

    def execute(
        self, batch: ScheduledBatch, token_source: Optional[tuple[torch.Tensor, Sequence[int]]] = None
    ) -> Optional[tuple[torch.Tensor, list[int]]]:
        """(logits (num_sampled, vocab) float32 on the device, seq_ids of the sampled requests), or
        None when the step must run eagerly instead. `token_source` = (tokens (m,) int64 on the
        device, per request its row there): the input ids are taken from those rows on the device
        (the previous step's tokens, not yet read by the host; runners/gpu.py)."""
        requests = batch.requests
        bucket = pick_bucket(self.buckets, len(requests))
        assert bucket is not None
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's upload has left the pinned buffer
        width = max(len(r.block_ids) for r in requests)
        fixed, tables = packed_views(self.host_np, bucket, width)
        rows = token_source[1] if token_source is not None else None
        sample = pack_decode_inputs(requests, self.block_size, fixed, tables, self.host_tables, rows)
        self._upload(bucket, width)
        if token_source is not None:
            # The uploaded ids' row holds source rows (padding repeats the last): gathered in
            # place, padding rows get the last row's id as in a host-packed step.
            self.model.kernels.gather_in_place(self.staged[:bucket], token_source[0])
        try:
            graph = self._graph(bucket)
        except Exception as exc:  # noqa: BLE001 - any failed capture means: this model cannot be graphed
            log.warning("CUDA graph capture failed for decode batch %d (%s); decoding eagerly from now on", bucket, exc)
            self.is_broken = True
            return None
        graph.replay()
        n = len(requests)
        out = self.outputs[bucket]  # (bucket, hidden_size)
        hidden = out[:n] if len(sample) == n else out[torch.tensor(sample, device=self.device)]
        logits = self.model.compute_logits(hidden)
        return logits, [requests[i].seq_id for i in sample]

    def _fill_dummy_rows(self, bucket: int) -> None:
        """Inputs for capturing a bucket without a real step: token 0 at position 0 of block 0, slot -1."""
        input_ids, positions, slot_mapping, seq_lens = self._inputs(bucket)
        input_ids.zero_()
        positions.zero_()
        slot_mapping.fill_(-1)
        seq_lens.fill_(1)
        self.block_tables[:, 0] = 0

    @torch.inference_mode()
    def capture_all(self, max_batch: Optional[int] = None) -> None:
        """Capture every bucket up to max_batch now (GPU only): dummy rows write nothing (slot -1)
        and read block 0."""
        assert not self.is_stand_in, "capture_all relies on the Triton KV writes skipping slot -1"
        limit = pick_bucket(self.buckets, min(max_batch or self.max_batch, self.max_batch))
        assert limit is not None, "the buckets end at self.max_batch"
        for bucket in reversed([b for b in self.buckets if b <= limit]):  # largest first: the rest fit in its pool
            if bucket not in self.graphs:
                self._fill_dummy_rows(bucket)
                self._graph(bucket)
        # engine.async_scheduling's id gather (one variant): compiled now, not in a timed step
        self.model.kernels.gather_in_place(self.staged[:1].zero_(), self.seq_ids)
        torch.cuda.synchronize()
