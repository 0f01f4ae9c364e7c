"""Engine start-up as named phases, each a small function that returns a frozen value.

    bind               EngineConfig -> KernelSet   the device target found, its kernel set bound (tables)
    load_target        KernelSet -> Target         weights in, linears quantized/packed, draft model
    tune               Target -> KernelSet         GPU: fused or not, tiles; CPU: native or torch per kind and rows
    plan_kv            Target -> KVPlan            KV blocks from the memory budget, max_model_len
    build_cache        KVPlan -> Cache             the KV manager and the runner (CPU or GPU) over its blocks
    pick_batch_limits  Cache -> BatchLimits        max_num_seqs / max_num_batched_tokens (profiled)
    build_core         all of the above -> Core    scheduler, sampler, grammars, admission, drafter
    describe           all of the above -> EngineSettings   what the manifest and benchmarks record
    warm_up            Core -> summary             every kernel variant and graph bucket, once

`start_engine` runs them in this order and hands the `EngineParts` to `Engine`, which only assigns
them. The order matters where one phase measures what an earlier one left: the kernel set decides
how the linears hold their weights, so it is bound before the model is prepared; tuning times on
model-shaped inputs while the memory the KV cache will take is still free; a draft model is loaded
before the KV cache is sized (both caches come out of one budget, measured with both models'
weights in place), and the batch limits are timed on the runner over the real cache. `bind` is the
one phase that asks which device the engine runs on (kernels/target.py: find_target).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch

from batchrun.engine import profiler
from batchrun.engine.adapters import Adapters, attach_adapters
from batchrun.engine.admission import Admission
from batchrun.engine.config import EngineConfig, EngineConfigError
from batchrun.engine.device import available_memory, resolve_device, resolve_dtype
from batchrun.engine.drafter import Drafter, build_drafter, load_draft_model
from batchrun.engine.grammar import GrammarCompiler
from batchrun.engine.group import FollowerReport, Group
from batchrun.engine.group_startup import open_group
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.profiler import BatchLimits, default_kv_bytes
from batchrun.engine.quantization import prepare_linears_for_engine
from batchrun.engine.reasoning import find_think_tags
from batchrun.engine.runners import CpuRunner, GpuRunner, ModelRunner, kv_bytes_per_block
from batchrun.engine.sampler import Sampler
from batchrun.engine.scheduler import Scheduler, SchedulerConfig
from batchrun.engine.settings import EngineSettings
from batchrun.engine.tasks import check_serving_path, generic_turned_off
from batchrun.engine.warmup import warm_up as run_warm_up
from batchrun.kernels.binding import bind_kernels, with_tuning
from batchrun.kernels.cpu_tuning import CpuRows, cpu_measurable, measure_cpu
from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.target import GpuTarget, find_target
from batchrun.kernels.tuning import measured_tuning, table_tuning
from batchrun.kernels.tuning_cases import tuning_cases
from batchrun.model.decoder import DecoderLM, build_decoder
from batchrun.model.gemm_shapes import attention_shape, cpu_linear_shapes, gemm_shapes
from batchrun.model.generic import GenericLM, GenericModelError, build_generic, serving_path
from batchrun.model.linear import count_native_linears
from batchrun.model.loader import load_model
from batchrun.model.prepare import apply_linear_choices, module_weight_bytes, owned_weight_bytes
from batchrun.model.quant import QuantizationSummary
from batchrun.model.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """The model the engine serves, loaded and prepared (phase `load_target`)."""

    device: torch.device  # engine.device resolved
    dtype: torch.dtype  # engine.dtype resolved: activations' and a float KV cache's dtype
    # In eval mode, every linear given its backend (quantized, packed or plain). A GenericLM
    # (model/generic.py) on the generic path: it has the surface of DecoderLM the engine calls.
    model: DecoderLM
    tokenizer: Any  # the model's Hugging Face tokenizer
    hf_config: Any  # the model's transformers config
    path: str  # where the weights were read from
    fingerprint: str  # the weight files' sha256 (the job's model fingerprint)
    quantization: QuantizationSummary  # what prepare_linears did: formats per kind, packed count
    draft: Optional[tuple[DecoderLM, str]]  # speculative.method=draft: the draft model and its path
    model_path: str = "native"  # model/generic.py: serving_path ("native" | "generic")
    lora: Optional[Adapters] = None  # engine.lora_adapters attached (start_engine, after tuning); None without

    def eos_token_ids(self) -> set[int]:
        """The model config's and the tokenizer's end-of-sequence ids."""
        ids: set[int] = set()
        for source in (getattr(self.hf_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        return ids


@dataclass(frozen=True)
class KVPlan:
    """The KV cache's size (phase `plan_kv`); a block holds the target's and a draft model's entries."""

    num_blocks: int  # KV blocks of block_size tokens, >= 1
    block_size: int  # tokens per block (engine.block_size)
    bytes_per_block: int  # all layers' K and V of one block, the draft model's included
    max_model_len: int  # prompt + output tokens one request may reach: <= num_blocks * block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class Cache:
    """The paged KV cache and the runner that computes into it (phase `build_cache`)."""

    kv: KVCacheManager  # block allocation, prefix cache, persistent block tables
    runner: ModelRunner  # the target's steps over the cache's tensors, sampled with the engine's sampler


