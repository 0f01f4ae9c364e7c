"""The launches the compile-only check (kernels/triton_aot.py) drives: every Triton kernel through
the launcher a run calls, once per variant a run uses.

Each case calls the real entry point (the kernel set's attention, KV write, fused qkv kernel,
elementwise kernels, dequantize-GEMMs, MoE experts) on small CPU tensors, through a kernel set bound
for the GPU `compile_only(arch)` simulates, so the launchers pick the tile sizes, num_warps,
num_stages and split counts they pick on that GPU, and each compiled variant is one a run there
compiles. Sizes are small where only a launch's shapes matter, and model-shaped where they
pick the variant (head counts, head_dim, hidden sizes, batch compositions that change the split
count).

`launch_cases(full=False)` is the set the test compiles (every kernel; bf16, fp16 and fp32; float,
int8 and fp8 caches; head_dim 64 and 128; GQA; decode with one and several splits, the merge,
prefill, mixed batches; the encoder's varlen attention, bidirectional and causal); `full=True` adds
the rest of the product (more model shapes, head_dim 256, windows and softcaps on every cache, every
elementwise width) for `python -m benchmarks.triton_compile`.

A library module (no `__main__`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from batchrun.kernels.binding import bind_kernels
from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.kv_layout import new_kv_cache
from batchrun.kernels.moe import fused_experts
from batchrun.kernels.qkv_heads import QKVHeads
from batchrun.kernels.quant import quantize_int4, quantize_int8
from batchrun.kernels.quant.act import INT_MM_MIN_ROWS, ActQuant
from batchrun.kernels.quant.kv import QuantizedKVCache
from batchrun.kernels.triton_aot import CompileLog, compile_only
from benchmarks.cases import attention_case

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
INT8, FP8 = torch.int8, torch.float8_e4m3fn


Kernels = Callable[[torch.dtype, Optional[torch.dtype]], KernelSet]  # (dtype, KV cache dtype) -> the bound set


@dataclass(frozen=True)
class LaunchCase:
    name: str  # what it launches, e.g. "attention mixed bf16 16:8 d128 int8"
    run: Callable[[Kernels], None]  # the launches, through the kernel sets given; their outputs are never read
    is_fast: bool  # in the test's set, not only the benchmark's


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention as the kernels see it."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: Optional[int] = None
    softcap: Optional[float] = None

    def label(self) -> str:
        extra = (f" win{self.window}" if self.window else "") + (f" cap{self.softcap:g}" if self.softcap else "")
        return f"{self.num_heads}:{self.num_kv_heads} d{self.head_dim}{extra}"


SMOLLM2 = AttentionShape("SmolLM2-135M", 9, 3, 64)
QWEN3 = AttentionShape("Qwen3-0.6B", 16, 8, 128)
LLAMA3 = AttentionShape("Llama-3-8B", 32, 8, 128)
MISTRAL = AttentionShape("Mistral-7B (window)", 32, 8, 128, window=4096)
GEMMA3 = AttentionShape("Gemma-3-1B local layers", 4, 1, 256, window=512)
GEMMA2 = AttentionShape("Gemma-2-2B", 8, 4, 256, window=4096, softcap=50.0)

# (cached tokens, new tokens) per sequence; one new token makes a decode. On an H200 the decode
# launcher picks one split for the short contexts (the block-table width caps them) and many for
# the long ones; the mixed batch holds decodes, a fresh prompt and a chunked prefill.
BATCHES: dict[str, list[tuple[int, int]]] = {
    "mixed": [(5, 1), (0, 9), (600, 1), (6, 70)],  # 600: long enough to split at 128-token tiles
    "decode 1 split": [(3, 1), (20, 1), (41, 1), (200, 1)],
    "decode splits": [(3000, 1), (700, 1)],
}
BLOCK_SIZE = 16


def _attention(
    shape: AttentionShape, batch: str, dtype: torch.dtype, kv: Optional[torch.dtype]
) -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        s = shape
        c = attention_case(
            BATCHES[batch], s.num_heads, s.num_kv_heads, s.head_dim, BLOCK_SIZE, dtype, kv_cache_dtype=kv
        )
        attend = kernels(dtype, kv).paged_attention
        attend(c.q, c.k_cache, c.v_cache, c.meta, s.head_dim**-0.5, s.window, s.softcap)

    return run


def _cache(shape: AttentionShape, dtype: torch.dtype, kv: Optional[torch.dtype]):
    """A small cache in the engine's layout: (num_blocks, block_size, num_kv_heads, head_dim), or a
    QuantizedKVCache of that shape."""
    size = (8, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    if kv is None:
        return new_kv_cache(*size, dtype, "cpu")
    return QuantizedKVCache.empty(size, kv, dtype, torch.device("cpu"))


def _kv_write(shape: AttentionShape, dtype: torch.dtype, kv: Optional[torch.dtype]) -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        k_cache, v_cache = _cache(shape, dtype, kv), _cache(shape, dtype, kv)
        k = torch.randn(5, shape.num_kv_heads, shape.head_dim).to(dtype)  # (num_tokens, num_kv_heads, head_dim)
        kernels(dtype, kv).write_kv_cache(k_cache, v_cache, k, k.clone(), torch.tensor([0, 1, 17, -1, 40]))

    return run


def _qkv_write(
    shape: AttentionShape, dtype: torch.dtype, kv: Optional[torch.dtype], has_norm: bool, is_gemma: bool = False
) -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        s = shape
        qkv = torch.randn(5, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim).to(dtype)
        cos = torch.randn(64, s.head_dim).to(dtype)  # (num_positions, head_dim): the decoder's tables
        norm = torch.ones(s.head_dim, dtype=dtype) if has_norm else None
        heads = QKVHeads(s.num_heads, s.num_kv_heads, s.head_dim, norm, norm, 1e-6, is_gemma)
        k_cache, v_cache = _cache(shape, dtype, kv), _cache(shape, dtype, kv)
        slots, positions = torch.tensor([0, 1, 17, -1, 40]), torch.tensor([3, 9, 0, 63, 12])
        write = kernels(dtype, kv).qkv_norm_rope_write
        write(qkv, heads, cos, cos.clone(), k_cache, v_cache, slots, positions)

    return run


def _norms(hidden: int, dtype: torch.dtype) -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        ks = kernels(dtype, None)
        x = torch.randn(3, hidden).to(dtype)  # (num_tokens, hidden)
        w = torch.ones(hidden, dtype=dtype)
        ks.rms_norm(x, w, 1e-6)
        ks.rms_norm(x, w, 1e-6, is_gemma=True)
        ks.add_rms_norm(x, x.clone(), w, 1e-6)
        ks.act_mul(torch.randn(3, 2 * hidden).to(dtype), "silu")
        # the norm quantizing for the fp8 / W8A8 linear after it (as RMSNorm.into asks: with and
        # without a residual, W8A8's float channels skipped and its padding rows)
        skip = torch.zeros(hidden, dtype=torch.bool)
        norm_quant = ks.rms_norm_quant
        assert norm_quant is not None
        norm_quant(x, x.clone(), w, 1e-6, ActQuant(INT8, skip, INT_MM_MIN_ROWS))
        norm_quant(x, None, w, 1e-6, ActQuant(INT8, None, INT_MM_MIN_ROWS))
        if dtype != FP32:
            norm_quant(x, x.clone(), w, 1e-6, ActQuant(FP8))
            norm_quant(x, None, w, 1e-6, ActQuant(FP8))

    return run


def _sampling(vocab: int, dtype: torch.dtype, threshold: bool) -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        from batchrun.kernels.sampling import pack_rows

        logits = torch.randn(4, vocab).to(dtype)  # (rows, vocab): the LM head's output
        rows = torch.from_numpy(pack_rows([1, 2, 3, 4], [0, 5, 9, 2], [0.0, 0.6, 1.0, 0.7]))
        kernels(dtype, None).sample(logits, rows, torch.full((4,), -1.0) if threshold else None)

    return run


def _spill(vocab: int) -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        s = torch.randn(4, vocab)  # (truncated rows, vocab): scaled logits
        flags = torch.tensor([True, False, True, False])
        top_p = torch.full((4,), 0.9, dtype=torch.float64)
        kernels(FP32, None).spill(s, torch.full((4,), float("-inf")), top_p, flags, s[:, 0])

    return run


def _gather() -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        # engine.async_scheduling's ids
        kernels(BF16, None).gather_in_place(torch.zeros(300, dtype=torch.int64), torch.arange(512))

    return run


def _fused(
    shape: AttentionShape, m: int, dtype: torch.dtype, bias: bool, hidden: int = 1024
) -> Callable[[Kernels], None]:
    """The fused projections (kernels/fused_projections.py) of a model of `shape` at `m` tokens: the
    qkv GEMM with q/k-norm + rotary + KV write, the gate/up GEMM with silu * up, the embedding with
    the first norm, the LM head with its float32 cast."""

    def run(kernels: Kernels) -> None:
        ks = kernels(dtype, None)
        s = shape
        x = torch.randn(m, hidden).to(dtype)  # (num_tokens, hidden)
        qkv = torch.nn.Linear(hidden, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, bias=bias, dtype=dtype)
        cos = torch.randn(64, s.head_dim).to(dtype)  # (num_positions, head_dim): the decoder's tables
        norm = torch.ones(s.head_dim, dtype=dtype)
        heads = QKVHeads(s.num_heads, s.num_kv_heads, s.head_dim, norm, norm, 1e-6, s is GEMMA3)
        slots = torch.arange(m) % (8 * BLOCK_SIZE)
        positions = torch.arange(m) % 64
        k_cache, v_cache = _cache(shape, dtype, None), _cache(shape, dtype, None)
        ks.qkv_project(x, qkv, heads, cos, cos.clone(), k_cache, v_cache, slots, positions)
        gate_up = torch.nn.Linear(hidden, 2 * 3 * hidden, bias=False, dtype=dtype)
        ks.gate_up_act(x, gate_up, "silu")
        embedding = torch.nn.Embedding(512, hidden, dtype=dtype)
        assert ks.embed_norm is not None
        ks.embed_norm(torch.arange(m) % 512, embedding, torch.ones(hidden, dtype=dtype), 1e-6)
        ks.lm_head_logits(x, torch.nn.Linear(hidden, 1000, bias=False, dtype=dtype))

    return run


def _w8a16(m: int, dtype: torch.dtype, group: Optional[int], has_bias: bool) -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        n, k = 256, 512
        qw, scales = quantize_int8(torch.randn(n, k), group)  # (N, K) int8, (N, num_groups)
        bias = torch.zeros(n, dtype=dtype) if has_bias else None
        kernels(dtype, None).linear_int8.matmul(torch.randn(m, k).to(dtype), qw, scales, bias, None)

    return run


def _w4a16(m: int, dtype: torch.dtype, group: int) -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        n, k = 256, 512
        qw, scales, mins = quantize_int4(torch.randn(n, k), group)  # (N, K // 2) uint8, (N, K // group) fp16
        kernels(dtype, None).linear_int4.matmul(torch.randn(m, k).to(dtype), qw, scales, mins, None)

    return run


def _act_quant(dtype: torch.dtype, k: int, float_channels: int) -> Callable[[Kernels], None]:
    """The fp8 and W8A8 linears' Triton kernels: per-token e4m3 and int8 quantization, W8A8's epilogue."""

    def run(kernels: Kernels) -> None:
        from batchrun.kernels.quant.triton_act import fp8_linear, w8a8_linear

        m, n = 5, 256
        x = torch.randn(m, k).to(dtype)
        qw, scales = quantize_int8(torch.randn(n, k))  # (N, K) int8, (N, 1)
        index = torch.arange(float_channels, dtype=torch.int64) if float_channels else None
        skip = torch.zeros(k, dtype=torch.bool) if float_channels else None
        weight_t = torch.randn(float_channels, n).to(dtype) if float_channels else None
        w8a8_linear(x, qw, scales.reshape(-1), torch.zeros(n, dtype=dtype), index, skip, weight_t)
        if dtype != FP32:
            fp8_linear(x, torch.randn(n, k).to(FP8), torch.ones(1, n))

    return run


def _moe(dtype: torch.dtype, num_experts: int = 8, top_k: int = 2) -> Callable[[Kernels], None]:
    def run(kernels: Kernels) -> None:
        hidden, inter, num_tokens = 256, 512, 7
        x = torch.randn(num_tokens, hidden).to(dtype)
        gate_up = torch.randn(num_experts, 2 * inter, hidden).to(dtype)  # (num_experts, 2 * inter, hidden)
        down = torch.randn(num_experts, hidden, inter).to(dtype)
        ids = torch.randint(0, num_experts, (num_tokens, top_k))  # (num_tokens, top_k)
        gemm = kernels(dtype, None).moe_grouped_gemm
        fused_experts(x, gate_up, down, torch.ones(num_tokens, top_k), ids, torch.nn.functional.silu, grouped_gemm=gemm)

    return run


def _invariant(n: int, k: int, dtype: torch.dtype, has_bias: bool) -> Callable[[Kernels], None]:
    """engine.batch_invariant's dense matmul: one variant per (N, K, dtype) tile config, whatever M."""

    def run(kernels: Kernels) -> None:
        from batchrun.kernels.triton_invariant import invariant_matmul

        w = torch.empty(n, k, dtype=dtype)  # (N, K); compiled, never run: the values do not matter
        bias = torch.zeros(n, dtype=dtype) if has_bias else None
        for m in (1, 16, 37):  # one variant: M is not specialized on
            invariant_matmul(torch.empty(m, k, dtype=dtype), w, bias)

    return run


