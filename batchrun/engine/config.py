"""Engine and sampling configuration: the frozen dataclasses every other engine module reads."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

QUANTIZATION_MODES = ("none", "int8", "w8a8", "int4", "w4a8", "fp8", "gguf")
TASKS = ("auto", "generate", "embed", "score")


class EngineConfigError(ValueError):
    """A configuration the engine finds it cannot run only once it sees the model or the machine
    (tensor_parallel_size against the head counts or the visible GPUs); the message names the key.
    A job reports it as a configuration error (exit 2) before anything is committed."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose tokens cheaply, verify them in one target forward, lossless."""

    method: str = "none"  # none | ngram | self | draft
    num_speculative_tokens: int = 4  # k: tokens proposed per request per step
    ngram_min: int = 1  # prompt lookup tries suffixes of ngram_max down to ngram_min tokens
    ngram_max: int = 4
    self_layers: Optional[int] = None  # self: draft = first L target layers + LM head (None: a quarter)
    draft_model: Optional[str] = None  # draft: a smaller model with the same tokenizer (name, dir or .gguf)
    adaptive: bool = True  # speculate only where the cost model expects a gain

    def __post_init__(self) -> None:
        if self.method not in ("none", "ngram", "self", "draft"):
            raise ValueError(f"engine.speculative.method must be none, ngram, self or draft, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("engine.speculative.num_speculative_tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("engine.speculative needs 1 <= ngram_min <= ngram_max")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("engine.speculative.draft_model is required when method is 'draft'")
        if self.self_layers is not None and self.self_layers < 1:
            raise ValueError("engine.speculative.self_layers must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    """How to build and size the engine. `model` is a registered name, a directory or a .gguf file."""

    model: str = "smollm2-135m"
    # auto: bf16 on a GPU and on CPUs with native bf16 matmuls (AVX-512 BF16, AMX), else float32
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto
    device: str = "auto"  # cpu | cuda | auto
    block_size: int = 16  # tokens per KV block
    # None: picked at start-up by a short profile of this model on this machine (see engine/profiler.py)
    max_num_seqs: Optional[int] = None  # most requests running in one step
    max_num_batched_tokens: Optional[int] = None  # token budget of one step (prefill chunks + decodes)
    # Bytes for the KV cache, or a fraction (0, 1] of free device memory (of available RAM on CPU).
    # None: 90% of free GPU memory after the weights, or on CPU 25% of available RAM capped at 1 GiB.
    # Bytes are each rank's in a tensor-parallel group; a CPU group shares a fraction or the default.
    kv_cache_memory: Optional[float] = None
    max_model_len: Optional[int] = None  # prompt + output; None means the model's own limit
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True  # split long prompts over steps under max_num_batched_tokens
    seed: int = 0
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    num_threads: Optional[int] = None  # torch intra-op threads on CPU; None leaves torch's default
    cache_dir: Optional[str] = None  # converted-weights cache; None means $BATCHRUN_CACHE or ~/.cache/batchrun
    # Weights: none | int8 (weight-only, groups) | w8a8 (int8 weights per channel and activations per
    # token, SmoothQuant-calibrated; the CPU throughput mode with w8a8_outlier_channels=0) | int4
    # (weight-only, groups) | w4a8 (int4 weights and int8 activations, both in groups of 32; the
    # CPU throughput mode for int4) | fp8 (e4m3)
    # | gguf (keep a GGUF file's Q8_0/Q4_0/Q4_1 blocks). See docs/quantization.md.
    quantization: str = "none"
    # int8/int4 group along the input dim: 32 (GGUF's Q8_0/Q4_x block; 64 is far worse for int4
    # on SmolLM2), 64, 128 or 256
    quant_group_size: int = 32
    # w8a8: input channels per projection kept in float (the largest after SmoothQuant). 0 is the
    # fastest; 64 keeps SmolLM2 within the int8 quality bound (tests/engine/test_quant_quality.py).
    w8a8_outlier_channels: int = 64
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 | fp8, with a scale per token and head
    # Run each kind of step once at start-up (Engine.warmup: compiles every Triton kernel variant and
    # captures every CUDA-graph bucket) so none of it lands in timed steps; None: on a GPU only.
    warmup: Optional[bool] = None
    # A row's greedy tokens the same alone or in any batch, with its prompt chunked or not, its
    # prefix cached or not, speculated or not: every row's attention runs the prefill kernels,
    # whose per-row reduction order is fixed (kernels/attention.py). Cost: docs/configuration.md.
    batch_invariant: bool = False
    # Launch a decode step before the previous step's tokens reach the host (its input ids gathered
    # on the device), so the host's scheduling, packing and bookkeeping of one step run while the
    # GPU computes the next. Only CUDA-graph decode steps of plain requests (no grammar, logprobs
    # or speculation) run ahead; float32 outputs are the same tokens (engine/runners/gpu.py).
    async_scheduling: bool = False
    # While every running request decodes, admit waiting requests only once this many slots are
    # free (or all waiting fit): an admission turns a CUDA-graph decode step into a mixed prefill
    # step, which runs eagerly, so on a GPU admitting in batches leaves fewer such steps. 1: admit
    # at every end (the default; the CPU has no graphs to keep). docs/configuration.md.
    admission_min_slots: int = 1
    # Time at start-up (before the KV cache is sized) the kernels that compete, per shape a run can
    # reach, and keep the faster (kernels/tuning.py): on a GPU the fused projection GEMMs against
    # cuBLAS and the Triton GEMMs' tiles; on a bf16 CPU the native kernels against torch's
    # (kernels/cpu_tuning.py). false: the static choices, nothing timed.
    tune_kernels: bool = True
    # Ranks of one worker's tensor-parallel group (engine/group.py): the model's heads, MLP and
    # vocabulary split over this many GPUs (one process each, NCCL), or CPU processes (gloo, the
    # threads split between them). 1: the whole model in this process.
    tensor_parallel_size: int = 1
    # What the model is served as (engine/tasks.py): generate (sample tokens), embed (a pooled
    # vector per prompt) or score (a classification / reward head's logits per prompt). auto: from
    # the model directory (sentence-transformers files mean embed, a *ForSequenceClassification
    # architecture means score, else generate).
    task: str = "auto"
    # LoRA adapters (model/lora.py): name -> PEFT adapter directory. A request names its adapter
    # (EngineRequest.adapter; None: the base model); {}: no adapter can be named.
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # Adapters whose weights are resident at once; the others are loaded on demand into the least
    # recently used slot no running request holds.
    max_loras: int = 4
    # The tags around a reasoning model's trace (engine/reasoning.py). null: `<think>` and
    # `</think>` when each is one token of the tokenizer, else no trace is recognised; [open, close]:
    # these (each must be one token); []: off, the output is one undivided text.
    think_tags: Optional[list[str]] = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"engine.task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if isinstance(self.speculative, dict):  # accepted from plain configs
            object.__setattr__(self, "speculative", SpeculativeConfig(**self.speculative))
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(
                f"engine.quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {self.quantization!r}"
            )
        if self.quant_group_size not in (32, 64, 128, 256):
            raise ValueError(f"engine.quant_group_size must be 32, 64, 128 or 256, got {self.quant_group_size!r}")
        if self.quantization == "w4a8" and self.quant_group_size != 32:
            raise ValueError(
                f"engine.quant_group_size must be 32 with engine.quantization=w4a8 (its kernel "
                f"works in groups of 32, GGUF's Q4 block), got {self.quant_group_size!r}"
            )
        if (
            isinstance(self.w8a8_outlier_channels, bool)
            or not isinstance(self.w8a8_outlier_channels, int)
            or self.w8a8_outlier_channels < 0
        ):
            raise ValueError(
                f"engine.w8a8_outlier_channels must be a whole number >= 0, got {self.w8a8_outlier_channels!r}"
            )
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(f"engine.kv_cache_dtype must be auto, int8 or fp8, got {self.kv_cache_dtype!r}")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"engine.dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"engine.device must be cpu, cuda or auto, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and int(value) <= 0:
                raise ValueError(f"engine.{name} must be positive, got {value!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"engine.kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if not isinstance(self.tune_kernels, bool):
            raise ValueError(f"engine.tune_kernels must be true or false, got {self.tune_kernels!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"engine.batch_invariant must be true or false, got {self.batch_invariant!r}")
        if (
            isinstance(self.admission_min_slots, bool)
            or not isinstance(self.admission_min_slots, int)
            or (self.admission_min_slots < 1)
        ):
            raise ValueError(
                f"engine.admission_min_slots must be a whole number >= 1, got {self.admission_min_slots!r}"
            )
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"engine.async_scheduling must be true or false, got {self.async_scheduling!r}")
        if self.warmup is not None and not isinstance(self.warmup, bool):
            raise ValueError(f"engine.warmup must be true, false or null, got {self.warmup!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"engine.max_model_len must be positive, got {self.max_model_len!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"engine.tensor_parallel_size must be a whole number >= 1, got {tp!r}")
        if tp > 1:
            self._check_tensor_parallel()
        self._check_lora()

    def _check_lora(self) -> None:
        """engine.lora_adapters' own shape, and the settings an engine serving adapters cannot run
        (each refused naming both keys)."""
        slots = self.max_loras
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"engine.max_loras must be a whole number >= 1, got {slots!r}")
        if not isinstance(self.lora_adapters, Mapping):
            kind = type(self.lora_adapters).__name__
            raise ValueError(f"engine.lora_adapters must map adapter names to PEFT directories, got {kind}")
        object.__setattr__(self, "lora_adapters", dict(self.lora_adapters))  # a plain dict, whatever mapping came
        for name, directory in self.lora_adapters.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"engine.lora_adapters: adapter names must be non-empty strings, got {name!r}")
            if not isinstance(directory, str) or not directory:
                raise ValueError(f"engine.lora_adapters.{name} must be a PEFT adapter directory, got {directory!r}")
        if not self.lora_adapters:
            return
        refused = (
            (
                self.tensor_parallel_size > 1,
                f"engine.tensor_parallel_size={self.tensor_parallel_size}",
                "the adapters' weights are not sharded over a group",
            ),
            (
                self.speculative.method == "draft",
                "engine.speculative.method=draft",
                "the draft model has no adapter, so its drafts would follow the base model (ngram and self work)",
            ),
            (
                self.task in ("embed", "score"),
                f"engine.task={self.task}",
                "adapters are applied to generation only",
            ),
            (
                self.batch_invariant,
                "engine.batch_invariant",
                "an adapter's low-rank update is a matmul over the rows of that adapter in the step, "
                "whose per-row result depends on how many there are",
            ),
        )
        for is_set, key, why in refused:
            if is_set:
                raise ValueError(f"engine.lora_adapters cannot run with {key}: {why}")

    def _check_tensor_parallel(self) -> None:
        """The settings a tensor-parallel group cannot run, each refused naming both keys."""
        tp = f"engine.tensor_parallel_size={self.tensor_parallel_size}"
        refused = (
            (
                self.quantization in ("w8a8", "w4a8"),
                f"engine.quantization={self.quantization}",
                "its activation scales span whole input rows, which no rank holds (int8, int4, fp8 and gguf shard)",
            ),
            (self.async_scheduling, "engine.async_scheduling", "a group runs every step eagerly, none ahead"),
            (
                self.speculative.method == "draft",
                "engine.speculative.method=draft",
                "the draft model is not sharded (ngram and self speculation work)",
            ),
            (
                self.batch_invariant,
                "engine.batch_invariant",
                "a group's all-reduce order is not one process's, so it cannot promise one process's bits",
            ),
        )
        for is_set, key, why in refused:
            if is_set:
                raise ValueError(f"{tp} cannot run with {key}: {why}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or negative: off
    top_p: float = 1.0
    seed: Optional[int] = None  # per-request; same seed, same tokens, whatever else is in the batch
    max_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, not included in the text
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-N logprobs per generated token; None for off
    # Samples per prompt: the prompt is prefilled once and its KV blocks shared by the n samples;
    # sample i is seeded from (seed, i), sample 0 exactly as a lone request with this seed.
    n: int = 1
    # top-N logprobs of every prompt token after the first, given the tokens before it (scoring);
    # None for off. Such a request bypasses the prefix cache: cached positions have no logits.
    prompt_logprobs: Optional[int] = None
    # Structured output, at most one of the three (engine/grammar.py): the output is constrained
    # token by token to a JSON Schema (a mapping, or its JSON text; stored as compact JSON text),
    # a regular expression, or exactly one of the choice strings, and ends when that is complete.
    json_schema: Union[str, dict[str, Any], None] = None
    regex: Optional[str] = None
    choice: tuple[str, ...] = field(default_factory=tuple)
    # Reasoning models (engine/reasoning.py): once a trace holds this many tokens without its
    # closing tag, the engine appends the tag (and the template's separator) itself and the request
    # goes on to answer within max_tokens, which counts both. None: no budget.
    max_thinking_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "choice", tuple(self.choice or ()))
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", canonical_json_schema(self.json_schema))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0 or None, got {self.prompt_logprobs}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < 1:
            raise ValueError(f"max_thinking_tokens must be >= 1 or None, got {self.max_thinking_tokens}")
        if self.n > 1 and self.is_greedy:
            # n greedy samples are n copies of one output: almost surely a forgotten temperature.
            raise ValueError(f"n={self.n} needs temperature > 0: greedy samples would all be identical")
        if self.is_constrained:
            from batchrun.engine.grammar import check_constraint  # xgrammar only when a constraint is set

            check_constraint(self.json_schema, self.regex, self.choice)  # type: ignore[arg-type]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_constrained(self) -> bool:
        """Whether the output follows a grammar (json_schema, regex or choice)."""
        return self.json_schema is not None or self.regex is not None or bool(self.choice)

    @property
    def constraint_key(self) -> tuple[str, str]:
        """(kind, text): what the grammar is compiled from and cached under (constrained params only)."""
        from batchrun.engine.grammar import constraint_key

        return constraint_key(self.json_schema, self.regex, self.choice)  # type: ignore[arg-type]


def canonical_json_schema(schema: Union[str, dict[str, Any]]) -> str:
    """A schema as compact JSON text: the key its compiled grammar is cached under. Key order is
    kept, because the grammar writes an object's properties in the schema's order."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema: not valid JSON text: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema: must be a JSON object, got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


PromptLike = Union[str, list[int]]