@dataclass(frozen=True)
class Core:
    """What a step runs besides the cache (phase `build_core`)."""

    scheduler: Scheduler  # which requests run how many tokens each step, and where each ends
    sampler: Sampler  # logits -> tokens, seeded from engine.seed (the runner's)
    grammars: GrammarCompiler  # structured output's compiled constraints (background thread)
    admission: Admission  # prompts and params -> queued requests, or error outputs
    drafter: Optional[Drafter]  # speculative decoding's proposer; None with method "none"
    speculative: Optional[dict[str, Any]]  # the drafter's settings (method, k, ...); None without one


@dataclass(frozen=True)
class EngineParts:
    """Everything start-up produced, in the order it was produced; `Engine` assigns it."""

    config: EngineConfig
    kernels: KernelSet  # bound at start-up, tuned: what every module of the model runs
    target: Target
    kv_plan: KVPlan
    cache: Cache
    limits: BatchLimits
    core: Core
    settings: EngineSettings
    startup_s: float  # seconds from the first phase to the end of the warm-up
    group: Optional[Group] = None  # a tensor-parallel worker's followers (engine/group.py); None alone


def bind(
    config: EngineConfig, simulate: Optional[GpuTarget] = None, device: Optional[torch.device] = None
) -> KernelSet:
    """Find the device target (engine.device; the CPU's native kernels switched on or not) and bind
    its kernel set for the resolved dtype and engine.kv_cache_dtype, with the static tables' choices.
    `simulate`: a GPU the CPU engine's kernel set is sized for instead (checks, launch counts);
    `device`: a tensor-parallel rank's own device instead of engine.device's."""
    target = find_target(device if device is not None else resolve_device(config.device), simulate=simulate)
    return bind_kernels(target, resolve_dtype(config.dtype, target), kv_cache_dtype=config.kv_cache_dtype)


