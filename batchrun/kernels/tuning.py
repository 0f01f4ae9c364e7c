"""What start-up tuning decided, as one frozen value the kernel set reads (`Tuning`), and how it is
made: timed on a real GPU (here) or a bf16 CPU (kernels/cpu_tuning.py), from the static tables
everywhere else.

On a GPU two kinds of choice, each per shape a run can reach (the engine lists them from the model at
start-up, before the KV cache is sized: engine/startup.py, model/gemm_shapes.py):

- fused or not (`FusedChoice`): a bf16/fp16 model's qkv, gate/up and LM-head projections can run
  as one Triton GEMM with the next kernel in its epilogue (kernels/fused_projections.py), which
  replaces a cuBLAS GEMM; per (kind, row bucket, N, K, dtype) the faster of the two is kept.
- the tile of a Triton GEMM (`TileChoice`): per (kernel, M bucket, N, K, group, dtype) the fastest
  of a few tile shapes around the table's (kernels/gemm_tiles.py: candidates), all with the
  table's split count, so a run's sums never depend on which tile won.

On a bf16 CPU with the native kernels a third kind of choice is made: native kernel or torch's
(oneDNN) per linear kind and row count, and for decode and prefill attention (`LinearChoice`,
`AttentionChoice`; timed by kernels/cpu_tuning.py, decided by kernels/cpu_choices.py).

In Triton's interpreter and for a simulated GPU nothing is timed: the choices are the tables'
(fused wherever the fused kernel serves, the table's tiles, the native CPU kernels wherever they
serve) and `source` says "table"; so does every target with engine.tune_kernels=false. A shape the
tuning never saw gets the same: nothing is timed after start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from batchrun.kernels.cpu_choices import AttentionChoice, LinearChoice
from batchrun.kernels.gemm_tiles import GemmConfig, candidates, default_config, fastest, m_bucket, row_bucket
from batchrun.kernels.target import DeviceTarget, GpuTarget

log = logging.getLogger(__name__)

FUSED_KINDS = ("qkv", "silu_mul", "logits")  # fused_projections' kinds: qkv + rope + KV write, gate/up + silu, logits
TILE_KERNELS = ("w8a16", "w4a16", "qkv_rope", "silu_mul", "logits")  # the Triton GEMMs that take a tile


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FusedChoice:
    """Whether the fused GEMM serves one (kind, row bucket, weight shape, dtype), and the times it was
    chosen by (None: the table's preference)."""

    kind: str  # FUSED_KINDS
    rows: int  # row bucket (gemm_tiles.row_bucket)
    n: int  # the projection's output features
    k: int  # its input features
    dtype: str  # the activations' dtype, e.g. "bfloat16"
    fused: bool
    fused_ms: Optional[float] = None
    unfused_ms: Optional[float] = None


@dataclass(frozen=True)
class TileChoice:
    """The tiling of one Triton GEMM at one (M bucket, N, K, group, dtype), and its time (None: the
    table's, untimed)."""

    kernel: str  # TILE_KERNELS
    rows: int  # M bucket (gemm_tiles.m_bucket)
    n: int
    k: int
    group: int  # the kernel's GROUP (gemm_tiles.group_constexpr; 0 for the fused GEMMs)
    dtype: str
    config: GemmConfig
    ms: Optional[float] = None


@dataclass(frozen=True)
class Tuning:
    """Start-up's choices; a lookup of a shape it holds no choice for gets the table's."""

    source: str = "table"  # "table" (nothing timed) or "measured" (timed on this GPU or CPU at start-up)
    fused: tuple[FusedChoice, ...] = ()
    tiles: tuple[TileChoice, ...] = ()
    # the CPU's: per bf16 linear kind and weight shape, and for attention (none: native wherever it serves)
    cpu_linears: tuple[LinearChoice, ...] = ()
    cpu_attention: Optional[AttentionChoice] = None
    seconds: Optional[float] = None  # how long the CPU measurement took
    _fused_by_key: dict[tuple, bool] = field(init=False, repr=False, compare=False)
    _tiles_by_key: dict[tuple, GemmConfig] = field(init=False, repr=False, compare=False)
    _linears_by_key: dict[tuple, LinearChoice] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fused = {(c.kind, c.rows, c.n, c.k, c.dtype): c.fused for c in self.fused}
        tiles = {(c.kernel, c.rows, c.n, c.k, c.group, c.dtype): c.config for c in self.tiles}
        object.__setattr__(self, "_fused_by_key", fused)
        object.__setattr__(self, "_tiles_by_key", tiles)
        object.__setattr__(self, "_linears_by_key", {(c.kind, c.n, c.k): c for c in self.cpu_linears})

    def cpu_linear(self, kind: str, n: int, k: int) -> Optional[LinearChoice]:
        """The measured choice for a bf16 CPU linear of `kind` over an (n, k) weight; None: the
        static one (the native kernel wherever it serves)."""
        return self._linears_by_key.get((kind, n, k))

    def is_fused(self, kind: str, m: int, n: int, k: int, dtype: torch.dtype) -> bool:
        """Whether a call of `kind` at m rows over an (n, k) weight takes the fused GEMM (the table's
        preference: yes, where it serves)."""
        return self._fused_by_key.get((kind, row_bucket(m), n, k, dtype_name(dtype)), True)

    def tile(
        self, kernel: str, m: int, n: int, k: int, group: int, dtype: torch.dtype, gpu: Optional[GpuTarget]
    ) -> GemmConfig:
        """The tiling of a launch at m rows: the tuned tile of its bucket, or the table's; the split
        count always the table's for m (past 256 rows: none)."""
        base = default_config(m, n, k, group, gpu.num_sms if gpu is not None else None)
        tuned = self._tiles_by_key.get((kernel, m_bucket(m), n, k, group, dtype_name(dtype)))
        if tuned is None:
            return base
        return tuned if tuned.split_k == base.split_k else replace(tuned, split_k=base.split_k)

    def describe(self) -> dict[str, Any]:
        """The JSON form EngineSettings.kernels records."""

        def ms(v: Optional[float]) -> Optional[float]:
            return None if v is None else round(v, 4)

        cpu: dict[str, Any] = {}
        if self.cpu_linears or self.cpu_attention is not None:
            cpu = {
                "cpu_seconds": None if self.seconds is None else round(self.seconds, 3),
                "cpu_linears": [c.describe() for c in self.cpu_linears],
                "cpu_attention": None if self.cpu_attention is None else self.cpu_attention.describe(),
            }
        return {
            "source": self.source,
            "fused": [
                {
                    "kind": c.kind,
                    "rows": c.rows,
                    "weight": [c.n, c.k],
                    "dtype": c.dtype,
                    "fused": c.fused,
                    "fused_ms": ms(c.fused_ms),
                    "unfused_ms": ms(c.unfused_ms),
                }
                for c in self.fused
            ],
            "tiles": [
                {
                    "kernel": c.kernel,
                    "rows": c.rows,
                    "weight": [c.n, c.k],
                    "group": c.group,
                    "dtype": c.dtype,
                    "tile": c.config.describe(),
                    "ms": ms(c.ms),
                }
                for c in self.tiles
            ],
            **cpu,
        }


@dataclass(frozen=True)
class GemmShape:
    """One GEMM a model's step runs through a Triton kernel that start-up may tune (listed by
    model/gemm_shapes.py): a fused projection, or a quantized linear's dequantize-GEMM."""

    kernel: str  # FUSED_KINDS (a fused projection) or "w8a16" / "w4a16"
    n: int  # output features
    k: int  # input features
    group: int = 0  # w8a16/w4a16: the kernel's GROUP (gemm_tiles.group_constexpr / w4a16_group)
    group_size: int = 0  # w8a16/w4a16: the weight's group size along K
    # qkv: (num_heads, num_kv_heads, head_dim, has_bias, has_norm, is_gemma)
    heads: Optional[tuple[int, int, int, bool, bool, bool]] = None


# The tile kernel a fused projection launches (gemm_tiles' table and the tiles tuning keeps).
FUSED_TILE_KERNEL = {"qkv": "qkv_rope", "silu_mul": "silu_mul", "logits": "logits"}

Runner = Callable[[int, GemmConfig], Any]  # (rows, tiling) -> one launch on inputs built beforehand


@dataclass(frozen=True)
class TuningCase:
    """One shape at one row bucket: `prepare` builds model-shaped inputs on the device (only where
    something is timed) and returns the launchers: the kernel at a tiling, and for a fused
    projection the unfused pair it replaces."""

    shape: GemmShape
    rows: int  # the bucket, timed at that many rows
    dtype: torch.dtype
    prepare: Callable[[], tuple[Runner, Optional[Callable[[int], Any]]]]

    @property
    def tile_kernel(self) -> str:
        return FUSED_TILE_KERNEL.get(self.shape.kernel, self.shape.kernel)

    @property
    def is_fused_projection(self) -> bool:
        return self.shape.kernel in FUSED_KINDS


def row_buckets(max_rows: int) -> list[int]:
    """Every row bucket a step of 1 to max_rows rows falls in (gemm_tiles.row_bucket)."""
    return sorted({row_bucket(m) for m in range(1, max_rows + 1)})


def table_tuning(gpu: Optional[GpuTarget], cases: Iterable[TuningCase]) -> Tuning:
    """The static tables' choices for every case: fused where it serves, the table's tiles."""
    num_sms = gpu.num_sms if gpu is not None else None
    fused: dict[tuple, FusedChoice] = {}
    tiles: dict[tuple, TileChoice] = {}
    for c in cases:
        s, dtype = c.shape, dtype_name(c.dtype)
        if c.is_fused_projection:
            fused_key = (s.kernel, row_bucket(c.rows), s.n, s.k, dtype)
            fused.setdefault(fused_key, FusedChoice(*fused_key, fused=True))
        bucket = m_bucket(c.rows)
        tile_key = (c.tile_kernel, bucket, s.n, s.k, s.group, dtype)
        tiles.setdefault(tile_key, TileChoice(*tile_key, config=default_config(bucket, s.n, s.k, s.group, num_sms)))
    return Tuning("table", tuple(fused.values()), tuple(tiles.values()))


def measured_tuning(target: DeviceTarget, cases: Iterable[TuningCase]) -> Tuning:
    """Every case timed on this GPU (Triton's do_bench): the fastest tile per M bucket, then at
    that tile the faster of fused and unfused per row bucket. A fused kernel that fails to run is
    not chosen; a tile that fails to run is not a candidate. Start-up runs this before the KV
    cache takes its share of memory."""
    gpu = target.gpu
    assert target.is_gpu and gpu is not None, "timing needs a real GPU"
    fused: dict[tuple, FusedChoice] = {}
    tiles: dict[tuple, TileChoice] = {}
    for c in cases:
        _measure(c, gpu, fused, tiles)  # the case's inputs go when it returns, before the next's are made
    torch.cuda.synchronize(target.device)
    # The cases' inputs and outputs (a long prefill's logits: gigabytes) stay reserved by torch's
    # caching allocator, which the free memory the KV cache is sized from next does not count
    torch.cuda.empty_cache()
    return Tuning("measured", tuple(fused.values()), tuple(tiles.values()))


def _bench(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=20))


