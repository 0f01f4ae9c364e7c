"""The run's whole configuration as plain frozen dataclasses, and the checker that builds it.

The cli composes YAML with Hydra and hands a plain dict to `build_run_config`; nothing below the cli
sees Hydra or OmegaConf. Every config group's dataclass is here (a leaf module: it imports nothing
from the job layer but its errors), each checking its own values; `build_run_config` checks every
key and type, so a typo stops the run with one line naming the key. The YAML in conf/ is checked
against these dataclasses by the tests.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import string
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from batchrun.engine import EngineConfig, SamplingParams
from batchrun.job.errors import ConfigError

# The fixed columns of every results file, in order (writer.py gives their types).
RESULT_COLUMNS = [
    "id",
    "output",
    "finish_reason",
    "error_type",
    "error_message",
    "num_prompt_tokens",
    "num_output_tokens",
    "num_cached_tokens",
    "ttft_s",
    "itl_s",
    "latency_s",
]
# Columns that follow them only when the sampling settings ask (writer.result_schema): n > 1 adds
# sample_index, logprobs adds cumulative_logprob and logprobs, prompt_logprobs adds prompt_logprobs.
# With none of these, a results file is what it was before they existed.
# With LoRA adapters (model.lora_adapters), `adapter` says which one served the row.
# With a reasoning model, REASONING_COLUMNS (below).
OPTIONAL_RESULT_COLUMNS = [
    "sample_index",
    "cumulative_logprob",
    "logprobs",
    "prompt_logprobs",
    "tool_calls",
    "adapter",
    "reasoning",
    "num_reasoning_tokens",
    "num_answer_tokens",
]
# A reasoning model's columns (the engine recognises think tags, engine.think_tags): the trace,
# and the output's tokens split into the trace's and the answer's. Decided once per run from the
# engine, not per row, so that every file of a run has one schema.
REASONING_COLUMNS = ["reasoning", "num_reasoning_tokens", "num_answer_tokens"]
# What an embed or score run writes instead (writer.pooled_fields): no generated text, no output
# tokens, no time to first token. `label` only when the score model has more than one label.
POOLED_RESULT_COLUMNS = [
    "id",
    "embedding",
    "score",
    "label",
    "finish_reason",
    "error_type",
    "error_message",
    "num_prompt_tokens",
    "num_truncated_tokens",
    "latency_s",
]
# What a job does with each prompt; `engine.task` serves it (auto: from the model directory).
JOB_TASKS = ("generate", "embed", "score")
PlanOrder = Literal["longest_first", "shortest_first", "input"]
DataFormat = Literal["parquet", "openai_batch"]


@dataclass(frozen=True)
class DataConfig:
    """Where the input is and which columns hold what."""

    # A directory, a glob or one input file: a local path or any fsspec URL (s3://, gs://, memory://).
    # An http(s) URL is one file, named by its path; its query (a signature) is never recorded (shards.py).
    uri: Optional[str] = None
    # parquet: *.parquet shards of rows. openai_batch: *.jsonl files of OpenAI batch requests
    # (openai_requests.py); each file is one shard and also gets OpenAI batch output and error files.
    format: DataFormat = "parquet"
    # openai_batch: the `model` a request may name besides model.path (the name your batch files use).
    openai_model_name: Optional[str] = None
    # The column of row ids, kept with its type in the results. null: ids are "<shard>-<row index>".
    # A shard without it fails; when the first shard lacks it, the run stops with a config error.
    id_column: Optional[str] = "id"
    text_column: str = "text"  # the prompt text, or an OpenAI-style list of {role, content} messages
    storage_options: dict[str, Any] = field(default_factory=dict)  # passed to fsspec
    on_too_long: Literal["error", "truncate"] = "error"  # prompts over max_model_len - max_tokens
    batch_size: int = 256  # rows read at a time
    # Rows with equal values here share a long prompt prefix (e.g. one document, many questions):
    # with several workers, shards go to workers by it (prefix affinity, affinity.py). null: by name.
    group_column: Optional[str] = None
    # A column of JSON Schema text, one per row: that row's output follows its schema (structured
    # output; overrides sampling.json_schema, which null rows keep). A row whose schema is not valid
    # ends as an invalid_schema error row; the others go on.
    schema_column: Optional[str] = None
    # embed/score: a column of responses. Each row becomes a conversation, text_column the user turn
    # and this column the assistant turn (a system turn only with job.system_prompt), rendered with
    # the chat template without a generation prompt: what a reward model scores.
    response_column: Optional[str] = None
    # A column naming each row's LoRA adapter (a key of model.lora_adapters); null or "" in a row:
    # the base model. A name that is not a key makes that row an unknown_adapter error row.
    adapter_column: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.uri:
            raise ValueError("data.uri: missing; set data.uri=<directory, glob or file of Parquet shards>")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size: must be >= 1, got {self.batch_size}")
        if self.format not in ("parquet", "openai_batch"):
            raise ValueError(f"data.format: must be parquet or openai_batch, got {self.format!r}")
        if self.format == "openai_batch" and self.group_column is not None:
            raise ValueError(
                "data.group_column: batch files have no columns; leave it null with data.format=openai_batch"
            )
        if self.format == "openai_batch" and self.adapter_column is not None:
            raise ValueError(
                "data.adapter_column: batch files have no columns; a request names its adapter in body.model "
                "(leave it null with data.format=openai_batch)"
            )


@dataclass(frozen=True)
class JobConfig:
    """What a job does with each row (one conf/job/<name>.yaml per job)."""

    name: str = "summarize"
    # str.format template; {text} is data.text_column, any other {name} is that column (null -> "").
    # None sends the text as it is. Not applied to messages.
    prompt_template: Optional[str] = None
    system_prompt: Optional[str] = None  # a system message (chat) or a leading paragraph (no chat template)
    # For text rows: auto uses the tokenizer's chat template when it has one; always requires one;
    # never sends the text raw. Message rows always go through the chat template.
    chat_template: Literal["auto", "always", "never"] = "auto"
    # Batch requests with tools (data.format=openai_batch): the chat template that shows the tools to
    # the model. null uses the model's own, which must render them (else a tools_unsupported error
    # line); `chatml` is batchrun's ChatML template with a Hermes-style tools section
    # (job/formats/tool_calls.py); anything else is the path of a Jinja template file.
    tools_chat_template: Optional[str] = None
    # generate | embed (an `embedding` per row) | score (a classifier's or reward model's `score`
    # per row, and its `label`). It sets engine.task when that is auto; a model that cannot serve it
    # stops the run (exit 2). null: whatever the engine serves (engine.task, auto: the model's).
    task: Optional[Literal["generate", "embed", "score"]] = None
    # Reasoning models: passed to the chat template as `enable_thinking` (Qwen3's switch: false
    # renders a closed, empty trace, so the model answers at once). null: the template's default.
    enable_thinking: Optional[bool] = None
    # Extra variables for every chat template render (as vLLM's chat_template_kwargs); a batch
    # request's body.chat_template_kwargs is merged over them.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_template is not None:
            template_fields(self.prompt_template)
        if self.enable_thinking is not None and "enable_thinking" in self.chat_template_kwargs:
            raise ConfigError(
                "job.enable_thinking, job.chat_template_kwargs",
                "both set enable_thinking; set it in one of them only",
            )
        reserved = reserved_template_kwargs(self.chat_template_kwargs)
        if reserved:
            raise ConfigError("job.chat_template_kwargs", f"{', '.join(reserved)}: set by the job itself, not here")

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """What every apply_chat_template call of the job gets besides the messages."""
        kwargs = dict(self.chat_template_kwargs)
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs

    def input_columns(self, data: DataConfig) -> list[str]:
        """Columns a shard must have for this job."""
        # {text} in the template is data.text_column, not a column named text
        fields = [] if self.prompt_template is None else template_fields(self.prompt_template)
        extra = [c for c in fields if c != "text"]
        if data.schema_column is not None:
            extra.append(data.schema_column)
        if data.response_column is not None:
            extra.append(data.response_column)
        if data.adapter_column is not None:
            extra.append(data.adapter_column)
        return list(dict.fromkeys([data.text_column, *extra]))


# apply_chat_template's own parameters: what the job sets itself (or that would make it return
# something other than the prompt text), so never a template variable from chat_template_kwargs.
_TEMPLATE_PARAMETERS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def reserved_template_kwargs(kwargs: Mapping[str, Any]) -> list[str]:
    """The keys of a chat_template_kwargs mapping that are apply_chat_template's own parameters."""
    return sorted(str(k) for k in kwargs if k in _TEMPLATE_PARAMETERS)