def load_target(
    config: EngineConfig, kernels: Optional[KernelSet] = None, tp: Optional[TensorParallel] = None
) -> Target:
    """Load the weights, give every linear its backend in one pass (quantized per
    engine.quantization, over `kernels`' kernel per format, and on a bf16 CPU the float ones packed
    once, for the native kernel or oneDNN, instead of reordered on every call), and load the draft
    model when there is one. `kernels`: None binds the config's (`bind`); `tp`: a rank of a
    tensor-parallel group, which reads and holds only its slices (its threads are set already)."""
    if config.num_threads and tp is None:
        torch.set_num_threads(config.num_threads)
    kernels = kernels if kernels is not None else bind(config)
    device, dtype = kernels.target.device, kernels.dtype
    loaded = load_model(
        config.model,
        dtype=dtype,
        cache_dir=config.cache_dir,
        keep_gguf_quantization=config.quantization in ("gguf", "w4a8"),
        tp_shard=tp.shard if tp is not None else None,
    )
    tokenizer, hf_config, path, fingerprint = loaded.tokenizer, loaded.config, loaded.path, loaded.fingerprint
    model_path = serving_path(hf_config)
    if model_path == "generic":
        check_serving_path(config, hf_config)
        try:
            generic = build_generic(hf_config, loaded.state_dict, dtype, device, kernels)
        except (
            GenericModelError
        ) as e:  # found once the class is built: one line naming the key, as check_serving_path's
            raise EngineConfigError(f"engine.model={config.model}: {e}") from None
        quantization = generic.pack_linears(kernels)  # nothing quantized (refused), bf16 CPU linears packed
        model = cast(DecoderLM, generic)
    else:
        model = build_decoder(hf_config, loaded.state_dict, dtype, device, kernels, tp)
        quantization = prepare_linears_for_engine(model, config, tokenizer, loaded.quantized_weights, kernels)
    del loaded  # the loaded tensors go before the draft model comes and before free memory is measured
    spec = config.speculative
    draft = load_draft_model(spec, tokenizer, kernels, config.cache_dir) if spec.method == "draft" else None
    return Target(
        device=device,
        dtype=dtype,
        model=model.eval(),
        tokenizer=tokenizer,
        hf_config=hf_config,
        path=path,
        fingerprint=fingerprint,
        quantization=quantization,
        draft=draft,
        model_path=model_path,
    )


def tune(config: EngineConfig, target: Target) -> KernelSet:
    """Start-up tuning (kernels/tuning.py), with engine.tune_kernels: on a real GPU, for every GEMM
    shape the models run through a Triton kernel (model/gemm_shapes.py) and every row bucket up to
    the token budget (the profile's largest where it is profiled), fused or not and the tile; on a
    bf16 CPU with the native kernels, native or torch's kernel per linear kind and row count and
    for decode and prefill attention (kernels/cpu_tuning.py; not under engine.batch_invariant,
    whose rows rely on the native kernels' per-row sums). Elsewhere the static tables'. Every
    model gets the kernel set bound with the result, and its linears the layout it chose."""
    kernels = target.model.kernels
    models = [target.model] + ([target.draft[0]] if target.draft is not None else [])
    max_rows = config.max_num_batched_tokens or max(profiler.PREFILL_SIZES)
    # A GenericLM's linears are HF's nn.Linear: no fused projection or packed tile to tune.
    shaped = [m for m in models if not isinstance(m, GenericLM)]
    cases = [c for m in shaped for c in tuning_cases(gemm_shapes(m), m.kernels, max_rows)]
    if config.tune_kernels and kernels.target.is_gpu and cases:
        tuning = measured_tuning(kernels.target, cases)
    else:
        tuning = table_tuning(kernels.target.gpu, cases)
    if config.tune_kernels and cpu_measurable(kernels) and not config.batch_invariant:
        rows = CpuRows.for_limits(config.max_num_seqs, config.max_num_batched_tokens)
        linears = [s for m in shaped for s in cpu_linear_shapes(m)]
        found = measure_cpu(linears, attention_shape(target.model, config.block_size), rows)
        tuning = dataclasses.replace(
            tuning, source="measured", cpu_linears=found.linears, cpu_attention=found.attention, seconds=found.seconds
        )
    for model in models:
        model.use_kernels(with_tuning(model.kernels, tuning))
        if not isinstance(model, GenericLM):
            apply_linear_choices(model, model.kernels)
    return target.model.kernels


