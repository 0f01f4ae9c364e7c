"""After engine/warmup.py's warm_sampler, no sampled step compiles a Triton variant.

Checked without a GPU: every launch inside kernels/triton_aot.py's `compile_only(90)` compiles the
variant an H100/H200 would (the dtypes, constexprs and int specializations of Triton's own launch
binder, `do_not_specialize` honoured) instead of running it. The warm-up runs first on a step's
float32 logits (the engine's logits dtype); then steps of every kind (greedy, temperature, top-k,
top-p, both, mixed) and of 1 to 33 rows must only reuse its variants. Without `do_not_specialize`
on the race's row count, or with a warm-up that skipped the race without a threshold or the spill
kernel, this fails.
"""

from __future__ import annotations

import pytest
import torch

from batchrun.engine.sampler import Sampler
from batchrun.engine.warmup import warm_sampler
from batchrun.kernels import triton_aot
from batchrun.kernels.binding import bind_kernels
from benchmarks import compile_counts
from tests.support.sampling import STEP_KINDS

pytest.importorskip("triton")

if triton_aot.triton_supported() is not None:
    pytestmark = pytest.mark.skip(reason=triton_aot.triton_supported())
elif compile_counts.interpreted():
    pytestmark = pytest.mark.skip(reason="under TRITON_INTERPRET the kernels are not JITFunctions")


@pytest.mark.parametrize("vocab", [49152, 151936])  # SmolLM2's and Qwen3's vocabularies
def test_sampled_steps_compile_nothing_after_the_warm_up(vocab):
    g = torch.Generator().manual_seed(0)
    with triton_aot.compile_only(90) as log:
        kernels = bind_kernels(log.target, torch.float32)  # the sampling kernels an sm_90 engine binds
        sampler = Sampler(0, race=kernels.sample, spill=kernels.spill)
        warm_sampler(sampler.draw, torch.randn(4, vocab, generator=g))  # a warm-up step's logits
        warmed = {v.key: v.launches for v in log.variants}
        assert {v.name for v in log.variants} == {"_gumbel_sample_kernel", "_spill_threshold_kernel"}
        for params in STEP_KINDS.values():
            for num_rows in (1, 2, 5, 16, 33):
                rows = [params[i % len(params)] for i in range(num_rows)]
                logits = torch.randn(num_rows, vocab, generator=g)
                sampler.draw(logits, rows, list(range(num_rows)), [7] * num_rows)
    assert not log.failures, [v.error for v in log.failures]
    new = [f"{v.name} {v.key}" for v in log.variants if v.key not in warmed]
    assert not new, f"compiled after the warm-up: {new}"
    assert sum(v.launches for v in log.variants) > sum(warmed.values()), "the steps launched nothing"
