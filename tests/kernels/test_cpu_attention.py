"""The native CPU attention kernels (kernels/cpu_attention.py): decode (csrc/paged_attention.cpp)
and prefill (csrc/prefill_attention.cpp).

It must equal the plain-torch decode path (gather_blocks + _decode_attend, itself checked against
dense attention in tests/kernels/test_attention.py) for every shape the engine can hand it: both dtypes, the
AVX-512 instances (head_dim 64/128, groups 1-8, block sizes that are multiples of 16) and the
portable fallback (other head dims, groups and block sizes), sliding windows that start inside a
16-position tile, soft-capping, one-token contexts, and the engine's head-major cache as well as a
token-major one. The engine must give the same greedy tokens with the kernel on and off.

The prefill kernel must equal the torch prefill path (one SDPA call per sequence) on batches that
mix fresh prompts, prompts whose start is cached (a query shorter than its context) and decodes,
with query and context lengths on both sides of the 16-key tiles and 32-query chunks, in both
dtypes (bf16 within the error torch's own bf16 path makes against float32), and must refuse the
shapes its build does not serve, which then take the torch path.
"""

from __future__ import annotations

import logging

import pytest
import torch

from batchrun.kernels import cpu_attention, cpu_native
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.attention_torch import decode_attend, gather_blocks, paged_attention_reference
from batchrun.kernels.cpu_attention import paged_attention_cpu as _paged_attention_cpu
from batchrun.kernels.kv_layout import new_kv_cache
from tests.support.engines import tiny_config


def paged_attention_cpu(*args, **kwargs):
    """The CPU attention as a kernel set with the native kernels on binds it."""
    return _paged_attention_cpu(*args, **kwargs, native=True)


pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler: the native kernel is not built")


def _reference(q, k_cache, v_cache, tables, seq_lens, scale, window, softcap):
    num_blocks = tables.shape[1]
    pos = torch.arange(num_blocks * k_cache.shape[1])
    mask = pos[None] < seq_lens[:, None]
    if window is not None:
        mask &= pos[None] > (seq_lens[:, None] - 1 - window)
    k = gather_blocks(k_cache, tables).float()
    v = gather_blocks(v_cache, tables).float()
    return decode_attend(q.float(), k, v, mask, scale, softcap)


def _case(heads, kv_heads, dim, block, dtype, seq_lens, head_major=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * width + 3
    if head_major:
        k_cache, v_cache = (new_kv_cache(num_blocks, block, kv_heads, dim, dtype, "cpu") for _ in range(2))
    else:
        k_cache, v_cache = (torch.zeros(num_blocks, block, kv_heads, dim, dtype=dtype) for _ in range(2))
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width].view(len(seq_lens), width)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens)


SEQ_LENS = (1, 15, 16, 17, 40, 100, 257)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block",
    [
        (9, 3, 64, 16),  # SmolLM2: AVX-512 path
        (4, 4, 128, 32),  # no GQA, head_dim 128, bigger blocks
        (16, 2, 64, 16),  # group 8
        (6, 2, 40, 16),  # head_dim not a multiple of 16: portable path
        (12, 1, 64, 16),  # group 12: portable path
        (4, 2, 64, 8),  # block size not a multiple of 16: portable path
    ],
)
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 7.0), (33, 7.0)])
def test_native_decode_equals_the_torch_path(dtype, heads, kv_heads, dim, block, window, softcap):
    q, k_cache, v_cache, tables, lens = _case(heads, kv_heads, dim, block, dtype, SEQ_LENS)
    got = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.17, window, softcap)
    want = _reference(q, k_cache, v_cache, tables, lens, 0.17, window, softcap)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the kernel's output is rounded once, to bf16
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_token_major_cache_and_thread_counts(one_torch_thread):
    q, k_cache, v_cache, tables, lens = _case(9, 3, 64, 16, torch.float32, SEQ_LENS, head_major=False, seed=3)
    want = _reference(q, k_cache, v_cache, tables, lens, 0.125, None, None)
    torch.testing.assert_close(
        cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125), want, rtol=1e-5, atol=1e-5
    )


