"""Triton compile counts: the variants of each batchrun kernel this process has compiled.

Triton compiles a kernel once per specialization key: dtypes, constexprs, and for each int argument
not marked do_not_specialize whether it is 1 or divisible by 16. An argument that changes from step
to step then compiles new variants in the middle of a run, each a stall of up to seconds. The GPU
check takes `snapshot()` after warm-up and again after the timed runs: a key that appears in
between is that failure, and the key says which argument moved.

Counted from each kernel's in-memory cache of compiled variants, so a variant loaded from Triton's
on-disk cache counts too (it still stalls the step that first needs it, only less). Under
TRITON_INTERPRET nothing is compiled: `snapshot()` is None.

A library module (no `__main__`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
from typing import Any, Optional

Snapshot = dict[str, set[str]]  # "module.kernel" -> keys of its compiled variants


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _jit_function(obj: Any) -> Any:
    """The JITFunction under an autotuner or heuristics wrapper (they keep it as `.fn`), else None."""
    from triton.runtime.jit import JITFunction

    for _ in range(4):
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def triton_kernels() -> dict[str, Any]:
    """'module.kernel' -> JITFunction of every Triton kernel under batchrun.kernels. Only modules whose
    source uses `triton.jit` are imported, so no other backend (the C++ build) is triggered."""
    import batchrun.kernels as package

    found: dict[str, Any] = {}
    seen: set[int] = set()
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        spec = importlib.util.find_spec(info.name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin) as f:
            if "triton.jit" not in f.read():
                continue
        module = importlib.import_module(info.name)
        for attr, obj in sorted(vars(module).items()):
            fn = _jit_function(obj)
            # re-exported kernels are listed once, under the module that defines them
            if fn is None or id(fn) in seen or getattr(fn, "__module__", module.__name__) != module.__name__:
                continue
            seen.add(id(fn))
            found[f"{info.name.removeprefix(package.__name__ + '.')}.{attr}"] = fn
    return found


def entry_kernels() -> dict[str, Any]:
    """The kernels of `triton_kernels()` that a launcher starts: those no other Triton function calls
    (the rest are helpers, compiled inlined into their callers)."""
    import ast

    kernels = triton_kernels()
    called: set[int] = set()
    for fn in kernels.values():
        for node in ast.walk(fn.parse()):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                callee = _jit_function(fn.__globals__.get(node.func.id))
                if callee is not None:
                    called.add(id(callee))
    return {name: fn for name, fn in kernels.items() if id(fn) not in called}


def variant_keys(fn: Any) -> set[str]:
    """Keys of the variants `fn` has compiled, on every device."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:  # Triton >= 3.3: device -> (kernel cache, ...)
        return {f"{device}:{key}" for device, entry in list(caches.items()) for key in entry[0]}
    cache = getattr(fn, "cache", None)  # older Triton: device -> {key: compiled kernel}
    if isinstance(cache, dict):
        return {f"{device}:{key}" for device, per_device in cache.items() for key in per_device}
    raise TypeError(f"this Triton keeps no compile cache where benchmarks.compile_counts looks ({type(fn).__name__})")


def snapshot() -> Optional[Snapshot]:
    """Compiled variants per kernel now; None under the interpreter (nothing compiles there)."""
    if interpreted():
        return None
    return {name: variant_keys(fn) for name, fn in triton_kernels().items()}


def counts(snap: Snapshot) -> dict[str, int]:
    """Variants per kernel, kernels never launched left out."""
    return {name: len(keys) for name, keys in sorted(snap.items()) if keys}


def compiled_between(before: Snapshot, after: Snapshot) -> dict[str, list[str]]:
    """Per kernel, the keys compiled after `before` was taken (kernels with none left out)."""
    new = {name: sorted(keys - before.get(name, set())) for name, keys in after.items()}
    return {name: keys for name, keys in sorted(new.items()) if keys}
