"""The cases start-up tuning times (kernels/tuning.py): for every GEMM shape a model runs through a
Triton kernel (model/gemm_shapes.py lists them) and every row bucket a run can reach, model-shaped
random inputs on the device and the launchers over them. The inputs are made only when a case is
timed (`TuningCase.prepare`), one case at a time; a table tuning never makes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.nn.functional as F

from batchrun.kernels.gemm_tiles import GemmConfig, m_bucket
from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.kv_layout import new_kv_cache
from batchrun.kernels.qkv_heads import QKVHeads
from batchrun.kernels.tuning import FUSED_KINDS, GemmShape, Runner, TuningCase, row_buckets

_BLOCK_SIZE = 16  # the scratch KV cache's block size: the fused qkv GEMM writes K and V there
_TABLE_ROWS = 4096  # rotary table rows of the scratch inputs (positions wrap around)

Prepared = tuple[Runner, Optional[Callable[[int], Any]]]


def tuning_cases(shapes: Iterable[GemmShape], kernels: KernelSet, max_rows: int) -> list[TuningCase]:
    """One case per (shape, row bucket) for up to `max_rows` rows a step: the fused projections per
    row bucket (gemm_tiles.row_bucket: up to 256 the tile buckets, powers of two above), the
    dequantize-GEMMs per tile bucket (past 256 rows they take the 256 bucket's tile)."""
    dtype = kernels.dtype
    cases = []
    for shape in dict.fromkeys(shapes):
        if shape.kernel in FUSED_KINDS:
            buckets = row_buckets(max_rows)
        else:
            buckets = sorted({m_bucket(m) for m in range(1, min(max_rows, 256) + 1)})
        for rows in buckets:
            cases.append(TuningCase(shape, rows, dtype, _preparer(shape, rows, kernels)))
    return cases


def _preparer(shape: GemmShape, rows: int, kernels: KernelSet) -> Callable[[], Prepared]:
    makers = {"qkv": _qkv, "silu_mul": _silu_mul, "logits": _logits, "w8a16": _w8a16, "w4a16": _w4a16}
    make = makers[shape.kernel]
    return lambda: make(shape, rows, kernels)


def _activations(rows: int, k: int, kernels: KernelSet) -> torch.Tensor:
    device = kernels.target.device
    return (torch.randn(rows, k, device=device) * 0.5).to(kernels.dtype)  # (rows, K)


def _weight(n: int, k: int, kernels: KernelSet) -> torch.Tensor:
    return (torch.randn(n, k, device=kernels.target.device) * 0.02).to(kernels.dtype)  # (N, K)


def _qkv(shape: GemmShape, rows: int, kernels: KernelSet) -> Prepared:
    from batchrun.kernels.triton_fused_gemm import gemm_qkv_norm_rope_write

    assert shape.heads is not None
    num_heads, num_kv_heads, head_dim, has_bias, has_norm, is_gemma = shape.heads
    device, dtype, gpu = kernels.target.device, kernels.dtype, kernels.target.gpu
    x, w = _activations(rows, shape.k, kernels), _weight(shape.n, shape.k, kernels)
    bias = torch.zeros(shape.n, dtype=dtype, device=device) if has_bias else None
    norm = torch.ones(head_dim, dtype=dtype, device=device) if has_norm else None
    heads = QKVHeads(num_heads, num_kv_heads, head_dim, norm, norm, 1e-6, is_gemma)
    cos = torch.randn(_TABLE_ROWS, head_dim, device=device).to(dtype)  # (num_positions, head_dim)
    sin = torch.randn(_TABLE_ROWS, head_dim, device=device).to(dtype)
    num_blocks = -(-rows // _BLOCK_SIZE)
    k_cache = new_kv_cache(num_blocks, _BLOCK_SIZE, num_kv_heads, head_dim, dtype, device)
    v_cache = new_kv_cache(num_blocks, _BLOCK_SIZE, num_kv_heads, head_dim, dtype, device)
    slots = torch.arange(rows, device=device)  # (rows,)
    positions = slots % _TABLE_ROWS

    def run(m: int, config: GemmConfig) -> Any:
        args = (heads, cos, sin, k_cache, v_cache, slots[:m], positions[:m])
        return gemm_qkv_norm_rope_write(x[:m], w, bias, *args, config, gpu)

    def unfused(m: int) -> Any:
        qkv = F.linear(x[:m], w, bias)
        return kernels.qkv_norm_rope_write(qkv, heads, cos, sin, k_cache, v_cache, slots[:m], positions[:m])

    return run, unfused


def _silu_mul(shape: GemmShape, rows: int, kernels: KernelSet) -> Prepared:
    from batchrun.kernels.triton_fused_gemm import gemm_silu_mul

    x, w, gpu = _activations(rows, shape.k, kernels), _weight(shape.n, shape.k, kernels), kernels.target.gpu
    return (
        lambda m, config: gemm_silu_mul(x[:m], w, config, gpu),
        lambda m: kernels.act_mul(F.linear(x[:m], w), "silu"),
    )


def _logits(shape: GemmShape, rows: int, kernels: KernelSet) -> Prepared:
    from batchrun.kernels.triton_fused_gemm import gemm_logits

    x, w, gpu = _activations(rows, shape.k, kernels), _weight(shape.n, shape.k, kernels), kernels.target.gpu
    return lambda m, config: gemm_logits(x[:m], w, config, gpu), lambda m: F.linear(x[:m], w).float()


def _w8a16(shape: GemmShape, rows: int, kernels: KernelSet) -> Prepared:
    from batchrun.kernels.quant.triton_gemm import w8a16_matmul

    device, gpu = kernels.target.device, kernels.target.gpu
    x = _activations(rows, shape.k, kernels)
    q = torch.randint(-127, 128, (shape.n, shape.k), dtype=torch.int8, device=device)  # (N, K)
    scales = torch.rand(shape.n, shape.k // shape.group_size, device=device) * 1e-3 + 1e-4  # (N, num_groups)
    return lambda m, config: w8a16_matmul(x[:m], q, scales, None, config, gpu), None


def _w4a16(shape: GemmShape, rows: int, kernels: KernelSet) -> Prepared:
    from batchrun.kernels.quant.triton_gemm import w4a16_matmul

    device, gpu = kernels.target.device, kernels.target.gpu
    x = _activations(rows, shape.k, kernels)
    q = torch.randint(0, 256, (shape.n, shape.k // 2), dtype=torch.uint8, device=device)  # (N, K // 2)
    groups = shape.k // shape.group_size
    scales = (torch.rand(shape.n, groups, device=device) * 1e-3 + 1e-4).half()  # (N, num_groups)
    mins = (torch.rand(shape.n, groups, device=device) * -1e-2).half()
    return lambda m, config: w4a16_matmul(x[:m], q, scales, mins, None, config, gpu), None
