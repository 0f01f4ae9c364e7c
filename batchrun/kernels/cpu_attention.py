"""Native CPU decode attention over the paged KV cache (csrc/paged_attention.cpp).

The torch path for a decode step copies every sequence's context out of the cache and runs
batched matmuls over the copy, in every layer; this kernel reads K and V where they lie, through
the block table, so a decode step's attention costs one pass over the context instead of three.

It is compiled on first use with the system C++ compiler (`c++`/`g++`, -O3 -march=native
-fopenmp) into a per-user cache, keyed by the source, the compiler, its flags and the CPU's
feature flags (a cache on a shared home directory can be reached from different CPUs), and
loaded with ctypes. Without a compiler, or with BATCHRUN_CPU_KERNELS=0, `decode_kernel()` is
None and attention takes the plain-torch path; the two agree to float32 rounding (tested).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def enabled() -> bool:
    return os.environ.get("BATCHRUN_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    root = os.environ.get("BATCHRUN_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchrun", "kernels")
    return Path(root)


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler: str) -> Path:
    """Compile the kernel into the cache (atomically: concurrent workers may build at once)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), version, " ".join(FLAGS), _cpu_fingerprint()])
                         .encode()).hexdigest()[:16]
    target = cache_dir() / f"batchrun_cpu_attention_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)
def _library() -> Optional[ctypes.CDLL]:
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler found (c++, g++, clang++ or $CXX): CPU decode attention takes the "
                    "slower plain-torch path")
        return None
    try:
        torch.ones(1).add_(1)  # torch's libgomp is loaded first, so the kernel's OpenMP resolves to it
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError) as exc:
        log.warning("native CPU attention kernel unavailable, using the plain-torch path: %s", exc)
        return None
    fn = lib.batchrun_paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ptr, ptr, ctypes.c_int, i64, i64, i64, i64, i64, ptr, i64, ptr,
                   ctypes.c_float, ctypes.c_float, i64, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call)."""
    return _library() is not None


def supports(q: torch.Tensor, k_cache) -> bool:
    """Whether the native kernel serves this query and cache: enabled (BATCHRUN_CPU_KERNELS, read
    on every call), CPU, float32 or bf16, a plain (not int8/fp8) cache of q's dtype with
    contiguous rows, and a kernel that built."""
    return (enabled() and isinstance(k_cache, torch.Tensor) and q.device.type == "cpu"
            and k_cache.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype
            and k_cache.stride(-1) == 1 and available())


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim), one query per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), any strides but a unit last one
    v_cache: torch.Tensor,  # same layout as k_cache
    block_tables: torch.Tensor,  # (num_seqs, >= ceil(max seq_len / block_size)) int64
    seq_lens: torch.Tensor,  # (num_seqs,) int64: context length, the query's own position included
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Single-query attention of each sequence over its cached context: (num_seqs, num_heads, head_dim)."""
    lib = _library()
    assert lib is not None, "paged_decode_attention needs the native kernel (check supports() first)"
    q = q.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    rc = lib.batchrun_paged_decode_attention(
        q.data_ptr(), _DTYPES[q.dtype], num_seqs, num_heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        _DTYPES[k_cache.dtype], num_kv_heads, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_size,
        tables.data_ptr(), tables.shape[1] if tables.dim() == 2 else 0, lens.data_ptr(), float(scale),
        float(softcap or 0.0), int(sliding_window or 0), out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}, at most 64 times it")
    return out
