"""The GPU check's 8B decode phase (benchmarks.gpu, `--only decode8b`): output tokens per second of the
engine's decode steps on a Llama-3-8B-shaped model (hidden 4096, 32 layers, 32 query / 8 KV heads
of 128, intermediate 14336, vocab 128256: ~16 GB in bf16) at batch 1, 16 and 64, for each weight
mode (none = bf16, int8, int4, fp8, w8a8), with each mode's ratio to bf16 measured in the same run.

The weights are random, drawn on the device straight into the engine's model (no checkpoint, no HF
model: an 8B one would cost a 16 GB write and read), then quantized by the engine's own pass
(engine.quantization: prepare_linears_for_engine, W8A8's calibration included) and served by a
real Engine (engine/startup.py's phases after `load_target`: KV sizing, CUDA-graph capture,
warm-up), so the figures are the engine's: its scheduler, CUDA graphs, sampler and kernels.

Decode rate at batch B: B prompts of PROMPT_LEN random tokens run cold (prefix cache reset) once
for 1 output token and once for 1 + T; the difference of the two wall times is T decode steps of B
sequences, so prefill, admission and the first token cancel out: tok/s = B * T / (t(1 + T) - t(1)).

The phase skips, saying why, where the GPU has too little free memory for the bf16 model and its
KV cache, and stops starting modes at its time estimate (the modes not run are named). In --smoke
the same code runs on the CPU at a tiny shape (benchmarks.gpu_engine.smoke_shape, float32, batch 1 and
4, 2 tokens): the engine, the quantization and the bookkeeping, with no timing reported.

A library module (no `__main__`); benchmarks.gpu runs it.
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Any, Optional

import torch

from benchmarks.gpu_engine import smoke_shape
from benchmarks.gpu_report import NO_CUDA, Report

DECODE_8B = "Llama-3-8B-shaped decode"  # benchmarks.gpu's phase
LLAMA3_8B = dict(
    model_type="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
MODES = ("none", "int8", "int4", "fp8", "w8a8")
BATCHES = (1, 16, 64)
SMOKE_BATCHES = (1, 4)  # --smoke: two sizes, so rows per batch size are told apart
PROMPT_LEN = 32
DECODE_TOKENS = 64  # timed decode steps per batch size on a GPU (3 in --smoke)
KV_CACHE_BYTES = 4 << 30  # batch 64 x (32 + 65) tokens needs ~0.8 GB in bf16; the rest is headroom
MEMORY_HEADROOM_BYTES = 6 << 30  # W8A8's calibration activations, quantization scratch, graphs, allocator


def random_decoder(hf_config: Any, dtype: torch.dtype, device: torch.device, kernels: Any, seed: int = 0) -> Any:
    """The engine's DecoderLM over `kernels` with random weights drawn on `device` in `dtype`
    (normal, std 0.02 as HF initializes; norm weights 1): build_decoder's steps with the state dict
    left out."""
    from batchrun.model.decoder import DecoderLM, RotaryTables

    with torch.device("meta"):
        model = DecoderLM(hf_config, kernels)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
        for buf in model.buffers():
            buf.zero_()  # the buffers made at construction are counters that start at zero
    if model.spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.device(device):
        model.rope = RotaryTables(hf_config, model.spec)  # computed on meta above: no values
        model.rope.tables(dtype, model.embed_tokens.weight.device)
    return model.eval()


def weight_bytes(hf_config: Any, dtype: torch.dtype) -> int:
    """The float model's bytes in `dtype`, counted on the meta device (no memory)."""
    from batchrun.model.decoder import DecoderLM

    with torch.device("meta"):
        model = DecoderLM(hf_config)
    return sum(p.numel() for p in model.parameters()) * torch.tensor([], dtype=dtype).element_size()


def memory_shortfall(need: int, free: int) -> Optional[str]:
    """Why the phase cannot run with `free` bytes of GPU memory when it needs `need`; None if it can."""
    if free >= need:
        return None
    return (
        f"needs ~{need / 2**30:.1f} GiB of GPU memory (bf16 weights, KV cache, headroom), {free / 2**30:.1f} GiB free"
    )