def plan_kv(config: EngineConfig, target: Target, others_available: Sequence[int] = ()) -> KVPlan:
    """Size the KV cache from engine.kv_cache_memory (bytes, a fraction of free memory, or the
    device's default share of it), measured now, with every model's weights in place.
    `others_available`: a group's followers' free memory; the group's block count is the smallest
    any rank can hold (every rank holds the same blocks, of its own heads)."""
    per_block = kv_bytes_per_block(target.model, config.block_size, target.dtype, config.kv_cache_dtype)
    if target.draft is not None:
        per_block += kv_bytes_per_block(target.draft[0], config.block_size, target.dtype)
    device_target = target.model.kernels.target
    kv_bytes = config.kv_cache_memory
    available = min([available_memory(device_target), *others_available]) if kv_bytes is None or kv_bytes <= 1 else 0
    if kv_bytes is None:
        kv_bytes = default_kv_bytes(device_target.is_gpu, available)
    elif kv_bytes <= 1:
        kv_bytes = kv_bytes * available
    if not device_target.is_gpu and (config.kv_cache_memory is None or config.kv_cache_memory <= 1):
        # A CPU group's ranks share one host's memory: a share of it is the group's, each rank's
        # 1/N of it (its blocks hold 1/N of the heads, so the group holds one process's blocks).
        kv_bytes = kv_bytes / config.tensor_parallel_size
    num_blocks = int(kv_bytes // per_block)
    if num_blocks < 1:
        raise ValueError(
            f"engine.kv_cache_memory={config.kv_cache_memory} leaves no room for one KV block ({per_block} bytes)"
        )
    model_limit = config.max_model_len or target.model.spec.max_position_embeddings
    max_model_len = min(model_limit, num_blocks * config.block_size)
    if max_model_len < model_limit and config.max_model_len:
        log.warning(
            "max_model_len %d capped to %d: the KV cache holds only %d blocks of %d tokens",
            model_limit,
            max_model_len,
            num_blocks,
            config.block_size,
        )
    return KVPlan(num_blocks, config.block_size, per_block, max_model_len)


def build_cache(config: EngineConfig, target: Target, kv_plan: KVPlan) -> Cache:
    """Allocate the cache's blocks and pick the runner, once: the GPU runner (CUDA graphs, steps
    run ahead) on a GPU, the CPU runner elsewhere. It reads the KV manager's persistent block tables
    and samples with the engine's sampler, seeded from engine.seed, over the kernel set's race and
    top-p spill kernels."""
    lora = target.lora
    fingerprints = lora.fingerprints if lora is not None else None
    kv = KVCacheManager(kv_plan.num_blocks, kv_plan.block_size, config.enable_prefix_caching, fingerprints)
    kernels = target.model.kernels
    runner_class = GpuRunner if target.device.type == "cuda" else CpuRunner
    runner = runner_class(
        target.model,
        kv_plan.num_blocks,
        kv_plan.block_size,
        target.dtype,
        target.device,
        config.kv_cache_dtype,
        block_tables=kv.block_tables,
        batch_invariant=config.batch_invariant,
        sampler=Sampler(config.seed, race=kernels.sample, spill=kernels.spill),
        max_model_len=kv_plan.max_model_len,
    )
    if lora is not None:
        runner.use_lora(lora.slots)
    return Cache(kv, runner)


def pick_batch_limits(config: EngineConfig, cache: Cache, kv_plan: KVPlan) -> BatchLimits:
    """The configured batch limits, the missing ones profiled on this runner (engine/profiler.py);
    with speculation the decode rates are profiled anyway, for its cost model."""
    spec = config.speculative
    return profiler.pick_batch_limits(
        cache.runner,
        kv_plan.num_blocks,
        kv_plan.block_size,
        kv_plan.max_model_len,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        profile_decode=spec.method != "none",
        spec_tokens=spec.num_speculative_tokens if spec.method != "none" else 0,
    )


def build_core(config: EngineConfig, target: Target, kv_plan: KVPlan, cache: Cache, limits: BatchLimits) -> Core:
    """The step's parts around the cache; the drafter prices drafting with the start-up profile."""
    eos_ids = target.eos_token_ids()
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_model_len=kv_plan.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            eos_token_ids=frozenset(eos_ids),
            admission_min_slots=config.admission_min_slots,
        ),
        cache.kv,
        target.tokenizer,
        lora=target.lora.slots if target.lora is not None else None,
    )
    sampler = cache.runner.sampler
    vocab_size = target.model.spec.vocab_size
    grammars = GrammarCompiler(target.tokenizer, vocab_size, sorted(eos_ids))
    adapter_names = list(target.lora.fingerprints) if target.lora is not None else []
    think_tags = find_think_tags(target.tokenizer, config.think_tags)
    if think_tags is not None:
        log.info(
            "think tags %r %r (ids %d %d), separator %r: traces are followed, answers apart",
            think_tags.open,
            think_tags.close,
            think_tags.open_id,
            think_tags.close_id,
            think_tags.separator,
        )
        assert cache.runner.step_sampler is not None
        cache.runner.step_sampler.thinking = True
    admission = Admission(
        target.tokenizer, vocab_size, kv_plan.max_model_len, config.seed, grammars, adapter_names, think_tags
    )
    drafter, speculative = None, None
    if config.speculative.method != "none":
        drafter, speculative = build_drafter(
            config.speculative, target.model, cache.runner, sampler, limits.profile, target.draft
        )
    return Core(scheduler, sampler, grammars, admission, drafter, speculative)


