"""The one-call GPU check: versions, kernels against their references, bandwidth, the engine's decode
step, CUDA graphs, memory and throughput; a table last and a JSON document with every measurement.

    python -m benchmarks.gpu                   # on a GPU: planned to fit 8 minutes on one H200
    python -m benchmarks.gpu --only kernels    # kernels | bandwidth | gemm | fused | engine | throughput (repeatable)
    python -m benchmarks.gpu --only decode8b   # the 8B decode phase (not in the default run)
    python -m benchmarks.gpu --smoke           # CPU: tiny shapes, kernels in Triton's interpreter
    python -m benchmarks.gpu --json PATH       # default: $OUT/bench-gpu.json, else ./bench-gpu.json

1. Kernels: each Triton kernel (paged attention decode and prefill over float, int8 and fp8 caches,
   the KV write and the fused q/k-norm + rotary + KV write into int8/fp8 caches, W8A16/W4A16 GEMMs,
   MoE grouped GEMM) against its torch reference on the device, random inputs, max |error| and
   relative error ||got - want|| / ||want|| (writes into quantized caches: bitwise). Then attention
   and the KV write on a cache whose last KV head starts past 2**31 elements
   (benchmarks.cases.far_blocks_case), where an int32 offset wraps: 2 x 6 GiB on the GPU; in --smoke
   virtual memory on the CPU, skipped where it cannot be mapped.
2. Bandwidth: a device copy (the HBM ceiling), then the decode attention kernel at the workload's
   shape as achieved KV bytes/s and its fraction of that ceiling (target >= 70%), a small sweep of
   its tile settings, and the same decode over int8 and fp8 caches (default tile and 64).
3. GEMMs (`--only gemm`, benchmarks.gpu_gemm): each weight mode's linear (int8, int4, fp8, W8A8, as the
   engine builds them) against cuBLAS bf16 at M = 1, 16, 64, 256 on Llama-3-8B's and Qwen3-0.6B's
   projection shapes: time, speed-up and % of the bytes-moved floor; a mode or call that fails is
   its row's error and the rest go on. In --smoke tiny shapes in the interpreter on a simulated
   sm_90, each mode's output checked against the float product.
3a. Fused GEMMs (`--only fused`, benchmarks.gpu_fused): the fused bf16 projections (qkv + q/k-norm +
   rotary + KV write, gate/up + SiLU, logits) against the unfused path (cuBLAS + the separate
   Triton kernel: the kernel set bound with fuse=False) and against float32, at M = 1, 16, 300 on
   the same models' shapes, within a stated bf16 tolerance, the KV cache slots too; both paths
   timed (what start-up tuning compares to choose). In --smoke tiny shapes in the interpreter.
3b. 8B decode (`--only decode8b`, benchmarks.gpu_decode; not in the default run: its ~5 minutes do not
   fit the 8-minute plan beside the rest): the engine's decode output tok/s on a Llama-3-8B-shaped
   random model at batch 1, 16 and 64 per weight mode (bf16, int8, int4, fp8, W8A8), with the ratio
   to bf16 from the same run; skipped, saying why, without the GPU memory for the bf16 model. In
   --smoke a tiny shape on the CPU through the same code, untimed.
4. Engine (`--only engine`), on the Qwen3-0.6B-shaped model: memory at the engine's default KV
   sizing (weights, KV bytes and blocks, peak allocated, free after construction); every CUDA-graph
   bucket captured, a failed capture named; then benchmarks.decode_step on 256 decoding sequences:
   graph replay against eager logits at every bucket, one decode step's device time against its
   host time (schedule / pack / launch / sample / update), kernels per step, eager and graphed, and
   the top kernels of one step by GPU time. In --smoke, benchmarks.gpu_launches' count of what one decode
   step launches on the GPU dispatch path (Triton in the interpreter), per layer and per step.
5. Throughput (`--only throughput`): nano-vllm's workload (256 sequences, prompt and output lengths
   uniform in 100-1024, ignore_eos) on the Qwen3-0.6B-shaped model greedy, greedy again with
   engine.async_scheduling (the ratio to the run before), and at temperature 0.6 (nano-vllm's
   setting; the sampler's own cost is benchmarks.sampling's measurement); then a turnover workload (3 x 256
   shorter requests streamed through the 256 slots, so requests end and are admitted every step or
   two) admitting at every end, admitting in batches (engine.admission_min_slots 16), and batched with
   engine.async_scheduling, each with its ratio to the first; and greedy on a
   SmolLM2-135M-shaped one. Random weights built here from transformers configs (nothing can be
   downloaded there; the SmolLM2 GGUF is too big to carry); prompts are token ids (the bundled
   512-token tokenizer only decodes). Triton compile counts per kernel after warm-up and after the
   timed runs (benchmarks.compile_counts): a variant compiled during the timed runs is a failure. Then
   the engine and HF transformers' `generate` on the same first prompts, each cold (the engine's
   prefix cache reset), for the ratio.

Every phase has a rough time estimate; one that no longer fits in --budget-s is skipped and says
so, and a timed workload is cut at the deadline, so the table always prints. No phase times a
kernel whose tiles or fused choice are still to be made: the engines tune at start-up, before their
KV cache and warm-up, and the GEMM and fused phases bind the static tables' choices. The JSON file is
rewritten after every phase. Exit status 1 when a check failed. In --smoke every phase runs on the
CPU at tiny sizes; what only a GPU can measure reads "n/a (no CUDA)".
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional, TypedDict

import torch

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.kernels.attention_torch import paged_attention_reference, write_kv_cache_reference
from batchrun.kernels.target import GpuTarget, find_target
from benchmarks.cases import attention_case, far_blocks_case, quantized_copy, rel_error
from benchmarks.gpu_decode import DECODE_8B, check_decode_8b
from benchmarks.gpu_engine import (
    QWEN3,
    QWEN3_0_6B,
    SMOLLM2,
    SMOLLM2_135M,
    TURNOVER_RUNS,
    check_model,
    model_phases,
)
from benchmarks.gpu_fused import FUSED, check_fused
from benchmarks.gpu_gemm import check_gemms
from benchmarks.gpu_launches import LAUNCHES
from benchmarks.gpu_report import NO_CUDA, Budget, Report, default_json_path, versions

BF16_TOL = 2e-2  # relative error allowed a bf16 kernel against its reference (_kernel_checks: bf16_tol)

# ---------------------------------------------------------------------------------------------
# 1. kernels against references


class SkipCheck(Exception):
    """A kernel check that cannot run on this machine (not a failure); the message says why."""


def _gpu(device: torch.device) -> Optional[GpuTarget]:
    """The GPU the direct launches below are sized for (None: Triton's interpreter, --smoke)."""
    return find_target(device).gpu if device.type == "cuda" else None


def _kernel_checks(
    device: torch.device, smoke: bool
) -> list[tuple[str, float, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    """(name, relative-error tolerance, () -> (got, want))."""
    from batchrun.kernels import triton_attention as ta
    from batchrun.kernels import triton_kv as tk

    gpu = _gpu(device)
    bf16 = torch.bfloat16
    # The quant and MoE kernels feed bf16 to tl.dot, which Triton's interpreter gets wrong; fp16 there.
    gemm_dtype = torch.float16 if smoke else bf16
    if smoke:
        heads, kv_heads, dim, bs = 4, 2, 16, 4
        mixed = [(5, 1), (0, 9), (17, 1), (6, 11), (30, 1)]
        decodes = [(c, 1) for c in (3, 20, 41, 9)]
        long_decodes = [(60, 1), (7, 1)]
        gemm = (5, 48, 64)
    else:
        heads, kv_heads, dim, bs = 16, 8, 128, 16
        rng = random.Random(0)
        mixed = [(rng.randint(1, 3000), 1) for _ in range(48)] + [(c, n) for c in (0, 100, 700) for n in (200, 900)]
        decodes = [(rng.randint(1, 3000), 1) for _ in range(128)]
        long_decodes = [(30000, 1), (12345, 1)]
        gemm = (256, 3072, 1024)

    def attn(seqs, h, kvh, d, dtype, window=None, softcap=None, num_splits=None, kv=None):
        def run():
            c = attention_case(seqs, h, kvh, d, bs, dtype, device, seed=1, kv_cache_dtype=kv)
            # Over an int8/fp8 cache the kernels read every key quantized, so the reference reads
            # the cache too (given this step's keys, it attends fresh prompts to them unquantized).
            k_new, v_new = (c.k_new, c.v_new) if kv is None else (None, None)
            want = paged_attention_reference(c.q, c.k_cache, c.v_cache, c.meta, d**-0.5, window, softcap, k_new, v_new)
            if num_splits is None:
                got = ta.paged_attention(c.q, c.k_cache, c.v_cache, c.meta, d**-0.5, window, softcap, gpu=gpu)
            else:
                got = ta.decode_attention(
                    c.q,
                    c.k_cache,
                    c.v_cache,
                    c.meta.block_tables,
                    c.meta.decode_seq_ids,
                    c.meta.decode_seq_lens,
                    d**-0.5,
                    window,
                    softcap,
                    num_splits=num_splits,
                    gpu=gpu,
                )
            return got, want

        return run

    def kv_write(dtype):
        def run():
            c = attention_case(mixed, heads, kv_heads, dim, bs, dtype, device, seed=2)
            k_ref, v_ref = c.k_cache.clone(), c.v_cache.clone()
            k_got, v_got = c.k_cache.clone(), c.v_cache.clone()
            k, v = torch.randn_like(c.k_new), torch.randn_like(c.v_new)
            write_kv_cache_reference(k_ref, v_ref, k, v, c.meta.slot_mapping)
            tk.write_kv_cache(k_got, v_got, k, v, c.meta.slot_mapping)
            return torch.stack([k_got, v_got]), torch.stack([k_ref, v_ref])

        return run

    def quantized_bytes(caches) -> torch.Tensor:
        """The caches' stored bytes and scales as one float64 vector: equal exactly when bitwise equal."""
        parts = [t for c in caches for t in (c.data.view(torch.uint8).flatten().double(), c.scale.flatten().double())]
        return torch.cat(parts)

    def kv_write_quantized(dtype, kv):
        def run():
            c = attention_case(mixed, heads, kv_heads, dim, bs, dtype, device, seed=2)
            k, v = torch.randn_like(c.k_new), torch.randn_like(c.v_new)
            k[::5] *= 1e-12  # rows whose scale is clamped at MIN_SCALE
            slots = c.meta.slot_mapping.clone()
            slots[::7] = -1  # CUDA-graph padding: nothing written
            keep = slots >= 0
            got_k, got_v, want_k, want_v = (quantized_copy(c.k_cache, kv) for _ in range(4))
            want_k.write(k[keep], slots[keep])  # the torch path: quantize_kv + index_copy_
            want_v.write(v[keep], slots[keep])
            tk.write_kv_cache(got_k, got_v, k, v, slots)
            return quantized_bytes([got_k, got_v]), quantized_bytes([want_k, want_v])

        return run

    def qkv_write_quantized(dtype, kv):
        def run():
            from batchrun.kernels.qkv_heads import QKVHeads
            from batchrun.kernels.triton_elementwise import qkv_norm_rope_write

            c = attention_case(mixed, heads, kv_heads, dim, bs, dtype, device, seed=3)
            num_tokens = c.q.shape[0]
            qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, device=device).to(dtype)
            angles = torch.rand(num_tokens, dim // 2, device=device) * 6.0
            emb = torch.cat((angles, angles), dim=-1)  # (num_tokens, dim), rotary's layout
            norm = torch.rand(dim, device=device).to(dtype) + 0.5
            layout = QKVHeads(heads, kv_heads, dim, norm, norm, 1e-6, False)
            got_k, got_v, want_k, want_v = (quantized_copy(c.k_cache, kv) for _ in range(4))
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            _, k, v = qkv_norm_rope_write(qkv, layout, cos, sin, got_k, got_v, c.meta.slot_mapping)
            # the fused kernel stores exactly the quantization of the K (and V) it returns
            want_k.write(k, c.meta.slot_mapping)
            want_v.write(v, c.meta.slot_mapping)
            return quantized_bytes([got_k, got_v]), quantized_bytes([want_k, want_v])

        return run

    def norm_quant(qdtype):
        def run():
            from batchrun.kernels import triton_elementwise as tew
            from batchrun.kernels.quant.act import INT_MM_MIN_ROWS, ActQuant
            from batchrun.kernels.quant.triton_act import quantize_rows

            if qdtype == fp8 and not (gpu is None or gpu.has_fp8):
                raise SkipCheck("no float8 e4m3 in Triton below compute capability 8.9")
            m, n = (5, 64) if smoke else (48, 4096)
            gen = torch.Generator().manual_seed(8)
            h = torch.randn(m, n, generator=gen).to(device, bf16)
            res = torch.randn(m, n, generator=gen).to(device, bf16)
            w = (torch.rand(n, generator=gen) + 0.5).to(device, bf16)
            skip = None
            if qdtype == int8:
                skip = torch.zeros(n, dtype=torch.bool, device=device)
                skip[::37] = True  # W8A8's float channels
            quant = ActQuant(qdtype, skip, INT_MM_MIN_ROWS if qdtype == int8 else 0)
            got, got_res = tew.rms_norm_quant(h.clone(), res.clone(), w, 1e-6, quant)
            want_x, want_res = tew.add_rms_norm(h.clone(), res.clone(), w, 1e-6)
            want_q, want_s = quantize_rows(want_x, qdtype, skip, quant.min_rows)

            def flat(x, res, q, s):
                return torch.cat([t.contiguous().view(torch.uint8).flatten().double() for t in (x, res, q, s)])

            return flat(got.x, got_res, got.q, got.scale), flat(want_x, want_res, want_q, want_s)

        return run

    def w8a16(group: Optional[int]):
        def run():
            from batchrun.kernels.quant import int8_weight_matmul, quantize_int8
            from batchrun.kernels.quant.triton_gemm import w8a16_matmul

            m, n, k = gemm
            gen = torch.Generator().manual_seed(4)
            w = torch.randn(n, k, generator=gen) * 0.05
            x = torch.randn(m, k, generator=gen).to(device, gemm_dtype)
            qw, scales = quantize_int8(w, group)
            qw, scales = qw.to(device), scales.to(device)
            return w8a16_matmul(x, qw, scales, gpu=gpu), int8_weight_matmul(x, qw, scales)

        return run

    def w4a16():
        from batchrun.kernels.quant import int4_weight_matmul, quantize_int4
        from batchrun.kernels.quant.triton_gemm import w4a16_matmul

        m, n, k = gemm
        gen = torch.Generator().manual_seed(5)
        w = torch.randn(n, k, generator=gen) * 0.05
        x = torch.randn(m, k, generator=gen).to(device, gemm_dtype)
        qw, scales, mins = (t.to(device) for t in quantize_int4(w, 32))
        return w4a16_matmul(x, qw, scales, mins, gpu=gpu), int4_weight_matmul(x, qw, scales, mins)

    def moe():
        from batchrun.kernels.moe import grouped_gemm_reference, sort_by_expert
        from batchrun.kernels.triton_moe import grouped_gemm

        m, n, k = gemm
        gen = torch.Generator().manual_seed(6)
        num_experts = 8
        x = torch.randn(m, k, generator=gen).to(device, gemm_dtype)
        b = (torch.randn(num_experts, n // 4, k, generator=gen) * 0.05).to(device, gemm_dtype)
        ids = torch.randint(0, num_experts, (m, 2), generator=gen).to(device)
        d = sort_by_expert(ids, num_experts)
        return (
            grouped_gemm(x, b, d.expert_offsets, d.sorted_token_ids),
            grouped_gemm_reference(x, b, d.expert_offsets, d.sorted_token_ids),
        )

    def sampling_race() -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's GPU sampler (one Gumbel-race launch) against its torch reference: mixed
        greedy and sampled rows, half of them under a top-k threshold. Equal tokens, but where two
        rows' race keys tie to the last bit of `log` (none expected at these sizes)."""
        from batchrun.kernels.sampling import gumbel_sample_reference, pack_rows
        from batchrun.kernels.triton_sampling import gumbel_sample

        rows, vocab = (12, 3000) if smoke else (256, 151936)
        gen = torch.Generator().manual_seed(7)
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device, bf16)
        temps = [0.0 if i % 4 == 0 else 0.6 for i in range(rows)]
        packed = torch.from_numpy(pack_rows(list(range(1, rows + 1)), [100 + i for i in range(rows)], temps)).to(device)
        s = logits.float() / torch.tensor(temps, device=device).clamp_min(1e-9)[:, None]
        kth = s.topk(50, dim=-1).values[:, -1]
        threshold = torch.where(torch.arange(rows, device=device) % 2 == 1, kth, float("-inf"))
        got = gumbel_sample(logits, packed, threshold)
        return got.double(), gumbel_sample_reference(logits, packed, threshold).double()

    f32, int8, fp8 = torch.float32, torch.int8, torch.float8_e4m3fn
    bf16_tol, f32_tol = 2e-2, 1e-4
    return [
        ("attention mixed batch bf16 (GQA)", bf16_tol, attn(mixed, heads, kv_heads, dim, bf16)),
        ("attention mixed batch fp32 (GQA)", f32_tol, attn(mixed, heads, kv_heads, dim, f32)),
        (
            "attention mixed bf16 window 64",
            bf16_tol,
            attn(mixed, heads, kv_heads, dim, bf16, window=64 if not smoke else 5),
        ),
        ("attention mixed bf16 softcap 50", bf16_tol, attn(mixed, heads, kv_heads, dim, bf16, softcap=50.0)),
        (
            "attention mixed bf16 MQA-ish 9:3 d64",
            bf16_tol,
            attn(mixed, 9 if not smoke else 3, 3 if not smoke else 1, 64 if not smoke else 16, bf16),
        ),
        ("attention decode bf16 (default splits)", bf16_tol, attn(decodes, heads, kv_heads, dim, bf16)),
        (
            "attention decode bf16 long, 8 splits",
            bf16_tol,
            attn(long_decodes, heads, kv_heads, dim, bf16, num_splits=8),
        ),
        ("kv write bf16", 0.0, kv_write(bf16)),
        ("attention mixed bf16 int8 cache", bf16_tol, attn(mixed, heads, kv_heads, dim, bf16, kv=int8)),
        ("attention mixed bf16 fp8 cache", bf16_tol, attn(mixed, heads, kv_heads, dim, bf16, kv=fp8)),
        ("attention mixed fp32 int8 cache win", f32_tol, attn(mixed, heads, kv_heads, dim, f32, window=5, kv=int8)),
        ("attention decode bf16 fp8 cache", bf16_tol, attn(decodes, heads, kv_heads, dim, bf16, kv=fp8)),
        (
            "attention decode bf16 long int8, 8 splits",
            bf16_tol,
            attn(long_decodes, heads, kv_heads, dim, bf16, num_splits=8, kv=int8),
        ),
        ("kv write bf16 -> int8 (slots -1 skipped)", 0.0, kv_write_quantized(bf16, int8)),
        ("kv write bf16 -> fp8 (slots -1 skipped)", 0.0, kv_write_quantized(bf16, fp8)),
        ("kv write fp32 -> fp8", 0.0, kv_write_quantized(f32, fp8)),
        ("qkv norm+rope+write bf16 -> int8", 0.0, qkv_write_quantized(bf16, int8)),
        ("qkv norm+rope+write bf16 -> fp8", 0.0, qkv_write_quantized(bf16, fp8)),
        ("add+RMSNorm quantizing int8 (W8A8) vs unfused", 0.0, norm_quant(int8)),
        ("add+RMSNorm quantizing fp8 vs unfused", 0.0, norm_quant(fp8)),
        ("W8A16 per-channel", bf16_tol, w8a16(None)),
        ("W8A16 group 32", bf16_tol, w8a16(32)),
        ("W4A16 group 32", bf16_tol, w4a16),
        ("MoE grouped GEMM", bf16_tol, moe),
        ("sampling race (temperature, top-k) vs reference", 0.0, sampling_race),
    ]


def _offset_checks(
    device: torch.device, smoke: bool
) -> tuple[list[tuple[str, float, Callable[[], tuple[torch.Tensor, torch.Tensor]]]], str]:
    """(checks, what they ran on): attention and the KV write on a cache past int32 offsets
    (benchmarks.cases.far_blocks_case); the same batch on a small cache is the expected result."""
    from batchrun.kernels import triton_attention as ta
    from batchrun.kernels import triton_kv as tk

    # fp16 in the interpreter as tests/kernels/test_triton_offsets.py; the production dtype and head size on a GPU
    gpu = _gpu(device)
    dtype, dim = (torch.float16, 16) if smoke else (torch.bfloat16, 128)
    heads, kv_heads, bs = 6, 3, 16
    seqs = [(20, 1), (0, 5), (37, 1), (9, 6)] if smoke else [(700, 1), (0, 300), (3000, 1), (90, 200), (1, 1)]

    def far_case():
        try:
            return far_blocks_case(seqs, heads, kv_heads, dim, bs, dtype, device, seed=3)
        except RuntimeError as exc:
            if smoke:  # a host that does not overcommit cannot map 2 x 6 GiB of untouched memory
                raise SkipCheck(f"cannot map the far cache here ({exc})") from exc
            raise

    def attention():
        far = far_case()
        c = far.small
        want = paged_attention_reference(c.q, c.k_cache, c.v_cache, c.meta, dim**-0.5)
        return ta.paged_attention(c.q, far.k_cache, far.v_cache, far.meta, dim**-0.5, gpu=gpu), want

    def kv_write():
        far = far_case()
        c = far.small
        k, v = torch.randn_like(c.k_new), torch.randn_like(c.v_new)
        write_kv_cache_reference(c.k_cache, c.v_cache, k, v, c.meta.slot_mapping)
        tk.write_kv_cache(far.k_cache, far.v_cache, k, v, far.meta.slot_mapping)
        n = c.k_cache.shape[0]
        return torch.stack([far.k_cache[-n:], far.v_cache[-n:]]), torch.stack([c.k_cache, c.v_cache])

    checks = [("attention past int32 offsets", BF16_TOL, attention), ("kv write past int32 offsets", 0.0, kv_write)]
    where = "interpreter on virtual memory, head_dim 16" if smoke else "2 x 6 GiB of device memory, head_dim 128"
    return checks, f"KV head 2 starts past 2**31 elements; {where}"


def check_kernels(device: torch.device, smoke: bool, report: Report) -> None:
    print(f"  {'kernel':<42} {'max abs err':>12} {'rel err':>10}  ok", flush=True)
    rows = report.data.setdefault("kernels", [])
    offset_checks, offset_note = _offset_checks(device, smoke)
    notes = {name: offset_note for name, *_ in offset_checks}
    for name, tol, run in [*_kernel_checks(device, smoke), *offset_checks]:
        row: dict[str, Any] = {"name": name, "tolerance": tol, "note": notes.get(name, "")}
        rows.append(row)
        try:
            got, want = run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            max_abs, rel = rel_error(got, want)
            ok = rel <= tol if tol > 0 else max_abs == 0.0
        except SkipCheck as exc:
            print(f"  {name:<42} skipped: {exc}", flush=True)
            row.update(skipped=str(exc), ok=None)
            continue
        except Exception as exc:  # noqa: BLE001 - report and go on: one broken kernel must not hide the rest
            print(f"  {name:<42} FAILED: {exc!r}", flush=True)
            traceback.print_exc()
            report.kernel_rows.append((name, math.nan, math.nan, False))
            row.update(error=repr(exc), ok=False)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the far cases hold 12 GiB until here
        report.kernel_rows.append((name, max_abs, rel, ok))
        row.update(max_abs_err=max_abs, rel_err=rel, ok=ok)
        print(f"  {name:<42} {max_abs:12.3e} {rel:10.3e}  {'yes' if ok else 'NO'}", flush=True)
    print(f"  (past int32 offsets: {offset_note})", flush=True)
    num_ok = sum(ok for *_, ok in report.kernel_rows)
    worst = max((r for _, _, r, _ in report.kernel_rows if not math.isnan(r)), default=math.nan)
    skipped = sum(1 for r in rows if r.get("skipped"))
    report.add(
        "kernels within tolerance",
        f"{num_ok}/{len(report.kernel_rows)} (worst rel err {worst:.2e})" + (f", {skipped} skipped" if skipped else ""),
        ok=num_ok == len(report.kernel_rows),
    )


# ---------------------------------------------------------------------------------------------
# 2. bandwidth


class _DecodeTile(TypedDict, total=False):
    """A `decode_attention` launch setting; the keys left out take its defaults."""

    block_n: int
    num_warps: int


def _time_ms(fn: Callable[[], Any]) -> float:
    if not torch.cuda.is_available():  # --smoke: one call, only to run the code
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def check_bandwidth(device: torch.device, smoke: bool, report: Report) -> None:
    from batchrun.kernels import triton_attention as ta

    gpu = _gpu(device)

    def rate_text(text: str) -> str:
        return NO_CUDA if smoke else text  # interpreter timings measure nothing

    section: dict[str, Any] = {"note": NO_CUDA if smoke else "", "decode": []}
    report.data["bandwidth"] = section
    src = torch.empty(1 << (31 if not smoke else 20), dtype=torch.uint8, device=device)  # 2 GiB: many times the L2
    dst = torch.empty_like(src)
    ms = _time_ms(functools.partial(dst.copy_, src))
    hbm = 2 * src.numel() / (ms * 1e-3)  # bytes read + written per second
    del src, dst
    section["copy_bytes_per_s"] = None if smoke else hbm
    report.add("device copy bandwidth", rate_text(f"{hbm / 1e12:.2f} TB/s (read + write)"))

    heads, kv_heads, dim, bs = (16, 8, 128, 16) if not smoke else (4, 2, 16, 4)
    rng = random.Random(1)
    shapes = ((256, 100, 2048), (16, 2000, 8000)) if not smoke else ((3, 5, 40), (1, 50, 90))
    for num_seqs, lo, hi in shapes:
        seqs = [(rng.randint(lo, hi), 1) for _ in range(num_seqs)]
        c = attention_case(seqs, heads, kv_heads, dim, bs, torch.bfloat16, device, seed=7)
        m = c.meta
        kv_bytes = sum(s for s in m.seq_lens) * kv_heads * dim * 2 * c.k_cache.element_size()
        tuned: list[_DecodeTile] = [{"block_n": bn, "num_warps": w} for bn in (32, 64, 128) for w in (4, 8)]
        configs: list[_DecodeTile] = [{}, *tuned[: None if not smoke else 1]]
        best = None
        for cfg in configs:

            def run(cfg=cfg, c=c, m=m):
                ta.decode_attention(
                    c.q,
                    c.k_cache,
                    c.v_cache,
                    m.block_tables,
                    m.decode_seq_ids,
                    m.decode_seq_lens,
                    dim**-0.5,
                    **cfg,
                    gpu=gpu,
                )

            point: dict[str, Any] = {"num_seqs": num_seqs, "context": [lo, hi], "config": cfg or "default"}
            section["decode"].append(point)
            try:
                ms = _time_ms(run)
            except Exception as exc:  # noqa: BLE001 - a tile setting that does not compile is just skipped
                print(f"  decode {num_seqs} seqs {cfg}: failed ({exc!r})", flush=True)
                point["error"] = repr(exc)
                continue
            rate = kv_bytes / (ms * 1e-3)
            if not smoke:
                point.update(us=ms * 1e3, kv_bytes=kv_bytes, bytes_per_s=rate, fraction_of_copy=rate / hbm)
            print(
                f"  decode {num_seqs} seqs ctx {lo}-{hi} {cfg or 'default'}: {ms * 1e3:.1f} us, "
                f"{rate / 1e12:.2f} TB/s = {100 * rate / hbm:.0f}% of copy",
                flush=True,
            )
            if not cfg:
                report.add(
                    f"decode attention {num_seqs} seqs ctx {lo}-{hi} (default)",
                    rate_text(f"{rate / 1e12:.2f} TB/s = {100 * rate / hbm:.0f}% of copy bandwidth (target >= 70%)"),
                )
            if best is None or rate > best[0]:
                best = (rate, cfg)
        if best is not None:
            report.add(
                f"decode attention {num_seqs} seqs best setting",
                rate_text(f"{best[1] or 'default'}: {100 * best[0] / hbm:.0f}% of copy bandwidth"),
            )
        del c
        # The same decode over int8 and fp8 caches (engine.kv_cache_dtype): half the bytes, the
        # per-token scales folded into scores and probabilities; the bytes count the scales too.
        # The default tile and 64 beside it, so the quantized tile choice is measured as well.
        for kv_name, kv_dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            if kv_dtype == torch.float8_e4m3fn and not (gpu is None or gpu.has_fp8):
                continue
            qc = attention_case(seqs, heads, kv_heads, dim, bs, torch.bfloat16, device, seed=7, kv_cache_dtype=kv_dtype)
            m = qc.meta
            q_bytes = sum(m.seq_lens) * kv_heads * (dim + 4) * 2
            kv_configs: list[_DecodeTile] = [{}, {"block_n": 64}]
            for cfg in kv_configs[: None if not smoke else 1]:
                ms = _time_ms(
                    functools.partial(
                        ta.decode_attention,
                        qc.q,
                        qc.k_cache,
                        qc.v_cache,
                        m.block_tables,
                        m.decode_seq_ids,
                        m.decode_seq_lens,
                        dim**-0.5,
                        **cfg,
                        gpu=gpu,
                    )
                )
                rate = q_bytes / (ms * 1e-3)
                point = {
                    "num_seqs": num_seqs,
                    "context": [lo, hi],
                    "config": cfg or "default",
                    "kv_cache_dtype": kv_name,
                }
                if not smoke:
                    point.update(us=ms * 1e3, kv_bytes=q_bytes, bytes_per_s=rate, fraction_of_copy=rate / hbm)
                section["decode"].append(point)
                report.add(
                    f"decode attention {num_seqs} seqs ctx {lo}-{hi} {kv_name} cache ({cfg or 'default'})",
                    rate_text(f"{ms * 1e3:.1f} us, {rate / 1e12:.2f} TB/s = {100 * rate / hbm:.0f}% of copy bandwidth"),
                )
            del qc


# ---------------------------------------------------------------------------------------------
# 3. GEMMs (benchmarks.gpu_gemm); 4. and 5. the engine (benchmarks.gpu_engine), its phases planned against the budget

# Rough seconds per phase on one H200 with a cold Triton cache (compiling dominates the first
# phases), with room over what an H200 run measured (docs/benchmarks.md, "The GPU check in one device
# call", lists both); the builds include start-up tuning, which compiles and times every tile
# candidate of the model's fused GEMMs. The JSON records each phase's real time beside its
# estimate. The default run's sum stays within the default --budget-s (`--plan` prints it).
GPU_ESTIMATES_S = {
    "kernels": 50,
    "bandwidth": 15,
    "gemm": 75,
    FUSED: 40,
    DECODE_8B: 300,  # 5 engines (random weights, quantization, graph capture, warm-up) x 3 batch sizes
    f"{QWEN3}: build": 60,
    f"{QWEN3}: decode step": 15,
    f"{QWEN3}: greedy": 20,
    f"{QWEN3}: greedy async": 20,
    f"{QWEN3}: temperature 0.6": 20,
    **{f"{QWEN3}: turnover {name}": 15 for name, _, _ in TURNOVER_RUNS},
    f"{QWEN3}: vs HF generate": 30,
    f"{SMOLLM2}: build": 45,
    f"{SMOLLM2}: greedy": 15,
    f"{SMOLLM2}: vs HF generate": 25,
}
SMOKE_ESTIMATE_S = 10  # per phase in --smoke


def check_launches(report: Report) -> None:
    """--smoke only: benchmarks.gpu_launches' count of what one bf16 decode step of a Qwen3-shaped model
    launches on the GPU dispatch path, per layer and per step, for 28 layers (Qwen3-0.6B's depth):
    the Triton kernels run in the interpreter, sized for a simulated sm_90. On a GPU the profiled
    decode step (the engine phase) counts the real kernels."""
    from benchmarks.gpu_launches import format_figures, launch_figures

    figures = launch_figures("qwen3", 28, torch.bfloat16)
    print(format_figures(figures, "qwen3 bf16, simulated sm_90"), flush=True)
    per_layer, per_step = sum(figures.per_layer.values()), sum(figures.per_step.values())
    report.data["decode_launches"] = {
        "per_layer": dict(figures.per_layer),
        "per_step": dict(figures.per_step),
        "total_28_layers": figures.total,
    }
    report.add(
        "decode step kernels, bf16, 28 layers (CPU count, sampling apart)",
        f"{figures.total} = {per_step} per step + 28 x {per_layer} per layer",
    )


def _model_phases(selected: list[str], no_baseline: bool) -> dict[str, list[str]]:
    """Each model's budgeted phases for the selected parts (none where no engine is built)."""
    per_model = {
        label: model_phases(label, "engine" in selected, "throughput" in selected, not no_baseline)
        for label in (QWEN3, SMOLLM2)
    }
    if "throughput" not in selected:  # engine checks alone: the Qwen3 engine only
        per_model[SMOLLM2] = []
    if "engine" not in selected and "throughput" not in selected:  # no engine to build
        per_model = {label: [] for label in per_model}
    return per_model


def _phase_names(selected: list[str], smoke: bool, no_baseline: bool) -> list[str]:
    """The budgeted phases of a run, in the order they run."""
    names: list[str] = [p for p in ("kernels", "bandwidth", "gemm") if p in selected]
    if "fused" in selected:
        names.append(FUSED)
    if "decode8b" in selected:
        names.append(DECODE_8B)
    names += [p for ps in _model_phases(selected, no_baseline).values() for p in ps]
    if smoke and "engine" in selected:  # the interpreter is on: count what a decode step launches
        names.append(LAUNCHES)
    return names


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        choices=("kernels", "bandwidth", "gemm", "fused", "decode8b", "engine", "throughput"),
    )
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, kernels in Triton's interpreter")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="seconds: phases whose estimate no longer fits are skipped, a workload past it is cut",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the HF generate comparison")
    parser.add_argument("--json", metavar="PATH", help=f"where the JSON goes (default: {default_json_path()})")
    parser.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the phases a GPU run of these options plans and whether they fit --budget-s; run nothing",
    )
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    selected = args.only or ["kernels", "bandwidth", "gemm", "fused", "engine", "throughput"]
    if args.plan:  # no device needed: exit status 1 when the estimates pass the budget
        plan = Budget(args.budget_s, {n: GPU_ESTIMATES_S[n] for n in _phase_names(selected, False, args.no_baseline)})
        for phase in plan.phases.values():
            print(f"  {phase.name:<48} ~{phase.estimate_s:.0f} s")
        print(plan.plan_line())
        return 0 if plan.planned_s <= plan.budget_s else 1
    if args.smoke:
        # Must precede triton's first import; nothing above imports it.
        assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
            "run --smoke in a fresh process (TRITON_INTERPRET must be set before triton is imported)"
        )
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
            return 2
        device = torch.device("cuda")
    models = [(QWEN3, QWEN3_0_6B), (SMOLLM2, SMOLLM2_135M)]
    per_model = _model_phases(selected, args.no_baseline)
    names = _phase_names(selected, args.smoke, args.no_baseline)
    budget = Budget(args.budget_s, {n: SMOKE_ESTIMATE_S if args.smoke else GPU_ESTIMATES_S[n] for n in names}, t_start)

    report = Report(json_path=args.json or default_json_path())
    report.data.update(
        command=script_command("benchmarks.gpu", argv),
        stamp=stamp(torch.cuda.get_device_name() if device.type == "cuda" else None),
        smoke=args.smoke,
        versions=versions(device),
    )
    v = report.data["versions"]
    print(
        f"device: {v['device_name']} | torch {v['torch']} | triton {v['triton']} | transformers "
        f"{v['transformers']} | CUDA {v['cuda']} | driver {v['driver']}",
        flush=True,
    )
    print(budget.plan_line(), flush=True)
    if "kernels" in selected:
        budget.run("kernels", functools.partial(check_kernels, device, args.smoke, report), report)
    if "bandwidth" in selected:
        budget.run("bandwidth", functools.partial(check_bandwidth, device, args.smoke, report), report)
    if "gemm" in selected:
        # the phase stops starting shapes at its own estimate, so it never eats the later phases' time
        gemm = functools.partial(check_gemms, device, args.smoke, report, budget.phases["gemm"].estimate_s)
        budget.run("gemm", gemm, report)
    if "fused" in selected:
        # on a GPU it stops starting (model, kind) groups at its own estimate, as gemm does
        fused_deadline = None if args.smoke else budget.phases[FUSED].estimate_s
        fused = functools.partial(check_fused, device, args.smoke, report, fused_deadline)
        budget.run(FUSED, fused, report)
    if "decode8b" in selected:
        # like gemm, it stops starting modes at its own estimate; its engines are freed before the next phase
        decode = functools.partial(check_decode_8b, device, args.smoke, report, budget.phases[DECODE_8B].estimate_s)
        budget.run(DECODE_8B, decode, report)
    for label, shape in models:
        if per_model[label]:
            check_model(label, shape, device, args.smoke, budget, report, per_model[label])
    if LAUNCHES in names:
        budget.run(LAUNCHES, functools.partial(check_launches, report), report)

    total_s = time.perf_counter() - t_start
    print(f"\n== summary ({total_s:.0f}s of {args.budget_s:.0f}s) ==")
    width = max(len(n) for n, _ in report.rows) if report.rows else 10
    for n, value in report.rows:
        print(f"{n:<{width}}  {value}")
    failed = bool(report.failures) or any(not ok for *_, ok in report.kernel_rows)
    report.data.update(ok=not failed, total_s=total_s)
    report.write_json()
    print(f"JSON: {report.json_path}")
    if args.write_docs:
        _write_docs(report, device, argv)
    return 1 if failed else 0


def _write_docs(report: Report, device: torch.device, argv: Optional[list[str]]) -> None:
    machine = torch.cuda.get_device_name() if device.type == "cuda" else f"{os.cpu_count()} CPU cores"
    tables = [markdown_table(["measurement", "result"], report.rows)]
    if report.kernel_rows:
        tables.append(
            markdown_table(
                ["kernel", "max abs err", "rel err", "within tolerance"],
                [[n, f"{a:.3e}", f"{r:.3e}", "yes" if ok else "NO"] for n, a, r, ok in report.kernel_rows],
            )
        )
    command = script_command("benchmarks.gpu", argv)
    v = report.data["versions"]
    notes = f"torch {v['torch']}, triton {v['triton']}, CUDA {v['cuda']}, driver {v['driver']}."
    write_section("gpu", command, stamp(machine), "\n\n".join(tables), notes, "GPU check")


if __name__ == "__main__":
    sys.exit(main())
