"""Decode steps launched before the previous step's tokens reach the host (engine.async_scheduling).

A synchronous step ends by copying its sampled tokens to the host; only then does the host append
them, check stops, schedule, pack and launch the next step, and the GPU waits for all of that. Here
a step runs ahead instead: the previous step's tokens stay on the device, the next step is
scheduled as if each of its requests produced one token (`Scheduler.hold_places`), its input ids
are gathered on the device from the previous step's token tensor (`DecodeGraphs.execute`'s
`token_source`), it is launched, and only then does the host wait for the previous step's tokens,
which were copied into pinned memory behind it, and do its bookkeeping while the GPU computes.

What runs ahead: a CUDA-graph decode step of plain requests (no grammar, logprobs, prompt
logprobs or speculation: each of those needs the previous token on the host first), when every
running request took part in the previous step, none would be admitted (nothing waits, the batch is
full, or engine.admission_min_slots holds them back: admitting comes first, in a synchronous
step), the step's budget holds them all, and the
free blocks cover every request's next slot, so scheduling it preempts nobody.

A request that ends at a step (a stop token, max_tokens, a stop string) is found out only after
the step ahead of it was launched: that step computes one more token for it, into a KV slot of a
block only it holds (never a published prefix block: those cover computed positions only), and the
token is dropped. So every request gets the synchronous engine's tokens wherever a row's result
does not depend on the rest of its batch (float32; in bf16 the extra row is a change of batch
composition, as any scheduling setting makes). Seeded sampling keys its draws on (seed, position),
so the extra row changes no other row's draw; an unseeded row's draw (hand-made requests only: the
engine seeds every sampled request) comes from the engine generator, which the extra rows advance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from batchrun.engine.request import Request
from batchrun.engine.runner import ModelRunner, RunnerOutput
from batchrun.engine.sampler import Sampler
from batchrun.engine.scheduler import ScheduledBatch, Scheduler


@dataclass
class InFlightStep:
    """A decode step whose tokens are on the device, on their way to the host."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # (num_seqs,) int64 on the device: row i is batch.requests[i]'s token
    host: torch.Tensor  # (num_seqs,) int64, pinned on a GPU: where the tokens are copied
    ready: Optional[torch.cuda.Event]  # recorded after the copy; None on a CPU (the copy is done)
    rows: dict[int, int] = field(default_factory=dict)  # seq_id -> its row of `tokens`
    held: bool = False  # a step ahead was scheduled from it: its requests' places are held

    def wait(self) -> list[int]:
        """The tokens on the host (waits for this step, not for the steps launched after it)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def is_plain(req: Request) -> bool:
    """Whether the request's next token needs nothing of its last one on the host."""
    return req.grammar is None and req.params.logprobs is None and req.prompt_logprobs is None


class AsyncSteps:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler  # the engine's (tests wrap it)
        self.num_ahead = 0  # steps launched before the previous step's tokens were read
        # Two buffers, used in turn: a step's tokens land in one while the step before it is read
        # from the other. Sized to the largest graph bucket when the first step needs them.
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def can_read_back(self, batch: ScheduledBatch, out: RunnerOutput) -> bool:
        """Whether a step just executed can leave its tokens on the device: a graphed decode step in
        which every request samples one plain token."""
        return (
            out.graphed and len(out.sample_seq_ids) == len(batch.requests) and all(is_plain(r) for r in batch.requests)
        )

    def read_back(self, batch: ScheduledBatch, logits: torch.Tensor) -> InFlightStep:
        """Draw the batch's tokens on the device (the same `Sampler.draw` as a synchronous step)
        and start their copy to the host."""
        reqs = batch.requests
        tokens = self.sampler.draw(
            logits,
            [r.params for r in reqs],
            [r.sample_seed for r in reqs],
            [len(r.token_ids) for r in reqs],  # the position of the token each row samples
        )
        host = self._buffer(tokens.shape[0])
        host.copy_(tokens, non_blocking=True)
        ready = None
        if tokens.is_cuda:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
            ready.record()
        return InFlightStep(batch, tokens, host, ready, {r.seq_id: i for i, r in enumerate(reqs)})

    def _buffer(self, num_rows: int) -> torch.Tensor:
        graphs = self.runner.graphs
        size = max(num_rows, graphs.max_batch if graphs is not None else 0)
        if not self._buffers or self._buffers[0].shape[0] < size:
            pin = torch.cuda.is_available() and self.runner.device.type == "cuda"
            self._buffers = [torch.empty(size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn ^= 1
        return self._buffers[self._turn][:num_rows]

    def can_run_ahead(self, cur: InFlightStep) -> bool:
        """Whether the step after `cur` can be scheduled and launched before cur's tokens are read
        (module doc): it would be a graphed decode step of exactly the running requests, every one
        of them in cur, admitting and preempting nobody."""
        graphs = self.runner.graphs
        running = self.scheduler.running
        n = len(running)
        if (
            graphs is None
            or graphs.is_broken
            or n == 0
            or n > graphs.max_batch
            or n > self.scheduler.config.max_num_batched_tokens
        ):
            return False
        if self.scheduler.admits_beside_decodes():
            return False  # a request would be admitted: that step runs synchronously
        kv = self.scheduler.kv
        need = width = 0
        for req in running:
            if req.seq_id not in cur.rows:
                return False
            blocks = kv.blocks_for(req.num_computed_tokens + 2)  # cur's token and the next one's slot
            need += max(0, blocks - len(req.block_ids))
            width = max(width, blocks)
        return need <= kv.pool.num_free_blocks and width <= graphs.block_tables.shape[1]

    def run_ahead(self, cur: InFlightStep) -> InFlightStep:
        """Schedule and launch the step after `cur` (can_run_ahead said it can) with its input ids
        gathered from cur's tokens on the device; return it, its tokens on their way to the host."""
        running = list(self.scheduler.running)
        self.scheduler.hold_places(running)
        cur.held = True
        batch = self.scheduler.schedule()
        assert batch.requests == running and not batch.preempted, "a step ahead schedules the running decodes"
        assert all(n == 1 for n in batch.num_new_tokens)
        rows = [cur.rows[r.seq_id] for r in running]
        out = self.runner.execute_ahead(batch, cur.tokens, rows)
        if out is None:  # the graphs could not take it (a capture failed): the eager step reads ids on the host
            tokens = cur.wait()
            for req, row in zip(running, rows):
                req.token_ids[-1] = tokens[row]
            out = self.runner.execute(batch)
        self.num_ahead += 1
        return self.read_back(batch, out.logits)
