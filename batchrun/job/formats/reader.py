"""Reading one input shard: open the Parquet file through fsspec, check its columns, yield rows.

Rows are read one record batch at a time and only the columns the job needs, so memory stays
bounded by `data.batch_size` whatever the shard's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.config import DataConfig
from batchrun.job.errors import ShardError
from batchrun.job.shards import Shard, one_line


@dataclass(frozen=True)
class InputRow:
    index: int  # position in the shard, from 0
    # The id column's value as read (its Arrow type kept: int ids stay ints); None when it is null
    # or NaN; "<shard>-<row index>" when data.id_column is null.
    id: Any
    values: dict[str, Any]  # the columns the job reads, by name (None where invalid_columns says so)
    invalid_columns: tuple[str, ...] = ()  # columns whose text is not valid UTF-8 in this row


class ShardReader:
    """One open input shard. `columns` must all exist; `id_column` is used only when present."""

    def __init__(self, shard: Shard, fs: fsspec.AbstractFileSystem, config: DataConfig, columns: Sequence[str]) -> None:
        self.shard = shard
        self._batch_size = config.batch_size
        try:
            self._file = fs.open(shard.path, "rb")
            self._parquet = pq.ParquetFile(self._file)
        except Exception as e:  # corrupt footer, missing object, permission: all mean "cannot read"
            raise ShardError(f"cannot read {shard.url}: {one_line(e)}") from None
        self.schema: pa.Schema = self._parquet.schema_arrow
        names = set(self.schema.names)
        missing = [c for c in dict.fromkeys(columns) if c not in names]
        if missing:
            raise ShardError(
                f"{shard.url}: missing column {', '.join(map(repr, missing))} (it has {', '.join(self.schema.names)})"
            )
        if config.id_column is not None and config.id_column not in names:
            raise ShardError(
                f"{shard.url}: missing id column {config.id_column!r} (data.id_column; it has "
                f"{', '.join(self.schema.names)}); set data.id_column=null for positional ids"
            )
        self.id_column = config.id_column
        self._columns = list(dict.fromkeys([*columns, *([self.id_column] if self.id_column else [])]))
        self.num_rows: int = self._parquet.metadata.num_rows

    def field(self, name: str) -> pa.Field:
        return self.schema.field(name)

    @property
    def id_type(self) -> pa.DataType:
        """The results' `id` type: the id column's own, or text for positional ids."""
        return self.schema.field(self.id_column).type if self.id_column else pa.string()

    def rows(self) -> Iterator[InputRow]:
        """Every row in file order; a read failure part way raises ShardError."""
        index = 0
        try:
            for batch in self._parquet.iter_batches(batch_size=self._batch_size, columns=self._columns):
                columns, invalid = {}, {}
                for name in self._columns:
                    columns[name], invalid[name] = _values(batch.column(name))
                for i in range(batch.num_rows):
                    bad = tuple(name for name in self._columns if i in invalid[name])
                    values = {name: column[i] for name, column in columns.items()}
                    row_id = _id(values.pop(self.id_column)) if self.id_column else f"{self.shard.name}-{index}"
                    if self.id_column:
                        values[self.id_column] = row_id
                    yield InputRow(index, row_id, values, bad)
                    index += 1
        except ShardError:
            raise
        except Exception as e:
            raise ShardError(f"cannot read {self.shard.url} at row {index}: {one_line(e)}") from None

    def close(self) -> None:
        self._file.close()


def _id(value: Any) -> Any:
    """An id as read; null and NaN are no id (NaN != NaN: as keys they would never match)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _values(column: pa.Array) -> tuple[list[Any], set[int]]:
    """A column as Python values, and the rows whose text is not valid UTF-8 (None there). Only a
    batch that fails to convert as a whole pays for the row-by-row pass that finds them."""
    try:
        return column.to_pylist(), set()
    except UnicodeDecodeError:
        pass
    values: list[Any] = []
    invalid: set[int] = set()
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
        except UnicodeDecodeError:
            values.append(None)
            invalid.add(i)
    return values, invalid