def random_engine(
    hf_config: Any, mode: str, device: torch.device, dtype: torch.dtype, smoke: bool, tokenizer: Any
) -> Any:
    """An Engine over random weights of `hf_config`'s shape, quantized per `mode` as the engine does
    (`tokenizer`: batchrun.testing's, for W8A8's calibration text and the engine's admission)."""
    from batchrun.engine import Engine, EngineConfig
    from batchrun.engine.quantization import prepare_linears_for_engine
    from batchrun.engine.startup import Target, bind, start_engine

    max_seqs = max(BATCHES if not smoke else SMOKE_BATCHES)
    tokens = DECODE_TOKENS if not smoke else 2
    config = EngineConfig(
        model="random:llama-3-8b-shaped",
        dtype=str(dtype).replace("torch.", ""),
        device=device.type,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_seqs * PROMPT_LEN,
        max_model_len=PROMPT_LEN + tokens + 16,
        kv_cache_memory=KV_CACHE_BYTES if not smoke else 16 << 20,
        quantization=mode,
    )
    kernels = bind(config)
    model = random_decoder(hf_config, dtype, device, kernels)
    summary = prepare_linears_for_engine(model, config, tokenizer, None, kernels)
    target = Target(
        device=device,
        dtype=dtype,
        model=model,
        tokenizer=tokenizer,
        hf_config=hf_config,
        path=config.model,
        fingerprint="random",
        quantization=summary,
        draft=None,
    )
    return Engine(config, start_engine(config, target))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_rate(
    engine: Any, batch: int, tokens: int, vocab_size: int, device: torch.device, repeats: int = 2
) -> dict[str, Any]:
    """Seconds of `batch` cold prompts generating 1 and 1 + `tokens` tokens (the best of `repeats`
    each, after one untimed run; 0: one run each, nothing else), and the decode rate their
    difference gives (module docstring)."""
    from batchrun.engine import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab_size, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]

    def run(max_tokens: int) -> float:
        engine.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        _sync(device)
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        _sync(device)
        assert all(len(o.token_ids) == max_tokens for o in outs), "ignore_eos runs to max_tokens"
        return time.perf_counter() - t

    if repeats:
        run(1 + tokens)  # the batch size's first steps (a graph bucket's first replay, the sampler's shapes)
    first = min(run(1) for _ in range(max(repeats, 1)))
    whole = min(run(1 + tokens) for _ in range(max(repeats, 1)))
    decode_s = max(whole - first, 1e-9)
    return {
        "batch": batch,
        "decode_tokens": tokens,
        "prefill_and_first_s": first,
        "whole_s": whole,
        "decode_s": decode_s,
        "output_tok_s": batch * tokens / decode_s,
    }


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_decode_8b(device: torch.device, smoke: bool, report: Report, estimate_s: float) -> None:
    """The phase: each mode's engine built in turn (the previous one freed), its decode rate at
    each batch size; ratios against bf16's at the end. On a GPU, modes are not started past
    `estimate_s` (in --smoke every mode runs: the test checks them all)."""
    from transformers import AutoConfig

    t0 = time.perf_counter()
    shape = dict(smoke_shape(LLAMA3_8B) if smoke else LLAMA3_8B)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = DECODE_TOKENS if not smoke else 2
    batches = BATCHES if not smoke else SMOKE_BATCHES
    section: dict[str, Any] = {
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "batches": list(batches),
        "prompt_len": PROMPT_LEN,
        "decode_tokens": tokens,
        "note": NO_CUDA if smoke else "",
        "rows": [],
        "not_run": [],
        "skipped": None,
        "engines": {},  # per mode: build seconds, weight bytes, quantized formats, warm-up
    }
    report.data["decode_8b"] = section
    kw = dict(shape)
    hf_config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    need = weight_bytes(hf_config, dtype) + (KV_CACHE_BYTES + MEMORY_HEADROOM_BYTES if not smoke else 0)
    section["memory_needed_bytes"] = need
    if device.type == "cuda":
        _free_memory(device)
        free = torch.cuda.mem_get_info()[0]
        section["memory_free_bytes"] = free
        section["skipped"] = memory_shortfall(need, free)
        if section["skipped"] is not None:
            report.add(DECODE_8B, f"skipped ({section['skipped']})")
            return
    from batchrun.testing import build_tokenizer

    tokenizer = build_tokenizer()  # trained on the spot: once for every mode
    per_mode_s: list[float] = []
    for mode in MODES:
        elapsed = time.perf_counter() - t0
        if not smoke and per_mode_s and elapsed + max(per_mode_s) > estimate_s:
            section["not_run"].append(mode)
            continue
        t_mode = time.perf_counter()
        try:
            _measure_mode(section, hf_config, mode, device, dtype, smoke, tokenizer, batches, tokens)
        except Exception as exc:  # noqa: BLE001 - one mode failing (a kernel, memory) must not hide the others
            traceback.print_exc()
            section.setdefault("errors", {})[mode] = repr(exc)
            report.add(f"{DECODE_8B} {mode}", f"FAILED: {exc!r}", ok=False)
        finally:
            _free_memory(device)  # the engine's cycles and cached blocks, before the next mode's weights
        if device.type == "cuda":  # what the freed engine left behind (should be ~0)
            section["engines"].setdefault(mode, {})["allocated_after_close_bytes"] = torch.cuda.memory_allocated()
        per_mode_s.append(time.perf_counter() - t_mode)
        report.write_json()
    _ratios(section, report)


