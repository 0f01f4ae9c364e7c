"""Attention with AttentionMetadata.batch_invariant (engine.batch_invariant): a query row's output is
bitwise the same whether its sequence's prompt runs in one prefill, in chunks of any size over the
cached prefix, one row at a time (a decode), or beside other sequences.

One sequence's K and V are written to a paged cache once; then the same rows are attended through
metadata built each way. Backends: the native CPU kernel (bf16 and float32, head_dim 16 and 32),
the float64 torch path (head_dim 24, which the native kernel does not serve), with and without a
sliding window; Triton's prefill kernel in the interpreter (a child process, small sizes) and on a
GPU (`-m gpu`). Without the flag the same comparisons fail: a decode row takes the decode kernel
(and under a window a chunk's key tiles start where the chunk does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from batchrun.kernels.attention_metadata import AttentionMetadata
from benchmarks.cases import attention_case
from tests.support.interpreted import interpreted_and_on_gpu

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SEQ_LEN = 70
CHUNKS = (5, 1, 16, 9, 30, 9)  # a chunking of SEQ_LEN positions, with a one-row chunk


def _meta(pieces: list[tuple[int, int]], table: torch.Tensor, block_size: int, invariant: bool) -> AttentionMetadata:
    """Metadata for sequences (first position, rows) that all use the block table `table` (the
    cache holds their keys already). With `invariant` every sequence is listed as a prefill, as
    the runner does under engine.batch_invariant; otherwise one-row pieces are decodes."""
    starts = [0]
    for _, n in pieces:
        starts.append(starts[-1] + n)
    device = table.device
    slots = torch.tensor(
        [int(table[p // block_size]) * block_size + p % block_size for c, n in pieces for p in range(c, c + n)],
        device=device,
    )
    decodes = [] if invariant else [i for i, (_, n) in enumerate(pieces) if n == 1]
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=starts,
        seq_lens=[c + n for c, n in pieces],
        block_tables=table.expand(len(pieces), -1).contiguous(),
        block_size=block_size,
        decode_seq_ids=torch.tensor(decodes, dtype=torch.long, device=device),
        decode_seq_lens=torch.tensor([pieces[i][0] + 1 for i in decodes], dtype=torch.long, device=device),
        prefill_seq_ids=[i for i in range(len(pieces)) if i not in decodes],
        batch_invariant=invariant,
    )


def check_invariance(spec: dict[str, Any], attend: Callable[..., torch.Tensor], device: Any = "cpu") -> None:
    """Raise AssertionError unless every way of computing the rows gives bitwise the whole prefill's."""
    invariant = spec.get("invariant", True)
    bs, window = spec["block_size"], spec["window"]
    c = attention_case(
        [(0, SEQ_LEN)], spec["heads"], spec["kv_heads"], spec["head_dim"], bs, _DTYPES[spec["dtype"]], device, seed=3
    )
    table = c.meta.block_tables[0]
    scale = spec["head_dim"] ** -0.5

    def rows(pieces: list[tuple[int, int]]) -> torch.Tensor:
        q = torch.cat([c.q[s : s + n] for s, n in pieces])  # the pieces' query rows, back to back
        return attend(q, c.k_cache, c.v_cache, _meta(pieces, table, bs, invariant), scale, window, None)

    want = rows([(0, SEQ_LEN)])  # (SEQ_LEN, num_heads, head_dim)
    starts = [sum(CHUNKS[:i]) for i in range(len(CHUNKS))]
    chunked = torch.cat([rows([(s, n)]) for s, n in zip(starts, CHUNKS)])
    assert torch.equal(chunked, want), "chunked prefill differs from the whole prefill"
    alone = torch.cat([rows([(p, 1)]) for p in range(SEQ_LEN - 8, SEQ_LEN)])
    assert torch.equal(alone, want[SEQ_LEN - 8 :]), "single-row (decode) attention differs from the prefill"
    # one step holding decodes, a verification-like block and a chunk, all of the same sequence
    batch = [(SEQ_LEN - 1, 1), (40, 5), (3, 1), (10, 20), (SEQ_LEN - 2, 1)]
    got = rows(batch)
    expect = torch.cat([want[s : s + n] for s, n in batch])
    assert torch.equal(got, expect), "rows in a mixed batch differ from the prefill"


