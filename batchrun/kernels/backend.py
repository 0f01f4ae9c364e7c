"""Whether Triton is installed here, and where it keeps compiled kernels.

Which kernels serve a tensor is decided once, at start-up, by the kernel set's binder for the
device target (kernels/target.py: find_target; kernels/binding.py: bind_kernels); nothing here is
asked per call.
"""

from __future__ import annotations

import functools
import logging
import os

from batchrun.utils.private_dir import private_dir

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def triton_installed() -> bool:
    """Whether `triton` imports (asked once per process, before any Triton kernel is used).

    Triton loads the compiled kernels it finds in its cache directory, so that directory is held
    to the rule of batchrun's own caches (utils/private_dir.py): created 0700, refused (an
    UnsafeCacheError, not cached here, so every later ask refuses too) when another user owns it
    or others can write it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        log.debug("triton is not installed: GPU tensors take the plain-torch paths")
        return False
    private_dir(triton_cache_dir(), "Triton kernel cache", "TRITON_CACHE_DIR")
    return True


def triton_cache_dir() -> str:
    """Where Triton reads and writes compiled kernels: $TRITON_CACHE_DIR, else $TRITON_HOME (or
    the home directory)/.triton/cache, as Triton itself resolves it."""
    try:
        from triton import knobs

        return os.path.expanduser(str(knobs.cache.dir))
    except (ImportError, AttributeError):  # a Triton without knobs reads the same variables
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
        return os.path.expanduser(os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache"))
