"""The GPU runner: decode steps replayed from CUDA graphs, and steps run one ahead of their tokens.

A pure decode step (every request computes one token, no drafts, no prompt scoring) replays the
graph of its batch-size bucket (runners/cuda_graphs.py); anything else, or a model whose capture
failed, runs eagerly. BATCHRUN_CUDA_GRAPHS=0 turns the graphs off.

Steps run ahead (engine.async_scheduling). A synchronous step ends by copying its sampled tokens to
the host; only then does the host append them, check stops, schedule, pack and launch the next
step, and the GPU waits for all of that. Here a graphed decode step of plain requests (no grammar,
logprobs, prompt logprobs or speculation: each of those needs the previous token on the host
first) draws its tokens on the device and starts their copy into pinned memory: `execute` returns
a `PendingStep`. If the scheduler can hold the running requests' places (`Scheduler.can_hold_places`:
each of them took part, nobody would be admitted or preempted) and this runner can replay their
next step (`can_replay_next`), the engine schedules that step as if each request produced one token
and `execute_ahead` launches it with its input ids gathered on the device from the pending step's
token tensor; only then does the host wait for the pending step's tokens and do its bookkeeping
while the GPU computes. A reasoning request whose trace may force its next tokens (a spent
thinking budget, engine/reasoning.py) is not plain either: forced rows are masked on the host.

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

import os
from typing import Optional, Union

import torch

from batchrun.engine.block_table import BlockTables
from batchrun.engine.request import Request
from batchrun.engine.runners.base import ModelRunner
from batchrun.engine.runners.cuda_graphs import MAX_GRAPH_BATCH, Capture, DecodeGraphs, EagerReplay
from batchrun.engine.runners.outputs import ForwardOutput, PendingStep
from batchrun.engine.sampler import Sampler
from batchrun.engine.scheduler import ScheduledBatch, StepResult
from batchrun.engine.speculative import DraftProbs
from batchrun.model.decoder import DecoderLM
from batchrun.model.generic import GenericLM


def is_plain(req: Request) -> bool:
    """Whether the request's next token needs nothing of its last one on the host."""
    return (
        req.grammar is None
        and req.params.logprobs is None
        and req.prompt_logprobs is None
        and (req.thinking is None or req.thinking.runs_blind)  # no forced token now or next (engine/reasoning.py)
    )


