"""The CPU attention path: native kernels over the paged KV cache (built by cpu_native), decode
(csrc/paged_attention.cpp) and prefill (csrc/prefill_attention.cpp), with the plain-torch path
(kernels/attention_torch.py) for whatever they do not serve (`paged_attention_cpu`).

The torch decode path copies every sequence's context out of the cache and runs batched matmuls
over the copy, in every layer; the decode kernel reads K and V where they lie, through the block
table, so a decode step's attention is one pass over the context. The two agree to float32
rounding (tested).

For prefills the torch path runs one SDPA call per sequence, after copying the context out of the
cache and building a mask whenever part of the prompt was cached (which sends SDPA to its slow
masked path); the prefill kernel computes causal flash attention for all prefilling sequences in
one call, reading the cache in place (bf16 on AVX512-BF16 dot products, probabilities rounded to
bf16 for the second product as torch's CPU flash attention does).

An int8 cache (engine.kv_cache_dtype: int8, kernels/quant/kv.py: QuantizedKVCache) is read as it is
stored: K's per-(slot, head) scale multiplies the scores, V's the probabilities (the float32
prefill dequantizes on load instead, exactly as the torch path does), and the cache write
quantizes natively, bitwise as quantize_kv.
"""

from __future__ import annotations

from typing import Optional

import torch

from batchrun.kernels import cpu_native
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.attention_torch import attend_decodes, attend_prefills, attend_rows_invariant
from batchrun.kernels.cpu_native import DTYPE_CODES
from batchrun.kernels.quant.kv import QuantizedKVCache

INT8_KV_CODE = 2  # the kernels' element code for an int8 cache (float32 0, bf16 1: DTYPE_CODES)


def supports(q: torch.Tensor, k_cache) -> bool:
    """Whether the native kernel takes this query and cache: float32 or bf16, a cache of q's dtype or
    an int8 QuantizedKVCache (engine.kv_cache_dtype: int8), with contiguous rows. Asked only where
    the kernels are built and on (a CPU kernel set binds `paged_attention_cpu(native=True)` there)."""
    if isinstance(k_cache, QuantizedKVCache):
        data = k_cache.data
        return q.dtype in DTYPE_CODES and data.dtype == torch.int8 and data.stride(-1) == 1
    return (
        isinstance(k_cache, torch.Tensor)
        and q.dtype in DTYPE_CODES
        and k_cache.dtype == q.dtype
        and k_cache.stride(-1) == 1
    )


