"""The CPU's native-or-torch rule (kernels/cpu_choices.py) on injected timings: an AMX-like CPU
(torch's oneDNN far faster at a prefill chunk's rows, the native kernel faster at a decode step's),
a Zen-like one (native faster or tied everywhere), near-ties, and the row threshold between them.
Nothing here is timed."""

from __future__ import annotations

import pytest

from batchrun.kernels.cpu_choices import (
    MARGIN,
    NATIVE,
    PACKED,
    TORCH,
    UNPACKED,
    KernelTiming,
    choose_attention,
    choose_linear,
    crossover_rows,
)

# (rows, native ms, torch ms[, torch over tiles unpacked per call, ms]) at decode rows 1 and 32 and
# a prefill chunk of 256, shaped like SmolLM2's gate/up projection on 2 cores.
AMX = [KernelTiming(1, 0.05, 0.09), KernelTiming(32, 0.30, 0.40), KernelTiming(256, 2.40, 0.80, 0.85)]
ZEN = [KernelTiming(1, 0.05, 0.08), KernelTiming(32, 0.30, 0.33), KernelTiming(256, 2.30, 2.20, 2.60)]


def test_amx_like_timings_split_the_layer_by_rows_without_a_second_copy():
    choice = choose_linear("gate_up_silu", 3072, 576, AMX)
    assert (choice.small, choice.large, choice.torch_form) == (NATIVE, TORCH, UNPACKED)
    assert choice.split_rows is not None and 32 < choice.split_rows <= 256
    assert [choice.kernel_at(r) for r in (1, 32, choice.split_rows - 1)] == [NATIVE] * 3
    assert [choice.kernel_at(r) for r in (choice.split_rows, 256, 4096)] == [TORCH] * 3
    assert not choice.is_native
    assert choice.describe()["timings"][-1] == {"rows": 256, "native_ms": 2.4, "torch_ms": 0.8, "unpacked_ms": 0.85}


def test_the_weight_is_held_twice_only_where_unpacking_per_call_costs_more_than_the_margin():
    slow_unpack = [*AMX[:2], KernelTiming(256, 2.40, 0.80, 1.20)]
    assert choose_linear("down", 576, 1536, slow_unpack).torch_form == PACKED
    # unpacking within the margin of oneDNN's own copy: no second copy
    close = [*AMX[:2], KernelTiming(256, 2.40, 0.80, 0.80 * (1 + MARGIN))]
    assert choose_linear("down", 576, 1536, close).torch_form == UNPACKED
    # unpacked would not beat the native kernel by the margin itself: the packed copy
    marginal = [*AMX[:2], KernelTiming(256, 1.00, 0.80, 0.90)]
    assert choose_linear("down", 576, 1536, marginal).torch_form == PACKED


def test_zen_like_timings_keep_the_native_kernel_everywhere():
    choice = choose_linear("gate_up_silu", 3072, 576, ZEN)
    assert choice.is_native and choice.split_rows is None and choice.torch_form is None


@pytest.mark.parametrize("faster", [0.0, 0.05, MARGIN - 0.01])
def test_a_near_tie_keeps_the_native_kernel(faster):
    """torch's kernel less than MARGIN faster at every row count: the static choice stays."""
    timings = [KernelTiming(r, 1.0 * r, 1.0 * r / (1 + faster), 1.0 * r / (1 + faster)) for r in (1, 32, 256)]
    assert choose_linear("qkv", 960, 576, timings).is_native


def test_torch_faster_at_every_row_count_takes_torch_with_one_layout():
    timings = [KernelTiming(1, 0.2, 0.1), KernelTiming(32, 0.6, 0.3), KernelTiming(256, 4.0, 1.0, 1.1)]
    choice = choose_linear("o", 576, 576, timings)
    assert (choice.small, choice.large, choice.split_rows, choice.torch_form) == (TORCH, TORCH, None, None)


def test_a_middle_row_count_that_disagrees_is_outvoted_by_both_regimes():
    timings = [KernelTiming(1, 0.05, 0.09), KernelTiming(32, 0.60, 0.30), KernelTiming(256, 2.0, 2.1, 2.5)]
    assert choose_linear("o", 576, 576, timings).is_native


def test_the_threshold_is_where_the_lines_cross_with_the_margin():
    # native 0.1 + 0.01 r, torch 0.3 + 0.002 r: equal with 15% on torch where
    # 0.1 + 0.01 r = 1.15 (0.3 + 0.002 r), r = 0.245 / 0.0077 = 31.8
    a, b = KernelTiming(16, 0.26, 0.332), KernelTiming(256, 2.66, 0.812)
    assert crossover_rows(a, b) == 32
    # a per-call overhead on torch's side moves the crossing up: 0.1 + 0.01 r = 1.15 (0.4 + 0.002 r)
    assert crossover_rows(a, b, torch_overhead_ms=0.1) == 47
    # far from the lines' crossing the measured row counts decide: above the smaller one at least
    assert crossover_rows(KernelTiming(16, 0.1, 10.0), b) == 225
    assert crossover_rows(KernelTiming(16, 1.0 + MARGIN, 1.0), b) == 17  # an exact tie at 16 (native keeps it)


def test_native_winning_only_at_large_rows_holds_both_kernels_packed():
    timings = [KernelTiming(1, 0.2, 0.1), KernelTiming(32, 0.6, 0.4), KernelTiming(256, 2.0, 3.0, 3.2)]
    choice = choose_linear("qkv", 960, 576, timings)
    assert (choice.small, choice.large, choice.torch_form) == (TORCH, NATIVE, PACKED)
    assert choice.split_rows is not None and 1 < choice.split_rows <= 256
    assert choice.kernel_at(1) == TORCH and choice.kernel_at(256) == NATIVE


def test_no_timings_keep_the_native_kernel():
    assert choose_linear("lm_head", 49152, 576, []).is_native


def test_attention_chooses_decode_and_prefill_apart():
    fresh, after_context = KernelTiming(256, 3.0, 1.0), KernelTiming(256, 4.0, 2.0)
    amx = choose_attention(KernelTiming(32, 0.40, 1.60), [fresh, after_context])
    assert (amx.decode, amx.prefill) == (NATIVE, TORCH)
    zen = choose_attention(KernelTiming(32, 0.40, 1.60), [KernelTiming(256, 1.0, 0.95), KernelTiming(256, 1.0, 2.0)])
    assert (zen.decode, zen.prefill) == (NATIVE, NATIVE)
    # torch faster on a fresh prompt only: its masked path after cached context is slower, so native
    masked_slow = choose_attention(None, [fresh, KernelTiming(256, 4.0, 5.0)])
    assert (masked_slow.decode, masked_slow.prefill) == (NATIVE, NATIVE)
    unmeasured = choose_attention(None, [])  # the native kernel does not take the shape
    assert (unmeasured.decode, unmeasured.prefill) == (NATIVE, NATIVE)
    assert amx.describe()["prefill_timings"][1] == {"rows": 256, "native_ms": 4.0, "torch_ms": 2.0}
