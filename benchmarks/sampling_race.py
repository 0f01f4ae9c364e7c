"""The CPU sampler by the Gumbel race against the inverse-CDF sampler it replaced, in one process.

    python -m benchmarks.sampling_race                       # both vocabularies, 1 to 128 rows
    python -m benchmarks.sampling_race --vocab 49152 --rows 8 --rounds 9
    python -m benchmarks.sampling_race --agreement 20000     # also: tokens vs the torch reference

For SmolLM2's vocabulary (49152) and Qwen3's (151936), at 1, 8, 32 and 128 rows of float32 logits,
and each kind of batch (greedy, temperature 0.7, + top-k 50, + top-p 0.9, + both, and a mix of all
of them with a fifth of the rows unseeded): milliseconds per
`Sampler.draw` of the engine's sampler now (the native race, thresholds without a host sync) and of
the previous CPU sampler (one uniform per row inverting the masked CDF; its code is kept below for
this comparison only). Each round times both back to back in alternating order; each figure is
the fastest round (interference only adds time), and the ratio is old / new of those, so above 1
the new sampler is faster. With --threads 1 the figures are the thread's CPU time (a shared
machine's preemptions would swamp the wall clock), with more threads wall time. Two kinds of logits: "zipf",
an LM's shape (a row's k-th most likely token at -a log k, a from 1 to 2 across rows, plus noise:
top-p 0.9 keeps a few to about a hundred tokens), and "normal" (N(0, 3^2): nuclei of hundreds of
tokens, past the 128 candidates, so top-p rows take the spill path on most rows).

--agreement N draws N seeded temperature rows (vocabulary 49152) with the native kernel and with the
torch reference and counts the tokens that differ: the rows whose two best race keys are within the
last bit of `log` (kernels/sampling.py), the float limit of "the same tokens on CPU and GPU".

--write-docs writes the table to docs/benchmarks.md (section sampling-race): per kind of batch,
old / new and the new sampler's milliseconds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.engine.config import SamplingParams
from batchrun.engine.sampler import CANDIDATES, Sampler, draw_from_probs, upload
from batchrun.kernels.sampling import cpu_race, gumbel_sample_reference, pack_rows

VOCABS = (49152, 151936)  # SmolLM2's, Qwen3's
ROWS = (1, 8, 32, 128)
KINDS: dict[str, list[SamplingParams]] = {
    "greedy": [SamplingParams(temperature=0.0)],
    "temperature": [SamplingParams(temperature=0.7)],
    "top_k": [SamplingParams(temperature=0.7, top_k=50)],
    "top_p": [SamplingParams(temperature=0.7, top_p=0.9)],
    "top_k_top_p": [SamplingParams(temperature=0.7, top_k=50, top_p=0.9)],
    "mixed": [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    ],
}


class InverseCdfSampler(Sampler):
    """The CPU draw before the race (kept here only to measure against): per group of sampled rows
    one uniform per row from (seed, position) or the generator, inverted through the CDF of the
    masked softmax; truncated rows through their top-k candidates, widened 8x while a kept set
    reaches past them (a host sync per widening on a GPU)."""

    @torch.inference_mode()
    def draw(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[Optional[int]],
        positions: Sequence[int],
    ) -> torch.Tensor:
        num_rows, vocab = logits.shape
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1)
        tokens = torch.empty(num_rows, dtype=torch.int64)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        if greedy:
            rows = torch.tensor(greedy)
            tokens[rows] = logits[rows].argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        for group in (
            [i for i in sampled if _is_truncated(params[i], vocab)],
            [i for i in sampled if not _is_truncated(params[i], vocab)],
        ):
            if not group:
                continue
            sub = [params[i] for i in group]
            rows = logits if len(group) == num_rows else logits[torch.tensor(group)]
            s = rows.float() / upload([p.temperature for p in sub], torch.float32, logits.device)[:, None]
            u = self.uniforms([seeds[i] for i in group], [positions[i] for i in group], 0, logits.device)
            if _is_truncated(sub[0], vocab):
                ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in sub]
                ps = [p.top_p if p.top_p < 1.0 else 2.0 for p in sub]
                drawn = _truncate(
                    s, torch.tensor(ks), torch.tensor(ps, dtype=torch.float64), u, max(CANDIDATES, *ks), not all(ks)
                )
            else:
                drawn = draw_from_probs(torch.softmax(s, dim=-1), u)
            tokens[torch.tensor(group)] = drawn
        return tokens


def _is_truncated(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0


def _truncate(
    s: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, width: int, any_without_k: bool
) -> torch.Tensor:
    """The previous sampler's draw from the kept set of each row: (B,) int64."""
    vocab = s.shape[-1]
    width = min(vocab, width)
    vals, idx = torch.topk(s, width, dim=-1)
    has_k = top_k > 0
    kth = vals.gather(1, (torch.where(has_k, top_k, width) - 1)[:, None])
    in_k = vals >= kth
    probs = torch.softmax(vals.masked_fill(~in_k, float("-inf")), dim=-1)
    if any_without_k:
        probs = torch.where(has_k[:, None], probs, torch.softmax(s, dim=-1).gather(1, idx))
    probs = probs.double()
    before = probs.cumsum(dim=-1) - probs
    num = (in_k & (before < top_p[:, None])).sum(dim=-1)
    threshold = vals.gather(1, (num - 1)[:, None]).squeeze(1)
    keep = vals >= threshold[:, None]
    weights = torch.where(keep, (vals - vals[:, :1]).exp(), 0.0).double()
    cdf = weights.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    pick = torch.minimum(pick, keep.sum(dim=-1, keepdim=True) - 1)
    token = idx.gather(1, pick).squeeze(1)
    if width < vocab:
        spill = (keep[:, -1] | (has_k & in_k[:, -1])).nonzero().squeeze(1)
        if spill.numel():
            sub = _truncate(s[spill], top_k[spill], top_p[spill], u[spill], width * 8, any_without_k)
            token = token.index_copy(0, spill, sub)
    return token


