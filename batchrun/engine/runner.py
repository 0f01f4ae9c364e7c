"""Runs one scheduled batch through the model: flattened inputs in, last-position logits out."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchrun.engine.scheduler import ScheduledBatch
from batchrun.kernels.attention import AttentionMetadata
from batchrun.model.decoder import DecoderLM


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # (num_sampled, vocab_size) float32, one row per request in `sample_seq_ids`
    sample_seq_ids: list[int]  # seq_id of each request whose token list was fully computed this step


def kv_bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype) -> int:
    s = model.spec
    return 2 * s.num_layers * block_size * s.num_kv_heads * s.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        s = model.spec
        shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(s.num_layers)
        ]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        bs = self.block_size
        starts = np.array([r.num_computed_tokens for r in batch.requests], dtype=np.int64)
        lens = np.array(batch.num_new_tokens, dtype=np.int64)
        ends = starts + lens
        query_start_loc = np.concatenate([[0], np.cumsum(lens)])
        num_tokens = int(query_start_loc[-1])
        # positions: for every token, its index in its own sequence (vectorized ranges)
        seq_of_token = np.repeat(np.arange(len(lens)), lens)
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], lens) + np.repeat(starts, lens)
        input_ids = np.fromiter(
            (t for r, s, e in zip(batch.requests, starts, ends) for t in r.token_ids[s:e]),
            dtype=np.int64, count=num_tokens,
        )
        max_blocks = max(len(r.block_ids) for r in batch.requests)
        block_tables = np.zeros((len(lens), max_blocks), dtype=np.int64)
        for i, r in enumerate(batch.requests):
            block_tables[i, : len(r.block_ids)] = r.block_ids
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        is_decode = lens == 1
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
        )
        # Rows to sample: requests whose whole token list is computed after this step.
        done = [i for i, r in enumerate(batch.requests) if ends[i] == r.num_tokens]
        logits_rows = [int(query_start_loc[i + 1]) - 1 for i in done]
        sample_seq_ids = [batch.requests[i].seq_id for i in done]
        return (torch.from_numpy(input_ids).to(self.device), torch.from_numpy(positions).to(self.device),
                meta, logits_rows, sample_seq_ids)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        input_ids, positions, meta, logits_rows, sample_seq_ids = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # (num_tokens, hidden_size)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return RunnerOutput(logits=logits.cpu(), sample_seq_ids=sample_seq_ids)