def _varlen(num_heads: int, head_dim: int, dtype: torch.dtype, causal: bool) -> Callable[[Kernels], None]:
    """The encoder's attention over packed rows: q, k and v as views of one qkv projection (its row
    stride 3 * num_heads * head_dim), rows shorter than a tile, over one and over several."""

    def run(kernels: Kernels) -> None:
        lens = [1, 37, 300, 128]
        qkv = torch.empty(sum(lens), 3 * num_heads * head_dim, dtype=dtype)  # compiled, never run
        q, k, v = (t.view(-1, num_heads, head_dim) for t in qkv.chunk(3, dim=1))
        kernels(dtype, None).varlen_attention(q, k, v, lens, head_dim**-0.5, causal)

    return run


def varlen_attention_cases(full: bool = False) -> list[LaunchCase]:
    """The encoder's attention: MiniLM (12 heads, head_dim 32) and BERT-base/BGE (12 heads, 64) in
    every dtype, bidirectional and causal."""
    fast = {(32, BF16, False), (64, BF16, True), (64, FP16, False), (32, FP32, False), (64, FP32, True)}
    cases = [
        LaunchCase(
            f"varlen attention {_dtype_name(dtype)} 12 heads d{head_dim} {'causal' if causal else 'bidirectional'}",
            _varlen(12, head_dim, dtype, causal),
            (head_dim, dtype, causal) in fast,
        )
        for head_dim in (32, 64)
        for dtype in (BF16, FP16, FP32)
        for causal in (False, True)
    ]
    return cases if full else [c for c in cases if c.is_fast]


