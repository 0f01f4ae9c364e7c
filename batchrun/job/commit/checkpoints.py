"""Checkpoints inside a shard: its results committed in parts, so that a killed or preempted worker
loses the rows since its last part, not the shard.

    {output.uri}/_parts/{shard}/{k:06d}.json                    part k's marker (create-if-absent)
    {output.uri}/_parts/{shard}/{k:06d}-{attempt}.parquet       its result rows, in input order
    {output.uri}/_parts/{shard}/{k:06d}-{attempt}.jsonl         its lines (formats with lines: openai_batch)

An attempt collects finished rows (ShardOutput). Every `output.checkpoint_rows` result rows or
`output.checkpoint_s` seconds it writes the input rows that are complete (every sample's result
row, and the batch line) as part k's files, then creates part k's marker if absent. Exactly one
attempt wins each k, whatever races: the marker names the attempt, its files, the input rows it
holds (runs of `[first row, end row, result rows per row]`) and the fingerprint it was computed
with. An attempt that finds part k taken by another attempt is fenced out: it stops the shard
(reported lost) and whoever takes the shard next resumes from the committed parts. Disjointness
follows from the indices: the writer of part k read parts 0..k-1 when it opened the shard (or
wrote them itself) and computed none of their rows, so no input row is in two committed parts.

A shard's rows are ordered by (input row, sample) everywhere, so a part's rows are a sorted run
and the shard's result file is a k-way merge of the parts. When the last row is done:
- no part was committed (a shard finished within one interval): the rows in memory are written as
  the attempt's results file, as without checkpoints;
- otherwise the remaining rows become the last part (fencing out any stale attempt), and the parts
  are merged into the attempt's results file; the shard's commit marker (store.py) names that file
  as it always does. Parts are deleted after publication; until then readers ignore the parts of a
  committed shard (committed_files reads the marker first).

So a completed shard is one results file as before, and while a shard is incomplete its committed
parts are readable on their own (committed_files(..., parts=True)): each input row is in at most
one of them, and never both in a part and in a committed shard's file.

With checkpoints off (both settings 0) rows are still buffered per input row, but spilled to
uncommitted files in the attempt's own directory every SPILL_ROWS result rows, so memory stays
bounded; a killed attempt then leaves nothing a rerun can use.
"""

from __future__ import annotations

import heapq
import json
import posixpath
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.commit.fingerprint import fingerprint_changes
from batchrun.job.commit.store import Attempt, RunStore, checked_name, committed_files
from batchrun.job.errors import ShardError

PARTS_DIR = "_parts"
PART_PROTOCOL = 1
ROWS_PER_ROW_GROUP = 1024
SPILL_ROWS = 16384  # result rows held in memory before an uncommitted spill (checkpoints off)
# The result columns a resumed attempt reads back from its committed parts to count them in the
# shard's metrics (metrics.ShardTally.add).
# An embed or score run's files lack the generation columns: they read as null (writer.read_result_columns).
TALLY_COLUMNS = (
    "error_type",
    "num_prompt_tokens",
    "num_output_tokens",
    "num_cached_tokens",
    "ttft_s",
    "itl_s",
    "latency_s",
    "num_truncated_tokens",
    "finish_reason",
    "num_reasoning_tokens",
    "num_answer_tokens",
)
# The engine's per-request counters (RequestMetrics fields) a part's marker sums over its rows, and
# a shard's metrics over all of its rows (metrics.ShardTally): the rows themselves do not hold them.
REQUEST_COUNTERS = ("num_preemptions", "num_spec_proposed", "num_spec_accepted")

RowRuns = list[tuple[int, int, int]]  # [(first input row, end input row, result rows per row)], sorted


