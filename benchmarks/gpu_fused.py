"""benchmarks.gpu's fused-GEMM phase: each fused bf16 projection of a Triton kernel set
(kernels/triton_fused_gemm.py: qkv + q/k-norm + rotary + KV write, gate/up + silu(gate) * up, the
LM head's logits) against the unfused path it replaces (cuBLAS's GEMM, then the separate Triton
kernel: the kernel set bound with fuse=False) and against a float32 reference, at M = 1, 16 and
300 rows on Qwen3-0.6B's and Llama-3-8B's projection shapes; then both paths timed at those rows,
as start-up tuning times them to choose (kernels/tuning.py: Triton's do_bench, 5 ms warm-up, 20 ms
of repetitions).

Nothing else checks these sums on a GPU: Triton's interpreter upcasts bf16 dot operands
(triton_attention._dot_f32), and the engine phase's graph-vs-eager check compares the fused path
with itself. Each call goes through the kernel set as the model calls it (qkv_project,
gate_up_act, lm_head_logits), and the fused kernel is also called directly at the tile the set
reads: the set's output must equal it bitwise, so a row cannot pass by falling back to the unfused
path. The kernel sets are bound with the static tables (fused at every row bucket, the table's
tiles: what engine.tune_kernels=false runs), so nothing is tuned or timed before the rows' own
timing; Triton's compile counts (benchmarks.compile_counts) are taken after the checked calls and
after the timed ones, and a variant compiled in between fails the phase.

Tolerance: TOLERANCE (= 4 u, u = 2**-8 the unit roundoff of bf16's 8-bit significand), norm-wise
relative error ||got - want|| / ||want||, the same against the unfused result and against float32.
Both paths sum K bf16 products in float32 (each product exact there) and round the sum to bf16
once; the two sums differ only in order, by about sqrt(K) * 2**-24 of sum |x * w| (a few 1e-4 of
|y| at K = 4096), so their roundings are equal or one ulp (at most 2 u |y|) apart, and each is
within u of the exact value. The epilogues (q/k-norm, rotary, silu x up) are the same float32 op
sequence with the same roundings on both paths, at most two or three more roundings of at most u
each. 4 u bounds that norm-wise with room for the float32 reference's own rounding; a kernel that
is wrong (a bf16 accumulator, a missing norm or rotation, a wrong head, row or cache slot) is
orders of magnitude above it. For the qkv kind the KV cache rows at the tokens' slots are compared
too, and every other slot (including those of -1, CUDA-graph padding) must keep its old bytes.

In --smoke the same code runs at tiny shapes and fewer rows on the CPU over a simulated sm_90's
kernel set (the kernels in Triton's interpreter, whose bf16 dots are upcast, and whose float32 to
bf16 conversions truncate: SMOKE_TOLERANCE) and times nothing.

A library module (`python -m benchmarks.gpu --only fused` runs it).
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from benchmarks import compile_counts
from benchmarks.cases import rel_error
from benchmarks.gpu_report import NO_CUDA, Report

FUSED = "fused GEMMs"  # benchmarks.gpu's phase
U_BF16 = 2.0**-8
TOLERANCE = 4 * U_BF16  # see the module doc
ROWS = (1, 16, 300)  # a decode step, a small batch, a prefill chunk past the last tile bucket
# --smoke: the interpreter runs the unfused qkv kernel one program per token and head (seconds at
# 300 rows); 33 rows still take the 64-row tile bucket, several row tiles of the decode ones
SMOKE_ROWS = (1, 16, 33)
# The interpreter converts float32 to bf16 by truncation (up to one ulp, not half of one): each
# rounding's error doubles, so --smoke allows twice the tolerance
SMOKE_TOLERANCE = 2 * TOLERANCE
KINDS = {"qkv": "qkv+norm+rope+KV write", "silu_mul": "gate/up+SiLU", "logits": "logits"}
BLOCK_SIZE = 16
NUM_POSITIONS = 4096  # rotary table rows; the tokens' positions are drawn from them


@dataclass(frozen=True)
class Projections:
    """One model's projections as the fused GEMMs see them."""

    model: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool
    intermediate: int
    vocab: int
    rope_theta: float