def _cpu_cases() -> dict[str, dict[str, Any]]:
    cases = {}
    for head_dim in (16, 24, 32):
        for window in (None, 50):  # 50: single rows' windows start off the chunks' 16-key grid
            for dtype in ("bfloat16", "float32"):
                cases[f"d{head_dim}-win{window}-{dtype}"] = dict(
                    heads=4, kv_heads=2, head_dim=head_dim, block_size=16, window=window, dtype=dtype
                )
    return cases


CPU_CASES = _cpu_cases()


def _cpu_attend(*args: Any) -> torch.Tensor:
    """The CPU attention as the CPU kernel set binds it: the native kernels where they are built and on."""
    from batchrun.kernels.cpu_attention import paged_attention_cpu
    from batchrun.kernels.target import find_target

    return paged_attention_cpu(*args, native=find_target(torch.device("cpu")).native_cpu_kernels)


@pytest.mark.parametrize("case_id", list(CPU_CASES))
def test_cpu_attention_rows_do_not_depend_on_chunking_or_batch(case_id):
    check_invariance(CPU_CASES[case_id], _cpu_attend)


def test_without_the_flag_decode_rows_differ_from_the_prefill():
    """The comparison above can fail: off, a one-row piece (the one-row chunk, a decode) runs the
    decode kernel, whose softmax and sums differ from the prefill kernel's."""
    spec = dict(CPU_CASES["d16-winNone-bfloat16"], invariant=False)
    with pytest.raises(AssertionError, match="chunked prefill differs"):
        check_invariance(spec, _cpu_attend)


def test_without_the_fixed_key_grid_windowed_rows_differ():
    """The native prefill kernel's fixed key grid is what keeps windowed rows invariant: with key
    steps starting at each chunk's first visible key (16-aligned) a lone row differs."""
    from batchrun.kernels.cpu_attention import paged_prefill_attention

    def attend(q, k_cache, v_cache, meta, scale, window, softcap):
        out = torch.empty_like(q)
        args = meta.prefill_native_inputs()
        paged_prefill_attention(q, k_cache, v_cache, *args, out, scale, window, softcap, fixed_key_grid=False)
        return out

    check_invariance(CPU_CASES["d16-winNone-bfloat16"], attend)  # no window: the grid starts at 0 anyway
    with pytest.raises(AssertionError, match="differs"):
        check_invariance(CPU_CASES["d16-win50-bfloat16"], attend)


# Triton: block size 4 and 16, a window that cuts across key tiles, float32 and bf16 (in the
# interpreter bf16 dots run in float32: triton_attention._dot_f32).
TRITON_CASES = {
    f"bs{bs}-win{window}-{dtype}": dict(heads=4, kv_heads=2, head_dim=16, block_size=bs, window=window, dtype=dtype)
    for bs, window, dtype in ((4, 11, "float32"), (16, None, "bfloat16"), (16, 23, "bfloat16"))
}


def _triton_attend(*args: Any) -> torch.Tensor:
    from batchrun.kernels.triton_attention import paged_attention

    return paged_attention(*args)


(
    test_triton_prefill_rows_do_not_depend_on_chunking_or_batch_interpreted,
    test_triton_prefill_rows_do_not_depend_on_chunking_or_batch_on_gpu,
) = interpreted_and_on_gpu(TRITON_CASES, lambda spec: check_invariance(spec, _triton_attend, "cuda"))


if __name__ == "__main__":  # the interpreted child (TRITON_INTERPRET=1, see tests/support/interpreted.py)
    from tests.support.interpreted import report_cases

    report_cases(TRITON_CASES, lambda spec: check_invariance(spec, _triton_attend))
