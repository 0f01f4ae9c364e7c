"""The token embedding and layer 0's RMSNorm in one Triton launch: one program per token gathers
its embedding row, stores it (the residual stream layer 0 starts from) and stores its norm, with
`triton_elementwise._norm`, the op sequence and block `rms_norm` uses: bitwise the embedding
followed by `triton_elementwise.rms_norm`. Non-Gemma norms only (Gemma scales the embedding by
sqrt(d) in between)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.triton_elementwise import _inverse, _norm


@triton.jit
def _embed_rms_norm_kernel(
    ids_ptr,
    table_ptr,
    w_ptr,
    x_out_ptr,
    out_ptr,
    n,
    inv_n,
    eps,
    stride_t,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(ids_ptr + row).to(tl.int64)  # int64: token * stride_t passes 2**31 on wide tables
    d = tl.arange(0, BLOCK)
    ok = d < n
    x = tl.load(table_ptr + token * stride_t + d, mask=ok, other=0.0)
    tl.store(x_out_ptr + row * stride_x + d, x, mask=ok)
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    out = _norm(x.to(tl.float32), w, inv_n, eps, False)
    tl.store(out_ptr + row * stride_o + d, out.to(out_ptr.dtype.element_ty), mask=ok)


def embed_rms_norm(
    input_ids: torch.Tensor,  # (num_tokens,) int
    table: torch.Tensor,  # (vocab_size, n)
    weight: torch.Tensor,  # (n,) the norm's weight, in table's dtype
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(table[input_ids]), table[input_ids]), each (num_tokens, n)."""
    assert input_ids.dim() == 1 and table.stride(1) == 1
    num_tokens, n = input_ids.shape[0], table.shape[1]
    x = torch.empty((num_tokens, n), dtype=table.dtype, device=table.device)  # (num_tokens, n)
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out, x
    _embed_rms_norm_kernel[(num_tokens,)](
        input_ids,
        table,
        weight,
        x,
        out,
        n,
        _inverse(n),
        float(eps),
        table.stride(0),
        x.stride(0),
        out.stride(0),
        BLOCK=triton.next_power_of_2(n),
        enable_fp_fusion=False,
    )
    return out, x
