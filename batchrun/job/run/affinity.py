"""Prefix affinity: shards whose prompts share a long prefix go to the same worker.

Within a run every prompt starts with the same chat template, system prompt and template text, so
that prefix is computed once per worker whatever the split, and the planner already puts prompts
sharing a prefix back to back within a shard. What a split can waste is a long prefix that only
some rows share, e.g. one long document asked many questions: `data.group_column` names the column
that says which rows share one. Each shard's group is its most common value there; groups are
dealt to workers largest first, each to the least loaded worker (ties: lowest rank), so every
worker computes the same partition on its own, shards of one group land on one worker (its prefix
cache holds the prefix), and the load stays balanced by shard count. A shard that cannot be read
here is its own group: reading it fails later, in the shard's own run, with its own error row.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import fsspec
import pyarrow.parquet as pq

from batchrun.job.shards import Shard


def shard_groups(fs: fsspec.AbstractFileSystem, shards: Sequence[Shard], column: str) -> dict[str, str]:
    """Shard name -> its group: the most common value of `column` (first in row order on ties)."""
    groups = {}
    for shard in shards:
        try:
            with fs.open(shard.path, "rb") as f:
                values = pq.read_table(f, columns=[column]).column(column).to_pylist()
        except Exception:
            values = []
        counts = collections.Counter(str(v) for v in values if v is not None)
        groups[shard.name] = f"value:{counts.most_common(1)[0][0]}" if counts else f"shard:{shard.name}"
    return groups


def partition_by_group(shards: Sequence[Shard], groups: dict[str, str], world_size: int) -> list[list[Shard]]:
    """Every worker's shards (by rank), whole groups to one worker, balanced by shard count."""
    by_group: dict[str, list[Shard]] = collections.defaultdict(list)
    for shard in sorted(shards, key=lambda s: s.name):
        by_group[groups[shard.name]].append(shard)
    parts: list[list[Shard]] = [[] for _ in range(world_size)]
    for key in sorted(by_group, key=lambda k: (-len(by_group[k]), k)):
        rank = min(range(world_size), key=lambda r: (len(parts[r]), r))
        parts[rank].extend(by_group[key])
    return [sorted(p, key=lambda s: s.name) for p in parts]
