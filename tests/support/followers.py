"""Find a tensor-parallel group's follower processes by a marker in their environment (followers
inherit rank 0's), through /proc: no dependency, and it finds orphans whose parent is gone."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

MARKER_KEY = "BATCHRUN_TEST_GROUP_MARKER"


def new_marker() -> dict[str, str]:
    """An environment entry that tags the processes a test starts (and their followers)."""
    return {MARKER_KEY: uuid.uuid4().hex}


def follower_pids(marker: dict[str, str]) -> list[int]:
    """Live `python -m batchrun.engine.follower` processes carrying `marker` (zombies excluded)."""
    wanted = f"{MARKER_KEY}={marker[MARKER_KEY]}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"batchrun.engine.follower" not in (entry / "cmdline").read_bytes():
                continue
            if wanted not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except OSError:  # exited meanwhile
            continue
        pids.append(int(entry.name))
    return pids


def wait_until_no_followers(marker: dict[str, str], limit_s: float = 60.0) -> list[int]:
    """Poll until no follower with `marker` lives; return those left at `limit_s` (a hang guard)."""
    deadline = time.monotonic() + limit_s
    while True:
        left = follower_pids(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_all(marker: dict[str, str]) -> None:
    """Clean up after a failed test: no follower outlives it."""
    for pid in follower_pids(marker):
        try:
            os.kill(pid, 9)
        except OSError:
            pass
