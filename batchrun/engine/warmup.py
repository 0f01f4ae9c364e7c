"""Start-up warm-up: run every kind of step a run will use once, before anything is timed.

On a GPU the first launch of each Triton kernel specialization compiles it, and a CUDA-graph bucket
is captured the first time a decode batch of its size comes. Left lazy, those seconds land inside
the first timed steps and the first requests' latencies. The warm-up runs, on hand-made requests:

- prefill-only steps of a few token counts: one block, two blocks, sixteen blocks (Triton
  specializes an integer argument, here a block table's row stride, on being 1 or a multiple of
  16), and one step per tile of the Triton GEMMs up to the token budget (`GEMM_ROWS`: a GEMM's tile
  and split-K follow its row count's bucket, kernels/gemm_tiles.py, past the last bucket the last
  one's tile unsplit), several prompts where one cannot hold the rows;
- a decode-only step of as many sequences as each tile bucket holds, up to max_num_seqs: the LM
  head's rows are the step's sequences (eager decode steps: drafters, no CUDA graphs);
- a chunked prefill over a cached prefix (the prefill kernel's path that reads earlier context);
- for every (decode split count, block-table width class) pair a step can get under this engine's
  shapes (the kernel set's `decode_num_splits` over 1 to max_num_seqs decodes and every table width; width
  classes 1, a multiple of 16, other): a decode-only step and a mixed prefill + decode step (the
  decode kernel is specialized on split or not and on whether decode rows are given, as in a mixed
  step; the merge kernel on the padded split count);
- every CUDA-graph bucket up to max_num_seqs (`DecodeGraphs.capture_all`), GPU only.

The plan is a pure function of shapes (`warmup_plan`), so the CPU tests check its coverage. Its
requests never pass through the scheduler or the KV manager: they name block ids directly, as the
start-up profile's do, so no block is allocated, no prefix hash registered and no request id
consumed. What their steps write into the cache is never read: the engine warms up only while no
request is in flight, after forgetting the prefix cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from batchrun.engine.config import SamplingParams
from batchrun.engine.request import Request
from batchrun.engine.runners import ForwardOutput, ModelRunner
from batchrun.engine.runners.cuda_graphs import pick_bucket
from batchrun.engine.sampler import Sampler
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.kernels.gemm_tiles import M_BUCKETS
from batchrun.kernels.kernel_set import KernelSet

log = logging.getLogger(__name__)

SplitFn = Callable[[int, int], int]  # (num_decode, block-table width in tokens) -> decode split count
PREFILL_BLOCKS = (1, 2, 16)  # prefill-only steps: tokens filling this many blocks (see the module doc)
# Rows of a step in each tile bucket of the Triton GEMMs, and one past the last (its tile, unsplit)
GEMM_ROWS = (*M_BUCKETS, 2 * M_BUCKETS[-1])
CACHED_BLOCKS = 2  # chunked prefill: blocks of prefix already in the cache


def width_class(num_blocks: int) -> str:
    """How Triton specializes a block table's row stride: 1, a multiple of 16, or neither."""
    if num_blocks == 1:
        return "one"
    return "div16" if num_blocks % 16 == 0 else "other"


@dataclass(frozen=True)
class WarmupStep:
    kind: str  # "prefill" | "chunked_prefill" | "decode" | "mixed"
    # per prefilling sequence: (tokens already in the cache, tokens computed this step)
    prefills: tuple[tuple[int, int], ...] = ()
    # per decoding sequence: its context length after this step, this step's token included
    decodes: tuple[int, ...] = ()
    num_splits: int = 0  # the decode split count the step's decodes get (0: no decodes)
    table_blocks: int = 0  # width of the step's block tables, in blocks


def decode_split_fn(kernels: KernelSet, num_kv_heads: int) -> SplitFn:
    """The split count the kernel set's decode attention picks for a step's decodes (1 where it
    splits no context: the CPU's)."""

    def split_fn(num_decode: int, max_context: int) -> int:
        return kernels.decode_num_splits(num_decode, num_kv_heads, max_context)

    return split_fn


