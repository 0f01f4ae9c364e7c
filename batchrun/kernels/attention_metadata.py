"""What one step's attention needs to know about its flattened batch (`AttentionMetadata`).

The batch holds sequences back to back with no padding: sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, which are the last `query_len` positions of its
`seq_len` tokens of context; its keys and values live in the cache blocks listed in its row of
`block_tables` (kernels/kv_layout.py). The derived index tensors are built once per step, by the
first layer that asks, and shared by the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

# Decodes that start with the same cached blocks (a shared system prompt or document) attend to
# that prefix once for all of them (AttentionMetadata.decode_groups, _decode_attend_shared).
MIN_SHARED_SEQS = 2
MIN_SHARED_TOKENS = 64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: list[int]  # (num_seqs + 1,) where each sequence's query rows start
    seq_lens: list[int]  # (num_seqs,) context length after this step, new tokens included
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int64, padded with 0
    block_size: int
    decode_seq_ids: torch.Tensor  # (num_decode,) indices of sequences with exactly one query token
    decode_seq_lens: torch.Tensor  # (num_decode,) int64 context lengths of those sequences
    prefill_seq_ids: list[int]  # sequences with more than one query token, attended one by one
    # engine.batch_invariant: every sequence is listed in prefill_seq_ids (none in decode_seq_ids)
    # and the kernels take a path whose per-row result does not depend on the other rows, the
    # query length or the chunking (see kernels/attention.py: paged_attention).
    batch_invariant: bool = False
    # Built lazily by the first layer that needs them and shared by the rest of the step.
    _memo: dict = field(default_factory=dict, repr=False)

    def decode_inputs(self, sliding_window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query rows, block tables, key mask) of the batched decodes, for one window size."""
        key = ("decode", sliding_window)
        if key not in self._memo:
            seq_lens = self.decode_seq_lens
            max_len = int(seq_lens.max())
            num_blocks = -(-max_len // self.block_size)
            tables = self.block_tables[self.decode_seq_ids, :num_blocks]  # (num_decode, num_blocks)
            key_pos = torch.arange(num_blocks * self.block_size, device=seq_lens.device)
            mask = key_pos[None, :] < seq_lens[:, None]  # (num_decode, num_blocks * block_size)
            if sliding_window is not None:
                mask &= key_pos[None, :] > (seq_lens[:, None] - 1 - sliding_window)
            rows = torch.tensor(
                [self.query_start_loc[i] for i in self.decode_seq_ids.tolist()],
                dtype=torch.long,
                device=seq_lens.device,
            )
            self._memo[key] = (rows, tables, mask)
        return self._memo[key]

    def decode_groups(
        self, sliding_window: Optional[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        """The batched decodes split for attention: [(query rows, block tables, key mask, num_shared)].

        Decodes whose block tables start with the same blocks (the same cached system prompt or
        document) form a group with num_shared > 0: the leading block columns all of its sequences
        share, with every position inside every context. The rest form one group with num_shared 0.
        Under a sliding window everything stays in one plain group."""
        key = ("groups", sliding_window)
        if key not in self._memo:
            rows, tables, mask = self.decode_inputs(sliding_window)
            groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
            plain = torch.ones(len(rows), dtype=torch.bool, device=rows.device)
            if sliding_window is None and len(rows) >= MIN_SHARED_SEQS:
                first = tables[:, 0]
                values, counts = torch.unique(first, return_counts=True)
                for value in values[counts >= MIN_SHARED_SEQS].tolist():
                    sel = torch.nonzero(first == value).flatten()
                    lens = self.decode_seq_lens[sel]
                    full = int(lens.min()) // self.block_size  # blocks inside every context of the group
                    t = tables[sel]
                    same = (t[:, :full] == t[:1, :full]).all(dim=0)
                    num_shared = int(same.long().cumprod(0).sum()) if full else 0
                    if num_shared * self.block_size < MIN_SHARED_TOKENS:
                        continue
                    width = -(-int(lens.max()) // self.block_size)
                    groups.append((rows[sel], t[:, :width], mask[sel, : width * self.block_size], num_shared))
                    plain[sel] = False
            if bool(plain.all()):
                groups = [(rows, tables, mask, 0)]
            elif bool(plain.any()):
                sel = torch.nonzero(plain).flatten()
                width = -(-int(self.decode_seq_lens[sel].max()) // self.block_size)
                groups.append((rows[sel], tables[sel, :width], mask[sel, : width * self.block_size], 0))
            self._memo[key] = groups
        return self._memo[key]

    def prefill_native_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block tables, first query rows, query lengths, context lengths) of the prefilling
        sequences, as int64 tensors for the native prefill kernel."""
        if "prefill_native" not in self._memo:
            ids = self.prefill_seq_ids
            starts = [self.query_start_loc[i] for i in ids]
            q_lens = [self.query_start_loc[i + 1] - self.query_start_loc[i] for i in ids]
            self._memo["prefill_native"] = (
                self.block_tables[torch.tensor(ids, dtype=torch.long, device=self.block_tables.device)],
                torch.tensor(starts, dtype=torch.long),
                torch.tensor(q_lens, dtype=torch.long),
                torch.tensor([self.seq_lens[i] for i in ids], dtype=torch.long),
            )
        return self._memo["prefill_native"]

    def prefill_inputs(
        self, i: int, sliding_window: Optional[int]
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(context slots, mask) of prefill sequence i; both None when it has no earlier context
        and no window, so its causal attention runs on the new keys alone."""
        key = ("prefill", i, sliding_window)
        if key not in self._memo:
            q_len = self.query_start_loc[i + 1] - self.query_start_loc[i]
            seq_len = self.seq_lens[i]
            if seq_len == q_len and sliding_window is None:
                self._memo[key] = (None, None)
            else:
                device = self.block_tables.device
                num_blocks = -(-seq_len // self.block_size)
                table = self.block_tables[i, :num_blocks]
                offsets = torch.arange(self.block_size, device=device)
                slots = (table[:, None] * self.block_size + offsets[None, :]).flatten()[:seq_len]
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                key_pos = torch.arange(seq_len, device=device)
                mask = key_pos[None, :] <= q_pos[:, None]  # (q_len, seq_len)
                if sliding_window is not None:
                    mask &= key_pos[None, :] > (q_pos[:, None] - sliding_window)
                self._memo[key] = (slots, mask)
        return self._memo[key]
