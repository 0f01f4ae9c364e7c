"""The GPU check's engine phases (benchmarks.gpu, parts 3 and 4): per model shape one engine with random
weights, built once at the engine's default KV sizing (its memory recorded, every CUDA-graph bucket
captured, warmed up), then measured by budgeted phases: one decode step taken apart
(benchmarks.decode_step), nano-vllm's workload timed greedy and at temperature 0.6, Triton compile
counts across the timed runs (benchmarks.compile_counts), and HF `generate` on the same first prompts.

A library module (no `__main__`); benchmarks.gpu runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import tempfile
import time
from typing import Any, Optional

import torch

from batchrun.benchmark.hf_baseline import hf_generate, load_hf_model
from batchrun.benchmark.timing import patched
from benchmarks import compile_counts
from benchmarks.decode_step import capture_buckets, probe_decode_steps
from benchmarks.gpu_report import NO_CUDA, Budget, Report
from benchmarks.workloads import nano_vllm_workload

# The turnover workload streams this many times the engine's slots (max_num_seqs) through it.
TURNOVER_SEQS = 3
GRAPH_REL_TOL = 2e-2  # graph replay against eager logits in bf16 (a padded bucket may tile differently)


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


def smoke_shape(shape: dict) -> dict:
    """The same family at a size the CPU runs in a moment."""
    return {
        **shape,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free_device_memory(device: torch.device) -> None:
    gc.collect()  # the engine's objects refer to each other; their tensors go only with the cycle
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _ms(value: Optional[float]) -> str:
    return NO_CUDA if value is None else f"{value:.2f} ms"


class ModelCheck:
    """One model shape's engine: built once (memory, graph capture, warm-up), then its budgeted
    phases (decode step, timed workloads, HF ratio) each measure it, and `close` frees it."""

    def __init__(self, label: str, shape: dict, device: torch.device, smoke: bool, report: Report, tmp: str) -> None:
        self.label = label
        self.shape = smoke_shape(shape) if smoke else shape
        self.device = device
        self.smoke = smoke
        self.report = report
        self.tmp = tmp
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.num_seqs, lo, hi = (8, 10, 40) if smoke else (256, 100, 1024)
        self.prompts, self.max_tokens = nano_vllm_workload(self.num_seqs, lo, hi, self.shape["vocab_size"])
        # the turnover workload: TURNOVER_SEQS x the slots, shorter (requests end every step or two)
        t_lo, t_hi = (4, 16) if smoke else (32, 384)
        self.turnover = nano_vllm_workload(TURNOVER_SEQS * self.num_seqs, t_lo, t_hi, self.shape["vocab_size"], seed=1)
        self.section = report.model(label)
        self.section["workload"] = {
            "num_seqs": self.num_seqs,
            "prompt_and_output_lengths": [lo, hi],
            "num_prompt_tokens": sum(map(len, self.prompts)),
            "num_output_tokens": sum(self.max_tokens),
            "shape": self.shape,
        }
        self.model_dir = ""
        self.engine: Any = None
        self.compiles_before: Optional[compile_counts.Snapshot] = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    # ---- build: memory at default sizing, graph capture, warm-up ------------------------------

    def build(self) -> None:
        from batchrun.engine import Engine, EngineConfig, SamplingParams

        t0 = time.perf_counter()
        self.model_dir = build_random_model(os.path.join(self.tmp, "model"), self.shape, self.device, self.dtype)
        free_before = total = None
        if self.cuda:
            _free_device_memory(self.device)
            torch.cuda.reset_peak_memory_stats()
            free_before, total = torch.cuda.mem_get_info()
        self.engine = Engine(
            EngineConfig(
                model=self.model_dir,
                dtype=str(self.dtype).replace("torch.", ""),
                device=self.device.type,
                max_num_seqs=self.num_seqs,
                max_num_batched_tokens=16384 if not self.smoke else 512,
                max_model_len=4096,
                # GPU: the engine's default, a fraction of the free memory (what `memory` reports)
                kv_cache_memory=None if self.cuda else 64 << 20,
                cache_dir=os.path.join(self.tmp, "cache"),
            )
        )
        self._memory(free_before, total)
        self._capture()
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        self.engine.generate([[1] * 64, [2] * 300, [3] * 17], warm)  # compiles the prefill and decode kernels
        _sync(self.device)
        # Start-up tuned and warmed up: from here on nothing should compile, the decode-step probe
        # included (it times eager and graphed steps)
        self.compiles_before = self._compile_snapshot()
        built_s = time.perf_counter() - t0
        print(f"  built and warmed in {built_s:.1f}s; settings: {self.engine.settings.as_dict()}", flush=True)

    def _memory(self, free_before: Optional[int], total: Optional[int]) -> None:
        from batchrun.engine.profiler import default_kv_bytes

        settings = self.engine.settings
        weights, kv = settings.weight_bytes, settings.kv_cache_bytes
        memory: dict[str, Any] = {
            "weight_bytes": weights,
            "kv_cache_bytes": kv,
            "num_kv_blocks": settings.num_kv_blocks,
            "block_size": settings.block_size,
            "max_model_len": settings.max_model_len,
        }
        self.section["memory"] = memory
        num_blocks, block_size = settings.num_kv_blocks, settings.block_size
        head = f"weights {_gib(weights)}, KV {_gib(kv)} = {num_blocks:,} blocks x {block_size} tokens"
        if not self.cuda:
            memory["note"] = f"{NO_CUDA}: KV sized 64 MiB, not the default"
            self.report.add(f"{self.label}: memory", f"{head}; default sizing and device memory {NO_CUDA}")
            return
        default_fraction = default_kv_bytes(self.device.type == "cuda", 1 << 40) / (1 << 40)
        free_after = torch.cuda.mem_get_info()[0]
        assert total is not None  # read before construction whenever self.cuda
        memory.update(
            default_kv_fraction_of_free=default_fraction,
            kv_fraction_of_free_after_weights=kv / max(free_before - weights, 1),  # approximate: the engine measures
            device_total_bytes=total,
            free_before_bytes=free_before,
            free_after_construction_bytes=free_after,
            allocated_after_construction_bytes=torch.cuda.memory_allocated(),
            peak_allocated_construction_bytes=torch.cuda.max_memory_allocated(),
            reserved_after_construction_bytes=torch.cuda.memory_reserved(),
        )
        self.report.add(
            f"{self.label}: memory at default sizing ({default_fraction:.0%} of free for KV)",
            f"{head}; "
            f"peak allocated {_gib(memory['peak_allocated_construction_bytes'])}, free after construction "
            f"{_gib(free_after)} of {_gib(total)}",
        )

    def _capture(self) -> None:
        graphs = self.engine.runner.graphs
        section: dict[str, Any] = {"capture": None}
        self.section["cuda_graphs"] = section
        if graphs is None:
            section["note"] = NO_CUDA if not self.cuda else "off (BATCHRUN_CUDA_GRAPHS=0)"
            if self.cuda:
                self.report.add(f"{self.label}: CUDA graph capture", section["note"], ok=False)
            return
        cap = capture_buckets(graphs, self.num_seqs)
        section["capture"] = cap
        failed = cap["failed"]
        self.report.add(
            f"{self.label}: CUDA graph capture",
            f"{len(cap['captured'])}/{len(cap['buckets'])} buckets in {cap['capture_s']:.1f}s"
            + (f"; FAILED at {sorted(failed)}: {next(iter(failed.values()))}" if failed else ""),
            ok=not failed,
        )

    # ---- one decode step at num_seqs, graph replay against eager --------------------------------

    def decode_step(self) -> None:
        tol = GRAPH_REL_TOL if self.dtype != torch.float32 else 1e-4
        result = probe_decode_steps(self.engine, self.prompts, tol, stand_in=not self.cuda)
        self.engine.reset_prefix_cache()  # the timed runs start cold, not on the probe's prompts
        self.section["decode_step"] = {k: v for k, v in result.items() if k != "graph_vs_eager"}
        rows = result["graph_vs_eager"] or []
        graphs = self.section["cuda_graphs"]
        graphs["graph_vs_eager"] = rows
        bad = [r for r in rows if not r["ok"]]
        worst = max((r.get("rel_err", math.nan) for r in rows), default=math.nan)
        what = f"graph replay vs eager logits ({'CPU stand-in replay' if not self.cuda else 'bf16'})"
        if not rows:
            self.report.add(f"{self.label}: {what}", "n/a (no graphs)", ok=not self.cuda)
        else:
            detail = "; ".join(
                f"{r['num_seqs']} seqs: " + (r["error"] if "error" in r else f"rel err {r['rel_err']:.2e}") for r in bad
            )
            self.report.add(
                f"{self.label}: {what}",
                f"agree at {len(rows) - len(bad)}/{len(rows)} batch sizes up to {self.num_seqs} (worst rel err "
                f"{worst:.2e})" + (f"; DISAGREE: {detail}" if bad else ""),
                ok=not bad,
            )
        where = f"{result['num_seqs']} seqs, mean context {result['mean_context']:.0f}"
        ahead, graphed = result.get("async"), result.get("graphed")
        if ahead is not None and graphed is not None:
            gpu_ms = graphed["timed"]["gpu_ms"]
            over = f"; wall - GPU {ahead['wall_ms'] - gpu_ms:.2f} ms (target <= 0.3)" if gpu_ms is not None else ""
            self.report.add(
                f"{self.label}: decode step graphed, async scheduling, {where}",
                f"wall {ahead['wall_ms']:.2f} ms per step back to back, {ahead['num_ahead']} ran ahead; "
                f"synchronous {graphed['wall_ms']:.2f} ms{over}",
                ok=ahead["num_ahead"] > 0,
            )
        for path in ("graphed", "eager"):
            measured = result.get(path)
            if measured is None:
                continue
            t = measured["timed"]
            kernels = measured["kernels"]
            if kernels is None:
                kernel_text = NO_CUDA
            elif "error" in kernels:
                kernel_text = f"profiler failed: {kernels['error']}"
            else:
                kernel_text = (
                    f"{kernels['gpu_kernels']} kernels + {kernels['gpu_copies']} copies on the device, "
                    f"{kernels['host_kernel_launches']} kernel + {kernels['host_graph_launches']} graph launches"
                )
            top = (kernels or {}).get("top_kernels") or []
            if top:
                total_us = sum(us for _, _, us in top)
                print(f"top kernels of one {path} decode step by GPU time (us, share of these, launches):")
                for name, n, us in top:
                    print(f"  {us:9.1f} {100 * us / total_us:5.1f}%  x{n:<4} {name[:100]}")
            path_name = path if self.cuda else f"{path}{' (stand-in)' if path == 'graphed' else ''}"
            self.report.add(
                f"{self.label}: decode step {path_name}, {where}",
                f"wall {measured['wall_ms']:.2f} ms; GPU {_ms(t['gpu_ms'])} (forward {_ms(t['gpu_forward_ms'])}); "
                f"host {t['host_ms']:.2f} ms = schedule {t['schedule_ms']:.2f} + pack {t['pack_ms']:.2f} + launch "
                f"{t['launch_ms']:.2f} + sample {t['sample_ms']:.2f} + update {t['update_ms']:.2f} + other "
                f"{max(t['other_ms'], 0.0):.2f}; per step: {kernel_text}",
            )

    # ---- timed workloads ---------------------------------------------------------------------

    def timed_run(
        self, temperature: float, cut_at: float, async_scheduling: bool = False, admission_min_slots: int = 0
    ) -> None:
        """One timed run of nano-vllm's workload (all sequences admitted at once), or with
        `admission_min_slots` >= 1 of the turnover workload (TURNOVER_SEQS requests streamed through
        the engine's slots, so requests end and are admitted every few steps) at that setting."""
        from batchrun.engine import EngineRequest, SamplingParams
        from batchrun.engine.runners import GpuRunner

        engine = self.engine
        if async_scheduling and not self.cuda and engine.runner.graphs is None:
            # --smoke: steps run ahead only on graphs; the tests' stand-in replays them eagerly
            with patched(engine, "runner", GpuRunner.stand_in(engine.runner, self.num_seqs)):
                return self.timed_run(temperature, cut_at, async_scheduling, admission_min_slots)
        turnover = admission_min_slots >= 1
        prompts, max_tokens = self.turnover if turnover else (self.prompts, self.max_tokens)
        scheduler = engine.scheduler
        default_config = scheduler.config
        if turnover:  # a scheduler setting, switched on the idle engine for this run only
            scheduler.config = dataclasses.replace(default_config, admission_min_slots=admission_min_slots)
        engine.set_async_scheduling(async_scheduling)
        engine.reset_prefix_cache()  # cold: the prompts ran before (warm-up, the probe, the other run)
        requests = [
            EngineRequest(i, p, SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompts, max_tokens))
        ]
        before = engine.stats()
        t = time.perf_counter()
        num_done = 0
        try:
            # Streamed so a slow engine is cut off (the rest aborted) and still reports the rate it
            # reached, instead of running the call past its limit.
            for out in engine.stream(requests, max_in_flight=None if turnover else self.num_seqs):
                num_done += 1
                assert out.error is None and len(out.token_ids) == max_tokens[out.request_id], (
                    "ignore_eos runs to max_tokens"
                )
                if time.perf_counter() > cut_at:
                    break
            _sync(self.device)
            wall = time.perf_counter() - t
            stats = engine.stats()
        finally:
            engine.set_async_scheduling(False)
            scheduler.config = default_config
        num_out = stats.num_generated_tokens - before.num_generated_tokens
        num_in = stats.num_prompt_tokens - before.num_prompt_tokens
        run = {
            "temperature": temperature,
            "num_seqs": len(requests),
            "num_finished": num_done,
            "is_cut": num_done < len(requests),
            "num_prompt_tokens": num_in,
            "num_output_tokens": num_out,
            "wall_s": wall,
            "output_tok_s": num_out / wall,
            "total_tok_s": (num_in + num_out) / wall,
            "num_steps": stats.num_steps - before.num_steps,
            "num_preemptions": stats.num_preemptions - before.num_preemptions,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if self.cuda else None,
            "async_scheduling": async_scheduling,
            # steps launched before the previous step's tokens were read (engine.async_scheduling)
            "num_async_steps": stats.num_async_steps if async_scheduling else None,
            "ms_per_step": 1e3 * wall / max(stats.num_steps - before.num_steps, 1),
        }
        if turnover:
            run["admission_min_slots"] = admission_min_slots
        runs = self.section.setdefault("turnover" if turnover else "throughput", [])
        # the first run of the list at this temperature (nano: the synchronous one; turnover: the
        # engine's defaults), same engine, measured just before
        base = next((r for r in runs if r["temperature"] == temperature), None)
        runs.append(run)
        cut = "" if not run["is_cut"] else f" CUT at the deadline after {num_done}/{len(requests)} finished;"
        what = "greedy" if temperature == 0 else f"temperature {temperature}"
        extra = ""
        if turnover:
            what = f"turnover {what}, admission_min_slots {admission_min_slots}"
        if async_scheduling:
            what += " async"
            extra = f", {run['num_async_steps']} ran ahead"
        if base is not None and not base["is_cut"] and not run["is_cut"]:
            extra += f"; {run['output_tok_s'] / base['output_tok_s']:.3f}x the first run"
        slots = f"{len(requests)} seqs" + (f" through {self.num_seqs} slots" if turnover else "")
        self.report.add(
            f"{self.label} {what}: {slots}, {num_in} prompt + {num_out} output tokens",
            f"{run['output_tok_s']:,.0f} output tok/s, {run['total_tok_s']:,.0f} total tok/s, {wall:.1f}s,{cut} "
            f"{run['num_steps']} steps ({run['ms_per_step']:.2f} ms each{extra}), {run['num_preemptions']} preemptions"
            + (" (target >= 28,000 output tok/s)" if self.label == QWEN3 and temperature == 0 and not turnover else ""),
            ok=not async_scheduling or bool(run["num_async_steps"]),  # the option must have run steps ahead
        )

    def _compile_snapshot(self) -> Optional[compile_counts.Snapshot]:
        try:
            return compile_counts.snapshot()
        except TypeError as exc:  # a Triton whose cache this cannot read: said in the row
            self.section["compile_counts"] = {"note": f"unavailable: {exc}"}
            return None

    def compiles(self) -> None:
        """Triton variants compiled after the build (start-up's tuning and warm-up) up to now: during the
        decode-step probe and the timed runs (none expected)."""
        name = f"{self.label}: Triton compiles during the timed runs"
        if compile_counts.interpreted():
            self.section["compile_counts"] = {"note": "n/a (interpreter: nothing compiles)"}
            self.report.add(name, self.section["compile_counts"]["note"])
            return
        before, after = self.compiles_before, self._compile_snapshot()
        if before is None or after is None:
            self.report.add(name, self.section.get("compile_counts", {}).get("note", "not measured"))
            return
        new = compile_counts.compiled_between(before, after)
        self.section["compile_counts"] = {
            "after_warmup": compile_counts.counts(before),
            "after_timed_runs": compile_counts.counts(after),
            "new_during_timed_runs": new,
            "ok": not new,
        }
        total = sum(compile_counts.counts(after).values())
        self.report.add(
            name,
            f"{sum(map(len, new.values()))} new ({total} variants of {len(compile_counts.counts(after))} kernels "
            "compiled in this process)"
            + (f"; RECOMPILED: {', '.join(f'{k} x{len(v)}' for k, v in new.items())}" if new else ""),
            ok=not new,
        )

    # ---- HF generate on the same first prompts -------------------------------------------------

    def hf_ratio(self) -> None:
        """HF `generate` (greedy, one left-padded static batch, fixed output length: ignore_eos) against
        the engine on the same first prompts, through the benchmark job's HF baseline. The engine runs
        first, its prefix cache reset (those prompts ran before), then is freed: HF gets the device."""
        from batchrun.engine import SamplingParams

        num, new = (4, 8) if self.smoke else (32, 128)
        subset = self.prompts[:num]
        self.engine.reset_prefix_cache()
        t = time.perf_counter()
        self.engine.generate(subset, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
        _sync(self.device)
        engine_s = time.perf_counter() - t
        self.close()
        hf = load_hf_model(self.model_dir, self.dtype, self.device)
        hf_generate(hf, [p[-16:] for p in subset], 2, num, 0, [], ignore_eos=True)  # warm-up
        hf_s = hf_generate(hf, subset, new, num, 0, [], ignore_eos=True).wall_s
        del hf
        _free_device_memory(self.device)
        self.section["hf_baseline"] = {
            "num_seqs": num,
            "max_new_tokens": new,
            "num_prompt_tokens": sum(map(len, subset)),
            "engine_s": engine_s,
            "hf_s": hf_s,
            "engine_tok_s": num * new / engine_s,
            "hf_tok_s": num * new / hf_s,
            "ratio": hf_s / engine_s,
        }
        self.report.add(
            f"{self.label}: vs HF generate ({num} seqs x {new} tokens, both cold)",
            f"engine {num * new / engine_s:,.0f} tok/s, HF {num * new / hf_s:,.0f} tok/s, ratio {hf_s / engine_s:.1f}x",
        )

    def close(self) -> None:
        if self.engine is None:
            return
        graphs = self.engine.runner.graphs
        if graphs is not None:  # a capture that failed while running makes the engine decode eagerly
            self.section["cuda_graphs"]["is_broken"] = graphs.is_broken
            if graphs.is_broken:
                self.report.add(f"{self.label}: CUDA graphs", "BROKE during the run (decoding eagerly)", ok=False)
        self.engine = None
        _free_device_memory(self.device)


QWEN3 = "Qwen3-0.6B-shaped"
SMOLLM2 = "SmolLM2-135M-shaped"


# The turnover workload's runs: (phase name, engine.admission_min_slots, engine.async_scheduling).
# Admitting at every end turns a graphed decode step into an eager mixed step at nearly every step;
# admitting in batches of max_num_seqs / 16 keeps most steps graphed (and lets them run ahead).
TURNOVER_RUNS = (("every end", 1, False), ("batched", 16, False), ("batched async", 16, True))


def model_phases(label: str, engine_checks: bool, throughput: bool, baseline: bool) -> list[str]:
    """The budgeted phases of one model, in the order they run."""
    phases = [f"{label}: build"]
    if engine_checks and label == QWEN3:
        phases.append(f"{label}: decode step")
    if throughput:
        phases.append(f"{label}: greedy")
        if label == QWEN3:
            phases.append(f"{label}: greedy async")  # engine.async_scheduling against the run before
            phases.append(f"{label}: temperature 0.6")
            phases += [f"{label}: turnover {name}" for name, _, _ in TURNOVER_RUNS]
        if baseline:
            phases.append(f"{label}: vs HF generate")
    return phases


def check_model(
    label: str, shape: dict, device: torch.device, smoke: bool, budget: Budget, report: Report, phases: list[str]
) -> None:
    with tempfile.TemporaryDirectory(prefix="batchrun-gpu-") as tmp:
        check = ModelCheck(label, shape, device, smoke, report, tmp)
        try:
            budget.run(f"{label}: build", check.build, report)
            if check.engine is None:
                return
            if f"{label}: decode step" in phases:
                budget.run(f"{label}: decode step", check.decode_step, report)
            for temperature, async_scheduling, phase in (
                (0.0, False, f"{label}: greedy"),
                (0.0, True, f"{label}: greedy async"),
                (0.6, False, f"{label}: temperature 0.6"),
            ):
                if phase in phases and check.engine is not None:
                    # a slow engine must not eat the later phases' time: cut at twice the estimate
                    cut_at = min(budget.deadline, time.perf_counter() + 2 * budget.phases[phase].estimate_s)
                    run = functools.partial(check.timed_run, temperature, cut_at, async_scheduling)
                    budget.run(phase, run, report)
            for name, slots, async_scheduling in TURNOVER_RUNS:
                phase = f"{label}: turnover {name}"
                if phase in phases and check.engine is not None:
                    cut_at = min(budget.deadline, time.perf_counter() + 2 * budget.phases[phase].estimate_s)
                    run = functools.partial(check.timed_run, 0.0, cut_at, async_scheduling, slots)
                    budget.run(phase, run, report)
            if check.section.get("throughput"):
                check.compiles()
            if f"{label}: vs HF generate" in phases and check.engine is not None:
                budget.run(f"{label}: vs HF generate", check.hf_ratio, report)
        finally:
            if check.engine is not None:
                # which fused GEMMs won their start-up timing against cuBLAS + the separate kernel
                choices = check.engine.settings.kernels["tuning"]["fused"]
                report.data.setdefault("fused_gemm_choices", {})[label] = choices
            check.close()
            report.write_json()
