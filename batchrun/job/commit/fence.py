"""The run's fingerprint fence: everything committed into one output.uri is computed with one set of
settings and one model, however many workers and launches write there.

    {output.uri}/_fingerprint.json      {"settings": {...}, "model": {...}, "created_at": ...}

The first launch that has loaded its engine creates the file (create-if-absent: exactly one of
several starting at once wins). Every worker compares its own settings and model with it at start
(the settings before the engine loads, so a mismatch costs no model load) and re-reads it before
each commit, of a part or a shard: one small read. So a worker of the same run started with another
model (launcher.rank 1 of 2, say), or a second launch with other settings overlapping the first,
stops with one line naming what differs, at the latest at its first commit, instead of mixing its
rows with the others'.

With output.on_change=recompute a launch with other settings replaces the file and redoes the
shards whose markers differ; launches still running with the old settings stop at their next
commit. A file deleted by hand is created again by the next commit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

from batchrun.job.commit.fingerprint import differences, fingerprint_changes
from batchrun.job.commit.manifest import utc_now
from batchrun.job.commit.store import RunStore
from batchrun.job.errors import ConfigError

log = logging.getLogger(__name__)

FENCE_FILE = "_fingerprint.json"


class FingerprintConflict(ConfigError):
    """This worker's settings or model differ from the run's: it must not commit anything."""


class FingerprintFence:
    def __init__(self, store: RunStore, on_change: str) -> None:
        self.store, self.on_change = store, on_change
        self.path = store.path(FENCE_FILE)
        self._expected: Optional[dict[str, Any]] = None  # {"settings", "model"} once established

    def check_settings(self, settings: Mapping[str, Any]) -> None:
        """Before the engine loads: a run recorded with other settings stops here (on_change=error)."""
        existing = self._read()
        if existing is None or self.on_change != "error":
            return
        changes = differences(existing.get("settings") or {}, settings)
        if changes:
            raise self._conflict(changes, "was started with other settings")

    def establish(self, settings: Mapping[str, Any], model: Mapping[str, Any]) -> None:
        """Once the engine is loaded: make this worker's fingerprint the run's, or check it is."""
        doc = {"settings": dict(settings), "model": dict(model)}
        self._expected = doc
        existing = self._read()
        if existing is None:
            if self.store.create_json(self.path, {**doc, "created_at": utc_now()}):
                return
            existing = self._read()  # another worker or launch created it first
        changes = self._changes(existing)
        if not changes:
            return
        if self.on_change == "error":
            raise self._conflict(changes, "was started with other settings or another model")
        log.warning(
            "%s: the run was started with other settings or another model (%s); output.on_change=recompute: "
            "this launch's settings are the run's from now on",
            self.store.url(self.store.root),
            "; ".join(changes[:4]),
        )
        self.store.write_json(self.path, {**doc, "created_at": utc_now()})

    def check(self) -> None:
        """Before a commit: the run's fingerprint must still be this worker's."""
        assert self._expected is not None, "establish() first"
        existing = self._read()
        if existing is None:  # deleted by hand: ours again
            if self.store.create_json(self.path, {**self._expected, "created_at": utc_now()}):
                return
            existing = self._read()
        changes = self._changes(existing)
        if changes:
            raise FingerprintConflict(
                "output.on_change",
                f"another launch with other settings or another model ({'; '.join(changes[:4])}) now writes to "
                f"{self.store.url(self.store.root)}; this worker stops without committing what it has in progress",
            )

    def _changes(self, existing: Optional[Mapping[str, Any]]) -> list[str]:
        assert self._expected is not None
        if existing is None:
            return ["the run's fingerprint file is unreadable"]
        return fingerprint_changes(existing, self._expected, ("settings", "model"))

    def _read(self) -> Optional[dict[str, Any]]:
        doc = self.store.read_json(self.path)
        return doc if isinstance(doc, dict) else None

    def _conflict(self, changes: list[str], what: str) -> FingerprintConflict:
        return FingerprintConflict(
            "output.on_change",
            f"the run in {self.store.url(self.store.root)} {what} ({'; '.join(changes[:4])}); use a new "
            "output.uri, or set output.on_change=recompute to redo it",
        )