def _seconds(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call: of this thread's CPU time when torch runs one thread (the kernels then run
    on it too), which a loaded machine's preemptions do not inflate; else of the wall clock."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    for _ in range(reps):
        fn()
    return (clock() - start) / reps


def make_logits(shape: str, num_rows: int, vocab: int) -> torch.Tensor:
    """(num_rows, vocab) float32 logits of the named shape (module doc)."""
    g = torch.Generator().manual_seed(num_rows)
    if shape == "normal":
        return torch.randn(num_rows, vocab, generator=g) * 3
    exponent = 1.0 + torch.rand(num_rows, 1, generator=g)  # (rows, 1) in [1, 2)
    by_rank = -exponent * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))  # (rows, vocab)
    by_rank = by_rank + torch.randn(num_rows, vocab, generator=g) * 0.3
    order = torch.argsort(torch.rand(num_rows, vocab, generator=g), dim=-1)  # the ranks among the ids
    return torch.empty_like(by_rank).scatter_(1, order, by_rank)


def measure(shape: str, vocab: int, num_rows: int, kind: str, rounds: int, reps: int) -> dict[str, float]:
    """ms per draw of each sampler in its fastest round, and their ratio old / new."""
    logits = make_logits(shape, num_rows, vocab)
    params = [KINDS[kind][i % len(KINDS[kind])] for i in range(num_rows)]
    seeds = [None if kind == "mixed" and i % 5 == 4 else 1000 + i for i in range(num_rows)]
    positions = [17] * num_rows
    new, old = Sampler(0, race=cpu_race()), InverseCdfSampler(0)
    calls = {
        "new": lambda: new.draw(logits, params, seeds, positions),
        "old": lambda: old.draw(logits, params, seeds, positions),
    }
    for fn in calls.values():
        fn()  # first calls: the kernel library, topk workspaces
    times: dict[str, list[float]] = {"new": [], "old": []}
    for r in range(rounds):
        for name in ("new", "old") if r % 2 == 0 else ("old", "new"):
            times[name].append(_seconds(calls[name], reps))
    # The fastest round of each: interference (other processes, page faults of fresh allocations
    # on a shared machine) only ever adds time.
    return {
        "new_ms": min(times["new"]) * 1e3,
        "old_ms": min(times["old"]) * 1e3,
        "ratio": min(times["old"]) / min(times["new"]),
    }


def agreement(num_rows: int, vocab: int = 49152, chunk: int = 256) -> tuple[int, int]:
    """(tokens that differ, rows drawn): the native race against the torch reference."""
    race = cpu_race()
    differ = 0
    g = torch.Generator().manual_seed(1)
    for start in range(0, num_rows, chunk):
        n = min(chunk, num_rows - start)
        logits = torch.randn(n, vocab, generator=g) * 3
        rows = torch.from_numpy(pack_rows(range(start, start + n), [5] * n, [0.7] * n))
        differ += int((race(logits, rows, None) != gumbel_sample_reference(logits, rows)).sum())
    return differ, num_rows


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="*", default=list(VOCABS))
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--logits", nargs="*", default=["zipf", "normal"], choices=["zipf", "normal"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="draws per timing")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--agreement", type=int, default=0, help="rows to compare with the torch reference")
    ap.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = "thread CPU" if torch.get_num_threads() == 1 else "wall"
    print(f"Sampler.draw, float32 logits, threads={torch.get_num_threads()}, fastest of {args.rounds} rounds ({clock})")
    print(f"{'logits':<7} {'vocab':>7} {'rows':>5} {'kind':<12} {'old ms':>9} {'new ms':>9} {'old/new':>8}")
    table = []
    for shape in args.logits:
        for vocab in args.vocab:
            for num_rows in args.rows:
                cells = []
                for kind in args.kinds:
                    row = measure(shape, vocab, num_rows, kind, args.rounds, args.reps)
                    cells.append(f"{row['ratio']:.2f}x ({row['new_ms']:.2f} ms)")
                    print(
                        f"{shape:<7} {vocab:>7} {num_rows:>5} {kind:<12} {row['old_ms']:>9.2f} {row['new_ms']:>9.2f}"
                        f" {row['ratio']:>7.2f}x",
                        flush=True,
                    )
                table.append([shape, vocab, num_rows, *cells])
    notes = (
        f"Old / new time of one `Sampler.draw` (above 1: the race is faster), the new draw's time in brackets; "
        f"float32 logits, {torch.get_num_threads()} thread(s), {clock} time, the fastest of {args.rounds} "
        f"alternating rounds of {args.reps} draws. Kinds: temperature 0.7, top-k 50, top-p 0.9, and a mix of "
        "those and greedy rows."
    )
    if args.agreement:
        differ, drawn = agreement(args.agreement)
        line = f"native race vs torch reference: {differ} of {drawn} tokens differ (vocab 49152, temperature 0.7)"
        print(line)
        notes += f" Tokens: {line}."
    if args.write_docs:
        command = script_command("benchmarks.sampling_race", argv)
        header = ["logits", "vocab", "rows", *args.kinds]
        write_section(
            "sampling-race", command, stamp(), markdown_table(header, table), notes, "Sampling: the race on the CPU"
        )


if __name__ == "__main__":
    main()
