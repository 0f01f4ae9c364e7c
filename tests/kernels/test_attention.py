"""The CPU paged attention (kernels/attention.py) against a dense per-sequence reference, in float32.

Focus: the decode path that attends once to a prefix every sequence shares (cascade attention) and
merges it with each sequence's own blocks; it must equal plain attention over the whole context.
"""

from __future__ import annotations

import pytest
import torch

from batchrun.kernels.attention_metadata import MIN_SHARED_TOKENS, AttentionMetadata
from batchrun.kernels.attention_torch import paged_attention_reference, write_kv_cache_reference
from batchrun.kernels.kv_layout import new_kv_cache
from tests.support.engines import make_tiny_engine

BLOCK = 4


def _dense(q, k_cache, v_cache, table, seq_len, scale, softcap):
    """One decode query (num_heads, dim) over its first seq_len cached positions, no paging tricks."""
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)])
    k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]  # (seq_len, kv_heads, dim)
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v)


def _case(seq_lens, num_shared_blocks, kv_heads=2, heads=6, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    shared = list(range(1, num_shared_blocks + 1))
    next_block = num_shared_blocks + 1
    tables = []
    for n in seq_lens:
        own = -(-n // BLOCK) - num_shared_blocks
        tables.append(shared + list(range(next_block, next_block + own)))
        next_block += own
    num_blocks = next_block + 1
    k_cache, v_cache = (new_kv_cache(num_blocks, BLOCK, kv_heads, dim, torch.float32, "cpu") for _ in range(2))
    slots = torch.arange(num_blocks * BLOCK)
    write_kv_cache_reference(
        k_cache,
        v_cache,
        torch.randn(len(slots), kv_heads, dim, generator=gen),
        torch.randn(len(slots), kv_heads, dim, generator=gen),
        slots,
    )
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(num_seqs, heads, dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(
            [tables[i][(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for i, n in enumerate(seq_lens)]
        ),
        query_start_loc=list(range(num_seqs + 1)),
        seq_lens=list(seq_lens),
        block_tables=block_tables,
        block_size=BLOCK,
        decode_seq_ids=torch.arange(num_seqs),
        decode_seq_lens=torch.tensor(seq_lens),
        prefill_seq_ids=[],
    )
    return q, k_cache, v_cache, tables, meta


@pytest.mark.parametrize(
    "seq_lens",
    [
        (70, 75, 83, 90),  # shared prefix plus own blocks, partial last blocks
        (68, 68, 68),  # every context ends exactly at the shared prefix: no own blocks at all
        (68, 71, 100),  # one sequence has no keys beyond the prefix: an all-masked row in the second part
    ],
)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_decode_over_a_shared_prefix_equals_dense_attention(seq_lens, softcap):
    q, k_cache, v_cache, tables, meta = _case(seq_lens, num_shared_blocks=MIN_SHARED_TOKENS // BLOCK + 1)
    [(_, _, _, num_shared)] = meta.decode_groups(None)
    assert num_shared == min(seq_lens) // BLOCK  # the shared path is taken, for the whole batch
    got = paged_attention_reference(q, k_cache, v_cache, meta, 0.3, softcap=softcap)
    for i, n in enumerate(seq_lens):
        want = _dense(q[i], k_cache, v_cache, tables[i], n, 0.3, softcap)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def _num_shared(meta, window=None):
    return [g[3] for g in meta.decode_groups(window)]


def test_short_or_unshared_prefixes_take_the_plain_path():
    _, _, _, _, meta = _case((20, 25, 30), num_shared_blocks=2)  # 8 shared tokens: below the threshold
    assert _num_shared(meta) == [0]
    _, _, _, _, meta = _case((70, 75), num_shared_blocks=0)  # nothing shared
    assert _num_shared(meta) == [0]
    _, _, _, _, meta = _case((70, 75), num_shared_blocks=17)
    assert _num_shared(meta, 8) == [0]  # a sliding window keeps the plain masked path
    q, k_cache, v_cache, tables, meta = _case((70, 75), num_shared_blocks=17)
    got = paged_attention_reference(q, k_cache, v_cache, meta, 0.3, sliding_window=8)
    assert torch.isfinite(got).all()


def test_a_batch_with_two_prefix_groups_and_loners_equals_dense_attention():
    # Sequences 0-2 share 18 blocks, 3-4 share 17 other blocks, 5 shares nothing: three groups.
    q, k_cache, v_cache, tables, meta = _case((70, 75, 90, 80), num_shared_blocks=18, seed=1)
    q2, k2, v2, tables2, meta2 = _case((72, 69), num_shared_blocks=17, seed=2)
    q3, k3, v3, tables3, meta3 = _case((40,), num_shared_blocks=0, seed=3)
    # one cache holding all three cases' blocks, side by side
    offsets = (0, k_cache.shape[0], k_cache.shape[0] + k2.shape[0])
    num_blocks = offsets[2] + k3.shape[0]
    kc, vc = (new_kv_cache(num_blocks, BLOCK, 2, 8, torch.float32, "cpu") for _ in range(2))
    for off, (kk, vv) in zip(offsets, ((k_cache, v_cache), (k2, v2), (k3, v3))):
        kc[off : off + kk.shape[0]], vc[off : off + vv.shape[0]] = kk, vv
    all_tables = (
        [t for t in tables]
        + [[b + offsets[1] for b in t] for t in tables2]
        + [[b + offsets[2] for b in t] for t in tables3]
    )
    seq_lens = (70, 75, 90, 80, 72, 69, 40)
    width = max(len(t) for t in all_tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens=list(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in all_tables]),
        block_size=BLOCK,
        decode_seq_ids=torch.arange(len(seq_lens)),
        decode_seq_lens=torch.tensor(seq_lens),
        prefill_seq_ids=[],
    )
    assert sorted(_num_shared(meta)) == [0, 17, 17]  # groups {0..3} (17 full blocks in the 70s), {4, 5}, {6}
    qs = torch.cat([q, q2, q3])
    got = paged_attention_reference(qs, kc, vc, meta, 0.3)
    for i, n in enumerate(seq_lens):
        torch.testing.assert_close(got[i], _dense(qs[i], kc, vc, all_tables[i], n, 0.3, None), rtol=1e-5, atol=1e-5)


def test_engine_greedy_output_is_the_same_with_and_without_the_shared_prefix_path(tiny_llama_dir, monkeypatch):
    from batchrun.engine import SamplingParams
    from batchrun.kernels import attention_metadata, attention_torch

    monkeypatch.setenv("BATCHRUN_CPU_KERNELS", "0")  # the torch decode path (the native kernel has no split)

    engine = make_tiny_engine(tiny_llama_dir, kv_cache_memory=16 << 20, max_num_batched_tokens=512, block_size=16)
    shared = list(range(5, 5 + 150))  # ~9 full blocks every prompt starts with
    prompts = [shared + [200 + i, 300 + 7 * i, 17 + i] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    taken = []
    real = attention_torch.decode_attend_shared
    monkeypatch.setattr(attention_torch, "decode_attend_shared", lambda *a, **k: taken.append(1) or real(*a, **k))
    with_shared = [o.token_ids for o in engine.generate(prompts, params)]
    assert taken  # the decode steps went through the shared-prefix path
    engine.reset_prefix_cache()
    monkeypatch.setattr(attention_metadata, "MIN_SHARED_SEQS", 10**9)
    assert [o.token_ids for o in engine.generate(prompts, params)] == with_shared


def test_triton_takes_fp8_caches_only_on_gpus_that_convert_e4m3():
    """An fp8 cache takes the Triton kernels from compute capability 8.9 on (Triton refuses
    float8_e4m3fn below); an int8 cache everywhere Triton runs. A CPU kernel set never does."""
    pytest.importorskip("triton")
    from batchrun.kernels import cpu_attention, triton_attention
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import MAX_SHARED_PER_BLOCK, GpuTarget, find_target

    def attention_kernel(target, kv_cache_dtype):
        return bind_kernels(target, torch.bfloat16, kv_cache_dtype=kv_cache_dtype).paged_attention.func

    assert attention_kernel(find_target("cpu"), "int8") is cpu_attention.paged_attention_cpu
    for capability, fp8 in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        # the kernel set of a GPU of this capability, simulated
        gpu = find_target("cpu", simulate=GpuTarget(capability, 132, MAX_SHARED_PER_BLOCK[capability]))
        want = triton_attention.paged_attention if fp8 else cpu_attention.paged_attention_cpu
        assert attention_kernel(gpu, "fp8") is want, capability
        assert attention_kernel(gpu, "int8") is triton_attention.paged_attention
        assert attention_kernel(gpu, "auto") is triton_attention.paged_attention
