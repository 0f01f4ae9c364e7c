"""The Gumbel race on the CPU: kernels/sampling.py's `gumbel_sample` by the native kernel
(csrc/sampling.cpp), the torch reference where the kernels are not built or are switched off.

The kernel computes the reference's float32 values op by op (the same hash bits, u, series and
division by the temperature, no fused multiply-add); its `log` is the correctly rounded one, which
torch's CPU log (SLEEF) and the GPU's may miss by the last bit. So it picks the reference's tokens
except where the two best race keys of a row are within a rounding of `log` of each other.
"""

from __future__ import annotations

from typing import Optional

import torch

from batchrun.kernels import cpu_native
from batchrun.kernels.sampling import RaceFn, _token_words, gumbel_sample_reference


def gumbel_sample_native(
    logits: torch.Tensor,  # (B, V) float32 or bf16 (others are widened to float32), on the CPU
    rows: torch.Tensor,  # (3, B) int64: kernels/sampling.pack_rows
    threshold: Optional[torch.Tensor] = None,  # (B,) float32, or None
    keys_out: Optional[torch.Tensor] = None,  # (B, V) float32: every token's race key, for the tests
) -> torch.Tensor:
    """(B,) int64: `gumbel_sample` by the native kernel (built: the caller checked)."""
    if logits.dtype not in cpu_native.DTYPE_CODES:
        logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    rows = rows.contiguous()
    assert rows.shape == (3, num_rows) and rows.dtype == torch.int64
    out = torch.empty(num_rows, dtype=torch.int64)
    if num_rows == 0:
        return out
    if threshold is not None:
        threshold = threshold.float().contiguous()
        assert threshold.shape == (num_rows,)
    if keys_out is not None:
        assert keys_out.shape == (num_rows, vocab) and keys_out.dtype == torch.float32 and keys_out.is_contiguous()
    err = cpu_native.loaded().batchrun_gumbel_sample(
        logits.data_ptr(),
        cpu_native.DTYPE_CODES[logits.dtype],
        num_rows,
        vocab,
        logits.stride(0),
        rows.data_ptr(),
        threshold.data_ptr() if threshold is not None else None,
        _token_words(vocab, logits.device).data_ptr(),
        out.data_ptr(),
        keys_out.data_ptr() if keys_out is not None else None,
        torch.get_num_threads(),
    )
    assert err == 0, f"batchrun_gumbel_sample failed ({err})"
    return out


def cpu_race() -> RaceFn:
    """The CPU's race kernel: the native one when built and enabled (BATCHRUN_CPU_KERNELS), else
    the torch reference."""
    if cpu_native.enabled() and cpu_native.available():
        return gumbel_sample_native
    return gumbel_sample_reference
