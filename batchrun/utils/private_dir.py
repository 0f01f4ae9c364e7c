"""Caches whose contents batchrun loads as code or trusts as model data (the native kernel `.so`,
converted weights, the file-hash memo) must be writable by this user only: a shared or
world-writable cache directory would let anyone who can write there run code in every job or swap
the weights a job uses. Directories batchrun creates are 0700; an existing directory or file owned
by another user, or writable by group or others, is refused with the path and the fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeCacheError(Exception):
    """A cache path that others could have written. Not an OSError: nothing may catch it as an
    ordinary I/O failure and fall back to loading the file anyway."""


def private_dir(path: Path | str, what: str, env_var: str) -> Path:
    """`path` as a directory only this user can write: missing components are created 0700, and
    the directory itself is checked (check_private). `what` and `env_var` name it in the error."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:  # a concurrent worker made it: checked below like any other
            pass
    check_private(path, what, env_var)
    return path


def check_private(path: Path | str, what: str, env_var: str) -> None:
    """Raise UnsafeCacheError unless `path` (not following a final symlink for ownership) is
    owned by this user (or root) and not writable by group or others."""
    path = Path(path)
    uid = os.geteuid()
    for st, kind in ((os.lstat(path), "link"), (os.stat(path), "target")):
        if st.st_uid not in (uid, 0):
            raise UnsafeCacheError(
                f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {uid}); it could hold "
                f"anyone's code or weights. Use a directory of your own ({env_var}=...) or remove it"
            )
        if kind == "target" and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeCacheError(
                f"{what} {path} is writable by group or others (mode {stat.filemode(st.st_mode)}); anyone who "
                f"can write there could change what batchrun loads. Fix: chmod go-w '{path}', or use a "
                f"directory of your own ({env_var}=...)"
            )
