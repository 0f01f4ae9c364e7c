"""The batch-invariant Triton matmul (kernels/triton_invariant.py): row r of an M-row product is
bitwise the row computed alone, for every M and wherever the row falls in the tiles.

On the CPU the kernel runs in Triton's interpreter, in one child process (tests/support/interpreted.py),
at sizes whose K and N leave partial tiles and whose row counts cross row tiles; on a GPU
(`-m gpu`) at model sizes, where cuBLAS's own choice of kernel per M is what the kernel replaces.
"""

from __future__ import annotations

import torch

from tests.support.interpreted import interpreted_and_on_gpu

# id -> (N, K, dtype, with bias): bf16 and fp16 take 64-row tiles, float32 32-row ones (IEEE dots)
CASES: dict[str, tuple[int, int, str, bool]] = {
    "bf16-N80-K200": (80, 200, "bfloat16", False),
    "fp16-N48-K64-bias": (48, 64, "float16", True),
    "fp32-N40-K72-bias": (40, 72, "float32", True),
}
ROW_COUNTS = (1, 3, 17, 64)
NUM_ROWS = 130  # rows to draw from: two bf16 row tiles and a partial third, four float32 ones


def check_rows(spec: tuple[int, int, str, bool], device: str = "cpu", row_counts=ROW_COUNTS) -> None:
    from dataclasses import replace

    from batchrun.kernels.triton_invariant import invariant_matmul, invariant_tiles, matmul_reference

    n, k, dtype_name, has_bias = spec
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(NUM_ROWS, k, generator=g).to(dtype).to(device)  # (NUM_ROWS, K)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)  # (N, K)
    b = torch.randn(n, generator=g).to(dtype).to(device) if has_bias else None
    alone = torch.cat([invariant_matmul(x[r : r + 1], w, b) for r in range(NUM_ROWS)])  # (NUM_ROWS, N)
    # close to the float32 product: within one step of the dtype (a rounding to nearest is half a
    # step; Triton's interpreter truncates float32 to bf16), plus float32 order noise
    want = x.float() @ w.float().T + (0.0 if b is None else b.float())  # (NUM_ROWS, N), unrounded
    assert torch.equal(matmul_reference(x, w, b), want.to(dtype))
    step = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}[dtype]
    err = ((alone.float() - want).abs() - want.abs() * step).amax().item()
    assert err <= 1e-3, f"alone rows are {err} past one rounding of the float32 product"
    for m in (*row_counts, NUM_ROWS):
        for first in (0, NUM_ROWS - m, (NUM_ROWS - m) // 2):  # the rows at other positions in the tiles
            got = invariant_matmul(x[first : first + m], w, b)  # (m, N)
            same = (got == alone[first : first + m]).all(dim=-1)
            assert bool(same.all()), f"M={m} from row {first}: rows {(~same).nonzero().flatten().tolist()} differ"
    # The check can fail: in the interpreter a dot's K-step sum is added to the accumulator as a
    # whole, so half the K step (what a kernel picked per row count may take) sums in another order
    # and some rows come out different. Not asserted in bf16, whose 8-bit results round the float32
    # order differences of these short sums away, nor on a GPU, where the dot accumulates into the
    # accumulator one MMA (or FMA) step at a time and the K step may not change the order at all.
    if dtype != torch.bfloat16 and device == "cpu":
        tiles = invariant_tiles(n, k, dtype)
        halved = invariant_matmul(x, w, b, replace(tiles, block_k=tiles.block_k // 2))
        assert not torch.equal(halved, alone), "another K step gave the same bits: the check above could not fail"


GPU_CASES: dict[str, tuple[int, int, str, bool]] = {
    "bf16-qkv-576x576": (576 + 2 * 192, 576, "bfloat16", False),  # SmolLM2's fused qkv
    "bf16-down-4096x14336": (4096, 14336, "bfloat16", False),
    "bf16-head-152k": (151936, 1024, "bfloat16", False),  # an LM head: the widest column tiles
    "fp16-bias-2048x1536": (2048, 1536, "float16", True),
    "fp32-bias-1536x1024": (1536, 1024, "float32", True),
}


test_rows_do_not_depend_on_the_row_count_interpreted, test_rows_do_not_depend_on_the_row_count_on_gpu = (
    interpreted_and_on_gpu(
        CASES, lambda spec: check_rows(spec, "cuda", row_counts=(1, 3, 17, 64, 100)), gpu_cases=GPU_CASES
    )
)


if __name__ == "__main__":  # the interpreted child (TRITON_INTERPRET=1, see tests/support/interpreted.py)
    from tests.support.interpreted import report_cases

    report_cases(CASES, check_rows)