def _kv_name(kv: Optional[torch.dtype]) -> str:
    return {None: "float", INT8: "int8", FP8: "fp8"}[kv]


def _dtype_name(dtype: torch.dtype) -> str:
    return {BF16: "bf16", FP16: "fp16", FP32: "fp32"}[dtype]


def _attention_cases() -> Iterator[LaunchCase]:
    fast = {
        # every batch kind on the production shape and dtype
        (QWEN3, "mixed", BF16, None),
        (QWEN3, "decode 1 split", BF16, None),
        (QWEN3, "decode splits", BF16, None),
        # each cache dtype
        (QWEN3, "mixed", BF16, INT8),
        (QWEN3, "mixed", BF16, FP8),
        (QWEN3, "decode splits", BF16, FP8),
        # each float dtype, head_dim 64 with a 3:1 group, windows
        (SMOLLM2, "mixed", FP16, None),
        (QWEN3, "mixed", FP32, None),
        (QWEN3, "mixed", FP32, INT8),
        (MISTRAL, "mixed", BF16, None),
        (GEMMA3, "mixed", BF16, None),  # head_dim 256
    }
    for shape in (SMOLLM2, QWEN3, LLAMA3, MISTRAL, GEMMA3, GEMMA2):
        for batch in BATCHES:
            for dtype in (BF16, FP16, FP32):
                for kv in (None, INT8, FP8):
                    name = f"attention {batch} {_dtype_name(dtype)} {shape.label()} {_kv_name(kv)} cache"
                    yield LaunchCase(name, _attention(shape, batch, dtype, kv), (shape, batch, dtype, kv) in fast)


