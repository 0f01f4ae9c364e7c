"""The native CPU kernels (csrc/*.cpp): built on first use, loaded with ctypes.

- csrc/paged_attention.cpp: decode attention straight over the paged KV cache, float or int8
  (kernels/cpu_attention.py);
- csrc/prefill_attention.cpp: causal prefill attention over the paged KV cache, float or int8,
  flash-style, on AVX-512 (bf16 on AVX512-BF16 dot products) (kernels/cpu_attention.py);
- csrc/quant.cpp: the per-token int8 quantization and the int32 -> float epilogue around W8A8's
  int8 GEMM (kernels/quant/w8a8.py: w8a8_matmul), and W4A8's quantization in groups of 32
  (kernels/quant/w4a8.py: quantize_groups_int8);
- csrc/elementwise.cpp: RMSNorm (with the residual add before it), rotary embedding and
  silu(gate) * up in bf16, one pass each (kernels/elementwise.py), and the KV-cache write, also
  quantizing into an int8 cache (kernels/cpu_attention.py);
- csrc/linear.cpp: bf16 linear layers over weights packed at load, prefetching the weight stream
  (kernels/cpu_linear.py: NativeLinear; with silu(gate) * up fused into a gate/up projection's
  store: NativeSiluMulLinear), W8A8's int8 GEMM with its scales and float channels
  (kernels/quant/w8a8.py: w8a8_matmul_native), and W4A8's grouped int8 x int4 GEMM (kernels/quant/w4a8.py);
- csrc/lora.cpp: the per-token LoRA updates of a step whose adapter tokens are spread over slots,
  added into a wrapped linear's output in place (kernels/lora.py; model/lora.py: LoraLinear).

They are compiled together with the system C++ compiler (`$CXX`, `c++`, `g++` or `clang++`;
-O3 -march=native -fopenmp) into one library in a per-user cache ($BATCHRUN_KERNEL_CACHE, else
~/.cache/batchrun/kernels), keyed by the sources, the compiler, its flags and the CPU's feature
flags (a cache on a shared home directory can be reached from different CPUs), written atomically
(data-parallel workers may build at once). Without a compiler, when the build fails (a warning
says why), or with BATCHRUN_CPU_KERNELS=0 (read when a kernel set is bound), the CPU kernel set
binds the plain-torch paths instead; each kernel is tested against that path. ctypes releases the
GIL during a call; OpenMP resolves to the libgomp that importing torch already loaded (same
soname), so the kernels share torch's threads instead of competing with them.
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

from batchrun.utils.private_dir import check_private, private_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# Argument types of each C entry point (all return int: 0, or a negative error code).
_SIGNATURES = {
    "batchrun_paged_decode_attention": (
        "ptr i32 i64 i64 i64 ptr ptr i32 i64 i64 i64 i64 ptr ptr i64 i64 i64 i64 ptr i64 ptr f32 f32 i64 ptr i32"
    ),
    "batchrun_prefill_attention_supported": "i64 i32 i64 i64 i32",
    "batchrun_paged_prefill_attention": (
        "ptr i32 i64 i64 i64 ptr ptr i32 i64 i64 i64 i64 ptr ptr "
        "i64 i64 i64 i64 ptr i64 ptr ptr ptr f32 f32 i64 i32 ptr i32"
    ),
    "batchrun_quantize_per_token_int8": "ptr i32 i64 i64 i64 ptr ptr ptr ptr i64 ptr i32",
    "batchrun_w8a8_epilogue": "ptr i64 i64 ptr ptr ptr ptr i32 i32",
    "batchrun_rms_norm_bf16": "ptr i64 i64 i64 ptr ptr f32 i32 ptr i32",
    "batchrun_rotary_bf16": "ptr i64 i64 i64 i64 ptr ptr i32",
    "batchrun_silu_mul_bf16": "ptr i64 i64 i64 ptr i32",
    "batchrun_write_kv_cache": "ptr ptr i64 i64 i64 i64 i64 i64 i64 i64 ptr ptr ptr i64 i64 i64 i64 i32",
    "batchrun_write_kv_cache_int8": (
        "ptr ptr i64 i64 i64 i64 i64 i64 i64 i64 ptr ptr ptr ptr ptr i64 i64 i64 i64 i64 i64 i64 i32"
    ),
    "batchrun_linear_bf16_supported": "i64 i64",
    "batchrun_linear_bf16": "ptr i64 i64 i64 ptr i64 ptr ptr i64 i32",
    "batchrun_linear_silu_mul_bf16": "ptr i64 i64 i64 ptr i64 ptr ptr i64 i32",
    "batchrun_w8a8_linear_supported": "i64 i64 i64",
    "batchrun_w8a8_linear": "ptr i64 i64 i64 ptr ptr i64 ptr ptr ptr ptr i64 ptr i64 i64 ptr ptr ptr i64 i32",
    "batchrun_quantize_groups_int8": "ptr i32 i64 i64 i64 i64 ptr ptr ptr i32",
    "batchrun_w4a8_linear_supported": "i64 i64",
    "batchrun_w4a8_linear": "ptr i64 i64 i64 ptr ptr ptr i64 ptr ptr ptr i64 ptr ptr i64 i32",
    "batchrun_w4a8_silu_quant": "ptr i64 i64 i64 ptr ptr ptr i64 ptr ptr ptr i64 ptr ptr ptr ptr i32",
    "batchrun_gumbel_sample": "ptr i32 i64 i64 i64 ptr ptr ptr ptr ptr i32",
    "batchrun_lora_rows": "ptr i32 i64 i64 i64 ptr i64 i64 ptr ptr i64 i64 ptr ptr i32",
}


def enabled() -> bool:
    """BATCHRUN_CPU_KERNELS: read once per kernel set, by kernels/target.py: find_target."""
    return os.environ.get("BATCHRUN_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where built kernels live: a directory only this user can write (the `.so` there is loaded
    as code), created 0700; one that others could write is refused (UnsafeCacheError)."""
    root = os.environ.get("BATCHRUN_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchrun", "kernels"
    )
    return private_dir(root, "kernel cache", "BATCHRUN_KERNEL_CACHE")


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
    key = hashlib.sha256(
        "\n".join([*(p.read_text() for p in SOURCES + HEADERS), version, " ".join(FLAGS), _cpu_fingerprint()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"batchrun_cpu_{key}.so"
    if target.exists():
        check_private(target, "kernel library", "BATCHRUN_KERNEL_CACHE")
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (no compiler, or the build failed: logged once)."""
    compiler = _compiler()
    if compiler is None:
        log.warning(
            "no C++ compiler found (c++, g++, clang++ or $CXX): the native CPU kernels are off and "
            "attention and W8A8 take their slower plain-torch paths"
        )
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError) as exc:
        log.warning("native CPU kernels unavailable, using the plain-torch paths: %s", exc)
        return None
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [{"i64": i64, "i32": i32, "f32": f32, "ptr": ptr}[a] for a in args.split()]
        fn.restype = ctypes.c_int
    return lib


def loaded() -> ctypes.CDLL:
    """The loaded kernels, for a caller bound where they are available (kernels/bind_cpu.py)."""
    lib = library()
    assert lib is not None, "native CPU kernels called where they are not built"
    return lib


def available() -> bool:
    """Whether the kernels are built and loaded (building them on the first call)."""
    return library() is not None


def on_host(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether the kernels can read these tensors' memory (None skipped): they read host memory
    only. A layer checks its buffers when it is built or refreshed (a later `.to()` may move them),
    never per call."""
    return all(t is None or t.device.type == "cpu" for t in tensors)


DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