def decode_shapes(
    split_fn: SplitFn, block_size: int, max_model_len: int, max_decodes: int
) -> dict[tuple[int, str], tuple[int, int]]:
    """(split count, width class) -> (number of decodes, table width in blocks) of the smallest step
    that gets it, for every pair a step of 1 to max_decodes decodes can get.

    A split count is min(a function of the decode count, a function of the table width): it grows
    with the width and shrinks with the count. So the narrowest width of each (count at one decode,
    width class) reaches, over the decode counts, every pair any step can get; the tests check this
    against a brute force over all counts and widths."""
    widths: dict[tuple[int, str], int] = {}
    for num_blocks in range(1, -(-max_model_len // block_size) + 1):
        widths.setdefault((split_fn(1, num_blocks * block_size), width_class(num_blocks)), num_blocks)
    shapes: dict[tuple[int, str], tuple[int, int]] = {}
    for num_blocks in sorted(widths.values()):
        for num_decodes in range(1, max_decodes + 1):
            key = (split_fn(num_decodes, num_blocks * block_size), width_class(num_blocks))
            shapes.setdefault(key, (num_decodes, num_blocks))
    return shapes


def warmup_plan(
    block_size: int, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int, split_fn: SplitFn
) -> list[WarmupStep]:
    """The steps a warm-up runs (see the module doc). Every context fits max_model_len, every step
    the token budget, and every step at most max_num_seqs sequences (a mixed step's prefill is one)."""
    steps: list[WarmupStep] = []
    longest_prompt = min(max_num_batched_tokens, max_model_len - 1)  # a prompt leaves room for one token
    for num_blocks in PREFILL_BLOCKS:
        n = min(num_blocks * block_size, longest_prompt)
        if n >= 2 and all(n != s.prefills[0][1] for s in steps):  # one token would be decode-shaped
            steps.append(WarmupStep("prefill", prefills=((0, n),), table_blocks=-(-n // block_size)))
    for rows in GEMM_ROWS:  # every tile bucket a step's token count reaches, several prompts past the longest
        prompts = _prompt_lengths(min(rows, max_num_batched_tokens), longest_prompt, max_num_seqs)
        if prompts and all(sum(n for _, n in s.prefills) != sum(prompts) for s in steps if s.kind == "prefill"):
            table_blocks = -(-max(prompts) // block_size)
            steps.append(WarmupStep("prefill", prefills=tuple((0, n) for n in prompts), table_blocks=table_blocks))
    cached = CACHED_BLOCKS * block_size
    chunk = min(block_size + block_size // 2, max_num_batched_tokens, max_model_len - 1 - cached)
    if chunk >= 2:  # crosses a block boundary after the cached blocks
        steps.append(
            WarmupStep("chunked_prefill", prefills=((cached, chunk),), table_blocks=-(-(cached + chunk) // block_size))
        )
    decode_only = decode_shapes(split_fn, block_size, max_model_len, min(max_num_seqs, max_num_batched_tokens))
    for (num_splits, _), (num_decodes, num_blocks) in decode_only.items():
        decodes = (min(num_blocks * block_size, max_model_len),) * num_decodes
        steps.append(WarmupStep("decode", decodes=decodes, num_splits=num_splits, table_blocks=num_blocks))
    for rows in M_BUCKETS:  # the LM head's rows (a step's sequences) in every tile bucket up to max_num_seqs
        num_decodes = min(rows, max_num_seqs, max_num_batched_tokens)
        if all(len(s.decodes) != num_decodes for s in steps if s.kind == "decode"):
            context = min(block_size, max_model_len)  # one-block tables
            num_splits = split_fn(num_decodes, block_size)
            steps.append(WarmupStep("decode", decodes=(context,) * num_decodes, num_splits=num_splits, table_blocks=1))
    # Beside one prompt of at most one block, so the decodes set the table width.
    mixed = decode_shapes(split_fn, block_size, max_model_len, min(max_num_seqs - 1, max_num_batched_tokens - 2))
    for (num_splits, _), (num_decodes, num_blocks) in mixed.items():
        decodes = (min(num_blocks * block_size, max_model_len),) * num_decodes
        prompt_len = min(block_size, max_num_batched_tokens - num_decodes, max_model_len - 1)
        if prompt_len >= 2:  # a one-token prompt chunk would be decode-shaped
            prompt = ((0, prompt_len),)
            steps.append(WarmupStep("mixed", prompt, decodes, num_splits=num_splits, table_blocks=num_blocks))
    return steps


def _prompt_lengths(rows: int, longest: int, max_prompts: int) -> list[int]:
    """Prompt lengths of a prefill-only step of `rows` tokens: as few prompts as hold them, each at
    most `longest` tokens and at least 2 (one token would be decode-shaped), at most `max_prompts`
    of them (fewer rows then); [] where no prompt of 2 tokens fits."""
    if longest < 2 or rows < 2:
        return []
    count = min(-(-rows // longest), max_prompts)
    rows = min(rows, count * longest)
    lengths = [rows // count + (i < rows % count) for i in range(count)]  # as even as can be: all >= 2
    return lengths if min(lengths) >= 2 else lengths[:-1]


def _request(
    seq_id: int, num_tokens: int, num_computed: int, block_size: int, first_block: int, num_blocks: int
) -> Request:
    """A greedy request whose tokens up to num_computed count as cached, holding consecutive block
    ids from first_block (wrapping around the pool)."""
    req = Request(seq_id, seq_id, [0] * num_tokens, SamplingParams(temperature=0.0), 0.0)
    req.num_computed_tokens = num_computed
    req.block_ids = [(first_block + i) % num_blocks for i in range(-(-num_tokens // block_size))]
    return req


def batch_for(step: WarmupStep, block_size: int, num_blocks: int) -> ScheduledBatch:
    """The step as a batch of hand-made requests: decodes first, then prefills; ids are negative,
    never an engine seq_id."""
    requests: list[Request] = []
    num_new: list[int] = []
    next_block = 0
    for context in step.decodes:
        requests.append(_request(-1 - len(requests), context, context - 1, block_size, next_block, num_blocks))
        num_new.append(1)
        next_block += len(requests[-1].block_ids)
    for cached, new in step.prefills:
        requests.append(_request(-1 - len(requests), cached + new, cached, block_size, next_block, num_blocks))
        num_new.append(new)
        next_block += len(requests[-1].block_ids)
    return ScheduledBatch(requests, num_new)


def run_warmup(runner: ModelRunner, plan: list[WarmupStep], num_blocks: int) -> Optional[ForwardOutput]:
    """Run every step of the plan on `runner`; return the last step's output (None for an empty plan).

    Decode-only steps run eagerly (a `num_computed` override keeps them off the CUDA graphs): the
    eager decode kernels serve drafter passes and any decode the graphs cannot take, and the graphs
    are captured separately (`capture_graphs`)."""
    out = None
    for step in plan:
        batch = batch_for(step, runner.block_size, num_blocks)
        if step.kind == "decode":
            out = runner.forward(batch, num_computed=[r.num_computed_tokens for r in batch.requests])
        else:
            out = runner.forward(batch)
    return out


def capture_graphs(runner: ModelRunner, max_num_seqs: int) -> list[int]:
    """Capture every CUDA-graph bucket a decode batch of up to max_num_seqs uses; return the buckets
    (none without graphs). A failed capture turns the graphs off, as a failed lazy capture does."""
    graphs = runner.graphs
    if graphs is None or graphs.is_broken:
        return []
    limit = pick_bucket(graphs.buckets, min(max_num_seqs, graphs.max_batch))
    try:
        graphs.capture_all(max_num_seqs)
    except Exception as exc:  # noqa: BLE001 - any failed capture means: this model cannot be graphed
        log.warning("CUDA graph capture failed during warm-up (%s); decoding eagerly from now on", exc)
        graphs.is_broken = True
        return []
    return [b for b in graphs.buckets if limit is not None and b <= limit]


def warm_sampler(sample: Callable[..., torch.Tensor], logits: torch.Tensor) -> None:
    """Draw once with every variant of the sampling kernels a run can launch on these logits (their
    dtype and vocabulary): the race without a threshold (temperature and greedy rows) and with one
    (top-k, top-p, both), and the spilled rows' thresholds (top-p without top-k). The row count is
    not specialized on (kernels/triton_sampling.py), so one draw of each serves every batch size.
    Every sampled row is seeded: an unseeded one would advance the sampler's generator and change
    later unseeded draws."""
    row = logits[:1].expand(3, -1).contiguous()  # (3, vocab_size): contiguous, as a step's rows are
    for params in (
        [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0)],
        [
            SamplingParams(temperature=0.8, top_k=40, seed=0),
            SamplingParams(temperature=0.8, top_p=0.9, seed=0),
            SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=0),
        ],
    ):
        sample(row[: len(params)], params, [None if p.is_greedy else 0 for p in params], [0] * len(params))


def warm_up(
    runners: list[ModelRunner],
    sampler: Sampler,
    num_blocks: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> dict[str, Any]:
    """Run the plan on every runner (the target's, and a draft model's), warm the sampler on the
    target's logits, capture the CUDA graphs, and zero the expert-load counters the forwards moved;
    return what ran: {"num_steps", "graph_buckets", "seconds"}."""
    t0 = time.perf_counter()
    num_steps = 0
    buckets: list[int] = []
    for i, runner in enumerate(runners):
        split_fn = decode_split_fn(runner.model.kernels, runner.model.spec.num_kv_heads)
        plan = warmup_plan(runner.block_size, max_model_len, max_num_batched_tokens, max_num_seqs, split_fn)
        out = run_warmup(runner, plan, num_blocks)
        if out is not None and i == 0:
            warm_sampler(sampler.draw, out.logits)
        num_steps += len(plan)
        buckets = capture_graphs(runner, max_num_seqs) or buckets
        runner.model.reset_expert_token_counts()
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d steps, CUDA graph buckets %s, %.1fs", num_steps, buckets or "none", seconds)
    return {"num_steps": num_steps, "graph_buckets": buckets, "seconds": round(seconds, 2)}