def _write_cases() -> Iterator[LaunchCase]:
    for shape in (SMOLLM2, QWEN3, GEMMA3):
        for dtype in (BF16, FP16, FP32):
            for kv in (None, INT8, FP8):
                is_fast = shape is QWEN3 and (dtype is BF16 or (dtype is FP32 and kv is FP8))
                yield LaunchCase(
                    f"kv write {_dtype_name(dtype)} {shape.label()} -> {_kv_name(kv)}",
                    _kv_write(shape, dtype, kv),
                    is_fast,
                )
                for has_norm in (False, True):
                    is_fast = shape is QWEN3 and dtype is BF16 and has_norm == (kv is not INT8)
                    norm = "q/k-norm " if has_norm else ""
                    yield LaunchCase(
                        f"qkv {norm}rope write {_dtype_name(dtype)} {shape.label()} -> {_kv_name(kv)}",
                        _qkv_write(shape, dtype, kv, has_norm),
                        is_fast,
                    )
        yield LaunchCase(
            f"qkv gemma q/k-norm rope write bf16 {shape.label()} -> float",
            _qkv_write(shape, BF16, None, True, is_gemma=True),
            False,
        )


def _elementwise_cases() -> Iterator[LaunchCase]:
    for hidden in (576, 1024, 4096, 8192):
        for dtype in (BF16, FP16, FP32):
            is_fast = (hidden, dtype) in ((1024, BF16), (4096, FP32))
            yield LaunchCase(f"norms + silu_mul {_dtype_name(dtype)} hidden {hidden}", _norms(hidden, dtype), is_fast)
    for vocab in (49152, 151936):  # SmolLM2's and Qwen3's vocabularies
        for dtype in (BF16, FP32):
            for threshold in (False, True):
                is_fast = vocab == 151936 and (dtype is FP32 or threshold)
                label = f"sampling race {_dtype_name(dtype)} vocab {vocab}" + (" top-k/top-p" if threshold else "")
                yield LaunchCase(label, _sampling(vocab, dtype, threshold), is_fast)
        yield LaunchCase(f"sampling top-p spill vocab {vocab}", _spill(vocab), vocab == 151936)
    yield LaunchCase("gather ids in place", _gather(), True)