def read_result_columns(source: Any, columns: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of a results file (a path or an open file), `columns` only; a column the file lacks
    (an embed or score run has no output tokens) reads as null."""
    parquet = pq.ParquetFile(source)
    names = set(parquet.schema_arrow.names)
    table = parquet.read(columns=[c for c in columns if c in names])
    rows: list[dict[str, Any]] = table.to_pylist()
    missing = [c for c in columns if c not in names]
    if missing:
        for row in rows:
            row.update(dict.fromkeys(missing))
    return rows


class PartLost(ShardError):
    """Another attempt committed the part index this attempt was about to take: it is fenced out."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """When an attempt commits a part (output.checkpoint_rows / output.checkpoint_s; 0 = never)."""

    rows: int = 0
    seconds: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.rows > 0 or self.seconds > 0


@dataclass(frozen=True)
class Part:
    """A committed part, as its marker says."""

    index: int
    attempt: str
    results_path: str
    lines_path: Optional[str]  # its batch lines (openai_batch runs only)
    rows: RowRuns
    num_result_rows: int
    fingerprint: dict[str, Any]
    request_counts: dict[str, int]  # the engine's per-request counters over its rows (ShardTally)
    wall_s: float  # the shard's wall time over all attempts up to this part's commit
    committed_at: Optional[str] = None  # by its writer's clock; for readers (status.py), never compared
    worker: Optional[int] = None  # its writer's rank
    owner: Optional[str] = None  # its writer's claim owner


@dataclass
class Resume:
    """What a new attempt takes over from the committed parts of its shard."""

    parts: list[Part] = field(default_factory=list)
    done: dict[int, int] = field(default_factory=dict)  # input row -> its result rows, for rows in parts

    @property
    def wall_s(self) -> float:
        return self.parts[-1].wall_s if self.parts else 0.0

    @property
    def num_result_rows(self) -> int:
        return sum(p.num_result_rows for p in self.parts)


def parts_dir(store: RunStore, shard: str) -> str:
    return store.path(PARTS_DIR, checked_name(shard))


def read_parts(store: RunStore, shard: str) -> list[Part]:
    """The committed parts of `shard`, by index: 0..k-1 without a gap (a part past a gap cannot be
    committed: each writer creates k only after reading or writing k-1)."""
    directory = parts_dir(store, shard)
    store.fs.invalidate_cache(directory)
    try:
        names = store.fs.ls(directory, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    indices = sorted(
        int(base[:-5])
        for base in (posixpath.basename(n) for n in names)
        if base.endswith(".json") and base[:-5].isdigit()
    )
    parts = []
    for expected, index in enumerate(indices):
        if index != expected:
            raise ShardError(f"shard {shard}: committed parts have a gap before part {index}; delete {directory}")
        doc = store.read_json(posixpath.join(directory, f"{index:06d}.json"))
        if not isinstance(doc, dict) or doc.get("protocol") != PART_PROTOCOL:
            raise ShardError(f"shard {shard}: part {index} is unreadable; delete {store.url(directory)} to redo it")
        parts.append(_part_of(store, directory, index, doc))
    return parts


def _part_of(store: RunStore, directory: str, index: int, doc: Mapping[str, Any]) -> Part:
    lines = doc.get("lines_file")
    return Part(
        index=index,
        attempt=str(doc["attempt"]),
        results_path=posixpath.join(directory, _plain(doc["results_file"])),
        lines_path=posixpath.join(directory, _plain(lines)) if isinstance(lines, str) else None,
        rows=[(int(a), int(b), int(c)) for a, b, c in doc["rows"]],
        num_result_rows=int(doc["num_result_rows"]),
        fingerprint=dict(doc.get("fingerprint") or {}),
        request_counts={k: int(v) for k, v in (doc.get("request_counts") or {}).items()},
        wall_s=float(doc.get("wall_s") or 0.0),
        committed_at=doc.get("committed_at") if isinstance(doc.get("committed_at"), str) else None,
        worker=doc.get("worker") if isinstance(doc.get("worker"), int) else None,
        owner=doc.get("owner") if isinstance(doc.get("owner"), str) else None,
    )


def _plain(name: Any) -> str:
    """A file name from a marker: one plain component (a marker is data, never a path to follow)."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ShardError(f"a part marker names a bad file {name!r}")
    return name


def remove_parts(store: RunStore, shard: str) -> None:
    """Drop a shard's parts: once it is committed (its results file holds their rows), or when they
    were computed with other settings and the shard is recomputed."""
    directory = parts_dir(store, shard)
    try:
        if store.fs.exists(directory):
            store.fs.rm(directory, recursive=True)
    except FileNotFoundError:
        pass
    if store.is_local:
        try:
            store.fs.rmdir(store.path(PARTS_DIR))  # only when empty: other shards' parts stay
        except OSError:
            pass


def parts_changes(parts: Sequence[Part], fingerprint: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What differs between the parts' fingerprints and this attempt's (settings, model, input)."""
    for part in parts:
        changes = fingerprint_changes(part.fingerprint, fingerprint)
        if changes:
            return changes
    return []


def resume_from(parts: Sequence[Part]) -> Resume:
    done: dict[int, int] = {}
    for part in parts:
        for first, end, per_row in part.rows:
            for row in range(first, end):
                assert row not in done, f"input row {row} in two committed parts"
                done[row] = per_row
    return Resume(list(parts), done)


def tally_rows(store: RunStore, parts: Sequence[Part]) -> Iterator[dict[str, Any]]:
    """The committed parts' result rows, as far as the shard's metrics need them."""
    for part in parts:
        with store.fs.open(part.results_path, "rb") as f:
            yield from read_result_columns(f, TALLY_COLUMNS)


def committed_parts(store: RunStore) -> dict[str, list[Part]]:
    """shard -> its committed parts, for every shard with any (one listing of `_parts/`)."""
    root = store.path(PARTS_DIR)
    store.fs.invalidate_cache(root)
    try:
        shards = [posixpath.basename(p) for p in store.fs.ls(root, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for shard in sorted(shards):
        try:
            parts = read_parts(store, checked_name(shard))
        except (ShardError, ValueError):
            continue  # a torn or foreign directory: no reader should see it
        if parts:
            out[shard] = parts
    return out


def _runs(rows: Sequence[tuple[int, int]]) -> RowRuns:
    """Sorted (row, result rows) pairs as runs of consecutive rows with the same count."""
    runs: RowRuns = []
    for row, count in rows:
        if runs and runs[-1][1] == row and runs[-1][2] == count:
            runs[-1] = (runs[-1][0], row + 1, count)
        else:
            runs.append((row, row + 1, count))
    return runs


@dataclass
class _Row:
    """An input row whose outputs are still arriving."""

    num_results: int  # result rows it will have (its samples; 1 for an error row)
    results: dict[int, dict[str, Any]] = field(default_factory=dict)  # sample -> result row
    line: Optional[dict[str, Any]] = None  # its batch output or error line (openai_batch)
    counts: dict[str, int] = field(default_factory=dict)  # REQUEST_COUNTERS over its samples


@dataclass
class _Chunk:
    """Complete rows written to a file in (row, sample) order: a committed part or a spill."""

    results_path: str
    lines_path: Optional[str]
    rows: RowRuns


@dataclass(frozen=True)
class LineFiles:
    """An attempt's per-row lines (formats with lines, shard_format.ShardFormat.has_lines): the attempt
    files they end in, and which of them takes a line."""

    names: tuple[str, ...]
    pick: Callable[[dict[str, Any]], str]


class ShardOutput:
    """One attempt's result rows (and batch lines): collected per input row in any order, written
    out in input order as committed parts (CheckpointPolicy) or spills, and finally as the
    attempt's results file (and output/errors files) holding every row of the shard."""

    def __init__(
        self,
        store: RunStore,
        attempt: Attempt,
        schema: pa.Schema,
        lines: Optional[LineFiles],
        policy: CheckpointPolicy,
        resume: Resume,
        part_marker: Callable[[], dict[str, Any]],
        before_commit: Callable[[], None],
    ) -> None:
        """`part_marker()` gives the fields every part marker carries (fingerprint, counters,
        wall time so far); `before_commit()` runs before each part is committed (the run's
        fingerprint fence: it raises when another launch changed the settings)."""
        self.store, self.attempt, self.schema, self.lines = store, attempt, schema, lines
        self.with_lines = lines is not None
        self.policy, self.resume = policy, resume
        self._part_marker, self._before_commit = part_marker, before_commit
        self._open: dict[int, _Row] = {}  # input row -> its outputs so far
        self._complete: dict[int, _Row] = {}  # input rows with every output, not yet in a file
        self._num_complete_results = 0
        self._spills: list[_Chunk] = []  # this attempt's uncommitted files (checkpoints off)
        self._parts = list(resume.parts)  # committed parts, ours included
        self._last_checkpoint = time.monotonic()
        self.num_committed_parts = 0  # parts this attempt committed

    # ---- collecting ---------------------------------------------------------------------------

    def expect(self, row: int, num_results: int) -> None:
        assert row not in self._open and row not in self._complete and row not in self.resume.done, row
        self._open[row] = _Row(num_results)

    def put(self, row: int, sample: int, result: dict[str, Any], metrics: Any = None) -> None:
        """One result row; `metrics`: the engine's RequestMetrics of that sample, when it ran."""
        entry = self._open[row]
        assert sample not in entry.results and 0 <= sample < entry.num_results, (row, sample)
        entry.results[sample] = result
        if metrics is not None:
            for name in REQUEST_COUNTERS:
                entry.counts[name] = entry.counts.get(name, 0) + int(getattr(metrics, name))
        self._settle(row, entry)

    def put_line(self, row: int, line: dict[str, Any]) -> None:
        entry = self._open[row]
        assert entry.line is None and self.with_lines, row
        entry.line = line
        self._settle(row, entry)

    def _settle(self, row: int, entry: _Row) -> None:
        if len(entry.results) == entry.num_results and (entry.line is not None or not self.with_lines):
            del self._open[row]
            self._complete[row] = entry
            self._num_complete_results += entry.num_results

    # ---- parts --------------------------------------------------------------------------------

    def is_due(self) -> bool:
        """A checkpoint is due: by rows (SPILL_ROWS bounds memory when no row limit is set) or by time."""
        if not self._complete:
            return False
        if self._num_complete_results >= (self.policy.rows or SPILL_ROWS):
            return True
        return self.policy.seconds > 0 and time.monotonic() - self._last_checkpoint >= self.policy.seconds

    def checkpoint(self) -> None:
        """Write the complete rows out: a committed part, or a spill with checkpoints off. Raises
        PartLost when another attempt took the next part index."""
        if not self._complete:
            return
        if self.policy.enabled:
            self._commit_part()
        else:
            self._spill()
        self._last_checkpoint = time.monotonic()

    def _take_complete(self) -> list[tuple[int, _Row]]:
        rows = sorted(self._complete.items())
        self._complete = {}
        self._num_complete_results = 0
        return rows

    def _spill(self) -> None:
        base = posixpath.join(self.attempt.directory, f"spill-{len(self._spills):06d}")
        rows = self._take_complete()
        self._spills.append(self._write_chunk(base, rows))

    def _commit_part(self) -> None:
        index = len(self._parts)
        directory = parts_dir(self.store, self.attempt.shard)
        base = posixpath.join(directory, f"{index:06d}-{self.attempt.attempt_id}")
        if self.store.is_local:
            self.store.fs.makedirs(directory, exist_ok=True)
        rows = self._take_complete()
        chunk = self._write_chunk(base, rows)
        num_results = sum(len(entry.results) for _, entry in rows)
        counts = {name: sum(entry.counts.get(name, 0) for _, entry in rows) for name in REQUEST_COUNTERS}
        doc = {
            **self._part_marker(),
            "protocol": PART_PROTOCOL,
            "shard": self.attempt.shard,
            "part": index,
            "attempt": self.attempt.attempt_id,
            "results_file": posixpath.basename(chunk.results_path),
            "lines_file": posixpath.basename(chunk.lines_path) if chunk.lines_path else None,
            "rows": [list(run) for run in chunk.rows],
            "num_result_rows": num_results,
            "request_counts": counts,
        }
        self._before_commit()
        marker = posixpath.join(directory, f"{index:06d}.json")
        if not self._create_decided(marker, doc):
            self._remove_files(chunk)
            raise PartLost(
                f"part {index} of shard {self.attempt.shard} was committed by another attempt; "
                "this one stops and the shard resumes from the committed parts"
            )
        self._parts.append(_part_of(self.store, directory, index, doc))
        self.num_committed_parts += 1

    def _create_decided(self, path: str, doc: dict[str, Any]) -> bool:
        """Create the part marker; an unclear outcome (a reply lost after the write landed) is
        decided by the marker's own attempt id (RunStore.create_owned)."""
        return self.store.create_owned(path, doc, "attempt")

    def _write_chunk(self, base: str, rows: list[tuple[int, _Row]]) -> _Chunk:
        results_path = f"{base}.parquet"
        with self.store.fs.open(results_path, "wb") as f:
            writer = pq.ParquetWriter(f, self.schema)
            batch: list[dict[str, Any]] = []
            for _, entry in rows:
                batch.extend(entry.results[s] for s in range(entry.num_results))
                if len(batch) >= ROWS_PER_ROW_GROUP:
                    writer.write_table(pa.Table.from_pylist(batch, schema=self.schema))
                    batch = []
            if batch or not rows:
                writer.write_table(pa.Table.from_pylist(batch, schema=self.schema))
            writer.close()
        lines_path = None
        if self.with_lines:
            lines_path = f"{base}.jsonl"
            with self.store.fs.open(lines_path, "wb") as f:
                for _, entry in rows:
                    f.write(_line_bytes(entry.line))
        self.store.sync_files([results_path, *([lines_path] if lines_path else [])])
        return _Chunk(results_path, lines_path, _runs([(row, entry.num_results) for row, entry in rows]))

    def _remove_files(self, chunk: _Chunk) -> None:
        for path in (chunk.results_path, chunk.lines_path):
            if path is not None:
                try:
                    self.store.fs.rm(path)
                except (FileNotFoundError, OSError):
                    pass

    # ---- the end ------------------------------------------------------------------------------

    def finish(self) -> tuple[int, int]:
        """Write the attempt's results file (and batch output/errors files) with every row of the
        shard: committed parts, spills and the rows in memory, merged in input order. Returns
        (result rows, batch lines)."""
        assert not self._open, f"rows {sorted(self._open)[:5]} are not complete"
        if self._parts and self._complete:  # the rest becomes the last part: a stale attempt cannot commit over it
            self._commit_part()
        chunks = [_Chunk(p.results_path, p.lines_path, p.rows) for p in self._parts] + self._spills
        memory = self._take_complete()
        num_rows = self._merge_results(chunks, memory)
        num_lines = self._merge_lines(chunks, memory) if self.with_lines else 0
        return num_rows, num_lines

    def _merge_results(self, chunks: Sequence[_Chunk], memory: list[tuple[int, _Row]]) -> int:
        def from_memory() -> Iterator[tuple[tuple[int, int], dict[str, Any]]]:
            for row, entry in memory:
                for sample in range(entry.num_results):
                    yield (row, sample), entry.results[sample]

        streams = [self._chunk_results(c) for c in chunks] + [from_memory()]
        num_rows = 0
        with self.store.fs.open(self.attempt.results_tmp, "wb") as f:
            writer = pq.ParquetWriter(f, self.schema)
            batch: list[dict[str, Any]] = []
            for _, result in heapq.merge(*streams, key=lambda item: item[0]):
                batch.append(result)
                if len(batch) >= ROWS_PER_ROW_GROUP:
                    writer.write_table(pa.Table.from_pylist(batch, schema=self.schema))
                    num_rows += len(batch)
                    batch = []
            if batch or not num_rows:
                writer.write_table(pa.Table.from_pylist(batch, schema=self.schema))
                num_rows += len(batch)
            writer.close()
        return num_rows

    def _chunk_results(self, chunk: _Chunk) -> Iterator[tuple[tuple[int, int], dict[str, Any]]]:
        keys = ((row, sample) for row, per_row in _expand(chunk.rows) for sample in range(per_row))
        with self.store.fs.open(chunk.results_path, "rb") as f:
            parquet = pq.ParquetFile(f)
            for batch in parquet.iter_batches(batch_size=ROWS_PER_ROW_GROUP):
                table = pa.Table.from_batches([batch]).cast(self.schema)
                for result in table.to_pylist():
                    yield next(keys), result

    def _merge_lines(self, chunks: Sequence[_Chunk], memory: list[tuple[int, _Row]]) -> int:
        def from_memory() -> Iterator[tuple[int, bytes]]:
            for row, entry in memory:
                yield row, _line_bytes(entry.line)

        def from_chunk(chunk: _Chunk) -> Iterator[tuple[int, bytes]]:
            rows = (row for row, _ in _expand(chunk.rows))
            assert chunk.lines_path is not None
            with self.store.fs.open(chunk.lines_path, "rb") as f:
                for line in f:
                    yield next(rows), line

        assert self.lines is not None
        num_lines = 0
        with ExitStack() as stack:
            files = {
                name: stack.enter_context(self.store.fs.open(self.attempt.file(name), "wb"))
                for name in self.lines.names
            }
            for _, line in heapq.merge(*[from_chunk(c) for c in chunks], from_memory(), key=lambda item: item[0]):
                files[self.lines.pick(json.loads(line))].write(line)
                num_lines += 1
        return num_lines

    def abort(self) -> None:
        """Drop what this attempt holds in memory; its own directory goes with the attempt
        (store.abandon), its committed parts stay for the next attempt."""
        self._open, self._complete = {}, {}


def _expand(runs: RowRuns) -> Iterator[tuple[int, int]]:
    """(input row, result rows) of each row in `runs`, in order."""
    for first, end, per_row in runs:
        for row in range(first, end):
            yield row, per_row


def _line_bytes(line: Optional[dict[str, Any]]) -> bytes:
    assert line is not None
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def readable_files(store: RunStore, kind: str = "results", parts: bool = True) -> dict[str, str]:
    """name -> path of each committed `kind` file: one per committed shard (store.committed_files)
    and, for results with `parts`, each committed part of a shard not committed yet, named
    "{shard}/part-{k:06d}" ('/' never occurs in a shard name). No input row is in two of them."""
    files = committed_files(store, kind)
    if not parts or kind != "results":
        return files
    raced = False
    for shard, shard_parts in committed_parts(store).items():
        if shard in files:
            continue  # committed: its file holds these rows
        if store.read_marker(shard) is not None:
            raced = True  # committed between the two listings: read its file, not the parts
            continue
        for part in shard_parts:
            files[f"{shard}/part-{part.index:06d}"] = part.results_path
    if raced:
        files.update(committed_files(store, kind))
    return files


def committed_urls(
    uri: str, storage_options: Optional[Mapping[str, Any]] = None, kind: str = "results", parts: bool = True
) -> dict[str, str]:
    """name -> URL of each committed `kind` file (results, metrics, outputs, errors) of the run at
    `uri`, for notebooks, pandas and `datasets.load_dataset("parquet", data_files=list(urls.values()))`.
    Keys are shard names; while a shard is not committed yet, its committed parts (checkpoints)
    are listed as "{shard}/part-{k:06d}" (results only; `parts=False` leaves them out). Every input
    row is in at most one file, also while workers are running."""
    store = RunStore(uri, storage_options or {})
    return {name: store.url(path) for name, path in readable_files(store, kind, parts).items()}