def _kv_args(k_cache, v_cache) -> tuple:
    """The C kernels' cache arguments: K and V data pointers, the element code (0 float32, 1 bf16,
    2 int8), the number of KV heads, the three data strides, K and V scale pointers (null for a
    float cache) and the three scale strides."""
    if isinstance(k_cache, QuantizedKVCache):
        kd, vd, ks, vs = k_cache.data, v_cache.data, k_cache.scale, v_cache.scale
        assert vd.stride() == kd.stride() and vs.stride() == ks.stride()
        return (
            kd.data_ptr(),
            vd.data_ptr(),
            INT8_KV_CODE,
            kd.shape[2],
            *kd.stride()[:3],
            ks.data_ptr(),
            vs.data_ptr(),
            *ks.stride(),
        )
    assert v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype
    return (
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        DTYPE_CODES[k_cache.dtype],
        k_cache.shape[2],
        *k_cache.stride()[:3],
        None,
        None,
        0,
        0,
        0,
    )


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim), one query per sequence
    # k_cache: (num_blocks, block_size, num_kv_heads, head_dim) tensor, any strides but a unit last one,
    # or int8 QuantizedKVCache
    k_cache,
    v_cache,  # same layout as k_cache
    block_tables: torch.Tensor,  # (num_seqs, >= ceil(max seq_len / block_size)) int64
    seq_lens: torch.Tensor,  # (num_seqs,) int64: context length, the query's own position included
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Single-query attention of each sequence over its cached context: (num_seqs, num_heads, head_dim)."""
    lib = cpu_native.library()
    assert lib is not None, "paged_decode_attention needs the native kernels (check supports() first)"
    q = q.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    rc = lib.batchrun_paged_decode_attention(
        q.data_ptr(),
        DTYPE_CODES[q.dtype],
        num_seqs,
        num_heads,
        head_dim,
        *_kv_args(k_cache, v_cache),
        block_size,
        tables.data_ptr(),
        tables.shape[1] if tables.dim() == 2 else 0,
        lens.data_ptr(),
        float(scale),
        float(softcap or 0.0),
        int(sliding_window or 0),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc == -1:
        raise ValueError(
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}, at most 64 times it"
        )
    if rc != 0:
        raise ValueError(f"the native decode kernel refused the cache ({rc}): an int8 cache needs its scales")
    return out


def write_kv_cache(
    # k_cache: (num_blocks, block_size, num_kv_heads, head_dim) tensor, any strides but a unit last one,
    # or int8 QuantizedKVCache
    k_cache,
    v_cache,  # same layout as k_cache
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), unit last and head_dim head strides
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int64; negative = skip
) -> bool:
    """Copy this step's K and V rows into their cache slots in one native pass (into an int8 cache,
    quantized on the way exactly as kernels/quant/kv.py: quantize_kv does); False (nothing written)
    when the kernel does not take these tensors and the caller must take the torch path. Called
    where the kernels are built and on (kernels/attention.py: write_kv_cache_native)."""
    head_dim = k.shape[-1]
    int8 = isinstance(k_cache, QuantizedKVCache)
    kc, vc = (k_cache.data, v_cache.data) if int8 else (k_cache, v_cache)
    if not (
        isinstance(kc, torch.Tensor)
        and k.dtype == v.dtype
        and k.dtype in DTYPE_CODES
        and (kc.dtype == vc.dtype == torch.int8 if int8 else kc.dtype == vc.dtype == k.dtype)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and k.stride(2) == v.stride(2) == kc.stride(3) == 1
        and k.stride(1) == v.stride(1) == head_dim
        and vc.stride() == kc.stride()
    ):
        return False
    lib = cpu_native.loaded()
    args = (
        k.data_ptr(),
        v.data_ptr(),
        k.element_size(),
        k.shape[0],
        k.shape[1],
        head_dim,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        slot_mapping.data_ptr(),
        kc.data_ptr(),
        vc.data_ptr(),
    )
    if int8:
        ks, vs = k_cache.scale, v_cache.scale
        if ks.stride() != vs.stride() or head_dim > 1024:
            return False
        lib.batchrun_write_kv_cache_int8(
            *args, ks.data_ptr(), vs.data_ptr(), kc.shape[1], *kc.stride()[:3], *ks.stride(), torch.get_num_threads()
        )
    else:
        lib.batchrun_write_kv_cache(*args, kc.shape[1], *kc.stride()[:3], torch.get_num_threads())
    return True


def supports_prefill(q: torch.Tensor, k_cache) -> bool:
    """Whether the native prefill kernel takes this query and cache: `supports`, and a head_dim,
    block size and dtype that this build's AVX-512 instances cover (16, 32, 64, 128 or 256; blocks of
    a multiple of 16; bf16 needs AVX512-BF16)."""
    if not supports(q, k_cache):
        return False
    _, block_size, _, head_dim = k_cache.shape
    int8 = isinstance(k_cache, QuantizedKVCache)
    data = k_cache.data if int8 else k_cache
    return bool(
        cpu_native.loaded().batchrun_prefill_attention_supported(
            head_dim,
            DTYPE_CODES[q.dtype],
            block_size,
            data.stride(1),
            INT8_KV_CODE if int8 else DTYPE_CODES[data.dtype],
        )
    )


def paged_prefill_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim): the batch's query rows
    # k_cache: (num_blocks, block_size, num_kv_heads, head_dim) tensor or int8 QuantizedKVCache,
    # this step's keys already written
    k_cache,
    v_cache,
    block_tables: torch.Tensor,  # (num_seqs, >= ceil(max seq_len / block_size)) int64: the prefilling sequences'
    q_starts: torch.Tensor,  # (num_seqs,) int64: each sequence's first row in q
    q_lens: torch.Tensor,  # (num_seqs,) int64: its number of query rows, the last of its context
    seq_lens: torch.Tensor,  # (num_seqs,) int64: its context length after this step
    out: torch.Tensor,  # like q: the rows of these sequences are written, the others left alone
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    fixed_key_grid: bool = False,
) -> None:
    """Causal attention of each prefilling sequence's query rows over its cached context, into `out`.
    `fixed_key_grid`: keys in steps on a grid from position 0, so that under a sliding window too a
    row's result does not depend on the other query rows of its sequence (engine.batch_invariant)."""
    lib = cpu_native.library()
    assert lib is not None, "paged_prefill_attention needs the native kernels (check supports_prefill() first)"
    assert q.is_contiguous() and out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int64).contiguous()
    starts, lens, ctx = (t.to(torch.int64).contiguous() for t in (q_starts, q_lens, seq_lens))
    rc = lib.batchrun_paged_prefill_attention(
        q.data_ptr(),
        DTYPE_CODES[q.dtype],
        len(starts),
        num_heads,
        head_dim,
        *_kv_args(k_cache, v_cache),
        block_size,
        tables.data_ptr(),
        tables.shape[1],
        starts.data_ptr(),
        lens.data_ptr(),
        ctx.data_ptr(),
        float(scale),
        float(softcap or 0.0),
        int(sliding_window or 0),
        int(fixed_key_grid),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc == -1:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if rc != 0:
        raise ValueError(
            f"the native prefill kernel does not serve head_dim {head_dim}, block_size {block_size} "
            "and this cache (an int8 cache needs its scales)"
        )


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    *,
    native: bool,
    native_prefill: Optional[bool] = None,
) -> torch.Tensor:
    """kernels/attention.py's paged_attention on the CPU (the cache may be a QuantizedKVCache): with
    `native` (the kernels built and on: bound once by the kernel set) decodes and prefills run the
    native kernels where they take the cache's dtype and shape (`supports`, `supports_prefill`), the
    rest the torch path; without, all of it the torch path. `native_prefill`: the prefills' choice
    where start-up tuning measured it apart from the decodes' (None: `native`).

    meta.batch_invariant (every sequence then counts as a prefill): the prefill kernel on its fixed
    key grid, whose per-row result depends only on the row's query and keys, or where it does not
    serve, the torch path's float64 `attend_rows_invariant`."""
    prefill_native = native if native_prefill is None else native_prefill
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (num_tokens, num_heads, head_dim)
    if meta.batch_invariant:
        if prefill_native and supports_prefill(q, k_cache):
            args = meta.prefill_native_inputs()
            paged_prefill_attention(q.contiguous(), k_cache, v_cache, *args, out, scale, sliding_window, softcap, True)
        else:
            attend_rows_invariant(out, q, k_cache, v_cache, meta, meta.prefill_seq_ids, scale, sliding_window, softcap)
        return out
    if isinstance(k_cache, QuantizedKVCache):
        # A prefix served from the cache is read quantized; a fresh prompt must see its own keys the
        # same way (not this step's float K/V), or prefix caching would change its outputs.
        k_new = v_new = None
    if prefill_native and meta.prefill_seq_ids and supports_prefill(q, k_cache):
        paged_prefill_attention(
            q.contiguous(), k_cache, v_cache, *meta.prefill_native_inputs(), out, scale, sliding_window, softcap
        )
        prefill_ids: list[int] = []
    else:
        prefill_ids = meta.prefill_seq_ids
    if native and meta.decode_seq_ids.numel() > 0 and supports(q, k_cache):
        rows, tables, _ = meta.decode_inputs(None)
        if not meta.prefill_seq_ids:  # a pure decode step: every row is a decode, in order
            return paged_decode_attention(
                q, k_cache, v_cache, tables, meta.decode_seq_lens, scale, sliding_window, softcap
            )
        out[rows] = paged_decode_attention(
            q[rows], k_cache, v_cache, tables, meta.decode_seq_lens, scale, sliding_window, softcap
        )
    elif meta.decode_seq_ids.numel() > 0:
        attend_decodes(out, q, k_cache, v_cache, meta, scale, sliding_window, softcap)
    attend_prefills(out, q, k_cache, v_cache, meta, prefill_ids, scale, sliding_window, softcap, k_new, v_new)
    return out