def test_bad_head_counts_are_refused():
    q, k_cache, v_cache, tables, lens = _case(8, 3, 64, 16, torch.float32, (5,))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)


def test_supports_only_plain_cpu_caches_of_the_query_dtype(monkeypatch):
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import find_target

    q, k_cache, _, _, _ = _case(9, 3, 64, 16, torch.bfloat16, (5,))
    assert cpu_attention.supports(q, k_cache)
    assert not cpu_attention.supports(q.float(), k_cache)  # dtypes differ
    assert not cpu_attention.supports(q.half(), k_cache.half())  # float16: torch path
    assert bind_kernels(find_target("cpu"), torch.bfloat16).paged_attention.keywords == {"native": True}
    monkeypatch.setenv("BATCHRUN_CPU_KERNELS", "0")  # read when a kernel set is bound
    assert bind_kernels(find_target("cpu"), torch.bfloat16).paged_attention.keywords == {"native": False}


def test_a_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "cxx"
    broken.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv("BATCHRUN_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="batchrun.kernels.cpu_native"):
            assert not cpu_native.available()
        assert "no compiler here" in caplog.text and "plain-torch path" in caplog.text
        assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-written is left to be loaded
    finally:
        monkeypatch.undo()
        cpu_native.library.cache_clear()
    assert cpu_native.available()  # the real compiler again


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_greedy_output_is_the_same_with_the_kernel_on_and_off(tiny_llama_dir, monkeypatch, kv_cache_dtype):
    # int8: the kernels read the int8 cache as it is and write it natively; off, the torch path
    # quantizes with torch ops and gathers the cache dequantized (float32: the same values).
    from batchrun.engine import Engine, SamplingParams

    config = tiny_config(
        tiny_llama_dir,
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=64,
        block_size=16,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = Engine(config)
    prompts = [[5 + (7 * i + j) % 200 for j in range(20 + 13 * i)] for i in range(6)]
    prompts += [list(range(5, 5 + 40)) + [100 + i] * (3 + 17 * i) for i in range(3)]  # a cached 32-token start
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    calls = []
    for name in ("paged_decode_attention", "paged_prefill_attention", "write_kv_cache"):
        real = getattr(cpu_attention, name)
        monkeypatch.setattr(
            cpu_attention, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    on = [o.token_ids for o in engine.generate(prompts, params)]
    # Decode steps and prefills (whole prompts, chunks of 64 after a first chunk, cached prefixes)
    # went through the kernels.
    assert {"paged_decode_attention", "paged_prefill_attention", "write_kv_cache"} <= set(calls)
    monkeypatch.setenv("BATCHRUN_CPU_KERNELS", "0")  # read when the engine binds its kernel set
    calls.clear()
    assert [o.token_ids for o in Engine(config).generate(prompts, params)] == on
    assert "paged_decode_attention" not in calls and "paged_prefill_attention" not in calls


# ---------------------------------------------------------------------------------------------
# prefill


def _skip_without_the_prefill_kernel(dtype, int8: bool) -> None:
    code = cpu_native.DTYPE_CODES[dtype]
    if not cpu_native.library().batchrun_prefill_attention_supported(64, code, 16, 128, 2 if int8 else code):
        pytest.skip("this build has no prefill kernel for this dtype (needs AVX-512, and AVX512-BF16 for bf16)")


def _prefill_case(heads, kv_heads, dim, block, dtype, seqs, seed=0):
    """A batch over a paged cache: seqs are (query length, context length); query length 1 is a decode."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for _, n in seqs)
    num_blocks = len(seqs) * width + 2
    k_cache, v_cache = (new_kv_cache(num_blocks, block, kv_heads, dim, dtype, "cpu") for _ in range(2))
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    tables = torch.randperm(num_blocks, generator=gen)[: len(seqs) * width].view(len(seqs), width)
    starts = [0]
    for q_len, _ in seqs:
        starts.append(starts[-1] + q_len)
    decodes = [i for i, (q_len, _) in enumerate(seqs) if q_len == 1]
    slots = [
        int(tables[i, p // block]) * block + p % block for i, (q_len, n) in enumerate(seqs) for p in range(n - q_len, n)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=starts,
        seq_lens=[n for _, n in seqs],
        block_tables=tables,
        block_size=block,
        decode_seq_ids=torch.tensor(decodes, dtype=torch.long),
        decode_seq_lens=torch.tensor([seqs[i][1] for i in decodes], dtype=torch.long),
        prefill_seq_ids=[i for i, (q_len, _) in enumerate(seqs) if q_len > 1],
    )
    q = torch.randn(starts[-1], heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta


# (query length, context length): fresh prompts of 2..70 tokens (tile and chunk edges), prompts
# with a cached start (the query is the tail), and two decodes in the same batch.
PREFILL_SEQS = [(37, 37), (2, 2), (16, 16), (33, 33), (70, 70), (5, 40), (64, 100), (17, 49), (1, 23), (1, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block",
    [
        (9, 3, 64, 16),  # SmolLM2
        (4, 4, 128, 32),  # no GQA, head_dim 128, bigger blocks
        (16, 2, 64, 48),  # group 8, blocks of three tiles
        (4, 1, 64, 16),  # one KV head for all
        (4, 2, 16, 16),  # the smallest head_dim served
    ],
)
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 7.0), (33, 7.0)])
def test_native_prefill_equals_the_torch_path(dtype, heads, kv_heads, dim, block, window, softcap):
    q, k_cache, v_cache, meta = _prefill_case(heads, kv_heads, dim, block, dtype, PREFILL_SEQS)
    _skip_without_the_prefill_kernel(dtype, int8=False)
    assert cpu_attention.supports_prefill(q, k_cache)
    scale = dim**-0.5
    got = paged_attention_cpu(q, k_cache, v_cache, meta, scale, window, softcap)
    # The torch path in float32 on the same (bf16-valued) inputs is the truth for both dtypes.
    want = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, scale, window, softcap)
    _assert_prefill_close(got, want, q, k_cache, v_cache, meta, scale, window, softcap)


def _assert_prefill_close(got, want, q, k_cache, v_cache, meta, scale, window=None, softcap=None):
    """float32: the torch path to float32 rounding; bf16: within twice the error of the torch
    path's own bf16 run (`want` is the float32 torch path on the same bf16-valued inputs)."""
    if q.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        return
    torch_bf16 = paged_attention_reference(q, k_cache, v_cache, meta, scale, window, softcap)
    torch_err = (torch_bf16.float() - want).abs()
    err = (got.float() - want).abs()
    # bf16 output rounding alone is up to 2^-9 relative; the kernel also rounds probabilities to
    # bf16 (as torch's flash kernel does), so allow twice torch's own largest error.
    assert err.max() <= 2 * torch_err.max() + 1e-3, (err.max(), torch_err.max())
    assert err.mean() <= 2 * torch_err.mean() + 1e-4, (err.mean(), torch_err.mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_across_threads_and_many_chunks(one_torch_thread, dtype):
    # One thread (the test fixture) and long prompts split into many 32-query chunks, each over
    # many 64-key steps, one of them starting mid-step (a cached start of 270 keys).
    q, k_cache, v_cache, meta = _prefill_case(9, 3, 64, 16, dtype, [(300, 300), (130, 400)])
    got = paged_attention_cpu(q, k_cache, v_cache, meta, 0.125)
    want = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    _assert_prefill_close(got, want, q, k_cache, v_cache, meta, 0.125)


def _int8_case(heads, kv_heads, dim, block, dtype, seqs):
    """_prefill_case over an int8 cache (engine.kv_cache_dtype: int8), plus float32 caches of its
    dequantized values (the truth both paths are measured against)."""
    from batchrun.kernels.quant.kv import QuantizedKVCache

    q, k_float, v_float, meta = _prefill_case(heads, kv_heads, dim, block, dtype, seqs)
    caches, exact = [], []
    for src in (k_float, v_float):
        cache = QuantizedKVCache.empty(tuple(src.shape), torch.int8, dtype, "cpu")
        cache.write(src.flatten(0, 1) * 3.0, torch.arange(src.shape[0] * src.shape[1]))  # scales well above 1/127
        caches.append(cache)
        exact.append(QuantizedKVCache(cache.data, cache.scale, torch.float32)[:])
    return q, caches, exact, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block", [(9, 3, 64, 16), (4, 4, 128, 32), (16, 2, 64, 48), (4, 2, 32, 16), (4, 2, 16, 16)]
)  # head_dim 16: widened, then gathered
@pytest.mark.parametrize("window,softcap", [(None, None), (33, 7.0)])
def test_native_attention_over_an_int8_cache(dtype, heads, kv_heads, dim, block, window, softcap):
    # Prefills, cached-start prefills and decodes in one batch, read straight from the int8 cache
    # (K's scale on the scores, V's on the probabilities) against the torch path, which gathers
    # the cache dequantized to the model dtype.
    q, (k_cache, v_cache), (k_exact, v_exact), meta = _int8_case(heads, kv_heads, dim, block, dtype, PREFILL_SEQS)
    _skip_without_the_prefill_kernel(dtype, int8=True)
    assert cpu_attention.supports(q, k_cache) and cpu_attention.supports_prefill(q, k_cache)
    scale = dim**-0.5
    got = paged_attention_cpu(q, k_cache, v_cache, meta, scale, window, softcap)
    want = paged_attention_reference(q.float(), k_exact, v_exact, meta, scale, window, softcap)
    if dtype == torch.float32:  # dequantized exactly as the torch path does: float32 rounding apart
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(
            got, paged_attention_reference(q, k_cache, v_cache, meta, scale, window, softcap), rtol=2e-5, atol=2e-5
        )
        return
    torch_err = (paged_attention_reference(q, k_cache, v_cache, meta, scale, window, softcap).float() - want).abs()
    err = (got.float() - want).abs()
    # The kernel keeps K and V as their integers (exact in bf16) and applies the scales in float32;
    # the torch path rounds the dequantized values to bf16 first. Both round probabilities and output.
    assert err.max() <= 2 * torch_err.max() + 1e-3, (err.max(), torch_err.max())
    assert err.mean() <= 2 * torch_err.mean() + 1e-4, (err.mean(), torch_err.mean())


@pytest.mark.parametrize("dim,block", [(40, 16), (64, 8), (96, 16)])
def test_prefill_shapes_the_build_does_not_serve_take_the_torch_path(dim, block, monkeypatch):
    q, k_cache, v_cache, meta = _prefill_case(4, 2, dim, block, torch.float32, [(20, 20), (7, 30)])
    assert not cpu_attention.supports_prefill(q, k_cache)
    with pytest.raises(ValueError, match="does not serve head_dim"):
        cpu_attention.paged_prefill_attention(
            q, k_cache, v_cache, *meta.prefill_native_inputs(), torch.empty_like(q), 0.2
        )
    calls = []
    monkeypatch.setattr(cpu_attention, "paged_prefill_attention", lambda *a, **k: calls.append(1))
    got = paged_attention_cpu(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got, paged_attention_reference(q, k_cache, v_cache, meta, 0.2), rtol=1e-5, atol=1e-5)
    assert not calls


def test_prefill_is_off_with_the_switch(monkeypatch):
    q, k_cache, v_cache, meta = _prefill_case(9, 3, 64, 16, torch.float32, [(20, 20)])
    assert cpu_attention.supports_prefill(q, k_cache)
    assert not cpu_attention.supports_prefill(q.bfloat16(), k_cache)  # dtype mismatch
    calls = []
    monkeypatch.setattr(cpu_attention, "paged_prefill_attention", lambda *a, **k: calls.append(1))
    got = _paged_attention_cpu(q, k_cache, v_cache, meta, 0.2, native=False)  # the set BATCHRUN_CPU_KERNELS=0 binds
    torch.testing.assert_close(got, paged_attention_reference(q, k_cache, v_cache, meta, 0.2), rtol=1e-5, atol=1e-5)
    assert not calls


# ---------------------------------------------------------------------------------------------
# cache write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [True, False])
def test_native_cache_write_equals_index_copy(dtype, head_major, monkeypatch):
    from batchrun.kernels.attention import write_kv_cache_native as write_kv_cache
    from batchrun.kernels.attention_torch import write_kv_cache_reference

    torch.manual_seed(1)
    num_blocks, block, heads, dim, tokens = 9, 16, 3, 64, 37
    shape = (num_blocks, block, heads, dim)
    make = (
        (lambda: new_kv_cache(*shape, dtype=dtype, device="cpu"))
        if head_major
        else (lambda: torch.zeros(shape, dtype=dtype))
    )
    qkv = torch.randn(tokens, (4 + 2) * heads * dim).to(dtype)  # k and v as strided views, as the decoder has them
    k = qkv[:, 4 * heads * dim : 5 * heads * dim].view(tokens, heads, dim)
    v = qkv[:, 5 * heads * dim :].view(tokens, heads, dim)
    slots = torch.randperm(num_blocks * block)[:tokens]
    want_k, want_v, got_k, got_v = make(), make(), make(), make()
    write_kv_cache_reference(want_k, want_v, k, v, slots)
    calls = []
    real = cpu_attention.write_kv_cache
    monkeypatch.setattr(cpu_attention, "write_kv_cache", lambda *a: calls.append(1) or real(*a))
    write_kv_cache(got_k, got_v, k, v, slots)
    assert calls and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # negative slots are skipped (nothing else written)
    skip_k, skip_v = make(), make()
    assert cpu_attention.write_kv_cache(skip_k, skip_v, k, v, torch.where(torch.arange(tokens) % 2 == 0, slots, -1))
    want_k2, want_v2 = make(), make()
    write_kv_cache_reference(want_k2, want_v2, k[::2], v[::2], slots[::2])
    assert torch.equal(skip_k, want_k2) and torch.equal(skip_v, want_v2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_int8_cache_write_is_bitwise_quantize_kv(dtype, monkeypatch):
    from batchrun.kernels.attention import write_kv_cache_native as write_kv_cache
    from batchrun.kernels.quant.kv import QuantizedKVCache

    torch.manual_seed(2)
    shape, tokens = (9, 16, 3, 64), 37
    qkv = torch.randn(tokens, 6 * 3 * 64).to(dtype)  # k and v as strided views, as the decoder has them
    qkv *= torch.logspace(-14, 3, tokens)[:, None].to(dtype)  # down to rows whose scale is clamped
    qkv[4] = 0.0
    qkv[9, 4 * 192 + 5] = float("nan")  # torch's row: a NaN scale and zeros (its NaN -> int8 cast)
    qkv[10, 5 * 192 + 70] = float("inf")
    k = qkv[:, 4 * 192 : 5 * 192].view(tokens, 3, 64)
    v = qkv[:, 5 * 192 :].view(tokens, 3, 64)
    slots = torch.randperm(9 * 16)[:tokens]
    slots[7] = -1  # skipped
    make = lambda: QuantizedKVCache.empty(shape, torch.int8, dtype, "cpu")  # noqa: E731
    got_k, got_v, want_k, want_v = make(), make(), make(), make()
    calls = []
    real = cpu_attention.write_kv_cache
    monkeypatch.setattr(cpu_attention, "write_kv_cache", lambda *a: calls.append(1) or real(*a))
    write_kv_cache(got_k, got_v, k, v, slots)
    keep = slots >= 0
    want_k.write(k[keep], slots[keep])  # the torch path: kernels/quant/kv.py quantize_kv + index_copy_
    want_v.write(v[keep], slots[keep])
    assert calls
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(got.data, want.data)
        torch.testing.assert_close(got.scale, want.scale, rtol=0, atol=0, equal_nan=True)  # exact, NaN rows included


def test_cache_write_refuses_what_it_does_not_serve():
    cache = new_kv_cache(4, 16, 2, 32, dtype=torch.bfloat16, device="cpu")
    k = torch.randn(3, 2, 32)  # float32 rows for a bf16 cache: the torch path casts
    assert not cpu_attention.write_kv_cache(cache, cache.clone(), k, k, torch.arange(3))
    assert not cpu_attention.write_kv_cache(
        cache, cache.clone(), k.to(torch.bfloat16), k.to(torch.bfloat16), torch.arange(3, dtype=torch.int32)
    )
