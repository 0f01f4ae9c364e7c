"""The run's whole configuration as plain frozen dataclasses, and the checker that builds it.

The cli composes YAML with Hydra and hands a plain dict to `build_run_config`; nothing below the cli
sees Hydra or OmegaConf. Each config group's dataclass lives next to the code that reads it (data in
reader.py, job in prompts.py, output in writer.py, launcher in shards.py, planner in planner.py,
benchmark in benchmark.py); this module assembles them and checks every key and type, so a typo
stops the run with one line naming the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from batchrun.engine import EngineConfig, SamplingParams
from batchrun.job.benchmark import BenchmarkConfig
from batchrun.job.errors import ConfigError
from batchrun.job.planner import PlannerConfig
from batchrun.job.prompts import JobConfig
from batchrun.job.reader import DataConfig
from batchrun.job.shards import LauncherConfig
from batchrun.job.writer import OutputConfig


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load: a registered name (e.g. smollm2-135m), a model directory or a .gguf file."""

    path: str = "smollm2-135m"


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
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)  # read by job=benchmark only
    quiet: bool = False  # no progress bar (for log files); per-shard log lines remain

    def __post_init__(self) -> None:
        if self.engine.model != self.model.path:
            object.__setattr__(self, "engine", dataclasses.replace(self.engine, model=self.model.path))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form, as written to the manifest (engine.model omitted: it is model.path)."""
        out = dataclasses.asdict(self)
        out["engine"].pop("model")
        return out


# Config groups whose dataclass is owned elsewhere; `engine.model` is filled from `model.path`.
_SECTIONS: dict[str, type] = {
    "job": JobConfig, "model": ModelConfig, "engine": EngineConfig, "sampling": SamplingParams,
    "data": DataConfig, "output": OutputConfig, "launcher": LauncherConfig, "planner": PlannerConfig,
    "benchmark": BenchmarkConfig,
}
_HIDDEN_FIELDS = {"engine": {"model"}}
_TOP_LEVEL_SCALARS = {"quiet": bool}
_MOVED_KEYS = {"engine.model": "model.path"}


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
        return ConfigError(dotted_key, "not a group of this job" + (" (use job=benchmark)" if dotted_key == "benchmark" else ""))
    if parts[0] not in _SECTIONS:
        allowed, prefix, key = [*_SECTIONS, *_TOP_LEVEL_SCALARS], "", parts[0]
    else:
        cls: Any = _SECTIONS[parts[0]]
        for depth, name in enumerate(parts[1:-1], start=1):  # nested groups such as engine.speculative
            cls = typing.get_type_hints(cls).get(name)
            if not dataclasses.is_dataclass(cls):
                return ConfigError(".".join(parts[: depth + 1]), "is not a group of keys")
        prefix, key = ".".join(parts[:-1]), parts[-1]
        allowed = [f.name for f in dataclasses.fields(cls) if f.name not in _HIDDEN_FIELDS.get(prefix, set())]
    try:
        _reject_unknown({key: None}, allowed, prefix)
    except ConfigError as e:
        return e
    return ConfigError(dotted_key, "is a known key")  # callers only ask about keys they could not set


def build_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """Check a plain nested dict (composed YAML) against the dataclasses and build the RunConfig."""
    _reject_unknown(raw, [*_SECTIONS, *_TOP_LEVEL_SCALARS], prefix="")
    kwargs: dict[str, Any] = {}
    for name, expected in _TOP_LEVEL_SCALARS.items():
        if name in raw:
            kwargs[name] = _check_value(raw[name], expected, name)
    for section, cls in _SECTIONS.items():
        values = raw.get(section, {}) or {}
        if not isinstance(values, Mapping):
            raise ConfigError(section, f"expected a mapping of keys, got {type(values).__name__} {values!r}")
        extra = {"model": kwargs["model"].path} if section == "engine" else {}  # model is built first
        kwargs[section] = build_section(cls, values, section, extra)
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
        # EngineConfig's messages already name the key ("engine.dtype must be ..."); others get the group.
        raise ConfigError("" if message.startswith(f"{prefix}.") else prefix, message) from None


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
