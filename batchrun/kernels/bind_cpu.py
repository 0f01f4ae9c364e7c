"""The kernel set of a CPU target (and of a GPU without Triton, whose tensors take the same torch
paths): the native csrc kernels where they are built and on and the dtype is theirs (bf16; the
attention, KV-write and W8A8/W4A8 quantization kernels take float32 too), the plain-torch
references elsewhere. float32 keeps torch's ops for everything the native kernels would change by
a rounding: that path is the one held token-identical to HF transformers.

Where start-up tuning measured torch's kernels against the native ones (bf16, engine.tune_kernels:
kernels/cpu_tuning.py), the set binds the winners: decode and prefill attention apart, and per
linear kind the kernels by row count (`FloatLinears.choices`, which model/prepare.py lays the
layers out for). Without a measurement, the native kernels wherever they serve.
"""

from __future__ import annotations

from functools import partial

import torch

from batchrun.kernels import attention, attention_torch, cpu_attention, fused_projections
from batchrun.kernels import elementwise as ew
from batchrun.kernels.cpu_choices import NATIVE, LinearChoice
from batchrun.kernels.kernel_set import BindOptions, FloatLinears, KernelSet, LinearKernel
from batchrun.kernels.lora import lora_rows_native
from batchrun.kernels.moe import grouped_gemm_reference
from batchrun.kernels.quant import linears, w4a8, w8a8, weight_only
from batchrun.kernels.quant.act import INT_MM_MIN_ROWS
from batchrun.kernels.sampling import (
    gather_in_place_reference,
    gumbel_sample_native,
    gumbel_sample_reference,
    spill_thresholds_reference,
)
from batchrun.kernels.target import DeviceTarget
from batchrun.kernels.tuning import Tuning
from batchrun.kernels.varlen_attention import varlen_attention


def _one_split(num_decodes: int, num_kv_heads: int, max_context: int) -> int:
    """The torch and native decode attention split no context: one split."""
    return 1


def bind_cpu(target: DeviceTarget, dtype: torch.dtype, tuning: Tuning, options: BindOptions) -> KernelSet:
    """The CPU kernel set for `target` and the model dtype (module doc), with `tuning`'s measured
    CPU choices where the native kernels serve."""
    on_cpu = target.gpu is None  # a GPU without Triton: CUDA tensors, torch paths only
    native = target.native_cpu_kernels and on_cpu
    native_bf16 = native and dtype == torch.bfloat16
    if native_bf16:
        rms_norm, add_rms_norm, act_mul = ew.rms_norm_native, ew.add_rms_norm_native, ew.act_mul_native
        rotary = ew.apply_rotary_native
    else:
        rms_norm, add_rms_norm, act_mul = ew.rms_norm_reference, ew.add_rms_norm_reference, ew.act_mul_reference
        rotary = ew.apply_rotary_reference
    write_kv_cache = attention.write_kv_cache_native if native else attention_torch.write_kv_cache_reference
    qkv_norm_rope_write = partial(
        attention.qkv_norm_rope_write_separate, rms_norm=rms_norm, apply_rotary=rotary, write_kv_cache=write_kv_cache
    )
    cpu_bf16 = on_cpu and dtype == torch.bfloat16
    int4 = LinearKernel(weight_only.int4_weight_matmul)
    if cpu_bf16:  # torch's own packed int4 kernel (no native kernel needed)
        int4 = LinearKernel(
            weight_only.int4_weight_matmul, packed_matmul=linears.int4_linear_cpu, pack=weight_only.int4_pack_for_cpu
        )
    # torch._int_mm on a GPU takes more than 16 rows: fewer are padded
    w8a8_kernel = LinearKernel(partial(w8a8.w8a8_matmul, native=native, min_rows=0 if on_cpu else INT_MM_MIN_ROWS))
    w4a8_kernel = LinearKernel(partial(w4a8.w4a8_matmul, native=native))
    if native_bf16:
        w8a8_kernel = LinearKernel(
            w8a8_kernel.matmul, packed_matmul=w8a8.w8a8_matmul_native, pack=w8a8.pack_w8a8_weight
        )
        w4a8_kernel = LinearKernel(
            w4a8_kernel.matmul,
            packed_matmul=w4a8.w4a8_matmul_native,
            pack=w4a8.pack_w4a8_weight,
            fused_silu=w4a8.w4a8_silu_quant_native,
        )
    paged_attention = partial(cpu_attention.paged_attention_cpu, native=native)
    linear_choices: tuple[LinearChoice, ...] = ()
    if native_bf16:
        measured = tuning.cpu_attention
        if measured is not None and (measured.decode, measured.prefill) != (NATIVE, NATIVE):
            paged_attention = partial(
                cpu_attention.paged_attention_cpu,
                native=measured.decode == NATIVE,
                native_prefill=measured.prefill == NATIVE,
            )
        linear_choices = tuple(c for c in tuning.cpu_linears if not c.is_native)
    gpu = target.gpu
    fp8 = weight_only.fp8_scaled_matmul if gpu is not None and gpu.has_fp8 else weight_only.fp8_weight_matmul
    packing = "none"
    if cpu_bf16:
        packing = "native" if native else "onednn"
    return KernelSet(
        target=target,
        dtype=dtype,
        binder="cpu",
        options=options,
        tuning=tuning,
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        rms_norm_quant=None,
        act_mul=act_mul,
        write_kv_cache=write_kv_cache,
        qkv_norm_rope_write=qkv_norm_rope_write,
        paged_attention=paged_attention,
        varlen_attention=varlen_attention,
        rope_reads_tables=False,
        decode_num_splits=_one_split,
        qkv_project=partial(fused_projections.qkv_project_separate, qkv_norm_rope_write=qkv_norm_rope_write),
        gate_up_act=partial(fused_projections.gate_up_act_separate, act_mul=act_mul),
        lm_head_logits=fused_projections.lm_head_logits_separate,
        embed_norm=None,
        sample=gumbel_sample_native if native else gumbel_sample_reference,
        spill=spill_thresholds_reference,
        gather_in_place=gather_in_place_reference,
        moe_grouped_gemm=grouped_gemm_reference,
        invariant_matmul=None,
        lora_rows=lora_rows_native if native else None,
        linear_float=FloatLinears(packing, linear_choices),
        linear_int8=LinearKernel(linears.int8_linear_cpu if cpu_bf16 else linears.int8_linear_reference),
        linear_int4=int4,
        linear_w8a8=w8a8_kernel,
        linear_w4a8=w4a8_kernel,
        linear_fp8=LinearKernel(fp8),
    )