def template_fields(template: str) -> list[str]:
    """Column names a template reads; ConfigError when it is not a valid str.format template."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ConfigError("job.prompt_template", f"not a valid template: {e}") from None
    roots = []
    for name in names:
        root = name.split(".")[0].split("[")[0]
        if not root.isidentifier():
            raise ConfigError("job.prompt_template", f"placeholders must name a column, got {{{name}}}")
        roots.append(root)
    return list(dict.fromkeys(roots))


@dataclass(frozen=True)
class OutputConfig:
    """Where results go and which input columns they carry along."""

    uri: str = "runs/summarize"  # a directory: local path or any fsspec URL
    storage_options: dict[str, Any] = field(default_factory=dict)  # passed to fsspec
    keep_columns: tuple[str, ...] = ()  # input columns copied into each result row
    # A rerun whose settings, model or input differ from what a shard was committed with: `error`
    # stops with one line naming what changed; `recompute` redoes those shards (fingerprint.py).
    on_change: Literal["error", "recompute"] = "error"
    # Checkpoints inside a shard (checkpoints.py): its finished rows are committed as a part every
    # this many result rows or seconds, whichever comes first, so a killed worker loses only the
    # rows since its last part and a rerun resumes the shard there. 0 turns a trigger off.
    checkpoint_rows: int = 10000
    checkpoint_s: float = 60.0
    # A store whose create-if-absent fails the start-up probe (an s3fs or botocore too old for
    # If-None-Match, a store that ignores it, no conditional create at all) is refused unless this
    # is true: then two racing committers may both publish, and the manifest's commit_method says so.
    allow_non_exclusive: bool = False
    # Each worker writes its progress here in Prometheus text format, for node_exporter's textfile
    # collector (textfile.py: rows, errors, tokens, shards, tok/s, TTFT, last success); `{rank}` is
    # replaced by the rank, else rank r of several writes PATH with `.rank{r}` before `.prom`.
    metrics_textfile: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.uri:
            raise ValueError("output.uri: missing")
        if self.checkpoint_rows < 0:
            raise ValueError(f"output.checkpoint_rows: must be >= 0, got {self.checkpoint_rows}")
        if self.checkpoint_s < 0:
            raise ValueError(f"output.checkpoint_s: must be >= 0, got {self.checkpoint_s}")
        # Only the columns every task writes here; the task's own (generate: `output`...; embed and
        # score: `embedding`, `score`...) are checked by check_task, so that a score run can keep
        # the `output` column of the generation run it scores.
        # sample_index: any task may write it (sampling.n > 1; a previous run's samples scored).
        every_task = [c for c in RESULT_COLUMNS if c in POOLED_RESULT_COLUMNS] + ["sample_index"]
        clash = [c for c in self.keep_columns if c in every_task]
        if clash:
            raise ValueError(f"output.keep_columns: {', '.join(clash)} would overwrite a result column")


@dataclass(frozen=True)
class LauncherConfig:
    """How this process finds its place among the workers; None reads it from the environment."""

    name: Literal["local", "ray"] = "local"  # ray: the workers are Ray actors (job/launch/ray_launch.py)
    rank: Optional[int] = None  # this worker's index; None: from the scheduler (shards.resolve_worker), else 0
    world_size: Optional[int] = None  # number of workers; None: from the scheduler, else 1
    # Workers this command starts (one engine each, one GPU each on cuda): processes on this
    # machine, or Ray actors with launcher=ray. None: one per visible GPU (the cluster's GPUs with
    # ray), and one on a CPU or where a scheduler already gave this process its rank.
    num_workers: Optional[int] = None
    # Idle workers take unstarted (and dead workers') shards through claim files (claims.py).
    work_stealing: bool = True
    claim_lease_s: float = 120.0  # a claim without a heartbeat for this long may be taken over
    # A shard whose attempts died this many times (a worker killed or frozen on it: OOM, a crash in
    # native code) is quarantined, reported as failed and no longer taken by anyone; raise the
    # limit or delete {output.uri}/_claims/{shard}/ to try it again.
    max_shard_attempts: int = 3
    # launcher=ray: the cluster (auto: the one this machine belongs to; ray://host:port: a remote
    # one through Ray Client; null: a Ray instance started for this run on this machine), and how
    # often Ray restarts a worker actor that died before the run gives up on it.
    ray_address: Optional[str] = None
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"launcher.num_workers must be >= 1 (or null: one per GPU), got {self.num_workers}")
        if self.claim_lease_s <= 0:
            raise ValueError(f"launcher.claim_lease_s must be > 0, got {self.claim_lease_s}")
        if self.max_shard_attempts < 1:
            raise ValueError(f"launcher.max_shard_attempts must be >= 1, got {self.max_shard_attempts}")
        if self.max_restarts < 0:
            raise ValueError(f"launcher.max_restarts must be >= 0, got {self.max_restarts}")
        if self.name != "ray" and self.ray_address is not None:
            raise ValueError("ray_address: used only with launcher=ray; drop it or add launcher=ray")


@dataclass(frozen=True)
class PlannerConfig:
    """How rows are ordered before they reach the engine (the `planner` config group)."""

    enabled: bool = True  # false: rows go to the engine in input order, one at a time
    # Among prompts (and groups of prompts sharing a prefix): longest_first | shortest_first | input.
    # longest_first is the default: no long prompt starts last and becomes the tail of the run (planner.py).
    order: PlanOrder = "longest_first"
    window: int = 4096  # rows read ahead and ordered together; memory grows with it, not the shard
    # Shards open at once per worker: the next shards' rows are admitted while earlier ones finish,
    # so small shards do not drain the batch at every boundary. Each open shard holds its claim, an
    # input file and a results file; 1 runs shards strictly one after another.
    max_open_shards: int = 16

    def __post_init__(self) -> None:
        if self.order not in ("longest_first", "shortest_first", "input"):
            raise ValueError(f"planner.order must be longest_first, shortest_first or input, got {self.order!r}")
        if self.window < 1:
            raise ValueError(f"planner.window must be >= 1, got {self.window}")
        if self.max_open_shards < 1:
            raise ValueError(f"planner.max_open_shards must be >= 1, got {self.max_open_shards}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load: a registered name (e.g. smollm2-135m), a model directory or a .gguf file."""

    path: str = "smollm2-135m"
    # LoRA adapters a row may name (data.adapter_column; a batch request's body.model): name -> a
    # PEFT adapter directory (adapter_config.json + adapter_model.safetensors), relative paths from
    # the working directory as model.path. Their files' sha256 are part of the run's fingerprint.
    lora_adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, directory in self.lora_adapters.items():
            if not isinstance(name, str) or not name.strip():
                raise ConfigError("model.lora_adapters", f"adapter names must be non-empty strings, got {name!r}")
            key = f"model.lora_adapters.{name}"
            if not isinstance(directory, str) or not directory:
                raise ConfigError(key, f"expected the path of a PEFT adapter directory, got {directory!r}")
            if not os.path.isdir(os.path.expanduser(directory)):
                raise ConfigError(
                    key, f"no directory {directory!r} (a PEFT adapter directory, as save_pretrained writes)"
                )


