"""The native per-token LoRA kernel (csrc/lora.cpp, kernels/lora.py: lora_rows_native) against the
torch path it replaces (model/lora.py: LoraLinear's gather, batched matmuls and index_add) and the
plain formula y[t] += B_s @ (A_s @ x[t]).

float32 agrees to a float32 sum order; bf16 rounds the update once, after adding it into y (the
torch path rounds the update to bf16 first, then the sum): within a bf16 rounding of the sum.
Covered: one token and 300, tokens of several slots mixed with base tokens, slots of smaller
ranks than the padded R and a slot of rank 0, strided x, both thread counts, a LoraLinear over each
path, and the engine (the CPU kernel set binds the native kernel; off with BATCHRUN_CPU_KERNELS=0).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchrun.kernels import cpu_native
from batchrun.kernels.binding import default_kernels
from batchrun.kernels.lora import lora_rows_native
from batchrun.model.lora import LoraLinear, _StepRows

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler: the native kernels are not built")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _weights(num_slots: int, rank: int, in_f: int, out_f: int, ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A (S, R, in), B (S, out, R) float32, zero past each slot's rank (as LoraSlots pads them)."""
    a = torch.randn(num_slots, rank, in_f) / in_f**0.5
    b = torch.randn(num_slots, out_f, rank) / rank**0.5
    for s, r in enumerate(ranks):
        a[s, r:] = 0
        b[s, :, r:] = 0
    return a, b


def _formula(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y + the update, in float64."""
    want = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += b[s].double() @ (a[s].double() @ x[t].double())
    return want


@pytest.mark.parametrize("num_tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("in_f,out_f", [(64, 64), (576, 3072), (100, 37)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_formula(num_tokens, in_f, out_f, dtype, threads):
    torch.manual_seed(num_tokens * 7 + in_f + out_f)
    ranks = [16, 4, 0, 9]  # slot 2 holds an adapter that does not reach this linear
    a, b = _weights(4, 16, in_f, out_f, ranks)
    slots = torch.randint(-1, 4, (num_tokens,), dtype=torch.int64)
    if num_tokens == 1:
        slots[0] = 3
    x_wide = torch.randn(num_tokens, in_f + 8).to(dtype)
    x = x_wide[:, 3 : 3 + in_f]  # a strided view: rows in_f + 8 apart
    y = torch.randn(num_tokens, out_f).to(dtype)
    want = _formula(x, y, a, b, slots)
    got = y.clone()
    assert lora_rows_native(x, got, a, b.transpose(1, 2).contiguous(), slots, torch.tensor(ranks))
    untouched = (slots < 0) | (slots == 2)
    assert torch.equal(got[untouched], y[untouched])  # base tokens and a rank-0 slot: y as it was
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:
        # one bf16 rounding of the exact sum (the float32 accumulation adds far less)
        step = want.abs() * 2.0**-8 + 1e-6
        assert bool(((got.double() - want).abs() <= step * 1.01).all())


def test_kernel_declines_what_it_does_not_take():
    a, b = _weights(2, 4, 8, 8, [4, 4])
    bt = b.transpose(1, 2).contiguous()
    slots, ranks = torch.tensor([0, 1]), torch.tensor([4, 4])
    half = torch.randn(2, 8, dtype=torch.float16)
    assert not lora_rows_native(half, half.clone(), a, bt, slots, ranks)  # float16
    x = torch.randn(2, 8)
    assert not lora_rows_native(x, torch.randn(8, 2).T, a, bt, slots, ranks)  # y columns strided
    assert not lora_rows_native(x, torch.randn(2, 8), a, b.transpose(1, 2), slots, ranks)  # B^T not contiguous


def _layers(in_f: int, out_f: int, ranks: list[int]) -> tuple[LoraLinear, LoraLinear]:
    """Two LoraLinears over one base and the same slots: the native kernel's and the torch path's."""
    base = nn.Linear(in_f, out_f)
    a, b = _weights(len(ranks), max(ranks), in_f, out_f, ranks)
    native = LoraLinear(base, in_f, out_f, len(ranks), max(ranks), lora_rows_native)
    torch_path = LoraLinear(base, in_f, out_f, len(ranks), max(ranks))
    for layer in (native, torch_path):
        layer.lora_a.copy_(a)
        layer.lora_b.copy_(b)
        layer.slot_ranks = list(ranks)
    assert native.lora_rows is not None and torch_path.lora_rows is None
    return native, torch_path


def _step(token_slots: list[int], max_loras: int) -> _StepRows:
    """The grouping LoraSlots.set_step makes, without slots to load."""
    from batchrun.model.lora import LoraSlots

    step = _StepRows()
    slots = LoraSlots({}, max_loras, {}, {}, step)
    slots._slot_names = [f"s{i}" for i in range(max_loras)]
    slots._resident.update({f"s{i}": i for i in range(max_loras)})
    slots.set_step(torch.tensor(token_slots))
    return step


@pytest.mark.parametrize("num_tokens", [1, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_native_equals_its_torch_path(num_tokens, dtype, threads, monkeypatch):
    torch.manual_seed(num_tokens)
    native, torch_path = _layers(96, 160, [8, 16, 3, 0])
    calls = []
    monkeypatch.setattr(native, "lora_rows", lambda *a: calls.append(1) or lora_rows_native(*a))
    # spread over slots with base tokens between (a decode step): the gathered path
    token_slots = [1] if num_tokens == 1 else [(t % 5) - 1 for t in range(num_tokens)]
    step = _step(token_slots, 4)
    assert step.spans is None or num_tokens == 1
    native.step = torch_path.step = step
    x = torch.randn(num_tokens, 96).to(dtype)
    if native.base.weight.dtype != dtype:
        native.base.to(dtype)
    got, want = native(x), torch_path(x)
    if num_tokens == 1:
        assert not calls  # one range of one slot: the in-place range path, for both
        assert torch.equal(got, want)
        return
    assert calls
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        # the torch path rounds the update to bf16 before adding it: two roundings against one
        g, w = got.float(), want.float()
        assert bool(((g - w).abs() <= w.abs() * 2.0**-7 + 1e-2).all())
        assert (g != w).float().mean() < 0.2


def test_the_cpu_kernel_set_binds_the_native_kernel_and_the_switch_turns_it_off(monkeypatch):
    assert default_kernels("cpu", torch.float32).lora_rows is lora_rows_native
    assert default_kernels("cpu", torch.bfloat16).lora_rows is lora_rows_native
    monkeypatch.setenv("BATCHRUN_CPU_KERNELS", "0")
    assert default_kernels("cpu", torch.float32).lora_rows is None
