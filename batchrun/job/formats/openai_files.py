"""OpenAI batch files: reading a .jsonl shard of requests, writing its output and errors files.

BatchFileReader has ShardReader's interface, so the runner treats a batch file as one more shard;
each non-blank line is one row (blank lines are not requests and are skipped, as OpenAI and vLLM
do). A line that is not JSON still becomes a row, so it gets its error line. The reader counts the
lines in a first pass: the runner needs the count before the rows (progress, and the check that
every row got its result before a commit), and memory stays bounded by one line.

BatchLineWriter writes the two files of one attempt, each in input order: successes to the output
file, failures to the errors file, so together they hold exactly one line per request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

import fsspec
import pyarrow as pa

from batchrun.job.errors import ShardError
from batchrun.job.formats.openai_requests import custom_id_of, parse_line
from batchrun.job.formats.reader import InputRow
from batchrun.job.shards import Shard, one_line


class BatchFileReader:
    """One open batch file. Rows carry `values` {"line": the parsed object or None, "error": a
    RequestError or None, "line_no": the 1-based line number}; `id` is the custom_id when usable."""

    id_column = "custom_id"

    def __init__(self, shard: Shard, fs: fsspec.AbstractFileSystem) -> None:
        self.shard = shard
        self._fs = fs
        try:
            with fs.open(shard.path, "rb") as f:
                self.num_rows: int = sum(1 for _ in _lines(f))
        except Exception as e:  # a missing object, permission, a broken connection: cannot read
            raise ShardError(f"cannot read {shard.url}: {one_line(e)}") from None

    @property
    def id_type(self) -> pa.DataType:
        return pa.string()

    def field(self, name: str) -> pa.Field:
        raise ShardError(f"{self.shard.url}: a batch file has no column {name!r} (output.keep_columns)")

    def rows(self) -> Iterator[InputRow]:
        index = 0
        try:
            with self._fs.open(self.shard.path, "rb") as f:
                for line_no, line in _lines(f):
                    obj, error = parse_line(line)
                    yield InputRow(index, custom_id_of(obj), {"line": obj, "error": error, "line_no": line_no})
                    index += 1
        except Exception as e:
            raise ShardError(f"cannot read {self.shard.url} at line {index + 1}: {one_line(e)}") from None

    def close(self) -> None:
        pass  # each pass opens and closes the file itself


def _lines(f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of each non-blank line."""
    for line_no, line in enumerate(f, start=1):
        if line.strip():
            yield line_no, line


class BatchLineWriter:
    """The output and errors files of one attempt; `put` takes lines in any order, each file gets
    its lines in input order."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_path: str, errors_path: str) -> None:
        self._fs = fs
        self._paths = (output_path, errors_path)
        self._output = fs.open(output_path, "wb")
        self._errors = fs.open(errors_path, "wb")
        self._pending: dict[int, dict[str, Any]] = {}  # finished lines waiting for an earlier one
        self._next_index = 0
        self.num_lines = 0

    def put(self, index: int, line: dict[str, Any]) -> None:
        assert index >= self._next_index and index not in self._pending, f"line {index} written twice"
        self._pending[index] = line
        while self._next_index in self._pending:
            line = self._pending.pop(self._next_index)
            target = self._errors if line["error"] is not None else self._output
            target.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
            self._next_index += 1
            self.num_lines += 1

    def close(self) -> int:
        """Finish both files; every line from 0 up must have been put. Returns the line count."""
        assert not self._pending, f"lines {sorted(self._pending)[:5]}... finished but an earlier line is missing"
        self._output.close()
        self._errors.close()
        return self.num_lines

    def abort(self) -> None:
        """Give up on both files (temporary names in the attempt's own directory)."""
        for f, path in zip((self._output, self._errors), self._paths):
            try:
                f.close()
                self._fs.rm(path)
            except Exception:  # best effort: the attempt directory is removed as a whole anyway
                pass
