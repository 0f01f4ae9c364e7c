"""Compile, without running, every Triton kernel the launchers start, for a CUDA GPU, on a machine
without one.

Triton's interpreter (TRITON_INTERPRET=1), where the kernel tests run on a CPU machine, executes a
kernel's Python with numpy and never lowers it: a type mismatch in a tl op, a constexpr misuse, a
dtype the architecture lacks (float8 below sm_89), a tile too large for shared memory or the
register file only shows on the first GPU run. Triton's compiler itself needs no GPU: given a
`GPUTarget` it lowers to PTX and runs the bundled ptxas. `compile_only(arch)` turns every launch
inside it into that compile:

- The arguments are typed and specialized by Triton's own launch binder, built for a CUDA backend of
  the target, so each compile is the variant a launch on that GPU would compile: pointer dtypes
  (float8_e4m3fn is "fp8e4nv"), ints as i32/i64, an int equal to 1 folded into a constant, ints and
  pointers divisible by 16 marked so, `do_not_specialize` honoured. CPU tensors stand in for CUDA
  ones: their data pointers are aligned at least as the 16 bytes the marking asks of a GPU's.
- The block's CompileLog carries the simulated GPU's DeviceTarget (`CompileLog.target`): a kernel
  set bound for it (kernels/binding.py: bind_kernels) routes CPU tensors to the Triton launchers,
  which size tiles, padding and split counts for that GPU.
- Each distinct variant (the runtime's cache key: specialization and options) compiles once; a
  later launch with the same key only counts a launch, which is how a test shows that an int a
  kernel does not specialize on compiles no new variant when it changes.
- Compiled, a variant's registers, local memory (spills and stack) and shared memory are read from
  its cubin (cuobjdump, bundled with Triton) and checked against what the GPU would refuse at load.

Nothing runs: a launcher's outputs stay uninitialised, so code after a launch must not depend on
their values. The patch of `JITFunction.run` is process-wide while the context is open (it is the
one thing here that is: the simulated GPU is a value the callers bind for).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from batchrun.kernels.target import MAX_SHARED_PER_BLOCK, DeviceTarget, GpuTarget, find_target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArchSpec:
    """The GPU a compile-only check sizes launches for, and the per-block limits it loads under."""

    name: str
    num_sms: int
    max_shared: int  # bytes of shared memory one block may use (the opt-in maximum)


# One representative GPU per architecture: the launchers' split counts follow its SM count.
ARCHS: dict[int, ArchSpec] = {
    80: ArchSpec("A100", 108, MAX_SHARED_PER_BLOCK[(8, 0)]),
    86: ArchSpec("A40", 84, MAX_SHARED_PER_BLOCK[(8, 6)]),
    89: ArchSpec("L40S", 142, MAX_SHARED_PER_BLOCK[(8, 9)]),
    90: ArchSpec("H100/H200", 132, MAX_SHARED_PER_BLOCK[(9, 0)]),
}

_REGISTERS_PER_SM = 65536  # every architecture above: a block's threads share at most this many
_REGISTER_GRANULE = 256  # registers are handed to each warp in these units


@dataclass
class CompiledVariant:
    """One variant of one kernel, compiled (or failing to) for one architecture."""

    kernel: str  # "module.function", e.g. "batchrun.kernels.triton_attention._decode_kernel"
    arch: int  # compute capability as Triton writes it, e.g. 90
    key: str  # the runtime's cache key: one compiled binary per distinct key
    signature: dict[str, str]  # argument -> Triton type ("*bf16", "i32", "constexpr")
    constexprs: dict[str, Any]  # argument -> value, the declared constexprs and the ints folded as 1
    divisible_by_16: list[str]  # pointers and ints specialized as multiples of 16
    num_warps: int
    num_stages: int
    error: Optional[str] = None  # why it failed: the compiler's message, or the limit it passes
    n_regs: Optional[int] = None  # registers per thread
    n_spills: Optional[int] = None  # local memory per thread in bytes (spills and stack), 0 when none
    shared: Optional[int] = None  # shared memory per block in bytes
    launches: int = 1  # launches inside the check that used this variant
    ptx: Optional[str] = field(default=None, repr=False)  # the PTX it lowered to: which instructions it issues
    label: str = ""  # CompileLog.label when it was first launched: what the caller was driving

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def name(self) -> str:
        return self.kernel.rsplit(".", 1)[-1]


@dataclass
class CompileLog:
    """What a `compile_only` block compiled, in launch order."""

    arch: int
    target: DeviceTarget  # the simulated GPU the block's launches are sized for: bind kernel sets for it
    variants: list[CompiledVariant] = field(default_factory=list)
    label: str = ""  # set by the caller to say what it launches next; copied into each new variant

    @property
    def failures(self) -> list[CompiledVariant]:
        return [v for v in self.variants if not v.ok]

    def kernels(self) -> set[str]:
        return {v.kernel for v in self.variants}

    def of(self, name: str) -> list[CompiledVariant]:
        """The variants of the kernel whose function is called `name` (e.g. "_decode_kernel")."""
        return [v for v in self.variants if v.name == name]


def triton_supported() -> Optional[str]:
    """None when the installed Triton has the internals `compile_only` drives (Triton 3.4 and later:
    the launch binder over a backend, `JITFunction._pack_args`), else why not."""
    try:
        import triton
        from triton.runtime import jit
    except ImportError:
        return "triton is not installed"
    missing = [
        name
        for owner, name in ((jit, "create_function_from_signature"), (jit.JITFunction, "_pack_args"))
        if not hasattr(owner, name)
    ]
    if missing:
        return f"triton {triton.__version__} lacks {', '.join(missing)} (compile_only needs Triton >= 3.4)"
    return None


def _cuobjdump() -> Optional[str]:
    try:
        from triton import knobs

        path = knobs.nvidia.cuobjdump.path
        if path and os.path.exists(path):
            return path
    except (ImportError, AttributeError, RuntimeError):
        pass
    return shutil.which("cuobjdump")


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _resource_usage(cubin: bytes) -> Optional[tuple[int, int]]:
    """(registers per thread, local bytes per thread) of a cubin's kernel, None without cuobjdump.
    Local bytes are the stack frame plus local memory, which is what spilled registers occupy and
    what the driver reports (Triton's `n_spills` on a GPU)."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            log.warning("cuobjdump could not read a cubin (%s): register counts unknown", e)
            return None
    m = _USAGE.search(out.stdout)
    if m is None:
        return None
    regs, stack, _, local = (int(g) for g in m.groups())
    return regs, stack + local


def _limit_error(v: CompiledVariant, spec: Optional[ArchSpec]) -> Optional[str]:
    """What the GPU would refuse when loading the compiled kernel (Triton raises OutOfResources)."""
    if spec is not None and v.shared is not None and v.shared > spec.max_shared:
        return f"shared memory {v.shared} B > {spec.max_shared} B per block on {spec.name}"
    if v.n_regs is not None:
        per_warp = -(-v.n_regs * 32 // _REGISTER_GRANULE) * _REGISTER_GRANULE
        if per_warp * v.num_warps > _REGISTERS_PER_SM:
            return f"{v.n_regs} registers x {v.num_warps} warps pass the register file"
    return None


class _Compiler:
    """The replacement of `JITFunction.run` for one architecture: bind as a launch would, compile each
    new variant, record it."""

    def __init__(self, arch: int, compile_log: CompileLog) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.spec = ARCHS.get(arch)
        self.log = compile_log
        self.binders: dict[int, Any] = {}  # id(JITFunction) -> its launch binder for this backend
        self.seen: dict[str, CompiledVariant] = {}  # kernel + key -> variant

    def run(self, fn: Any, args: tuple, kwargs: dict) -> None:
        import triton
        from triton.compiler import ASTSource
        from triton.runtime import jit

        if id(fn) not in self.binders:
            self.binders[id(fn)] = jit.create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = self.binders[id(fn)](*args, **kwargs)
        kernel = f"{fn.__module__}.{fn.__name__}"
        key = f"{specialization}{sorted(options.items())}"
        if kernel + key in self.seen:
            self.seen[kernel + key].launches += 1
            return
        opts, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
        names = [p.name for p in fn.params]
        v = CompiledVariant(
            kernel=kernel,
            arch=self.target.arch,
            key=key,
            signature=dict(signature),
            constexprs={names[path[0]]: value for path, value in constexprs.items()},
            divisible_by_16=[n for n, s in zip(names, specialization) if s[0] != "constexpr" and s[1] == "D"],
            num_warps=opts.num_warps,
            num_stages=opts.num_stages,
            label=self.log.label,
        )
        self.seen[kernel + key] = v
        self.log.variants.append(v)
        try:
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs, attrs), target=self.target, options=opts.__dict__
            )
        except Exception as e:  # noqa: BLE001 - any compiler failure is this check's finding
            lines = [line for line in str(e).splitlines() if line.strip()] or traceback.format_exception_only(e)
            v.error = f"{type(e).__name__}: " + " | ".join(lines[-6:])
            log.info("%s for sm_%d does not compile: %s", kernel, self.target.arch, v.error)
            return
        v.shared = int(compiled.metadata.shared)
        v.ptx = compiled.asm.get("ptx")
        usage = _resource_usage(compiled.asm["cubin"])
        if usage is not None:
            v.n_regs, v.n_spills = usage
        v.error = _limit_error(v, self.spec)


@contextlib.contextmanager
def compile_only(arch: int = 90, num_sms: Optional[int] = None) -> Iterator[CompileLog]:
    """Inside, Triton launches compile for sm_`arch` instead of running, and are recorded in the
    yielded CompileLog, whose `target` is that GPU simulated (`num_sms` defaults to the
    architecture's representative GPU in ARCHS): a kernel set bound for it launches as on that GPU.
    A failing compile is recorded, not raised, so one pass reports every kernel."""
    why = triton_supported()
    if why is not None:
        raise RuntimeError(why)
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("under TRITON_INTERPRET the kernels are interpreted, never compiled")
    assert arch in ARCHS, f"no GPU on file for sm_{arch}"
    if num_sms is None:
        num_sms = ARCHS[arch].num_sms
    gpu = GpuTarget((arch // 10, arch % 10), num_sms, ARCHS[arch].max_shared)
    compile_log = CompileLog(arch, find_target("cpu", simulate=gpu))
    compiler = _Compiler(arch, compile_log)
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        compiler.run(self, args, kwargs)
        return None

    JITFunction.run = run
    try:
        yield compile_log
    finally:
        JITFunction.run = real_run