def _gemm_cases() -> Iterator[LaunchCase]:
    # token counts in each of the launchers' BLOCK_M buckets (16, 32, 64)
    for m in (1, 20, 256):
        for dtype in (BF16, FP16, FP32):
            for group, has_bias in ((None, False), (32, True)):
                is_fast = (dtype, m, group) in ((BF16, 1, None), (BF16, 256, 32), (FP16, 20, None), (FP32, 1, 32))
                kind = "per-channel" if group is None else f"group {group}" + (" bias" if has_bias else "")
                yield LaunchCase(f"W8A16 {kind} {_dtype_name(dtype)} M={m}", _w8a16(m, dtype, group, has_bias), is_fast)
            for group in (32, 128):
                is_fast = (dtype, m, group) in ((BF16, 20, 32), (FP16, 256, 128), (FP32, 1, 32))
                yield LaunchCase(f"W4A16 group {group} {_dtype_name(dtype)} M={m}", _w4a16(m, dtype, group), is_fast)
    for dtype in (BF16, FP16, FP32):
        for k, float_channels in ((1024, 0), (4096, 64), (14336, 0)):
            is_fast = dtype is BF16 and k != 14336 or (dtype is FP32 and k == 1024)
            yield LaunchCase(
                f"fp8/W8A8 activation quant + epilogue {_dtype_name(dtype)} K={k} float channels {float_channels}",
                _act_quant(dtype, k, float_channels),
                is_fast,
            )
        yield LaunchCase(f"MoE grouped GEMM {_dtype_name(dtype)} 8 experts", _moe(dtype), dtype is BF16)
    yield LaunchCase("MoE grouped GEMM bf16 64 experts top 8", _moe(BF16, 64, 8), False)
    # batch-invariant linears: each column-tile width (a narrow projection, a wide one, an LM head's
    # over 8192 columns), each dtype
    for n, k in ((576 + 2 * 192, 576), (4096, 2048), (16384, 1024)):
        for dtype in (BF16, FP16, FP32):
            is_fast = dtype is BF16 or (dtype is FP32 and n <= 4096) or (dtype is FP16 and n == 4096)
            yield LaunchCase(
                f"batch-invariant matmul {_dtype_name(dtype)} {n}x{k}", _invariant(n, k, dtype, n < 1000), is_fast
            )


