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
- Tiles: `default_config` is the table per (M bucket, N, K) on the GPU at hand; on a real GPU the
  first call of a (bucket, N, K) times a few tile shapes around it and keeps the fastest for the
  process (`select_config`). The split count is the table's, never timed, so a run's numbers do not
  depend on which tile won.

int4 tiles are split by parity: a packed byte holds k = 2j (low nibble) and 2j + 1 (high), so the
even and odd columns of x meet the two nibble planes in two dots, with no interleaving in registers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from batchrun.kernels.backend import gpu_target

log = logging.getLogger(__name__)


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
# tile configurations


@dataclass(frozen=True)
class GemmConfig:
    """One launch's tiling: a (block_m, block_n) output tile per program, K in block_k steps, K cut
    into split_k ranges (one program each), and the compiler's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


M_BUCKETS = (16, 32, 64, 128, 256)  # token counts are rounded up to these; more than 256 counts as 256
MAX_SPLIT_K = 8
# Output tiles up to which split-K may run (so the workspace stays small): the few-row buckets.
SPLIT_K_MAX_BUCKET = 64


def m_bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def _group_constexpr(group_size: int, k: int) -> int:
    """GROUP for a weight with `group_size` (k: per channel, 0)."""
    if group_size == k:
        return 0
    return group_size if group_size >= 16 and group_size & (group_size - 1) == 0 else -1


def default_config(m: int, n: int, k: int, group: int, num_sms: Optional[int]) -> GemmConfig:
    """The table: tiles per M bucket; at up to SPLIT_K_MAX_BUCKET rows K is split until the programs
    cover 90% of the GPU's `num_sms` (None: no split), at most MAX_SPLIT_K ways, each split at least two K
    steps. `group`: the kernels' GROUP (a power-of-two group needs block_k a multiple of it or a
    divisor)."""
    bucket = m_bucket(m)
    block_m = min(bucket, 64)
    block_n = 64 if bucket <= 64 else 128
    block_k = 128 if bucket <= 64 else 64
    block_k = max(32, min(block_k, triton.next_power_of_2(k)))
    split = 1
    if num_sms and bucket <= SPLIT_K_MAX_BUCKET:
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        steps = triton.cdiv(k, block_k)
        # until the programs fill 90% of the SMs (one wave; a second, mostly idle one costs more)
        while tiles * split * 10 < num_sms * 9 and split * 2 <= MAX_SPLIT_K and steps // (split * 2) >= 2:
            split *= 2
    num_warps = 4 if bucket <= 64 else 8
    return GemmConfig(block_m, block_n, block_k, split, num_warps, 3 if bucket <= 64 else 4)


def candidates(base: GemmConfig) -> list[GemmConfig]:
    """Tile shapes timed around the table's choice; all keep its split count (module docstring)."""
    out = [base]
    for bn, bk, warps, stages in ((32, 128, 4, 4), (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 5)):
        c = replace(base, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        if c not in out:
            out.append(c)
    return out


def fastest(configs: list[GemmConfig], time_ms: Callable[[GemmConfig], float]) -> GemmConfig:
    """The config with the smallest time_ms; one that fails to run (too much shared memory) is left
    out; the first when all fail."""
    best, best_ms = configs[0], float("inf")
    for c in configs:
        try:
            ms = time_ms(c)
        except Exception as exc:  # noqa: BLE001 - an unfit tile is just not a candidate
            log.debug("GEMM config %s failed: %r", c, exc)
            continue
        if ms < best_ms:
            best, best_ms = c, ms
    return best


# Tuned configs for the process: (kernel, device, M bucket, N, K, group, dtype) -> config.
_TUNED: dict[tuple, GemmConfig] = {}
TUNE_ON_GPU = True  # time the candidates at a (bucket, N, K)'s first call on a real GPU


def select_config(
    kernel: str, x: torch.Tensor, n: int, k: int, group: int, run: Callable[[GemmConfig], None]
) -> GemmConfig:
    """The config for this call: the table's (interpreter, simulated GPU, during a CUDA graph
    capture), or on a real GPU the fastest of `candidates` timed at the first call (`run` launches
    one), kept for the process."""
    m = x.shape[0]
    target = gpu_target(x.device)
    base = default_config(m, n, k, group, target.num_sms if target is not None else None)
    if not (x.is_cuda and TUNE_ON_GPU):
        return base
    key = (kernel, x.device.index, m_bucket(m), n, k, group, x.dtype)
    hit = _TUNED.get(key)
    if hit is not None:
        return hit
    if torch.cuda.is_current_stream_capturing():  # nothing can be timed inside a capture
        return base
    import triton.testing

    best = fastest(candidates(base), lambda c: float(triton.testing.do_bench(lambda: run(c), warmup=5, rep=20)))
    _TUNED[key] = best
    return best


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
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequant(qweight int8 (N, K), scales (N, num_groups)).T, in x's dtype.
    `config`: a fixed tiling (tests, the benchmark); else `select_config`'s."""
    m, k = x.shape
    n = qweight.shape[0]
    num_groups = scales.shape[1]
    scales = scales.float().contiguous()
    group = _group_constexpr(k // num_groups, k)
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

    run(config or select_config("w8a16", x, n, k, group, run))
    return y


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequant(qweight uint8 (N, K // 2), scales, mins (N, num_groups)).T."""
    m, k = x.shape
    n = qweight.shape[0]
    num_groups = scales.shape[1]
    group_size = k // num_groups
    assert k % 2 == 0 and group_size % 2 == 0
    group = _group_constexpr(group_size, k)
    if group == 0:  # one group over all of K: the general group path (the min term is per group)
        group = group_size if group_size & (group_size - 1) == 0 else -1
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

    run(config or select_config("w4a16", x, n, k, group, run))
    return y