def describe(
    config: EngineConfig,
    kernels: KernelSet,
    target: Target,
    kv_plan: KVPlan,
    limits: BatchLimits,
    core: Core,
    followers: Sequence[FollowerReport] = (),
) -> EngineSettings:
    """What start-up resolved, for logs, run manifests and benchmark tables. `followers`: a
    tensor-parallel group's reports; weight_bytes is then the whole model's (each tensor once),
    rank_weight_bytes what each rank holds."""
    device = target.device
    rank_bytes = [module_weight_bytes(target.model), *(r.weight_bytes for r in followers)]
    weight_bytes = rank_bytes[0]
    if followers:
        weight_bytes = round(owned_weight_bytes(target.model) + sum(r.owned_weight_bytes for r in followers))
    return EngineSettings(
        model_type=target.model.spec.model_type,
        device=str(device),
        dtype=str(target.dtype).replace("torch.", ""),
        num_threads=torch.get_num_threads(),
        block_size=kv_plan.block_size,
        num_kv_blocks=kv_plan.num_blocks,
        kv_cache_bytes=kv_plan.kv_cache_bytes,
        max_model_len=kv_plan.max_model_len,
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        batch_limits_profile=limits.profile,
        native_cpu_kernels=kernels.target.native_cpu_kernels,
        packed_linears=target.quantization.num_packed,
        native_linears=count_native_linears(target.model),
        quantization=config.quantization,
        quant_group_size=config.quant_group_size,
        w8a8_outlier_channels=config.w8a8_outlier_channels if config.quantization == "w8a8" else None,
        quant_formats=dict(target.quantization.formats),
        weight_bytes=weight_bytes,
        kv_cache_dtype=config.kv_cache_dtype,
        async_scheduling=config.async_scheduling,
        admission_min_slots=config.admission_min_slots,
        kernels=kernels.describe(),
        speculative=core.speculative,
        draft_model=target.draft[1] if target.draft is not None else None,
        tensor_parallel_size=config.tensor_parallel_size,
        rank_weight_bytes=tuple(rank_bytes),
        model_path=target.model_path,
        lora=target.lora.settings() if target.lora is not None else None,
    )


