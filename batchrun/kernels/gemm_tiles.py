"""The tile table of the Triton GEMMs (the W8A16/W4A16 dequantize-GEMMs and the fused projections):
one tiling per (M bucket, N, K, group) and GPU, and the candidates the start-up tuning times around it
(kernels/tuning.py). Plain Python, so the table and a tuning result can be read where Triton is not
installed (a CPU engine's settings, tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

log = logging.getLogger(__name__)


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

    def describe(self) -> str:
        """e.g. "16x64x128 split 4, 4 warps, 3 stages"."""
        split = f" split {self.split_k}" if self.split_k > 1 else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k}{split}, {self.num_warps} warps, {self.num_stages} stages"


M_BUCKETS = (16, 32, 64, 128, 256)  # token counts are rounded up to these; more than 256 counts as 256
MAX_SPLIT_K = 8


def m_bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def row_bucket(m: int) -> int:
    """The bucket a fused-vs-unfused choice is made per: the tile table's buckets up to 256 rows,
    powers of two above (prefill sizes, where cuBLAS may win instead)."""
    return m_bucket(m) if m <= M_BUCKETS[-1] else 1 << (m - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def group_constexpr(group_size: int, k: int) -> int:
    """The dequantize-GEMMs' GROUP for a weight with `group_size` along K: 0 per output channel
    (group_size == k), the size itself for a power of two from 16, -1 for any other size."""
    if group_size == k:
        return 0
    return group_size if group_size >= 16 and group_size & (group_size - 1) == 0 else -1


def w4a16_group(group_size: int, k: int) -> int:
    """GROUP of the W4A16 kernel: as `group_constexpr`, but one group over all of K takes the
    general group path (its min term is per group)."""
    group = group_constexpr(group_size, k)
    if group == 0:
        return group_size if group_size & (group_size - 1) == 0 else -1
    return group


def default_config(m: int, n: int, k: int, group: int, num_sms: Optional[int]) -> GemmConfig:
    """The table: tiles per M bucket. Up to 256 rows (every bucket) K is split until the programs of
    the bucket's tiles cover 90% of the GPU's `num_sms` (None: no split), at most MAX_SPLIT_K ways,
    each split at least two K steps: a narrow projection (few column tiles) leaves most SMs idle
    at a prefill chunk's rows too. Past 256 rows (long prefill chunks) there are tiles enough and K
    is never split. The split depends on the bucket, not on m, so each bucket compiles one variant
    (engine/warmup.py runs one step per bucket). `group`: the kernels' GROUP (a power-of-two group
    needs block_k a multiple of it or a divisor)."""
    bucket = m_bucket(m)
    block_m = min(bucket, 64)
    block_n = 64 if bucket <= 64 else 128
    block_k = 128 if bucket <= 64 else 64
    block_k = max(32, min(block_k, _next_power_of_2(k)))
    split = 1
    if num_sms and m <= M_BUCKETS[-1]:
        tiles = _cdiv(bucket, block_m) * _cdiv(n, block_n)
        steps = _cdiv(k, block_k)
        # until the programs fill 90% of the SMs (one wave; a second, mostly idle one costs more)
        while tiles * split * 10 < num_sms * 9 and split * 2 <= MAX_SPLIT_K and steps // (split * 2) >= 2:
            split *= 2
    num_warps = 4 if bucket <= 64 else 8
    return GemmConfig(block_m, block_n, block_k, split, num_warps, 3 if bucket <= 64 else 4)


def candidates(base: GemmConfig) -> list[GemmConfig]:
    """Tile shapes timed around the table's choice; all keep its split count, so a run's sums do not
    depend on which tile won the timing."""
    out = [base]
    for bn, bk, warps, stages in ((32, 128, 4, 4), (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 5)):
        c = replace(base, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        if c not in out:
            out.append(c)
    return out


def fastest(configs: list[GemmConfig], time_ms: Callable[[GemmConfig], float]) -> tuple[GemmConfig, Optional[float]]:
    """(the config with the smallest time_ms, its time); one that fails to run (too much shared
    memory) is left out; the first, untimed, when all fail."""
    best, best_ms = configs[0], None
    for c in configs:
        try:
            ms = time_ms(c)
        except Exception as exc:  # noqa: BLE001 - an unfit tile is just not a candidate
            log.debug("GEMM config %s failed: %r", c, exc)
            continue
        if best_ms is None or ms < best_ms:
            best, best_ms = c, ms
    return best, best_ms
