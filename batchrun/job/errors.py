"""The expected failures of a run, each reported as one line instead of a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; `key` is the dotted path users type on the command line."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


class JobError(RuntimeError):
    """The run cannot start or go on at all (no input found, model cannot load, output unwritable)."""


class ShardError(RuntimeError):
    """One input shard cannot be processed (unreadable, corrupt, missing column); the others go on."""