def _measure(c: TuningCase, gpu: GpuTarget, fused: dict[tuple, FusedChoice], tiles: dict[tuple, TileChoice]) -> None:
    """Time one case into `fused` and `tiles` (keyed as Tuning keys them), unless both are known."""
    s, dtype = c.shape, dtype_name(c.dtype)
    bucket = m_bucket(c.rows)
    tile_key = (c.tile_kernel, bucket, s.n, s.k, s.group, dtype)
    fused_key = (s.kernel, row_bucket(c.rows), s.n, s.k, dtype)
    if tile_key in tiles and (not c.is_fused_projection or fused_key in fused):
        return
    run, unfused = c.prepare()
    if tile_key not in tiles:
        base = default_config(bucket, s.n, s.k, s.group, gpu.num_sms)
        best, best_ms = fastest(candidates(base), lambda cfg: _bench(lambda: run(bucket, cfg)))
        tiles[tile_key] = TileChoice(*tile_key, config=best, ms=best_ms)
    if not c.is_fused_projection or fused_key in fused:
        return
    assert unfused is not None
    config = Tuning(tiles=tuple(tiles.values())).tile(c.tile_kernel, c.rows, s.n, s.k, s.group, c.dtype, gpu)
    try:
        fused_ms = _bench(lambda: run(c.rows, config))
        unfused_ms = _bench(lambda: unfused(c.rows))
    except Exception as exc:  # noqa: BLE001 - a fused kernel that cannot run here is just not chosen
        log.warning("timing the fused %s GEMM failed at %s (%r); the unfused pair there", s.kernel, fused_key[1:], exc)
        fused[fused_key] = FusedChoice(*fused_key, fused=False)
        return
    fused[fused_key] = FusedChoice(*fused_key, fused_ms <= unfused_ms, fused_ms, unfused_ms)
    log.debug("%s %s: fused %.4f ms, unfused %.4f ms", s.kernel, fused_key[1:], fused_ms, unfused_ms)
