"""The one-call GPU check: kernels against their references, bandwidth, then throughput; table last.

    python -m batchrun.bench.gpu                   # on a GPU (sized for < 10 minutes on one H200)
    python -m batchrun.bench.gpu --only kernels    # kernels | bandwidth | throughput (repeatable)
    python -m batchrun.bench.gpu --smoke           # CPU: tiny shapes, kernels in Triton's interpreter

1. Kernels: each Triton kernel (paged attention decode and prefill over float, int8 and fp8 caches,
   the KV write and the fused q/k-norm + rotary + KV write into int8/fp8 caches, W8A16/W4A16 GEMMs,
   MoE grouped GEMM) against its torch reference on the device, random inputs, max |error| and
   relative error ||got - want|| / ||want|| printed (writes into quantized caches: bitwise).
2. Bandwidth: a device copy (the HBM ceiling), then the decode attention kernel at the workload's
   shape as achieved KV bytes/s and its fraction of that ceiling (target >= 70%), a small sweep of
   its tile settings, and the same decode over an int8 cache.
3. Throughput: nano-vllm's workload (256 sequences, prompt and output lengths uniform in 100-1024,
   ignore_eos) on a Qwen3-0.6B-shaped model and a SmolLM2-135M-shaped one, random weights built
   here from transformers configs (nothing can be downloaded there; the SmolLM2 GGUF is too big to
   carry). Prompts are token ids (the bundled 512-token tokenizer only decodes). Greedy only, not
   nano-vllm's temperature 0.6: this check times the GPU forward path; the sampler's cost against
   greedy is bench.sampling's measurement. Then HF transformers' `generate` on a subset, with
   the engine on the same subset, for the ratio.

A deadline (--budget-s) skips what would not fit, so the table always prints.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from batchrun.bench.cases import attention_case, quantized_copy, rel_error
from batchrun.bench.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.bench.hf_baseline import hf_generate, load_hf_model
from batchrun.bench.workloads import nano_vllm_workload
from batchrun.kernels.attention_torch import paged_attention_reference, write_kv_cache_reference

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# 1. kernels against references


@dataclass
class Results:
    rows: list[tuple[str, str]] = field(default_factory=list)  # the final table
    kernel_rows: list[tuple[str, float, float, bool]] = field(default_factory=list)

    def add(self, name: str, value: str) -> None:
        self.rows.append((name, value))
        print(f"  {name}: {value}", flush=True)


def _kernel_checks(
    device: torch.device, smoke: bool
) -> list[tuple[str, float, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    """(name, relative-error tolerance, () -> (got, want))."""
    from batchrun.kernels import triton_attention as ta
    from batchrun.kernels import triton_kv as tk

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
                got = ta.paged_attention(c.q, c.k_cache, c.v_cache, c.meta, d**-0.5, window, softcap)
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
            return w8a16_matmul(x, qw, scales), int8_weight_matmul(x, qw, scales)

        return run

    def w4a16():
        from batchrun.kernels.quant import int4_weight_matmul, quantize_int4
        from batchrun.kernels.quant.triton_gemm import w4a16_matmul

        m, n, k = gemm
        gen = torch.Generator().manual_seed(5)
        w = torch.randn(n, k, generator=gen) * 0.05
        x = torch.randn(m, k, generator=gen).to(device, gemm_dtype)
        qw, scales, mins = (t.to(device) for t in quantize_int4(w, 32))
        return w4a16_matmul(x, qw, scales, mins), int4_weight_matmul(x, qw, scales, mins)

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
        ("W8A16 per-channel", bf16_tol, w8a16(None)),
        ("W8A16 group 32", bf16_tol, w8a16(32)),
        ("W4A16 group 32", bf16_tol, w4a16),
        ("MoE grouped GEMM", bf16_tol, moe),
    ]


def check_kernels(device: torch.device, smoke: bool, results: Results) -> None:
    print(f"\n== kernels vs references on {device} ==", flush=True)
    print(f"  {'kernel':<42} {'max abs err':>12} {'rel err':>10}  ok", flush=True)
    for name, tol, run in _kernel_checks(device, smoke):
        try:
            got, want = run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            max_abs, rel = rel_error(got, want)
            ok = rel <= tol if tol > 0 else max_abs == 0.0
        except Exception as exc:  # noqa: BLE001 - report and go on: one broken kernel must not hide the rest
            print(f"  {name:<42} FAILED: {exc!r}", flush=True)
            traceback.print_exc()
            results.kernel_rows.append((name, math.nan, math.nan, False))
            continue
        results.kernel_rows.append((name, max_abs, rel, ok))
        print(f"  {name:<42} {max_abs:12.3e} {rel:10.3e}  {'yes' if ok else 'NO'}", flush=True)
    num_ok = sum(ok for *_, ok in results.kernel_rows)
    worst = max((r for _, _, r, _ in results.kernel_rows if not math.isnan(r)), default=math.nan)
    results.add("kernels within tolerance", f"{num_ok}/{len(results.kernel_rows)} (worst rel err {worst:.2e})")


# ---------------------------------------------------------------------------------------------
# 2. bandwidth


def _time_ms(fn: Callable[[], Any]) -> float:
    if not torch.cuda.is_available():  # --smoke: one call, only to run the code
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def check_bandwidth(device: torch.device, smoke: bool, results: Results) -> None:
    from batchrun.kernels import triton_attention as ta

    print("\n== bandwidth ==", flush=True)
    src = torch.empty(1 << (31 if not smoke else 20), dtype=torch.uint8, device=device)  # 2 GiB: many times the L2
    dst = torch.empty_like(src)
    ms = _time_ms(functools.partial(dst.copy_, src))
    hbm = 2 * src.numel() / (ms * 1e-3)  # bytes read + written per second
    del src, dst
    results.add("device copy bandwidth", f"{hbm / 1e12:.2f} TB/s (read + write)")

    heads, kv_heads, dim, bs = (16, 8, 128, 16) if not smoke else (4, 2, 16, 4)
    rng = random.Random(1)
    shapes = ((256, 100, 2048), (16, 2000, 8000)) if not smoke else ((3, 5, 40), (1, 50, 90))
    for num_seqs, lo, hi in shapes:
        seqs = [(rng.randint(lo, hi), 1) for _ in range(num_seqs)]
        c = attention_case(seqs, heads, kv_heads, dim, bs, torch.bfloat16, device, seed=7)
        m = c.meta
        kv_bytes = sum(s for s in m.seq_lens) * kv_heads * dim * 2 * c.k_cache.element_size()
        configs = [dict()] + [dict(block_n=bn, num_warps=w) for bn in (32, 64, 128) for w in (4, 8)][
            : None if not smoke else 1
        ]
        best = None
        for cfg in configs:

            def run(cfg=cfg, c=c, m=m):
                ta.decode_attention(
                    c.q, c.k_cache, c.v_cache, m.block_tables, m.decode_seq_ids, m.decode_seq_lens, dim**-0.5, **cfg
                )

            try:
                ms = _time_ms(run)
            except Exception as exc:  # noqa: BLE001 - a tile setting that does not compile is just skipped
                print(f"  decode {num_seqs} seqs {cfg}: failed ({exc!r})", flush=True)
                continue
            rate = kv_bytes / (ms * 1e-3)
            print(
                f"  decode {num_seqs} seqs ctx {lo}-{hi} {cfg or 'default'}: {ms * 1e3:.1f} us, "
                f"{rate / 1e12:.2f} TB/s = {100 * rate / hbm:.0f}% of copy",
                flush=True,
            )
            if not cfg:
                results.add(
                    f"decode attention {num_seqs} seqs ctx {lo}-{hi} (default)",
                    f"{rate / 1e12:.2f} TB/s = {100 * rate / hbm:.0f}% of copy bandwidth (target >= 70%)",
                )
            if best is None or rate > best[0]:
                best = (rate, cfg)
        if best is not None:
            results.add(
                f"decode attention {num_seqs} seqs best setting",
                f"{best[1] or 'default'}: {100 * best[0] / hbm:.0f}% of copy bandwidth",
            )
        del c
        # The same decode over an int8 cache (engine.kv_cache_dtype: int8): half the bytes, each tile
        # dequantized in registers; its bytes count the scales too.
        qc = attention_case(seqs, heads, kv_heads, dim, bs, torch.bfloat16, device, seed=7, kv_cache_dtype=torch.int8)
        m = qc.meta
        q_bytes = sum(m.seq_lens) * kv_heads * (dim + 4) * 2
        ms = _time_ms(
            lambda qc=qc, m=m: ta.decode_attention(
                qc.q, qc.k_cache, qc.v_cache, m.block_tables, m.decode_seq_ids, m.decode_seq_lens, dim**-0.5
            )
        )
        rate = q_bytes / (ms * 1e-3)
        results.add(
            f"decode attention {num_seqs} seqs ctx {lo}-{hi} int8 cache (default)",
            f"{ms * 1e3:.1f} us, {rate / 1e12:.2f} TB/s = {100 * rate / hbm:.0f}% of copy bandwidth",
        )
        del qc


# ---------------------------------------------------------------------------------------------
# 3. throughput

QWEN3_0_6B = dict(
    model_type="qwen3",
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
SMOLLM2_135M = dict(
    model_type="llama",
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def build_random_model(out_dir: str, shape: dict, device: torch.device, dtype: torch.dtype) -> str:
    """A random-weight HF model directory of the given shape (weights initialized on the device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from batchrun.testing import build_tokenizer

    kw = dict(shape)
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(out_dir)
    del model
    return out_dir


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_throughput(
    name: str, shape: dict, device: torch.device, smoke: bool, deadline: float, results: Results, baseline: bool
) -> None:
    from batchrun.engine import Engine, EngineConfig, EngineRequest, SamplingParams

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"\n== throughput: {name} ==", flush=True)
    num_seqs, lo, hi = (8, 10, 40) if smoke else (256, 100, 1024)
    with tempfile.TemporaryDirectory(prefix="batchrun-gpu-") as tmp:
        t0 = time.perf_counter()
        model_dir = build_random_model(os.path.join(tmp, "model"), shape, device, dtype)
        engine = Engine(
            EngineConfig(
                model=model_dir,
                dtype=str(dtype).replace("torch.", ""),
                device=device.type,
                max_num_seqs=num_seqs,
                max_num_batched_tokens=16384 if not smoke else 512,
                max_model_len=4096,
                kv_cache_memory=0.5 if device.type == "cuda" else 64 << 20,
                cache_dir=os.path.join(tmp, "cache"),
            )
        )
        graphs = engine.runner.graphs
        if graphs is not None:
            graphs.capture_all(max_batch=num_seqs)
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        engine.generate([[1] * 64, [2] * 300, [3] * 17], warm)  # compiles the prefill and decode kernels
        _sync(device)
        print(f"  built and warmed in {time.perf_counter() - t0:.1f}s; settings: {engine.settings}", flush=True)
        if time.perf_counter() > deadline:
            results.add(f"{name} throughput", "skipped (out of time)")
            return
        prompts, max_tokens = nano_vllm_workload(num_seqs, lo, hi, shape["vocab_size"])
        requests = [
            EngineRequest(i, p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompts, max_tokens))
        ]
        before = engine.stats()
        t = time.perf_counter()
        num_done = 0
        # Streamed so a slow engine is cut off at the deadline (the rest aborted) and still reports
        # the rate it reached, instead of running the call past its limit.
        for out in engine.stream(requests, max_in_flight=num_seqs):
            num_done += 1
            assert out.error is None and len(out.token_ids) == max_tokens[out.request_id], (
                "ignore_eos runs to max_tokens"
            )
            if time.perf_counter() > deadline:
                break
        _sync(device)
        wall = time.perf_counter() - t
        stats = engine.stats()
        num_out = stats.num_generated_tokens - before.num_generated_tokens
        num_in = stats.num_prompt_tokens - before.num_prompt_tokens
        cut = "" if num_done == num_seqs else f" CUT at the deadline after {num_done}/{num_seqs} finished;"
        results.add(
            f"{name}: {num_seqs} seqs, {num_in} prompt + {num_out} output tokens",
            f"{num_out / wall:,.0f} output tok/s, {(num_in + num_out) / wall:,.0f} total tok/s, "
            f"{wall:.1f}s,{cut} {stats.num_steps - before.num_steps} steps, "
            f"{stats.num_preemptions - before.num_preemptions} preemptions"
            + (" (target >= 20,000 output tok/s)" if "qwen3" in name.lower() else ""),
        )
        if baseline and deadline - time.perf_counter() > 30:
            _hf_ratio(name, engine, model_dir, prompts, device, dtype, smoke, results)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _hf_ratio(
    name: str,
    engine: Any,
    model_dir: str,
    prompts: list[list[int]],
    device: torch.device,
    dtype: torch.dtype,
    smoke: bool,
    results: Results,
) -> None:
    """HF `generate` (greedy, one left-padded static batch, fixed output length: ignore_eos) against the
    engine, same subset, through the benchmark job's HF baseline."""
    from batchrun.engine import SamplingParams

    num, new = (4, 8) if smoke else (32, 128)
    subset = prompts[:num]
    hf = load_hf_model(model_dir, dtype, device)
    hf_generate(hf, [p[-16:] for p in subset], 2, num, 0, [], ignore_eos=True)  # warm-up
    hf_s = hf_generate(hf, subset, new, num, 0, [], ignore_eos=True).wall_s
    del hf
    t = time.perf_counter()
    engine.generate(subset, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    _sync(device)
    engine_s = time.perf_counter() - t
    results.add(
        f"{name}: vs HF generate ({num} seqs x {new} tokens)",
        f"engine {num * new / engine_s:,.0f} tok/s, HF {num * new / hf_s:,.0f} tok/s, ratio {hf_s / engine_s:.1f}x",
    )


# ---------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=("kernels", "bandwidth", "throughput"))
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, kernels in Triton's interpreter")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="seconds: phases that would start too late are skipped, a workload past it is cut",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the HF generate comparison")
    parser.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
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
        print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    phases = args.only or ["kernels", "bandwidth", "throughput"]
    results = Results()
    if "kernels" in phases:
        check_kernels(device, args.smoke, results)
    if "bandwidth" in phases:
        if time.perf_counter() < deadline:
            try:
                check_bandwidth(device, args.smoke, results)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                results.add("bandwidth", f"FAILED: {exc!r}")
    if "throughput" in phases:
        for name, shape in (("Qwen3-0.6B-shaped", QWEN3_0_6B), ("SmolLM2-135M-shaped", SMOLLM2_135M)):
            if args.smoke:
                shape = {
                    **shape,
                    "hidden_size": 64,
                    "num_hidden_layers": 2,
                    "intermediate_size": 128,
                    "vocab_size": 1000,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "head_dim": 16,
                }
            if deadline - time.perf_counter() < 60:  # building, loading and warming a model takes about that
                results.add(f"{name} throughput", "skipped (out of time)")
                continue
            try:
                run_throughput(name, shape, device, args.smoke, deadline, results, not args.no_baseline)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                results.add(f"{name} throughput", f"FAILED: {exc!r}")
    print(f"\n== summary ({time.perf_counter() - t_start:.0f}s) ==")
    width = max(len(n) for n, _ in results.rows) if results.rows else 10
    for n, v in results.rows:
        print(f"{n:<{width}}  {v}")
    failed = any(not ok for *_, ok in results.kernel_rows) or any("FAILED" in v for _, v in results.rows)
    if args.write_docs:
        _write_docs(results, device, argv)
    return 1 if failed else 0


def _write_docs(results: Results, device: torch.device, argv: Optional[list[str]]) -> None:
    machine = torch.cuda.get_device_name() if device.type == "cuda" else f"{os.cpu_count()} CPU cores"
    tables = [markdown_table(["measurement", "result"], results.rows)]
    if results.kernel_rows:
        tables.append(
            markdown_table(
                ["kernel", "max abs err", "rel err", "within tolerance"],
                [[n, f"{a:.3e}", f"{r:.3e}", "yes" if ok else "NO"] for n, a, r, ok in results.kernel_rows],
            )
        )
    command = script_command("batchrun.bench.gpu", argv)
    notes = f"torch {torch.__version__}."
    write_section("gpu", command, stamp(machine), "\n\n".join(tables), notes, "GPU check")


if __name__ == "__main__":
    sys.exit(main())
