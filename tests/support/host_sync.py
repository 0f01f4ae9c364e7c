"""A torch function mode that fails on every op that would make the host wait for a CUDA device.

A GPU step launched before the previous one's tokens are read (engine.async_scheduling) only runs
ahead if nothing on the way reads a device value on the host. On a machine without a GPU that
cannot be timed, but it can be checked op by op: the code runs on CPU tensors standing for device
tensors, and every op that would synchronize on CUDA raises HostSync: reading a value (`item`,
`tolist`, `bool`, `int`, `float`, printing), ops whose output shape depends on values (`nonzero`,
`masked_select`, boolean-mask indexing, `unique`, single-argument `where`, `repeat_interleave`
without `output_size`), comparisons that return a Python bool (`equal`, `allclose`), and copies
to the host (`cpu`, `numpy`, `to` the CPU, a blocking `copy_` into a host tensor).

Which tensors stand for device tensors: those given to the mode, those an op computes from one,
those a factory makes with an explicit `device=`, and host tensors moved `to` a device (uploads).
Host tensors stay host tensors (a generator's draws, `torch.tensor` of host values), so reading
them is allowed, as it is on a GPU. Device kernels are opaque: a call inside `opaque()` (a Triton
launch, a stand-in kernel) is not inspected, and what it returns is a device tensor.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor


class HostSync(AssertionError):
    """An op that would wait for the device."""


# Ops that read device values on the host whenever a device tensor is among their inputs.
_READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.__bool__,
    Tensor.__int__,
    Tensor.__float__,
    Tensor.__index__,
    Tensor.__complex__,
    Tensor.__repr__,
    Tensor.__str__,
    Tensor.__format__,
    Tensor.is_nonzero,
    torch.is_nonzero,
    Tensor.numpy,
    Tensor.cpu,
    Tensor.nonzero,
    torch.nonzero,
    Tensor.argwhere,
    torch.argwhere,
    Tensor.masked_select,
    torch.masked_select,
    Tensor.unique,
    torch.unique,
    Tensor.unique_consecutive,
    torch.unique_consecutive,
    torch.equal,
    Tensor.equal,
    torch.allclose,
    Tensor.allclose,
    torch.bincount,
    Tensor.bincount,
}
_INDEXING = {Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put, Tensor.index_put_, torch.index_put}


def _tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _is_cpu(device: Any) -> bool:
    return isinstance(device, (torch.device, str)) and torch.device(device).type == "cpu"


class NoHostSync(TorchFunctionMode):
    def __init__(self, *device_tensors: Tensor) -> None:
        super().__init__()
        self._device: dict[int, weakref.ref[Tensor]] = {}  # id -> the device tensor (by identity)
        self._opaque = 0
        self.mark(device_tensors)

    def on_device(self, t: Tensor) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def mark(self, out: Any) -> Any:
        for t in _tensors(out):
            self._device[id(t)] = weakref.ref(t)
        return out

    @contextlib.contextmanager
    def opaque(self) -> Iterator[None]:
        self._opaque += 1
        try:
            yield
        finally:
            self._opaque -= 1

    def kernel(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` as an opaque device kernel: not inspected, its result on the device."""

        def launch(*args: Any, **kwargs: Any) -> Any:
            with self.opaque():
                return self.mark(fn(*args, **kwargs))

        return launch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._opaque:
            return func(*args, **kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        touches = any(self.on_device(t) for t in inputs)
        if touches:
            self._check(func, args, kwargs)
        out = func(*args, **kwargs)
        uploads = func is Tensor.to and any(
            isinstance(a, (torch.device, str)) for a in (*args[1:], kwargs.get("device"))
        )
        if touches or kwargs.get("device") is not None or uploads:
            self.mark(out)
        return out

    def _check(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = getattr(func, "__name__", repr(func))
        if func in _READS:
            raise HostSync(f"{name} of a device tensor")
        if func in (torch.where, Tensor.where) and len(args) + len(kwargs) == 1:
            raise HostSync("where(condition) of a device tensor")
        if func in (torch.repeat_interleave, Tensor.repeat_interleave) and kwargs.get("output_size") is None:
            if any(isinstance(a, Tensor) for a in args[1:2]) or isinstance(kwargs.get("repeats"), Tensor):
                raise HostSync("repeat_interleave by a tensor without output_size")
        if func in _INDEXING:
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            if any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(index)):
                raise HostSync(f"{name} with a boolean mask")
        if func is Tensor.to and self.on_device(args[0]):
            if any(_is_cpu(a) for a in (*args[1:], kwargs.get("device"))):
                raise HostSync("a device tensor copied to the host")
        if func is Tensor.copy_ and not self.on_device(args[0]) and not kwargs.get("non_blocking", False):
            raise HostSync("a blocking copy of a device tensor into a host tensor")


@contextlib.contextmanager
def opaque_triton_launches(mode: NoHostSync) -> Iterator[None]:
    """Triton's interpreter moving a launch's arguments to numpy and back is the launch itself, one
    device op on a GPU: not inspected."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def opaque_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with mode.opaque():
            return run(self, *args, **kwargs)

    InterpretedFunction.run = opaque_run
    try:
        yield
    finally:
        InterpretedFunction.run = run