# The GEMM phase's models (benchmarks.gpu_gemm.SHAPES: the same qkv and gate/up weights)
MODELS = (
    Projections("Qwen3-0.6B", 1024, 16, 8, 128, True, 3072, 151936, 1e6),
    Projections("Llama-3-8B", 4096, 32, 8, 128, False, 14336, 128256, 5e5),
)
# --smoke: the same two layouts (q/k-norm or not) at sizes the interpreter runs in seconds;
# head_dim 16 pads each rotary half to tl.dot's 16 columns
SMOKE_MODELS = (
    Projections("tiny Qwen3", 64, 4, 2, 32, True, 96, 384, 1e6),
    Projections("tiny Llama", 64, 4, 2, 16, False, 96, 256, 5e5),
)


@dataclass
class Part:
    """One compared output of a case: the fused path's, the unfused path's, float32's (each flat)."""

    name: str
    fused: torch.Tensor
    unfused: torch.Tensor
    reference: torch.Tensor
    note: str = ""  # a further check that failed, said in the row


@dataclass
class Case:
    """One kind at M rows: the two paths as the model calls them (timed), and the comparison."""

    fused: Callable[[], Any]
    unfused: Callable[[], Any]
    compare: Callable[[], list[Part]]


def _randn(shape: tuple[int, ...], gen: torch.Generator, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """Normal bf16 values drawn on `device` by `gen`, a generator of that device (a vocabulary's
    LM head is half a billion of them: drawn where they are used)."""
    return (torch.randn(shape, generator=gen, device=device) * scale).to(torch.bfloat16)


def _linear(k: int, n: int, gen: torch.Generator, device: torch.device) -> tuple[nn.Linear, nn.Linear]:
    """A plain bf16 nn.Linear (K -> N; weights as HF initializes them) and its float32 copy."""
    weight = _randn((n, k), gen, device, 0.02)  # (N, K)
    proj = nn.Linear(k, n, bias=False, device="meta")
    proj.weight = nn.Parameter(weight, requires_grad=False)
    proj32 = nn.Linear(k, n, bias=False, device="meta")
    proj32.weight = nn.Parameter(weight.float(), requires_grad=False)
    return proj, proj32


def _flat(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.float().flatten() for t in tensors])


def _same(got: Any, want: Any) -> bool:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    return all(torch.equal(a, b) for a, b in zip(got, want))


