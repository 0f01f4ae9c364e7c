"""Triton dequantize-GEMMs for the GPU: W8A16 (int8 weights) and W4A16 (packed int4 in groups), one
launch per linear.

Same signatures and formats as the torch references in `batchrun.kernels.quant.weight_only`
(`int8_weight_matmul`, `int4_weight_matmul`), which the tests compare them with, on CPU tensors in
Triton's interpreter (TRITON_INTERPRET=1) and on a GPU when there is one. Each program computes a
(BLOCK_M, BLOCK_N) tile of y = x @ W.T over its share of K: it loads the quantized weight tile,
dequantizes it in registers and feeds tl.dot, so the weight crosses memory at 1 or 0.5 bytes per
element.

- Group size is a constexpr (`GROUP`): a K step loads one scale (and min) per group and column,
  BLOCK_K // GROUP of them, and broadcasts them over the group's rows in registers. GROUP 0 is per
  output channel (applied once, after the sum); -1 is a group size that is not a power of two,
  gathered per element as a fallback.
- Split-K (`GemmConfig.split_k`) for few rows: at decode sizes a projection has too few output
  tiles to fill the GPU, so K is cut into split_k ranges, each a program of its own. Each writes its
  float32 partial tile to a workspace and takes a ticket from a per-tile counter; the program that
  draws the last ticket sums the partials in split order (0, 1, ...), whichever finished last, so
  the result is deterministic, applies the epilogue, stores, and resets the counter for the next
  launch (a CUDA graph replays it as is). Still one launch.
- Tiles: kernels/gemm_tiles.py's `default_config` is the table per (M bucket, N, K) for the GPU a
  launch is sized for (`gpu`); on a real GPU start-up tuning times a few tile shapes around it per
  (bucket, N, K) and the kernel set's `*_linear` functions launch with its choice
  (kernels/tuning.py). The split count is the table's, never timed, so a run's numbers do not
  depend on which tile won.

int4 tiles are split by parity: a packed byte holds k = 2j (low nibble) and 2j + 1 (high), so the
even and odd columns of x meet the two nibble planes in two dots, with no interleaving in registers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import triton
import triton.language as tl

from batchrun.kernels.gemm_tiles import (  # noqa: F401 - the table, reached from here by the benchmarks and tests
    M_BUCKETS,
    GemmConfig,
    candidates,
    default_config,
    group_constexpr,
    m_bucket,
    w4a16_group,
)
from batchrun.kernels.target import GpuTarget
from batchrun.kernels.tuning import Tuning


@triton.jit
def _epilogue_store(
    acc,
    y_ptr,
    s_ptr,
    b_ptr,
    offs_m,
    offs_n,
    m_ok,
    n_ok,
    stride_sn,
    stride_ym,
    stride_yn,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """acc (BLOCK_M, BLOCK_N) float32 -> y: the per-channel scale, the bias, one rounding."""
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _finish(
    acc,
    ws_ptr,
    lock_ptr,
    y_ptr,
    s_ptr,
    b_ptr,
    offs_m,
    offs_n,
    m_ok,
    n_ok,
    M,
    N,
    stride_sn,
    stride_ym,
    stride_yn,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Store the tile; with split-K, through the workspace (SPLIT_K, M, N) float32 and the tile's
    counter in lock_ptr (module docstring)."""
    if SPLIT_K == 1:
        _epilogue_store(
            acc, y_ptr, s_ptr, b_ptr, offs_m, offs_n, m_ok, n_ok, stride_sn, stride_ym, stride_yn, PER_CHANNEL, HAS_BIAS
        )
    else:
        mask = m_ok[:, None] & n_ok[None, :]
        tile = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        split_stride = M.to(tl.int64) * N
        tl.store(tile + tl.program_id(2) * split_stride, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        lock = lock_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        ticket = tl.atomic_add(lock, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:  # the last split of this tile: sum all in split order
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(tile + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue_store(
                total,
                y_ptr,
                s_ptr,
                b_ptr,
                offs_m,
                offs_n,
                m_ok,
                n_ok,
                stride_sn,
                stride_ym,
                stride_yn,
                PER_CHANNEL,
                HAS_BIAS,
            )
            tl.atomic_xchg(lock, 0)  # ready for the next launch


@triton.jit(do_not_specialize=["M"])  # the step's token count: one compiled variant for all
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    K_SPLIT,
    num_groups,
    group_size,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_ym,
    stride_yn,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 rows and columns: offs_m * stride_xm and offs_n * stride_wn pass 2**31 on a long batch
    # or a wide vocabulary, where an int32 product wraps.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = tl.program_id(2) * K_SPLIT  # this split's K range: a multiple of BLOCK_K (and of GROUP)
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < k_hi
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )  # (BLOCK_M, BLOCK_K)
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + k[:, None] * stride_wk, mask=n_ok[None, :] & k_ok[:, None], other=0
        )  # (BLOCK_K, BLOCK_N) int8
        wf = w.to(tl.float32)
        if GROUP >= BLOCK_K:  # one group spans the step: one scale per column
            s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP, mask=n_ok, other=0.0)
            wf = wf * s[None, :]
        elif GROUP > 0:  # BLOCK_K // GROUP groups in the step: a scale per group and column
            g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            s = tl.load(
                s_ptr + offs_n[None, :] * stride_sn + g[:, None],
                mask=n_ok[None, :] & (g < num_groups)[:, None],
                other=0.0,
            )  # (BLOCK_K // GROUP, BLOCK_N)
            wf = tl.reshape(tl.reshape(wf, (BLOCK_K // GROUP, GROUP, BLOCK_N)) * s[:, None, :], (BLOCK_K, BLOCK_N))
        elif GROUP == -1:  # a group size that is no power of two: each row's scale gathered
            s = tl.load(
                s_ptr + offs_n[None, :] * stride_sn + (k // group_size)[:, None],
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            wf = wf * s
        acc += tl.dot(x, wf.to(x.dtype))
    _finish(
        acc,
        ws_ptr,
        lock_ptr,
        y_ptr,
        s_ptr,
        b_ptr,
        offs_m,
        offs_n,
        m_ok,
        n_ok,
        M,
        N,
        stride_sn,
        stride_ym,
        stride_yn,
        GROUP == 0,
        HAS_BIAS,
        SPLIT_K,
    )


@triton.jit(do_not_specialize=["M"])  # the step's token count: one compiled variant for all
def _w4a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    K_SPLIT,
    num_groups,
    group_size,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_ym,
    stride_yn,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 rows and columns: offs_m * stride_xm and offs_n * stride_wn pass 2**31 on a long batch
    # or a wide vocabulary, where an int32 product wraps.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_K // 2)  # packed byte (k pair) within the tile
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = tl.program_id(2) * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_even = k0 + 2 * offs_j
        k_ok = k_even < k_hi  # K is even, so k_even + 1 is in range with it
        x_lo = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k_even[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K // 2)
        x_hi = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (k_even + 1)[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        packed = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + (k_even // 2)[:, None] * stride_wk,
            mask=n_ok[None, :] & k_ok[:, None],
            other=0,
        )  # (BLOCK_K // 2, BLOCK_N) uint8
        q_lo = (packed & 0xF).to(tl.float32)
        q_hi = (packed >> 4).to(tl.float32)
        if GROUP >= BLOCK_K:  # one group spans the step
            s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + offs_n * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            w_lo = q_lo * s + z
            w_hi = q_hi * s + z
        elif GROUP > 0:  # BLOCK_K // GROUP groups, GROUP // 2 packed rows each
            G: tl.constexpr = BLOCK_K // GROUP
            g = k0 // GROUP + tl.arange(0, G)
            g_mask = n_ok[None, :] & (g < num_groups)[:, None]
            s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g[:, None], mask=g_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + offs_n[None, :] * stride_sn + g[:, None], mask=g_mask, other=0.0).to(tl.float32)
            s3 = s[:, None, :]
            z3 = z[:, None, :]
            w_lo = tl.reshape(tl.reshape(q_lo, (G, GROUP // 2, BLOCK_N)) * s3 + z3, (BLOCK_K // 2, BLOCK_N))
            w_hi = tl.reshape(tl.reshape(q_hi, (G, GROUP // 2, BLOCK_N)) * s3 + z3, (BLOCK_K // 2, BLOCK_N))
        else:  # a group size that is no power of two: each row's scale gathered
            gk = (k_even // group_size)[:, None]
            s = tl.load(s_ptr + offs_n[None, :] * stride_sn + gk, mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(
                tl.float32
            )
            z = tl.load(z_ptr + offs_n[None, :] * stride_sn + gk, mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(
                tl.float32
            )
            w_lo = q_lo * s + z
            w_hi = q_hi * s + z
        acc += tl.dot(x_lo, w_lo.to(x_lo.dtype))
        acc += tl.dot(x_hi, w_hi.to(x_hi.dtype))
    _finish(
        acc,
        ws_ptr,
        lock_ptr,
        y_ptr,
        s_ptr,
        b_ptr,
        offs_m,
        offs_n,
        m_ok,
        n_ok,
        M,
        N,
        stride_sn,
        stride_ym,
        stride_yn,
        False,
        HAS_BIAS,
        SPLIT_K,
    )


# ---------------------------------------------------------------------------------------------
# launchers

_LOCKS: dict[torch.device, torch.Tensor] = {}
_LOCK_SLOTS = 1 << 16  # output tiles a split launch may have (counters, int32, all zero between launches)


def _split_buffers(
    m: int, n: int, config: GemmConfig, device: torch.device, unused: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace (split_k, M, N) float32, the device's tile counters); without split-K `unused`
    stands in for both (never read)."""
    if config.split_k == 1:
        return unused, unused
    lock = _LOCKS.get(device)
    if lock is None:  # zeroed once; every split launch leaves its counters at zero again
        lock = _LOCKS[device] = torch.zeros(_LOCK_SLOTS, dtype=torch.int32, device=device)
    return torch.empty((config.split_k, m, n), dtype=torch.float32, device=device), lock


def _fit(config: GemmConfig, m: int, n: int, k: int, group: int) -> GemmConfig:
    """A config the kernels take for this shape: block_k and group nest (a power-of-two group),
    the split a whole number of block_k steps, the tiles within the counters."""
    bk = config.block_k
    if group > 0 and bk > group and bk % group:
        bk = group
    split = config.split_k
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if split > 1 and (tiles > _LOCK_SLOTS or triton.cdiv(k, bk) < split):
        split = 1
    return replace(config, block_k=bk, split_k=split)


def _k_split(k: int, config: GemmConfig) -> int:
    return triton.cdiv(triton.cdiv(k, config.block_k), config.split_k) * config.block_k


def w8a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[GemmConfig] = None,
    gpu: Optional[GpuTarget] = None,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequant(qweight int8 (N, K), scales (N, num_groups)).T, in x's dtype.
    `config`: the tiling (None: the table's for `gpu`, the GPU the launch is sized for; None there:
    Triton's interpreter, no split)."""
    m, k = x.shape
    n = qweight.shape[0]
    num_groups = scales.shape[1]
    scales = scales.float().contiguous()
    group = group_constexpr(k // num_groups, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y

    def run(c: GemmConfig) -> None:
        c = _fit(c, m, n, k, group)
        ws, lock = _split_buffers(m, n, c, x.device, scales)
        grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), c.split_k)
        _w8a16_kernel[grid](
            x,
            qweight,
            scales,
            bias if bias is not None else scales,
            y,
            ws,
            lock,
            m,
            n,
            k,
            _k_split(k, c),
            num_groups,
            k // num_groups,
            x.stride(0),
            x.stride(1),
            qweight.stride(0),
            qweight.stride(1),
            scales.stride(0),
            y.stride(0),
            y.stride(1),
            GROUP=group,
            HAS_BIAS=bias is not None,
            BLOCK_M=c.block_m,
            BLOCK_N=c.block_n,
            BLOCK_K=c.block_k,
            SPLIT_K=c.split_k,
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )

    run(config or default_config(m, n, k, group, gpu.num_sms if gpu is not None else None))
    return y


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[GemmConfig] = None,
    gpu: Optional[GpuTarget] = None,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequant(qweight uint8 (N, K // 2), scales, mins (N, num_groups)).T;
    `config` and `gpu` as w8a16_matmul's."""
    m, k = x.shape
    n = qweight.shape[0]
    num_groups = scales.shape[1]
    group_size = k // num_groups
    assert k % 2 == 0 and group_size % 2 == 0
    group = w4a16_group(group_size, k)
    scales, mins = scales.contiguous(), mins.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y

    def run(c: GemmConfig) -> None:
        c = _fit(c, m, n, k, group)
        ws, lock = _split_buffers(m, n, c, x.device, scales)
        grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), c.split_k)
        _w4a16_kernel[grid](
            x,
            qweight,
            scales,
            mins,
            bias if bias is not None else scales,
            y,
            ws,
            lock,
            m,
            n,
            k,
            _k_split(k, c),
            num_groups,
            group_size,
            x.stride(0),
            x.stride(1),
            qweight.stride(0),
            qweight.stride(1),
            scales.stride(0),
            y.stride(0),
            y.stride(1),
            GROUP=group,
            HAS_BIAS=bias is not None,
            BLOCK_M=c.block_m,
            BLOCK_N=c.block_n,
            BLOCK_K=c.block_k,
            SPLIT_K=c.split_k,
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )

    run(config or default_config(m, n, k, group, gpu.num_sms if gpu is not None else None))
    return y


def w8a16_linear(
    x2: torch.Tensor,  # (M, K)
    qweight: torch.Tensor,  # (N, K) int8
    scales: torch.Tensor,  # (N, num_groups) float32
    bias: Optional[torch.Tensor],
    scales_bf16: Optional[torch.Tensor] = None,  # unused here (the CPU kernel's side copy)
    *,
    tuning: Tuning,
    gpu: Optional[GpuTarget],
) -> torch.Tensor:
    """The int8 linear of a Triton kernel set: w8a16_matmul at the tiling start-up tuning chose."""
    m, k = x2.shape
    n = qweight.shape[0]
    group = group_constexpr(k // scales.shape[1], k)
    return w8a16_matmul(x2, qweight, scales, bias, tuning.tile("w8a16", m, n, k, group, x2.dtype, gpu), gpu)


def w4a16_linear(
    x2: torch.Tensor,  # (M, K)
    qweight: torch.Tensor,  # (N, K // 2) uint8
    scales: torch.Tensor,  # (N, num_groups) float16
    mins: torch.Tensor,  # (N, num_groups) float16
    bias: Optional[torch.Tensor],
    *,
    tuning: Tuning,
    gpu: Optional[GpuTarget],
) -> torch.Tensor:
    """The int4 linear of a Triton kernel set: w4a16_matmul at the tiling start-up tuning chose."""
    m, k = x2.shape
    n = qweight.shape[0]
    group = w4a16_group(k // scales.shape[1], k)
    return w4a16_matmul(x2, qweight, scales, mins, bias, tuning.tile("w4a16", m, n, k, group, x2.dtype, gpu), gpu)