@dataclass(frozen=True)
class RunConfig:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    # `engine.model` always equals `model.path`: users set the model in one place only.
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    data: DataConfig = field(default_factory=DataConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    quiet: bool = False  # no progress bar (for log files); per-shard log lines remain
    # Plan instead of run (dry_run.py): read and validate every row, estimate the time; nothing is
    # written to output.uri. dry_run_json: also write the plan there as JSON (outside output.uri).
    dry_run: bool = False
    dry_run_json: Optional[str] = None

    def __post_init__(self) -> None:
        if self.engine.model != self.model.path:
            object.__setattr__(self, "engine", dataclasses.replace(self.engine, model=self.model.path))
        if self.engine.lora_adapters != self.model.lora_adapters:
            object.__setattr__(self, "engine", dataclasses.replace(self.engine, lora_adapters=self.model.lora_adapters))
        check_adapters(self)
        task = self.job.task
        if task is not None and self.engine.task == "auto":
            object.__setattr__(self, "engine", dataclasses.replace(self.engine, task=task))
        elif task is not None and self.engine.task != task:
            raise ConfigError("engine.task", f"is {self.engine.task} but job.task is {task}; set one of them only")
        configured = self.job.task or self.engine.task
        if configured != "auto":
            check_task(self, configured)

    @property
    def task(self) -> str:
        """The task as configured: job.task, else engine.task (auto: known once the engine loads,
        taken as generate until then; check_task runs again with the engine's)."""
        configured = self.job.task or self.engine.task
        return "generate" if configured == "auto" else configured

    @property
    def has_adapters(self) -> bool:
        """Rows may name LoRA adapters: their result rows carry `adapter`."""
        return bool(self.model.lora_adapters)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form, as written to the manifest (engine.model and engine.lora_adapters
        omitted: they are model.path and model.lora_adapters; the LoRA keys only where they are set)."""
        out = dataclasses.asdict(self)
        out["engine"].pop("model")
        out["engine"].pop("lora_adapters")
        if not out["model"]["lora_adapters"]:  # a run without adapters records what it always has
            out["model"].pop("lora_adapters")
        if out["data"]["adapter_column"] is None:
            out["data"].pop("adapter_column")
        return out


def check_adapters(config: RunConfig) -> None:
    """model.lora_adapters and data.adapter_column come together (a batch file's requests name
    their adapter in body.model instead of a column); adapters serve generation only."""
    adapters, column = config.model.lora_adapters, config.data.adapter_column
    if config.data.format == "parquet" and bool(adapters) != (column is not None):
        missing = "data.adapter_column" if adapters else "model.lora_adapters"
        raise ConfigError(
            "model.lora_adapters, data.adapter_column",
            f"set both or neither ({missing} is missing): the adapters rows may name, and the column "
            "that names each row's adapter",
        )
    if adapters and (config.job.task or config.engine.task) in ("embed", "score"):
        raise ConfigError("model.lora_adapters", "LoRA adapters serve generation; leave them empty for embed or score")
    if adapters and "adapter" in config.output.keep_columns:
        raise ConfigError("output.keep_columns", "adapter would overwrite the result column naming each row's adapter")


def check_task(config: RunConfig, task: str, tokenizer: Any = None) -> None:
    """Keys that mean nothing for `task` (the configured one, and again the one the engine
    resolved, with its `tokenizer`): one ConfigError naming the key."""
    if config.job.task is not None and task != config.job.task:
        raise ConfigError(
            "job.task",
            f"the job is {config.job.task} but the engine serves {config.model.path} as {task} (engine.task); "
            f"use a model that can {config.job.task}, or another job",
        )
    # `adapter` is written only with model.lora_adapters (check_adapters): without them an input
    # column of that name (a LoRA run's results read again) may be kept; the reasoning columns only
    # with an engine that has think tags (check_thinking)
    optional = [c for c in OPTIONAL_RESULT_COLUMNS if c != "adapter" and c not in REASONING_COLUMNS]
    own = [*RESULT_COLUMNS, *optional] if task == "generate" else [*POOLED_RESULT_COLUMNS, "sample_index"]
    clash = [c for c in config.output.keep_columns if c in own]
    if clash:
        raise ConfigError("output.keep_columns", f"{', '.join(clash)} would overwrite a result column of a {task} job")
    if task == "generate":
        if config.data.response_column is not None:
            raise ConfigError(
                "data.response_column", "is for embed and score jobs (job.task); a generation job has no responses"
            )
        return
    if config.model.lora_adapters:
        raise ConfigError("model.lora_adapters", f"LoRA adapters serve generation; the engine serves {task}")
    if config.sampling.max_thinking_tokens is not None:
        raise ConfigError("sampling.max_thinking_tokens", f"a {task} job generates no reasoning trace; leave it null")
    if config.sampling.n != 1:
        raise ConfigError("sampling.n", f"must be 1 for a {task} job (one vector per row)")
    if config.data.schema_column is not None:
        raise ConfigError("data.schema_column", f"structured output means nothing for a {task} job")
    if (
        config.data.response_column is not None
        and tokenizer is not None
        and not getattr(tokenizer, "chat_template", None)
    ):
        # A BERT-style cross-encoder reads (text, response) as a sentence pair with token types,
        # which the job does not build yet; a conversation needs the chat template.
        raise ConfigError(
            "data.response_column",
            f"the model's tokenizer has no chat template, and a {task} job renders (text, response) as a "
            "conversation through it; sentence-pair cross-encoders (token types) are not supported yet",
        )
    if config.job.chat_template == "always" and config.data.response_column is None:
        raise ConfigError(
            "job.chat_template",
            f"a {task} job tokenizes text rows as they are (as sentence-transformers does); chat templates "
            "apply to message rows and to data.response_column",
        )


def check_thinking(config: RunConfig, think_tags: Any) -> None:
    """Keys that need the engine's think tags (`think_tags`: Engine.think_tags, None when the
    model's tokenizer has none or engine.think_tags is []), checked once the engine has loaded."""
    if think_tags is None:
        if config.sampling.max_thinking_tokens is not None:
            raise ConfigError(
                "sampling.max_thinking_tokens",
                f"the model's tokenizer has no think tags ({config.model.path}); set engine.think_tags to "
                "[open, close] (each one token), or leave it null",
            )
        return
    clash = [c for c in config.output.keep_columns if c in REASONING_COLUMNS]
    if clash:
        raise ConfigError(
            "output.keep_columns",
            f"{', '.join(clash)} would overwrite a result column of a reasoning model's run (its think tags "
            f"{think_tags.open} {think_tags.close}; engine.think_tags=[] turns them off)",
        )


# Every config group's dataclass; `engine.model` is filled from `model.path`.
_SECTIONS: dict[str, type] = {
    "job": JobConfig,
    "model": ModelConfig,
    "engine": EngineConfig,
    "sampling": SamplingParams,
    "data": DataConfig,
    "output": OutputConfig,
    "launcher": LauncherConfig,
    "planner": PlannerConfig,
}
# Groups that only one job composes (its YAML adds them), checked where that job runs, not in
# RunConfig: group -> the job's name (the cli hands job=benchmark's group to benchmark/config.py).
JOB_GROUPS = {"benchmark": "benchmark"}
_HIDDEN_FIELDS = {"engine": {"model", "lora_adapters"}}
_TOP_LEVEL_SCALARS = {"quiet": bool, "dry_run": bool, "dry_run_json": Optional[str]}
_MOVED_KEYS = {"engine.model": "model.path", "engine.lora_adapters": "model.lora_adapters"}


def config_fields(section: str) -> list[str]:
    """The keys users may set under `section` (for the cli's 'did you mean' and for tests)."""
    hidden = _HIDDEN_FIELDS.get(section, set())
    return [f.name for f in dataclasses.fields(_SECTIONS[section]) if f.name not in hidden]


def unknown_key(dotted_key: str) -> ConfigError:
    """The error for a key that no config group has (the cli uses it for Hydra's own refusals)."""
    if dotted_key in _MOVED_KEYS:
        return ConfigError(dotted_key, f"set {_MOVED_KEYS[dotted_key]} instead")
    parts = dotted_key.split(".")
    if len(parts) == 1 and parts[0] in _SECTIONS:  # a group this job's composed config does not have
        return ConfigError(dotted_key, "not a group of this job")
    if parts[0] in JOB_GROUPS:
        return ConfigError(parts[0], f"not a group of this job (use job={JOB_GROUPS[parts[0]]})")
    if parts[0] not in _SECTIONS:
        allowed, prefix, key = [*_SECTIONS, *_TOP_LEVEL_SCALARS], "", parts[0]
    else:
        cls: Any = _SECTIONS[parts[0]]
        for depth, name in enumerate(parts[1:-1], start=1):  # nested groups such as engine.speculative
            cls = typing.get_type_hints(cls).get(name)
            group = ".".join(parts[: depth + 1])
            if typing.get_origin(cls) is dict:  # a free mapping (model.lora_adapters, storage_options)
                return ConfigError(group, f"a mapping: set it whole, '{group}={{name: value, ...}}'")
            if not dataclasses.is_dataclass(cls):
                return ConfigError(group, "is not a group of keys")
        prefix, key = ".".join(parts[:-1]), parts[-1]
        allowed = [f.name for f in dataclasses.fields(cls) if f.name not in _HIDDEN_FIELDS.get(prefix, set())]
    try:
        _reject_unknown({key: None}, allowed, prefix)
    except ConfigError as e:
        return e
    return ConfigError(dotted_key, "is a known key")  # callers only ask about keys they could not set


def build_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """Check a plain nested dict (composed YAML) against the dataclasses and build the RunConfig."""
    extra_group = next((g for g in raw if g in JOB_GROUPS), None)
    if extra_group is not None:  # the job that composes it takes it out first (cli.py)
        raise unknown_key(extra_group)
    _reject_unknown(raw, [*_SECTIONS, *_TOP_LEVEL_SCALARS], prefix="")
    kwargs: dict[str, Any] = {}
    for name, expected in _TOP_LEVEL_SCALARS.items():
        if name in raw:
            kwargs[name] = _check_value(raw[name], expected, name)
    for section, cls in _SECTIONS.items():
        values = raw.get(section, {}) or {}
        if not isinstance(values, Mapping):
            raise ConfigError(section, f"expected a mapping of keys, got {type(values).__name__} {values!r}")
        extra = {}
        if section == "engine":  # model is built first
            extra = {"model": kwargs["model"].path, "lora_adapters": kwargs["model"].lora_adapters}
        if section == "sampling" and isinstance(values.get("json_schema"), str):
            values = {**values, "json_schema": _read_schema(values["json_schema"])}
        try:
            kwargs[section] = build_section(cls, values, section, extra)
        except ConfigError as e:
            if section != "engine" or "lora_adapters" in values or "engine.lora_adapters" not in str(e):
                raise
            # the engine names the adapters by its own key; users set them as model.lora_adapters
            raise ConfigError("", str(e).replace("engine.lora_adapters", "model.lora_adapters")) from None
    return RunConfig(**kwargs)


def build_section(cls: type, values: Mapping[str, Any], prefix: str, extra: Optional[Mapping[str, Any]] = None) -> Any:
    """One dataclass from a mapping: unknown keys and wrong types become ConfigError(key, ...)."""
    allowed = [f.name for f in dataclasses.fields(cls) if f.name not in _HIDDEN_FIELDS.get(prefix, set())]
    for key in values:
        if f"{prefix}.{key}" in _MOVED_KEYS:
            raise unknown_key(f"{prefix}.{key}")
    _reject_unknown(values, allowed, prefix)
    hints = typing.get_type_hints(cls)
    kwargs = {k: _check_value(v, hints[k], f"{prefix}.{k}") for k, v in values.items()}
    kwargs.update(extra or {})
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e)
        # EngineConfig's messages already name the key ("engine.dtype must be ..."); SamplingParams'
        # structured-output ones start with the field ("json_schema: ..."); others get the group.
        field_name, _, problem = message.partition(": ")
        if field_name in allowed and problem:
            raise ConfigError(f"{prefix}.{field_name}", problem) from None
        raise ConfigError("" if message.startswith(f"{prefix}.") else prefix, message) from None