class GpuRunner(ModelRunner):
    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        block_tables: Optional[BlockTables] = None,
        batch_invariant: bool = False,
        sampler: Optional[Sampler] = None,
        max_model_len: Optional[int] = None,
    ) -> None:
        """ModelRunner's; the graphs' block tables are max_model_len wide."""
        super().__init__(
            model,
            num_blocks,
            block_size,
            dtype,
            device,
            kv_cache_dtype,
            block_tables,
            batch_invariant,
            sampler,
            max_model_len,
        )
        self._set_up(MAX_GRAPH_BATCH, None)

    @classmethod
    def stand_in(cls, runner: ModelRunner, max_batch: int, capture: Optional[Capture] = None) -> GpuRunner:
        """This runner's code on the CPU over `runner`'s model, cache tensors, block tables and
        sampler: graphs whose "capture" is `capture` (default `EagerReplay`: a replay runs the step
        again), no pinned memory, no CUDA events. Tests and the benchmarks' --smoke put it in place
        of an engine's runner, so the graph path and steps run ahead run where CUDA cannot."""
        gpu = cls.__new__(cls)
        gpu.__dict__.update(runner.__dict__)  # the same tensors and sampler, not copies
        gpu._set_up(max_batch, capture or EagerReplay)
        return gpu

    def _set_up(self, max_batch: int, capture: Optional[Capture]) -> None:
        self.is_stand_in = capture is not None
        self.graphs = None
        # Not when batch-invariant: the graphs replay the decode kernel, whose splits follow the batch.
        # Not in a tensor-parallel group: a replay would run rank 0's part without shipping the step
        # to the followers, so rank 0 decides once that every step of a group runs eagerly.
        in_group = getattr(self.model, "tp", None) is not None
        # Not on the generic path (model/generic.py): transformers' modules are not captured. Not with
        # LoRA adapters (ModelRunner.use_lora): a replay would not apply the step's adapters.
        eager = self.batch_invariant or in_group or isinstance(self.model, GenericLM) or self.lora is not None
        if os.environ.get("BATCHRUN_CUDA_GRAPHS", "1") != "0" and not eager:
            max_blocks = -(-self.max_model_len // self.block_size)
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, self.block_size, max_blocks, self.device, self.dtype, max_batch, capture
            )
            self.graphs.host_tables = self.block_tables
        # Two token buffers, used in turn: a step's tokens land in one while the step before it is
        # read from the other. Sized to the largest graph bucket when the first step needs them.
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    @torch.inference_mode()
    def forward(
        self, batch: ScheduledBatch, num_layers: Optional[int] = None, num_computed: Optional[list[int]] = None
    ) -> ForwardOutput:
        """A full decode step replays its bucket's graph where it can; anything else runs eagerly."""
        graphs = self.graphs
        # A one-token prefill chunk looks like a decode; the graphs score no prompt tokens.
        if (
            graphs is not None
            and num_layers is None
            and num_computed is None
            and not any(r.prompt_logprobs is not None for r in batch.requests)
            and graphs.can_run(batch)
        ):
            graphed = graphs.execute(batch)
            if graphed is not None:
                logits, sample_seq_ids = graphed
                return ForwardOutput(logits, sample_seq_ids, [1] * len(sample_seq_ids), graphed=True)
        return super().forward(batch, num_layers, num_computed)

    def execute(self, batch: ScheduledBatch, drafts: Optional[DraftProbs] = None) -> Union[StepResult, PendingStep]:
        """As ModelRunner's; with run_ahead a graphed decode step of plain requests leaves its
        tokens on the device (a PendingStep) instead."""
        assert self.step_sampler is not None, "a runner built without the engine's sampler only runs forwards"
        self.step_sampler.start_masks(batch)
        out = self.forward(batch)
        reqs = batch.requests
        if self.run_ahead and out.graphed and len(out.sample_seq_ids) == len(reqs) and all(map(is_plain, reqs)):
            return self._read_back(batch, out.logits)
        return self.step_sampler.sample(batch, out, drafts)

    def can_replay_next(self, requests: list[Request]) -> bool:
        """Whether the decode step after the one in flight (each request one token further) can be
        launched ahead and replayed: run_ahead on, graphs that work, a bucket and table width for it."""
        graphs = self.graphs
        if not self.run_ahead or graphs is None or graphs.is_broken or not 0 < len(requests) <= graphs.max_batch:
            return False
        width = -(-(max(r.num_computed_tokens for r in requests) + 2) // self.block_size)  # in flight + next
        return width <= graphs.block_tables.shape[1]

    @torch.inference_mode()
    def execute_ahead(self, batch: ScheduledBatch, previous: PendingStep) -> PendingStep:
        """A decode step (scheduled on held places) whose input ids are `previous`'s tokens, still
        on the device: request i's id is previous.tokens[previous.rows[seq_id]]. Its own tokens are
        left on the device too. If its bucket's capture fails, the ids are read to the host and the
        step runs eagerly."""
        graphs = self.graphs
        assert graphs is not None and graphs.can_run(batch)
        rows = [previous.rows[r.seq_id] for r in batch.requests]
        graphed = graphs.execute(batch, token_source=(previous.tokens, rows))
        if graphed is not None:
            logits = graphed[0]
        else:  # the graphs could not take it (a capture failed): the eager step reads ids on the host
            tokens = previous.wait()
            for req, row in zip(batch.requests, rows):
                req.token_ids[-1] = tokens[row]
            logits = super().forward(batch).logits
        return self._read_back(batch, logits)

    def _read_back(self, batch: ScheduledBatch, logits: torch.Tensor) -> PendingStep:
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
        if not self.is_stand_in:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
            ready.record()
        return PendingStep(batch, tokens, host, ready, {r.seq_id: i for i, r in enumerate(reqs)})

    def _buffer(self, num_rows: int) -> torch.Tensor:
        size = max(num_rows, self.graphs.max_batch if self.graphs is not None else 0)
        if not self._buffers or self._buffers[0].shape[0] < size:
            self._buffers = [torch.empty(size, dtype=torch.int64, pin_memory=not self.is_stand_in) for _ in range(2)]
        self._turn ^= 1
        return self._buffers[self._turn][:num_rows]
