"""Triton kernels do not specialize on ints that change from step to step.

Triton compiles a kernel variant per class of each int argument's value (1, divisible by 16, other),
so an int that varies per step (the block-table width, the split count, the token count) compiles new
variants in the middle of a run. Compile counts can only be measured on a GPU (benchmarks.gpu); here the
decorators are checked to mark those arguments, by name, so a renamed argument fails this test
instead of silently specializing again.
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("triton")

# module -> kernel -> the per-step ints it must not specialize on
PER_STEP_INTS = {
    "batchrun.kernels.triton_attention": {
        "_decode_kernel": {"stride_bt"},  # block-table width: the step's longest context
        "_prefill_kernel": {"stride_bt"},
        "_merge_splits_kernel": {"num_splits"},  # depends on the batch size and context length
    },
    "batchrun.kernels.triton_fused_gemm": {  # the step's token count
        "_gemm_silu_mul_kernel": {"M"},
        "_gemm_qkv_kernel": {"M"},
        "_gemm_logits_kernel": {"M"},
    },
    "batchrun.kernels.quant.triton_gemm": {
        "_w8a16_kernel": {"M"},  # the step's token count
        "_w4a16_kernel": {"M"},
    },
    "batchrun.kernels.quant.triton_act": {"_quantize_rows_kernel": {"M"}},  # the step's token count
    "batchrun.kernels.triton_sampling": {"_gumbel_sample_kernel": {"num_rows"}},  # the step's sampled rows
}


@pytest.mark.parametrize(
    "module,kernel", [(m, k) for m, kernels in PER_STEP_INTS.items() for k in kernels], ids=lambda x: x
)
def test_per_step_ints_are_not_specialized(module, kernel):
    fn = getattr(importlib.import_module(module), kernel)
    names = {p.name for p in fn.params}
    wanted = PER_STEP_INTS[module][kernel]
    assert wanted <= names, f"{kernel} has no argument {sorted(wanted - names)}"
    unspecialized = {p.name for p in fn.params if p.do_not_specialize}
    assert wanted <= unspecialized, f"{kernel} specializes on {sorted(wanted - unspecialized)}"
