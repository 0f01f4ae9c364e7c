"""Block tables kept between steps: one row of block ids for every request that holds KV blocks.

Rebuilding each running request's table from its Python list every step costs host time that grows
with batch size times context. Instead the KV manager writes a request's block ids into its own row
as blocks are attached, and clears the row when they are freed; a step gathers its batch's rows with
one numpy index. Entries past a row's blocks are 0, the padding block id the kernels expect.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NO_ROW = -1  # Request.table_row of a request that holds no row (no blocks, or not KV-managed)


class BlockTables:
    """Rows handed out and taken back; both dimensions grow (doubling) when a request needs more."""

    def __init__(self, num_rows: int = 64, width: int = 64) -> None:
        assert num_rows > 0 and width > 0
        self.table = np.zeros((num_rows, width), dtype=np.int64)  # (num_rows, width) block ids, 0-padded
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)  # (num_rows,) filled entries of each row
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: lowest row first

    @property
    def num_rows_used(self) -> int:
        return self.table.shape[0] - len(self._free_rows)

    def acquire(self) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            self._resize(2 * old, self.table.shape[1])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def append(self, row: int, block_ids: Sequence[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            width = self.table.shape[1]
            while width < end:
                width *= 2
            self._resize(self.table.shape[0], width)
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def release(self, row: int) -> None:
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), widest of those rows) int64: the rows' tables, 0-padded, as a new array."""
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        return self.table[rows, :width]

    def _resize(self, num_rows: int, width: int) -> None:
        table = np.zeros((num_rows, width), dtype=np.int64)  # (num_rows, width)
        old_rows, old_width = self.table.shape
        table[:old_rows, :old_width] = self.table
        num_blocks = np.zeros(num_rows, dtype=np.int64)  # (num_rows,)
        num_blocks[:old_rows] = self.num_blocks
        self.table, self.num_blocks = table, num_blocks


def tables_from_lists(block_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """(len(block_ids), longest) int64, 0-padded: the same tables rebuilt from per-request lists (for
    requests that hold no row, such as the start-up profile's, and as the tests' reference)."""
    width = max((len(b) for b in block_ids), default=0)
    out = np.zeros((len(block_ids), width), dtype=np.int64)  # (num_seqs, width)
    for i, ids in enumerate(block_ids):
        out[i, : len(ids)] = ids
    return out
