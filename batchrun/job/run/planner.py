"""Admission order: prompts that share a prefix run back to back, longest first.

The planner reads ahead a window of prompts (already built and tokenized; rows of consecutive
shards alike, see flow.py), orders them, and feeds the engine in that order. The order is a
depth-first walk of the trie of the prompts' full KV blocks (the granularity at which the engine's
prefix cache shares KV): every set of prompts that share their first k full blocks is contiguous,
so the shared blocks are computed once and served from the cache to the rest of the set while it
is still cached. Among siblings in the trie, `order` decides: longest_first puts the longest
(sub)groups first so that no long prompt starts last and becomes the tail of the run;
shortest_first does the reverse; input keeps first-appearance order.

Results keep their ids and row indices; the ResultWriter puts them back in input order, so memory
grows with the window (prompts read ahead plus finished rows waiting for an earlier one), never
with the shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Optional

from batchrun.engine import EngineRequest
from batchrun.job.config import PlannerConfig, PlanOrder


def plan_requests(
    requests: Iterable[Optional[EngineRequest]], config: PlannerConfig, block_size: int
) -> Iterator[Optional[EngineRequest]]:
    """`requests` in planned order, a window at a time (lazily: the next window is read only after
    this one has been handed out). Every request comes out exactly once. A None from the source
    (see Engine.stream: nothing to admit right now) ends the window early: what was read is
    planned and handed out, then the None is passed on."""
    source = iter(requests)
    if not config.enabled:
        yield from source
        return
    while True:
        window: list[EngineRequest] = []
        paused = False  # the source has nothing right now: plan what it gave, then pass the pause on
        for request in islice(source, config.window):
            if request is None:
                paused = True
                break
            window.append(request)
        if not window and not paused:
            return
        prompts = [r.prompt if isinstance(r.prompt, list) else [] for r in window]  # text prompts: no grouping
        for i in plan_order(prompts, config.order, block_size):
            yield window[i]
        if paused:
            yield None


def plan_order(prompts: Sequence[Sequence[int]], order: PlanOrder, block_size: int) -> list[int]:
    """A permutation of range(len(prompts)): the admission order (see the module docstring)."""
    assert block_size > 0
    if len(prompts) <= 1:
        return list(range(len(prompts)))
    # Lexicographic order makes every set of prompts with a common prefix one contiguous run.
    # (sorted is stable: identical prompts keep their input order.)
    lists = [p if isinstance(p, list) else list(p) for p in prompts]
    prompts = lists
    run = sorted(range(len(lists)), key=lambda i: lists[i])
    key = _SORT_KEYS[order]
    # A depth-first walk with an explicit stack: prompts that extend one another (conversations)
    # make the trie as deep as the window is long. A frame holds the trie children still to plan,
    # the planned ones, and the depth (in blocks) the children share.
    stack: list[tuple[list[list[int]], list[_Group], int]] = []

    def open_node(run: list[int], depth: int) -> None:
        # The run's first and last prompts share exactly what all of them share: skip those blocks.
        depth = _common_blocks(prompts[run[0]], prompts[run[-1]], depth, block_size)
        stack.append((_children(prompts, run, depth, block_size)[::-1], [], depth + 1))

    open_node(run, 0)
    while True:
        todo, planned, depth = stack[-1]
        if todo:
            child = todo.pop()
            if len(child) == 1:
                planned.append(_Group(child, len(prompts[child[0]]), len(prompts[child[0]]), child[0]))
            else:
                open_node(child, depth)
            continue
        stack.pop()
        planned.sort(key=key)
        group = _Group(
            [i for g in planned for i in g.indices],
            max(g.max_len for g in planned),
            min(g.min_len for g in planned),
            min(g.first_index for g in planned),
        )
        if not stack:
            return group.indices
        stack[-1][1].append(group)


@dataclass
class _Group:
    """Prompts planned together (a trie subtree), with what sorting it among its siblings needs."""

    indices: list[int]  # in planned order
    max_len: int
    min_len: int
    first_index: int  # smallest input position


# Sort keys among siblings; ties go to input order.
_SORT_KEYS: dict[str, Callable[[_Group], tuple[int, int]]] = {
    "longest_first": lambda g: (-g.max_len, g.first_index),
    "shortest_first": lambda g: (g.min_len, g.first_index),
    "input": lambda g: (0, g.first_index),
}


def _children(prompts: Sequence[Sequence[int]], run: list[int], depth: int, block_size: int) -> list[list[int]]:
    """Split a sorted run sharing `depth` blocks by its next full block; prompts without one stand alone."""
    lo, hi = depth * block_size, (depth + 1) * block_size
    children: list[list[int]] = []
    previous = None
    for i in run:
        p = prompts[i]
        block = tuple(p[lo:hi]) if len(p) >= hi else None
        if block is not None and block == previous:
            children[-1].append(i)
        else:
            children.append([i])
        previous = block
    return children


def _common_blocks(a: Sequence[int], b: Sequence[int], start: int, block_size: int) -> int:
    """Full blocks a and b share from the beginning, given that they share the first `start`."""
    n = start
    while (n + 1) * block_size <= min(len(a), len(b)) and a[n * block_size : (n + 1) * block_size] == b[
        n * block_size : (n + 1) * block_size
    ]:
        n += 1
    return n
