"""Runs one scheduled batch through the model: flattened inputs in, last-position logits out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from batchrun.engine.block_table import NO_ROW, BlockTables, tables_from_lists
from batchrun.engine.cuda_graphs import DecodeGraphs, cuda_graphs_enabled
from batchrun.engine.request import Request
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.kv_layout import new_kv_cache
from batchrun.kernels.quant.kv import KV_CACHE_DTYPES, QuantizedKVCache, kv_bytes_per_token_head
from batchrun.model.decoder import DecoderLM

PROMPT_LOGITS_ROWS = 256  # prompt positions whose logits are materialized at once (prompt_logprobs)


@dataclass
class RunnerOutput:
    # (num_rows, vocab_size) float32 on the model's device (the sampler, the drafter and verification
    # all work there; only token ids come back): per request in `sample_seq_ids`, the row of its last
    # real token followed by one row per draft token it carried (1 + num_spec rows)
    logits: torch.Tensor
    sample_seq_ids: list[int]  # seq_id of each request whose token list was fully computed this step
    num_rows: list[int]  # rows of `logits` per request in sample_seq_ids
    # Requests scoring their prompt (SamplingParams.prompt_logprobs): seq_id -> (index of the first
    # prompt token scored this step minus one, per scored token {token_id: logprob} of it and the top-N)
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    graphed: bool = False  # replayed from a CUDA graph (engine/cuda_graphs.py)


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
    # The KV manager's persistent block tables (engine/block_table.py); None: rebuilt every step.
    block_tables: Optional[BlockTables] = None
    # engine.batch_invariant: attention metadata lists every sequence as a prefill (prepare)
    batch_invariant: bool = False

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
    ) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.block_tables = block_tables
        self.block_size = block_size
        self.device = device
        self.dtype = dtype  # activations' and a float cache's dtype
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
        # GPU only: pure decode steps replay CUDA graphs (engine/cuda_graphs.py); None on CPU. Not
        # when batch-invariant: the graphs replay the decode kernel, whose splits follow the batch.
        self.graphs: Optional[DecodeGraphs] = None
        if cuda_graphs_enabled(device) and not batch_invariant:
            max_blocks = min(num_blocks, -(-s.max_position_embeddings // block_size))
            self.graphs = DecodeGraphs(model, self.kv_caches, block_size, max_blocks, device, dtype)
            self.graphs.host_tables = block_tables

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

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, num_layers: Optional[int] = None, num_computed: Optional[list[int]] = None
    ) -> RunnerOutput:
        is_full_step = num_layers is None and num_computed is None
        # A one-token prefill chunk looks like a decode; the graphs score no prompt tokens.
        scores_prompt = any(r.prompt_logprobs is not None for r in batch.requests)
        if self.graphs is not None and is_full_step and not scores_prompt and self.graphs.can_run(batch):
            graphed = self.graphs.execute(batch)
            if graphed is not None:
                logits, sample_seq_ids = graphed
                return RunnerOutput(
                    logits=logits,
                    sample_seq_ids=sample_seq_ids,
                    num_rows=[1] * len(sample_seq_ids),
                    graphed=True,
                )
        input_ids, positions, meta, logits_rows, sample_seq_ids, num_rows = self.prepare(batch, num_computed)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, num_layers)  # (num_tokens, hidden_size)
        sampled_hidden = hidden  # (num_sampled_rows, hidden_size); `hidden` stays whole for prompt logprobs
        if len(logits_rows) < hidden.shape[0]:  # rows ascend and are distinct: equal length means all
            rows = torch.tensor(logits_rows, dtype=torch.long, device=hidden.device)
            sampled_hidden = hidden.index_select(0, rows)
        logits = self.model.compute_logits(sampled_hidden)
        return RunnerOutput(
            logits=logits,
            sample_seq_ids=sample_seq_ids,
            num_rows=num_rows,
            prompt_logprobs=self._prompt_logprobs(batch, hidden, meta.query_start_loc) if is_full_step else {},
        )

    @torch.inference_mode()
    def execute_ahead(self, batch: ScheduledBatch, tokens: torch.Tensor, rows: list[int]) -> Optional[RunnerOutput]:
        """A decode step whose input ids are still on the device: request i's id is tokens[rows[i]]
        (the previous step's sampled tokens). Graph replay only; None when the graphs cannot take
        the step (a failed capture), and then the caller must put the ids on the host and `execute`."""
        assert self.graphs is not None and self.graphs.can_run(batch)
        graphed = self.graphs.execute(batch, token_source=(tokens, rows))
        if graphed is None:
            return None
        logits, sample_seq_ids = graphed
        return RunnerOutput(logits=logits, sample_seq_ids=sample_seq_ids, num_rows=[1] * len(rows), graphed=True)

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
