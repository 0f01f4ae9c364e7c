"""Per-token LoRA updates beside a linear's base GEMM, for a step whose adapter tokens are spread
over slots (a decode step): `lora_rows_native` runs csrc/lora.cpp (built by cpu_native), bound as
KernelSet.lora_rows where the native CPU kernels are built and on. The plain-torch path it is
tested against, and that serves everywhere else, is model/lora.py: LoraLinear's gather, batched
matmuls and index_add (KernelSet.lora_rows None)."""

from __future__ import annotations

import torch

from batchrun.kernels import cpu_native


def lora_rows_native(
    x2: torch.Tensor,
    y2: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
) -> bool:
    """y2[t] += lora_bt[s].T @ (lora_a[s] @ x2[t]) in place for every token t with slot
    s = token_slots[t] >= 0 (and ranks[s] > 0): x2 (T, in), y2 (T, out) float32 or bf16 host
    tensors, both unit last stride; lora_a (S, R, in), lora_bt (S, R, out) float32 contiguous (B
    transposed, scale folded in); token_slots (T,) and ranks (S,) int64 contiguous. Accumulates in
    float32; a bf16 y is rounded once, after the add. False (nothing done) where the tensors are not
    in a form the kernel takes: the caller takes the torch path."""
    dtype = x2.dtype
    if (
        dtype not in cpu_native.DTYPE_CODES
        or y2.dtype != dtype
        or x2.stride(-1) != 1
        or y2.stride(-1) != 1
        or lora_a.dtype != torch.float32
        or lora_bt.dtype != torch.float32
        or not lora_a.is_contiguous()
        or not lora_bt.is_contiguous()
    ):
        return False
    num_slots, rank, in_features = lora_a.shape
    rc = cpu_native.loaded().batchrun_lora_rows(
        x2.data_ptr(),
        cpu_native.DTYPE_CODES[dtype],
        x2.shape[0],
        in_features,
        x2.stride(0),
        y2.data_ptr(),
        y2.stride(0),
        y2.shape[1],
        lora_a.data_ptr(),
        lora_bt.data_ptr(),
        num_slots,
        rank,
        token_slots.data_ptr(),
        ranks.data_ptr(),
        torch.get_num_threads(),
    )
    assert rc == 0, f"batchrun_lora_rows failed ({rc})"
    return True