def _fused_cases() -> Iterator[LaunchCase]:
    # token counts in each of the table's BLOCK_M buckets (16, 32, 64 and up); the dispatch fuses
    # bf16 and fp16 models only
    for shape, bias in ((QWEN3, False), (SMOLLM2, True), (GEMMA3, False)):
        for m in (1, 20, 256):
            for dtype in (BF16, FP16):
                is_fast = shape is QWEN3 and (dtype, m) in ((BF16, 1), (BF16, 256), (FP16, 20))
                name = f"fused qkv/gate_up GEMMs, embed + norm {_dtype_name(dtype)} {shape.label()} M={m}"
                yield LaunchCase(name + (" bias" if bias else ""), _fused(shape, m, dtype, bias), is_fast)


def launch_cases(full: bool = False) -> list[LaunchCase]:
    """The cases to compile: the test's set, or with `full` every one."""
    cases = [
        *_attention_cases(),
        *varlen_attention_cases(full=True),
        *_write_cases(),
        *_elementwise_cases(),
        *_gemm_cases(),
        *_fused_cases(),
    ]
    return cases if full else [c for c in cases if c.is_fast]


_KV_OPTION = {None: "auto", INT8: "int8", FP8: "fp8"}  # a cache's dtype -> engine.kv_cache_dtype


def compile_cases(arch: int, cases: list[LaunchCase]) -> CompileLog:
    """Every case's launches compiled for sm_`arch`, through kernel sets bound for that GPU (one per
    dtype and cache); each variant labelled with the case that first launched it."""
    torch.manual_seed(0)
    with compile_only(arch) as compile_log:
        bound: dict[tuple, KernelSet] = {}

        def kernels(dtype: torch.dtype, kv: Optional[torch.dtype]) -> KernelSet:
            if (dtype, kv) not in bound:
                bound[dtype, kv] = bind_kernels(compile_log.target, dtype, kv_cache_dtype=_KV_OPTION[kv])
            return bound[dtype, kv]

        for case in cases:
            compile_log.label = case.name
            case.run(kernels)
    return compile_log
