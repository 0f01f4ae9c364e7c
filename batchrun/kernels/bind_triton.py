"""The kernel set of a GPU target, real or simulated: the Triton kernels, sized for the target's GPU
(`GpuTarget`: SM count, shared memory, fp8), cuBLAS for the float GEMMs the start-up tuning left
unfused, and torch's own fp8/int8 GEMMs behind the Triton quantization kernels.

Bound for a target without a GPU (`target.gpu` None), the same set runs in Triton's interpreter on
CPU tensors, with the interpreter's tiles (the decoder tests). An fp8 KV cache on a GPU without e4m3
(below sm_89) is the one cache the Triton kernels do not take: attention, the KV write and the
qkv front end are then the torch paths, which sync with the host (no CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Optional

import torch

from batchrun.kernels import (
    attention,
    attention_torch,
    cpu_attention,
    fused_projections,
    triton_attention,
    triton_elementwise,
    triton_kv,
    triton_moe,
    triton_sampling,
    triton_varlen_attention,
)
from batchrun.kernels import elementwise as ew
from batchrun.kernels.kernel_set import BindOptions, FloatLinears, KernelSet, LinearKernel
from batchrun.kernels.quant import linears, triton_gemm, w4a8, weight_only
from batchrun.kernels.target import DeviceTarget
from batchrun.kernels.triton_invariant import invariant_matmul
from batchrun.kernels.tuning import Tuning


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """engine.batch_invariant's linear: the batch-invariant Triton matmul where it takes x (the
    weight's dtype, unit last stride), F.linear elsewhere."""
    if x.dtype == weight.dtype and weight.stride(-1) == 1:
        return invariant_matmul(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def bind_triton(target: DeviceTarget, dtype: torch.dtype, tuning: Tuning, options: BindOptions) -> KernelSet:
    """The Triton kernel set for `target` (module doc) and the model dtype."""
    gpu = target.gpu
    has_fp8 = gpu is None or gpu.has_fp8  # the interpreter holds e4m3 values anywhere
    rms_norm = ew.rms_norm_triton
    triton_cache = not (options.kv_cache_dtype == "fp8" and not has_fp8)
    # the torch paths for the cache where Triton's cannot hold it (module doc)
    write_kv_cache = triton_kv.write_kv_cache if triton_cache else attention_torch.write_kv_cache_reference
    separate = partial(
        attention.qkv_norm_rope_write_separate,
        rms_norm=rms_norm,
        apply_rotary=ew.apply_rotary_reference,
        write_kv_cache=write_kv_cache,
    )
    if not triton_cache:
        qkv_norm_rope_write = separate
        paged_attention = partial(cpu_attention.paged_attention_cpu, native=False)
    else:
        qkv_norm_rope_write = partial(attention.qkv_norm_rope_write_triton, separate=separate)
        paged_attention = partial(triton_attention.paged_attention, gpu=gpu)
    qkv_separate = partial(fused_projections.qkv_project_separate, qkv_norm_rope_write=qkv_norm_rope_write)
    gate_up_separate = partial(fused_projections.gate_up_act_separate, act_mul=ew.act_mul_triton)
    qkv_project: Callable[..., Any] = qkv_separate
    gate_up_act: Callable[..., Any] = gate_up_separate
    lm_head_logits: Callable[..., Any] = fused_projections.lm_head_logits_separate
    embed_norm: Optional[Callable[..., Any]] = None
    if options.fuse:
        if options.kv_cache_dtype == "auto":  # the fused qkv GEMM writes a float cache only
            qkv_project = partial(fused_projections.qkv_project_fused, separate=qkv_separate, tuning=tuning, gpu=gpu)
        gate_up_act = partial(fused_projections.gate_up_act_fused, separate=gate_up_separate, tuning=tuning, gpu=gpu)
        lm_head_logits = partial(fused_projections.lm_head_logits_fused, tuning=tuning, gpu=gpu)
        embed_norm = fused_projections.embed_norm_triton
    dense = options.dense_min_rows
    # float32 activations take torch._scaled_mm on a real GPU with fp8; the dequantizing reference
    # elsewhere (a simulated GPU's CPU tensors, older GPUs)
    wide_fp8 = weight_only.fp8_scaled_matmul if target.is_gpu and has_fp8 else weight_only.fp8_weight_matmul
    fp8 = LinearKernel(weight_only.fp8_weight_matmul)
    if has_fp8:
        fp8 = LinearKernel(partial(linears.fp8_linear_triton, wide=wide_fp8), takes_quantized_rows=True)
    return KernelSet(
        target=target,
        dtype=dtype,
        binder="triton",
        options=options,
        tuning=tuning,
        rms_norm=rms_norm,
        add_rms_norm=ew.add_rms_norm_triton,
        rms_norm_quant=triton_elementwise.rms_norm_quant,
        act_mul=ew.act_mul_triton,
        write_kv_cache=write_kv_cache,
        qkv_norm_rope_write=qkv_norm_rope_write,
        paged_attention=paged_attention,
        varlen_attention=partial(triton_varlen_attention.varlen_attention, gpu=gpu),
        # the tables and positions go to the qkv front end, which reads each token's row (the
        # separate path gathers them itself): no gather kernels per step
        rope_reads_tables=True,
        decode_num_splits=partial(_decode_num_splits, gpu=gpu) if triton_cache else _one_split,
        qkv_project=qkv_project,
        gate_up_act=gate_up_act,
        lm_head_logits=lm_head_logits,
        embed_norm=embed_norm,
        sample=triton_sampling.gumbel_sample,
        spill=triton_sampling.spill_thresholds,
        gather_in_place=triton_sampling.gather_in_place,
        moe_grouped_gemm=triton_moe.grouped_gemm,
        invariant_matmul=invariant_linear,
        lora_rows=None,
        linear_float=FloatLinears("none"),
        linear_int8=LinearKernel(
            partial(triton_gemm.w8a16_linear, tuning=tuning, gpu=gpu), tile_kernel="w8a16", dense_min_rows=dense
        ),
        linear_int4=LinearKernel(
            partial(triton_gemm.w4a16_linear, tuning=tuning, gpu=gpu), tile_kernel="w4a16", dense_min_rows=dense
        ),
        linear_w8a8=LinearKernel(linears.w8a8_linear_triton, takes_quantized_rows=True),
        linear_w4a8=LinearKernel(w4a8.w4a8_matmul),  # no GPU kernel: the reference (docs/quantization.md)
        linear_fp8=fp8,
    )


def _decode_num_splits(num_decodes: int, num_kv_heads: int, max_context: int, *, gpu) -> int:
    """The split count the Triton decode attention picks for a step (engine/warmup.py plans by it)."""
    return triton_attention.default_num_splits(num_decodes, num_kv_heads, max_context, gpu)


def _one_split(num_decodes: int, num_kv_heads: int, max_context: int) -> int:
    """The torch decode attention splits no context."""
    return 1