def qkv_rows(p: Projections, fused: Any, unfused: Any, device: torch.device, gen: torch.Generator):
    """m -> Case of the qkv projection with q/k-norm, rotary and the KV write."""
    from batchrun.kernels.binding import reference_kernels
    from batchrun.kernels.kv_layout import new_kv_cache
    from batchrun.kernels.qkv_heads import QKVHeads
    from batchrun.kernels.triton_fused_gemm import gemm_qkv_norm_rope_write

    n = (p.num_heads + 2 * p.num_kv_heads) * p.head_dim
    proj, proj32 = _linear(p.hidden, n, gen, device)
    norms = (torch.rand(2, p.head_dim, generator=gen, device=device) + 0.5).to(torch.bfloat16) if p.qk_norm else None
    heads = QKVHeads(p.num_heads, p.num_kv_heads, p.head_dim, *(norms if norms is not None else (None, None)))
    heads32 = QKVHeads(p.num_heads, p.num_kv_heads, p.head_dim, *(norms.float() if norms is not None else (None, None)))
    inv_freq = 1.0 / p.rope_theta ** (torch.arange(0, p.head_dim, 2).float() / p.head_dim)
    angles = torch.arange(NUM_POSITIONS).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1).to(device)  # (NUM_POSITIONS, head_dim): the model's tables
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    gpu = fused.target.gpu

    def case(m: int) -> Case:
        x = _randn((m, p.hidden), gen, device)  # (M, hidden)
        positions = torch.randint(0, NUM_POSITIONS, (m,), generator=gen, device=device)
        num_blocks = -(-2 * m // BLOCK_SIZE) + 1
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=device)[:m]
        slots[3::7] = -1  # CUDA-graph padding: nothing written
        kept = slots[slots >= 0]
        initial = _randn((2, num_blocks, BLOCK_SIZE, p.num_kv_heads, p.head_dim), gen, device)

        def caches() -> tuple[torch.Tensor, torch.Tensor]:
            k_cache, v_cache = (
                new_kv_cache(num_blocks, BLOCK_SIZE, p.num_kv_heads, p.head_dim, torch.bfloat16, device) for _ in "kv"
            )
            k_cache.copy_(initial[0])
            v_cache.copy_(initial[1])
            return k_cache, v_cache

        timed = {"fused": caches(), "unfused": caches()}

        def run(kernels: Any, cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return kernels.qkv_project(x, proj, heads, cos, sin, *cache, slots, positions)

        def compare() -> list[Part]:
            got_cache, unf_cache, direct_cache = caches(), caches(), caches()
            got, unf = run(fused, got_cache), run(unfused, unf_cache)
            config = fused.tuning.tile("qkv_rope", m, n, p.hidden, 0, x.dtype, gpu)
            direct = gemm_qkv_norm_rope_write(
                x, proj.weight, None, heads, cos, sin, *direct_cache, slots, positions, config, gpu
            )
            # float32 throughout, over the bf16 inputs upcast, into a scratch cache of every token
            scratch = new_kv_cache(-(-m // BLOCK_SIZE), BLOCK_SIZE, p.num_kv_heads, p.head_dim, torch.float32, device)
            every = torch.arange(m, device=device)
            want = reference_kernels().qkv_project(
                x.float(), proj32, heads32, cos.float(), sin.float(), scratch, scratch.clone(), every, positions
            )
            keep = slots >= 0
            untouched = torch.ones(num_blocks * BLOCK_SIZE, dtype=torch.bool, device=device)
            untouched[kept] = False
            before = initial.flatten(1, 2)[:, untouched]
            same = _same(got, direct) and all(torch.equal(a, b) for a, b in zip(got_cache, direct_cache))
            outside = [
                f"the {name} path wrote outside the tokens' slots"
                for name, cache in (("fused", got_cache), ("unfused", unf_cache))
                if not torch.equal(torch.stack([c.flatten(0, 1)[untouched] for c in cache]), before)
            ]

            def rows(cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
                return _flat(*(c.flatten(0, 1)[kept] for c in cache))

            return [
                Part("q, k, v", _flat(*got), _flat(*unf), _flat(*want), "" if same else NOT_FUSED),
                Part(
                    "KV cache slots",
                    rows(got_cache),
                    rows(unf_cache),
                    _flat(want[1][keep], want[2][keep]),
                    "; ".join(outside),
                ),
            ]

        return Case(lambda: run(fused, timed["fused"]), lambda: run(unfused, timed["unfused"]), compare)

    return case


def silu_mul_rows(p: Projections, fused: Any, unfused: Any, device: torch.device, gen: torch.Generator):
    """m -> Case of the gate/up projection with silu(gate) * up."""
    from batchrun.kernels.binding import reference_kernels
    from batchrun.kernels.triton_fused_gemm import gemm_silu_mul

    proj, proj32 = _linear(p.hidden, 2 * p.intermediate, gen, device)
    gpu = fused.target.gpu

    def case(m: int) -> Case:
        x = _randn((m, p.hidden), gen, device)

        def compare() -> list[Part]:
            got = fused.gate_up_act(x, proj, "silu")
            config = fused.tuning.tile("silu_mul", m, 2 * p.intermediate, p.hidden, 0, x.dtype, gpu)
            direct = gemm_silu_mul(x, proj.weight, config, gpu)
            want = reference_kernels().gate_up_act(x.float(), proj32, "silu")
            unf = unfused.gate_up_act(x, proj, "silu")
            return [Part("out", _flat(got), _flat(unf), _flat(want), "" if _same(got, direct) else NOT_FUSED)]

        return Case(lambda: fused.gate_up_act(x, proj, "silu"), lambda: unfused.gate_up_act(x, proj, "silu"), compare)

    return case


def logits_rows(p: Projections, fused: Any, unfused: Any, device: torch.device, gen: torch.Generator):
    """m -> Case of the LM head with the logits' float32 cast."""
    from batchrun.kernels.triton_fused_gemm import gemm_logits

    head, head32 = _linear(p.hidden, p.vocab, gen, device)
    gpu = fused.target.gpu

    def case(m: int) -> Case:
        x = _randn((m, p.hidden), gen, device)

        def compare() -> list[Part]:
            got = fused.lm_head_logits(x, head)
            direct = gemm_logits(
                x, head.weight, fused.tuning.tile("logits", m, p.vocab, p.hidden, 0, x.dtype, gpu), gpu
            )
            want = head32(x.float())
            unf = unfused.lm_head_logits(x, head)
            return [
                Part("logits", got.flatten(), unf.flatten(), want.flatten(), "" if _same(got, direct) else NOT_FUSED)
            ]

        return Case(lambda: fused.lm_head_logits(x, head), lambda: unfused.lm_head_logits(x, head), compare)

    return case


NOT_FUSED = "the kernel set's output is not the fused kernel's"
CASES = {"qkv": qkv_rows, "silu_mul": silu_mul_rows, "logits": logits_rows}


@contextlib.contextmanager
def _float32_matmuls() -> Iterator[None]:
    """IEEE float32 matmuls for the reference (no TF32, whatever the process set)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _time_us(fn: Callable[[], Any]) -> float:
    import triton.testing

    return 1e3 * float(triton.testing.do_bench(fn, warmup=5, rep=20))


def check_fused(device: torch.device, smoke: bool, report: Report, deadline_s: Optional[float] = None) -> None:
    """Fill report.data["fused"] and the summary rows. `deadline_s`: seconds this phase may take;
    (model, kind) groups not started by then are left out (and said so)."""
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import SM90, find_target

    start = time.perf_counter()
    target = find_target("cpu", simulate=SM90) if smoke else find_target(device)
    fused = bind_kernels(target, torch.bfloat16)  # the tables' choices: fused everywhere, the table's tiles
    unfused = bind_kernels(target, torch.bfloat16, fuse=False)
    section: dict[str, Any] = {
        "note": NO_CUDA if smoke else "",
        "dtype": "bfloat16",
        "tolerance": SMOKE_TOLERANCE if smoke else TOLERANCE,
        "m": list(SMOKE_ROWS if smoke else ROWS),
        "tuning": fused.tuning.source,
        "cublas_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "rows": [],
        "compiles_during_timing": {},
    }
    report.data["fused"] = section
    print(
        f"  {'fused GEMM':<40} {'vs unfused':>21} {'vs float32':>21} {'fused':>9} {'unfused':>9}\n"
        f"  {'':<40} {'max abs':>10} {'rel':>10} {'fused':>10} {'unfused':>10} {'us':>9} {'us':>9}  ok",
        flush=True,
    )
    cut = 0
    gen = torch.Generator(device).manual_seed(0)
    with torch.inference_mode(), _float32_matmuls():
        for p in SMOKE_MODELS if smoke else MODELS:
            for kind, rows_of in CASES.items():
                if deadline_s is not None and time.perf_counter() - start > deadline_s:
                    cut += 1
                    continue
                _check_group(p, kind, rows_of, fused, unfused, device, gen, smoke, section)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    section["cut_groups"] = cut
    _summarize(section, smoke, report, cut)


def _check_group(
    p: Projections,
    kind: str,
    rows_of: Callable[..., Callable[[int], Case]],
    fused: Any,
    unfused: Any,
    device: torch.device,
    gen: torch.Generator,
    smoke: bool,
    section: dict[str, Any],
) -> None:
    """One (model, kind) over one set of weights: every M checked (which compiles), then timed."""
    label = f"{p.model} {KINDS[kind]}"
    timed: list[tuple[list[dict[str, Any]], Case]] = []
    try:
        case_at = rows_of(p, fused, unfused, device, gen)
    except Exception as exc:  # noqa: BLE001 - one model's weights that cannot be made must not hide the rest
        traceback.print_exc()
        case_at = None
        error = repr(exc)
    for m in section["m"]:
        base = {"model": p.model, "kind": kind, "m": m}
        try:
            if case_at is None:
                raise RuntimeError(error)
            case = case_at(m)
            parts = case.compare()
        except Exception as exc:  # noqa: BLE001 - a failing row is recorded, the rest go on
            traceback.print_exc()
            row = {**base, "part": KINDS[kind], "error": repr(exc), "ok": False}
            section["rows"].append(row)
            print(f"  {label + f' M={m}':<40} FAILED: {exc!r}", flush=True)
            continue
        rows = [_compare(base, part, section["tolerance"]) for part in parts]
        section["rows"].extend(rows)
        timed.append((rows, case))
        if smoke:
            for row in rows:
                _print_row(row)
    if smoke or not timed:
        return
    before = compile_counts.snapshot()
    for rows, case in timed:
        try:
            fused_us, unfused_us = _time_us(case.fused), _time_us(case.unfused)
        except Exception as exc:  # noqa: BLE001 - recorded in the row
            traceback.print_exc()
            rows[0].update(error=f"timing: {exc!r}", ok=False)
        else:
            rows[0].update(fused_us=fused_us, unfused_us=unfused_us, fused_is_faster=fused_us <= unfused_us)
        for row in rows:
            _print_row(row)
    after = compile_counts.snapshot()
    if before is not None and after is not None:
        section["compiles_during_timing"][label] = compile_counts.compiled_between(before, after)


def _compare(base: dict[str, Any], part: Part, tol: float) -> dict[str, Any]:
    max_abs, rel = rel_error(part.fused, part.unfused)
    max_abs_f32, rel_f32 = rel_error(part.fused, part.reference)
    _, rel_unfused_f32 = rel_error(part.unfused, part.reference)
    ok = rel <= tol and rel_f32 <= tol and not part.note
    row = {
        **base,
        "part": part.name,
        "max_abs_err": max_abs,
        "rel_err": rel,
        "max_abs_err_vs_float32": max_abs_f32,
        "rel_err_vs_float32": rel_f32,
        "unfused_rel_err_vs_float32": rel_unfused_f32,
        "ok": ok,
    }
    if part.note:
        row["error"] = part.note
    return row


def _print_row(row: dict[str, Any]) -> None:
    name = f"{row['model']} {KINDS[row['kind']] if row['part'] in ('out', 'logits', 'q, k, v') else 'qkv KV slots'}"
    name += f" M={row['m']}"
    if "rel_err" not in row:
        print(f"  {name:<40} FAILED: {row.get('error')}", flush=True)
        return

    def us(key: str) -> str:
        return f"{row[key]:9.1f}" if key in row else f"{'n/a':>9}"

    print(
        f"  {name:<40} {row['max_abs_err']:10.3e} {row['rel_err']:10.3e} {row['rel_err_vs_float32']:10.3e} "
        f"{row['unfused_rel_err_vs_float32']:10.3e} {us('fused_us')} {us('unfused_us')}  "
        + ("yes" if row["ok"] else f"NO{': ' + row['error'] if 'error' in row else ''}"),
        flush=True,
    )


def _summarize(section: dict[str, Any], smoke: bool, report: Report, cut: int) -> None:
    rows = section["rows"]
    models = " and ".join(dict.fromkeys(r["model"] for r in rows)) or "no model"
    for kind, what in KINDS.items():
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        bad = [r for r in mine if not r["ok"]]

        def worst(key: str, rows: list[dict[str, Any]] = mine) -> float:
            return max((r[key] for r in rows if key in r), default=math.nan)

        detail = "; ".join(f"{r['model']} M={r['m']} {r['part']}: {_why(r)}" for r in bad[:3])
        report.add(
            f"fused {what} vs unfused ({models}; M = {', '.join(map(str, section['m']))})",
            f"{len(mine) - len(bad)}/{len(mine)} within {section['tolerance']:.3g} (worst rel err vs unfused "
            f"{worst('rel_err'):.2e}, vs float32 {worst('rel_err_vs_float32'):.2e}, unfused vs float32 "
            f"{worst('unfused_rel_err_vs_float32'):.2e})" + (f"; FAILED: {detail}" if bad else ""),
            ok=not bad,
        )
        if smoke:
            report.add(f"fused {what} vs unfused time", NO_CUDA)
            continue
        for model in dict.fromkeys(r["model"] for r in mine):
            timed = [r for r in mine if r["model"] == model and "fused_us" in r]
            report.add(
                f"fused {what} vs unfused time, {model}",
                "; ".join(
                    f"M={r['m']}: {r['fused_us']:.1f} vs {r['unfused_us']:.1f} us "
                    f"({'fused' if r['fused_is_faster'] else 'unfused'} faster)"
                    for r in timed
                )
                or "not timed",
            )
    name = "fused GEMMs: Triton compiles during the timed calls"
    if compile_counts.interpreted():
        report.add(name, "n/a (interpreter: nothing compiles)")
    else:
        new = {k: v for k, v in section["compiles_during_timing"].items() if v}
        report.add(
            name,
            f"{sum(len(keys) for kernels in new.values() for keys in kernels.values())} new"
            + (f"; RECOMPILED in {', '.join(new)}" if new else ""),
            ok=not new,
        )
    if cut:
        report.add("fused GEMM groups left out", f"{cut} (out of the phase's time)")


def _why(row: dict[str, Any]) -> str:
    return row.get("error") or f"rel err {row['rel_err']:.2e} / {row['rel_err_vs_float32']:.2e} vs float32"
