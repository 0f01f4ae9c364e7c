"""The runner seam: one scheduled batch in, the tokens it produced out.

`ModelRunner` holds the KV cache tensors and runs a batch through the model (`prepare` flattens it,
`forward` gives the last-position logits of every request that samples), then samples inside
(`execute`: grammar masks, draft verification and the sampler, runners/sampling.py) and returns a
`StepResult` per step: per request its tokens, logprobs, prompt logprobs and grammar failures, on
the host. The CPU runner (runners/cpu.py) is this synchronous step. The GPU runner
(runners/gpu.py) replays decode steps from CUDA graphs and, with engine.async_scheduling, leaves a
step's tokens on the device (a `PendingStep`) while the next step is launched ahead of them.

`forward` alone is what the start-up profile, warm-up, the drafter and calibration run.

With LoRA adapters (`use_lora`), every forward, a draft pass of the first layers included, tells
the slots which adapter each of its tokens uses (`LoraSlots.set_step`) before the model runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch

from batchrun.engine.block_table import NO_ROW, BlockTables, tables_from_lists
from batchrun.engine.request import Request
from batchrun.engine.runners.cuda_graphs import DecodeGraphs
from batchrun.engine.runners.outputs import ForwardOutput, PendingStep
from batchrun.engine.runners.sampling import StepSampler
from batchrun.engine.sampler import Sampler
from batchrun.engine.scheduler import ScheduledBatch, StepResult
from batchrun.engine.speculative import DraftProbs
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.kv_layout import new_kv_cache
from batchrun.kernels.quant.kv import KV_CACHE_DTYPES, QuantizedKVCache, kv_bytes_per_token_head
from batchrun.model.decoder import DecoderLM

if TYPE_CHECKING:
    from batchrun.model.lora import LoraSlots

log = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 256  # prompt positions whose logits are materialized at once (prompt_logprobs)


def kv_bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    s = model.spec
    if kv_cache_dtype != "auto":
        # int8/fp8 entries plus one float32 scale per token and head: about half of bf16.
        per_head = kv_bytes_per_token_head(s.head_dim, KV_CACHE_DTYPES[kv_cache_dtype])
        return 2 * s.num_layers * block_size * s.num_kv_heads * per_head
    return 2 * s.num_layers * block_size * s.num_kv_heads * s.head_dim * torch.finfo(dtype).bits // 8


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[dict[int, float]]:
    """Per row of `logits` (num_rows, vocab_size): {its token: logprob} plus the top-`top_n`, from
    the raw (unscaled) distribution in float32; the same numbers as the sampler's logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (num_rows, vocab_size)
    token_ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
    chosen = lp.gather(1, token_ids[:, None]).squeeze(1).tolist()
    top_vals, top_idx = torch.topk(lp, min(top_n, lp.shape[-1]), dim=-1)
    vals, idx = top_vals.tolist(), top_idx.tolist()
    return [{token: chosen[i], **dict(zip(idx[i], vals[i]))} for i, token in enumerate(tokens)]