def _measure_mode(
    section: dict[str, Any],
    hf_config: Any,
    mode: str,
    device: torch.device,
    dtype: torch.dtype,
    smoke: bool,
    tokenizer: Any,
    batches: tuple[int, ...],
    tokens: int,
) -> None:
    """One mode's engine built, its decode rate at each batch size into section["rows"]."""
    t = time.perf_counter()
    engine = random_engine(hf_config, mode, device, dtype, smoke, tokenizer)
    build_s = time.perf_counter() - t
    settings = engine.settings
    section["engines"][mode] = {
        "build_s": build_s,
        "weight_bytes": settings.weight_bytes,
        "quant_formats": dict(settings.quant_formats),
        "warmup": dict(settings.warmup) if settings.warmup else None,  # steps, graph buckets, seconds
    }
    for batch in batches:
        row = decode_rate(engine, batch, tokens, hf_config.vocab_size, device, repeats=0 if smoke else 2)
        row.update(mode=mode, build_s=build_s, weight_bytes=settings.weight_bytes)
        if smoke:  # CPU timings of a tiny model say nothing about a GPU
            row.update(output_tok_s=None, decode_s=None, prefill_and_first_s=None, whole_s=None)
        section["rows"].append(row)
        rate = NO_CUDA if smoke else f"{row['output_tok_s']:,.0f} output tok/s"
        print(f"  {mode:<5} batch {batch:>2}: {rate} (engine built in {build_s:.0f}s)", flush=True)
    if engine.runner.graphs is not None:
        section["engines"][mode]["graphs_broken"] = engine.runner.graphs.is_broken


def _ratios(section: dict[str, Any], report: Report) -> None:
    """Each row's output tok/s over bf16's at the same batch size, and one table row per mode."""
    bf16 = {r["batch"]: r["output_tok_s"] for r in section["rows"] if r["mode"] == "none"}
    for row in section["rows"]:
        base = bf16.get(row["batch"])
        rate = row["output_tok_s"]
        row["ratio_vs_bf16"] = rate / base if rate is not None and base else None
    for mode in MODES:
        rows = [r for r in section["rows"] if r["mode"] == mode]
        if not rows:
            continue
        name = "bf16" if mode == "none" else mode
        if rows[0]["output_tok_s"] is None:
            text = f"{NO_CUDA}; ran at batch {', '.join(str(r['batch']) for r in rows)}"
        else:
            text = "; ".join(
                f"b{r['batch']} {r['output_tok_s']:,.0f} tok/s"
                + (f" ({r['ratio_vs_bf16']:.2f}x bf16)" if mode != "none" and r["ratio_vs_bf16"] else "")
                for r in rows
            )
        report.add(f"{DECODE_8B} {name}", text)
    if section["not_run"]:
        report.add(f"{DECODE_8B} not run", f"out of the phase's time: {', '.join(section['not_run'])}")