def _read_schema(value: str) -> str:
    """sampling.json_schema given as a string: JSON text when it starts with '{', else the path (or
    fsspec URL) of a .json file, whose text is returned."""
    if value.lstrip().startswith("{"):
        return value
    import fsspec

    try:
        with fsspec.open(value, "r", encoding="utf-8") as f:
            return str(f.read())
    except (OSError, ValueError) as e:
        raise ConfigError("sampling.json_schema", f"cannot read the schema file {value!r}: {e}") from None


def _reject_unknown(values: Mapping[str, Any], allowed: list[str], prefix: str) -> None:
    for key in values:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else f" (known keys: {', '.join(allowed)})"
            raise ConfigError(f"{prefix}.{key}" if prefix else str(key), f"unknown key{hint}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _check_value(value: Any, tp: Any, key: str) -> Any:
    """Return `value` converted to the annotated type (lists to tuples, ints to floats) or raise."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):  # a nested group, e.g. engine.speculative
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping of keys, got {type(value).__name__} {value!r}")
        return build_section(tp, value, key)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_value(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(key, f"must be one of {', '.join(map(str, args))}; got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {type(value).__name__} {value!r}")
        item_tp = args[0] if args else Any
        items = [_check_value(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if value is None:  # a preset's null mapping (model.lora_adapters): a plain override assigns it
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