class ModelRunner:
    """The common base of the runners: the KV cache tensors, a batch's forward and its sampled step."""

    # The KV manager's persistent block tables (engine/block_table.py); None: rebuilt every step.
    block_tables: Optional[BlockTables] = None
    # engine.batch_invariant: attention metadata lists every sequence as a prefill (prepare)
    batch_invariant: bool = False
    # The GPU runner's decode graphs (runners/cuda_graphs.py); None: every step runs eagerly.
    graphs: Optional[DecodeGraphs] = None
    # engine.async_scheduling: a step may leave its tokens on the device for one launched ahead (the
    # GPU runner's graphed decode steps; the CPU runner's tokens reach the host in every step).
    run_ahead: bool = False
    # engine.lora_adapters: the resident adapters' slots (model/lora.py); None: no adapter, no cost.
    lora: Optional[LoraSlots] = None

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
        """`sampler`: the engine's (None: a runner that only runs `forward`, as calibration's);
        `max_model_len`: the longest request the engine admits (default: the cache's capacity)."""
        self.model = model
        self.batch_invariant = batch_invariant
        self.block_tables = block_tables
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.dtype = dtype  # activations' and a float cache's dtype
        self.max_model_len = max_model_len or num_blocks * block_size
        # The step's grammar masks, draft verification and sampler; None without a sampler.
        self.step_sampler = StepSampler(sampler) if sampler is not None else None
        s = model.spec
        shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
        self.kv_caches: list[tuple[Union[torch.Tensor, QuantizedKVCache], ...]]  # one (K, V) pair per layer
        if kv_cache_dtype != "auto":
            kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
            self.kv_caches = [
                tuple(QuantizedKVCache.empty(shape, kv_dtype, dtype, device) for _ in range(2))
                for _ in range(s.num_layers)
            ]
        else:
            self.kv_caches = [
                (new_kv_cache(*shape, dtype=dtype, device=device), new_kv_cache(*shape, dtype=dtype, device=device))
                for _ in range(s.num_layers)
            ]

    @property
    def sampler(self) -> Sampler:
        assert self.step_sampler is not None, "a runner built without the engine's sampler only runs forwards"
        return self.step_sampler.sampler

    def for_draft(self, model: DecoderLM) -> ModelRunner:
        """A runner of the same kind for a draft model, which only runs forwards: its own float
        cache under the same block ids (one block table serves both caches)."""
        return type(self)(
            model,
            self.num_blocks,
            self.block_size,
            self.dtype,
            self.device,
            block_tables=self.block_tables,
            max_model_len=self.max_model_len,
        )

    def use_lora(self, slots: LoraSlots) -> None:
        """Serve LoRA adapters over these slots. Decode graphs are dropped: a replay runs the
        kernels its capture saw, not the step's per-token adapter rows."""
        self.lora = slots
        if self.graphs is not None:
            log.info(
                "CUDA graphs are off, and with them engine.async_scheduling's steps ahead: engine.lora_adapters "
                "is set (a step's adapter rows run eagerly)"
            )
            self.graphs = None

    def token_slots(self, batch: ScheduledBatch) -> torch.Tensor:
        """(num_tokens,) int64 on the host (the slots split it into rows per slot there, then move
        the indices): each token's adapter slot (-1: the base model), in the order `prepare` lays
        the tokens out (each request's new tokens, its drafts included)."""
        assert self.lora is not None
        slot_of = self.lora.slot_of
        per_request = [-1 if r.adapter is None else slot_of(r.adapter) for r in batch.requests]
        assert None not in per_request, "a running request's adapter holds a slot (the scheduler pins it)"
        return torch.from_numpy(np.repeat(np.array(per_request, dtype=np.int64), batch.num_new_tokens))

    def prepare(
        self, batch: ScheduledBatch, num_computed: Optional[list[int]] = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int], list[int]]:
        """Flatten a batch; `num_computed` overrides each request's start (used by draft passes).

        Per request only its scalars are read (and its new tokens' ids); everything else is numpy over
        the whole batch, and block tables come from the KV manager's persistent rows, so the cost of
        a step does not grow with context length."""
        bs = self.block_size
        reqs = batch.requests
        n = len(reqs)
        start_list = num_computed if num_computed is not None else [r.num_computed_tokens for r in reqs]
        starts = np.array(start_list, dtype=np.int64)  # (num_seqs,)
        lens = np.array(batch.num_new_tokens, dtype=np.int64)  # (num_seqs,)
        num_real = np.array([len(r.token_ids) for r in reqs], dtype=np.int64)  # (num_seqs,) tokens without drafts
        ends = starts + lens
        query_start_loc = np.zeros(n + 1, dtype=np.int64)  # (num_seqs + 1,)
        np.cumsum(lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if num_tokens == n and not batch.spec_token_ids:  # one real token per request: no ranges to expand
            seq_of_token = np.arange(n)
            positions = starts
            input_ids = np.array([r.token_ids[i] for r, i in zip(reqs, start_list)], dtype=np.int64)  # (num_tokens,)
        else:
            seq_of_token = np.repeat(np.arange(n), lens)  # (num_tokens,)
            # for every token, its index in its own sequence (vectorized ranges)
            positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - starts, lens)
            input_ids = self._chunk_token_ids(batch, start_list, ends.tolist(), num_tokens)
        block_tables = self._block_tables(reqs)  # (num_seqs, widest table), 0-padded
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        # Batch-invariant: every sequence takes the prefill kernels, whose per-row result does not
        # depend on its query length (a decode, a verification block or a prompt chunk alike).
        is_decode = (lens == 1) & (not self.batch_invariant)
        decode_ids = np.nonzero(is_decode)[0]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
            query_start_loc=query_start_loc.tolist(),
            seq_lens=ends.tolist(),
            block_tables=torch.from_numpy(block_tables).to(self.device),
            block_size=bs,
            decode_seq_ids=torch.from_numpy(decode_ids).to(self.device),
            decode_seq_lens=torch.from_numpy(ends[decode_ids]).to(self.device),
            prefill_seq_ids=np.nonzero(~is_decode)[0].tolist(),
            batch_invariant=self.batch_invariant,
        )
        # Rows to sample: requests whose real tokens are all computed after this step; from the row
        # of the last real token to the end of the request's rows (its drafts).
        sampled = np.nonzero(ends >= num_real)[0]  # (num_sampled,) batch indices
        first = query_start_loc[sampled] + np.maximum(0, num_real[sampled] - 1 - starts[sampled])
        num_rows = query_start_loc[sampled + 1] - first  # (num_sampled,)
        # each sampled request's rows first[i] .. first[i] + num_rows[i] - 1, back to back
        offsets = np.repeat(first - (np.cumsum(num_rows) - num_rows), num_rows)
        logits_rows = offsets + np.arange(int(num_rows.sum()))
        return (
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(positions).to(self.device),
            meta,
            logits_rows.tolist(),
            [reqs[i].seq_id for i in sampled.tolist()],
            num_rows.tolist(),
        )

    def _block_tables(self, reqs: list[Request]) -> np.ndarray:
        """(num_seqs, widest) int64 tables: the persistent rows of KV-managed requests, else rebuilt
        from the requests' lists (the start-up profile's and tests' hand-made requests)."""
        if self.block_tables is not None:
            rows = np.array([r.table_row for r in reqs], dtype=np.int64)  # (num_seqs,)
            if rows.min() != NO_ROW:
                return self.block_tables.gather(rows)
        return tables_from_lists([r.block_ids for r in reqs])

    @staticmethod
    def _chunk_token_ids(batch: ScheduledBatch, starts: list[int], ends: list[int], num_tokens: int) -> np.ndarray:
        """(num_tokens,) int64: each request's tokens start..end, drafts past its real tokens."""
        spec = batch.spec_token_ids
        chunks = []
        for r, s_, e in zip(batch.requests, starts, ends):
            chunk = r.token_ids[s_:e]
            if e > r.num_tokens:  # past the real tokens: the drafts carried this step
                chunk = chunk + spec[r.seq_id][max(s_, r.num_tokens) - r.num_tokens : e - r.num_tokens]
            chunks.append(chunk)
        return np.fromiter((t for c in chunks for t in c), dtype=np.int64, count=num_tokens)

    def execute(self, batch: ScheduledBatch, drafts: Optional[DraftProbs] = None) -> Union[StepResult, PendingStep]:
        """Run the step and sample it: the tokens every request whose token list this step computed
        produces (`drafts`: the distributions sampled drafts were drawn from, for verification).
        Grammar masks are filled while the forward runs (runners/sampling.py)."""
        assert self.step_sampler is not None, "a runner built without the engine's sampler only runs forwards"
        self.step_sampler.start_masks(batch)
        return self.step_sampler.sample(batch, self.forward(batch), drafts)

    def can_replay_next(self, requests: list[Request]) -> bool:
        """Whether the decode step after the one in flight, of these requests one token further,
        can be launched before its tokens are read (the GPU runner's graphs; never here)."""
        return False

    def execute_ahead(self, batch: ScheduledBatch, previous: PendingStep) -> PendingStep:
        """Run a decode step whose input ids are `previous`'s tokens, still on the device."""
        raise NotImplementedError("only the GPU runner leaves tokens on the device")

    @torch.inference_mode()
    def forward(
        self, batch: ScheduledBatch, num_layers: Optional[int] = None, num_computed: Optional[list[int]] = None
    ) -> ForwardOutput:
        """The logits of the batch's sampling requests (and the prompt logprobs it asks for);
        `num_layers` and `num_computed` make a draft pass of the first layers (self-speculation)."""
        input_ids, positions, meta, logits_rows, sample_seq_ids, num_rows = self.prepare(batch, num_computed)
        if self.lora is None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, num_layers)  # (num_tokens, hidden_size)
        else:
            self.lora.set_step(self.token_slots(batch))
            try:
                hidden = self.model(input_ids, positions, self.kv_caches, meta, num_layers)
            finally:
                self.lora.clear_step()
        sampled_hidden = hidden  # (num_sampled_rows, hidden_size); `hidden` stays whole for prompt logprobs
        if len(logits_rows) < hidden.shape[0]:  # rows ascend and are distinct: equal length means all
            rows = torch.tensor(logits_rows, dtype=torch.long, device=hidden.device)
            sampled_hidden = hidden.index_select(0, rows)
        logits = self.model.compute_logits(sampled_hidden)
        is_full_step = num_layers is None and num_computed is None
        return ForwardOutput(
            logits=logits,
            sample_seq_ids=sample_seq_ids,
            num_rows=num_rows,
            prompt_logprobs=self._prompt_logprobs(batch, hidden, meta.query_start_loc) if is_full_step else {},
        )

    def _prompt_logprobs(
        self, batch: ScheduledBatch, hidden: torch.Tensor, query_start_loc: list[int]
    ) -> dict[int, tuple[int, list[dict[int, float]]]]:
        """Logprobs of the prompt tokens this step computed the predecessors of, for requests that
        ask; positions already scored (before a preemption) are not scored again."""
        out: dict[int, tuple[int, list[dict[int, float]]]] = {}
        for i, r in enumerate(batch.requests):
            if r.prompt_logprobs is None:
                continue
            start = r.num_computed_tokens
            first = max(start, len(r.prompt_logprobs))  # position j's logits score prompt token j + 1
            end = min(start + batch.num_new_tokens[i], r.num_prompt_tokens - 1)
            if first >= end:
                continue
            offset = query_start_loc[i] - start
            entries: list[dict[int, float]] = []
            for lo in range(first, end, PROMPT_LOGITS_ROWS):  # bounds the (rows, vocab) logits in memory
                hi = min(lo + PROMPT_LOGITS_ROWS, end)
                chunk = self.model.compute_logits(hidden[offset + lo : offset + hi])  # (hi - lo, vocab_size)
                targets = r.prompt_token_ids[lo + 1 : hi + 1]
                entries.extend(token_logprobs(chunk, targets, r.params.prompt_logprobs or 0))
            out[r.seq_id] = (first, entries)
        return out
