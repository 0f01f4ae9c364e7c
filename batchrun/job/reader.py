"""Reading one input shard: open the Parquet file through fsspec, check its columns, yield rows.

Rows are read one record batch at a time and only the columns the job needs, so memory stays
bounded by `data.batch_size` whatever the shard's size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Optional, Sequence

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.errors import ShardError
from batchrun.job.shards import Shard


@dataclass(frozen=True)
class DataConfig:
    """Where the input is and which columns hold what."""

    # A directory, a glob or one Parquet file: a local path or any fsspec URL (s3://, gs://, memory://).
    uri: Optional[str] = None
    id_column: Optional[str] = "id"  # when null or absent from a shard, ids are "<shard>-<row index>"
    text_column: str = "text"  # the prompt text, or an OpenAI-style list of {role, content} messages
    storage_options: dict[str, Any] = field(default_factory=dict)  # passed to fsspec
    on_too_long: Literal["error", "truncate"] = "error"  # prompts over max_model_len - max_tokens
    batch_size: int = 256  # rows read at a time
    # Rows with equal values here share a long prompt prefix (e.g. one document, many questions):
    # with several workers, shards go to workers by it (prefix affinity, affinity.py). null: by name.
    group_column: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.uri:
            raise ValueError("data.uri: missing; set data.uri=<directory, glob or file of Parquet shards>")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size: must be >= 1, got {self.batch_size}")


@dataclass(frozen=True)
class InputRow:
    index: int  # position in the shard, from 0
    id: Optional[str]  # None when the id column holds null in this row
    values: dict[str, Any]  # the columns the job reads, by name


class ShardReader:
    """One open input shard. `columns` must all exist; `id_column` is used only when present."""

    def __init__(self, shard: Shard, fs: fsspec.AbstractFileSystem, config: DataConfig, columns: Sequence[str]) -> None:
        self.shard = shard
        self._batch_size = config.batch_size
        try:
            self._file = fs.open(shard.path, "rb")
            self._parquet = pq.ParquetFile(self._file)
        except Exception as e:  # corrupt footer, missing object, permission: all mean "cannot read"
            raise ShardError(f"cannot read {shard.url}: {_one_line(e)}") from None
        self.schema: pa.Schema = self._parquet.schema_arrow
        names = set(self.schema.names)
        missing = [c for c in dict.fromkeys(columns) if c not in names]
        if missing:
            raise ShardError(f"{shard.url}: missing column {', '.join(map(repr, missing))} "
                             f"(it has {', '.join(self.schema.names)})")
        self.id_column = config.id_column if config.id_column in names else None
        self._columns = list(dict.fromkeys([*columns, *([self.id_column] if self.id_column else [])]))
        self.num_rows: int = self._parquet.metadata.num_rows

    def field(self, name: str) -> pa.Field:
        return self.schema.field(name)

    def rows(self) -> Iterator[InputRow]:
        """Every row in file order; a read failure part way raises ShardError."""
        index = 0
        try:
            for batch in self._parquet.iter_batches(batch_size=self._batch_size, columns=self._columns):
                ids = batch.column(self.id_column).to_pylist() if self.id_column else None
                columns = {name: batch.column(name).to_pylist() for name in self._columns}
                for i in range(batch.num_rows):
                    row_id = self._id(ids[i]) if ids is not None else f"{self.shard.name}-{index}"
                    yield InputRow(index, row_id, {name: values[i] for name, values in columns.items()})
                    index += 1
        except ShardError:
            raise
        except Exception as e:
            raise ShardError(f"cannot read {self.shard.url} at row {index}: {_one_line(e)}") from None

    @staticmethod
    def _id(value: Any) -> Optional[str]:
        if value is None:
            return None
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

    def close(self) -> None:
        self._file.close()


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) < 300 else text[:297] + "..."