def warm_up(
    kv: KVCacheManager,
    runner: ModelRunner,
    drafter: Optional[Drafter],
    sampler: Sampler,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> dict[str, Any]:
    """Run each kind of step once on every runner (engine/warmup.py) with no request in flight:
    the warm-up writes into free blocks, so none may hold a cached prefix."""
    kv.reset_prefix_cache()
    runners = [runner]
    if drafter is not None and drafter.runner is not runner:
        runners.append(drafter.runner)  # a draft model: its own shapes, its own kernels and graphs
    summary = run_warm_up(runners, sampler, kv.num_blocks, max_model_len, max_num_batched_tokens, max_num_seqs)
    kv.reset_peak()
    return summary


def start_engine(
    config: EngineConfig,
    target: Optional[Target] = None,
    kernels: Optional[KernelSet] = None,
    simulate: Optional[GpuTarget] = None,
) -> EngineParts:
    """Every phase in order; EngineConfig.warmup None warms up on a GPU only. `target`: a model
    already loaded and prepared over its kernel set (a benchmark's random weights built on the
    device) instead of `load_target`; `kernels`: a kernel set bound by the caller (Triton's on the
    CPU: the interpreter's tiles) instead of `bind(config)`; `simulate`: a GPU the CPU engine's
    kernel set is sized for (`bind`). The last two are for checks and launch counts."""
    t0 = time.perf_counter()
    if target is None:
        check_serving_path(config)  # the generic path's refusals, before a group opens
    opened = open_group(config) if target is None and config.tensor_parallel_size > 1 else None
    try:
        if target is None:
            if kernels is None:
                kernels = bind(config, simulate, opened.device if opened is not None else None)
            target = load_target(config, kernels, opened.tp if opened is not None else None)
        followers = opened.group.wait_loaded() if opened is not None else []
        kernels = tune(config, target)
        if config.lora_adapters:  # wraps the linears as tuning laid them out; the KV cache gets what is left
            target = dataclasses.replace(target, lora=attach_adapters(config, target.model))
        kv_plan = plan_kv(config, target, [r.available_memory for r in followers])
        if opened is not None:  # the followers take rank 0's tuning and its block count
            opened.group.set_up(kernels.tuning, kv_plan.num_blocks, kv_plan.block_size, kv_plan.max_model_len)
        cache = build_cache(config, target, kv_plan)
        limits = pick_batch_limits(config, cache, kv_plan)
        core = build_core(config, target, kv_plan, cache, limits)
        settings = describe(config, kernels, target, kv_plan, limits, core, followers)
        target.model.reset_expert_token_counts()  # start-up profiling forwards are not real tokens
        if config.warmup or (config.warmup is None and kernels.target.is_gpu):
            sizes = (kv_plan.max_model_len, limits.max_num_batched_tokens, limits.max_num_seqs)
            settings = settings.with_warmup(warm_up(cache.kv, cache.runner, core.drafter, core.sampler, *sizes))
    except BaseException:
        if opened is not None:
            opened.group.close()
        raise
    startup_s = time.perf_counter() - t0
    off = generic_turned_off(kernels.target.is_gpu) if target.model_path == "generic" else []
    log.info(
        "engine ready in %.1fs: %s (%s, %s path%s) on %s/%s, %d KV blocks x %d tokens, max_model_len %d, "
        "max_num_seqs %d, max_num_batched_tokens %d%s",
        time.perf_counter() - t0,
        target.path,
        settings.model_type,
        target.model_path,
        f"; off: {'; '.join(off)}" if off else "",
        target.device,
        target.dtype,
        kv_plan.num_blocks,
        kv_plan.block_size,
        kv_plan.max_model_len,
        limits.max_num_seqs,
        limits.max_num_batched_tokens,
        f" (profiled: {limits.profile})" if limits.profile else "",
    )
    group = opened.group if opened is not None else None
    return EngineParts(config, kernels, target, kv_plan, cache, limits, core, settings, startup_s, group)
