"""The quantized KV cache: int8 or float8_e4m3fn (..., head_dim) with one float32 scale per
(token, head), and `QuantizedKVCache`, which stands in for one layer's float cache tensor."""

from __future__ import annotations

import torch

from batchrun.kernels.kv_layout import from_head_major, slots_by_head
from batchrun.kernels.quant.formats import FP8_E4M3_MAX, INT8_MAX, INV_FP8_E4M3_MAX, INV_INT8_MAX, MIN_SCALE

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, num_kv_heads, head_dim) float -> (same shape in `dtype`, scales (num_tokens, num_kv_heads)).

    scale = max(amax * fl32(1 / qmax), MIN_SCALE), then x / scale (a true division, tensor by tensor,
    IEEE on every device) clamped to +-qmax and rounded to nearest even: the Triton kernels
    (kernels/triton_kv.py) and the native CPU write (csrc/elementwise.cpp) do the same operations."""
    int8 = dtype == torch.int8
    qmax = INT8_MAX if int8 else FP8_E4M3_MAX
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1).float()
    scale = (amax * (INV_INT8_MAX if int8 else INV_FP8_E4M3_MAX)).clamp_(min=MIN_SCALE)  # (num_tokens, num_kv_heads)
    xs = (x.float() / scale[..., None]).clamp_(-qmax, qmax)
    q = torch.round(xs).to(dtype) if dtype == torch.int8 else xs.to(dtype)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_kv for any leading shape: q (..., head_dim), scale (...)."""
    return (q.to(torch.float32) * scale[..., None]).to(dtype)


class QuantizedKVCache:
    """One layer's K (or V) cache held as int8/fp8 with a float32 scale per (slot, head).

    It stands in for the float cache tensor in `paged_attention`: `.shape` is the logical
    (num_blocks, block_size, num_kv_heads, head_dim), the storage is head-major like the float
    cache's (kernels/attention.py), and `gather_blocks` / `gather_slots` return the gathered
    entries dequantized to `out_dtype`, so attention reads floats and the float path keeps its code.
    `write_kv_cache` quantizes new entries on the way in.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> None:
        assert data.shape[:-1] == scale.shape
        self.data = data  # (num_blocks, block_size, num_kv_heads, head_dim) int8 | float8_e4m3fn
        self.scale = scale  # (num_blocks, block_size, num_kv_heads) float32
        self.out_dtype = out_dtype

    @staticmethod
    def empty(
        shape: tuple[int, ...], dtype: torch.dtype, out_dtype: torch.dtype, device: torch.device
    ) -> QuantizedKVCache:
        num_blocks, block_size, num_kv_heads, head_dim = shape
        data = torch.zeros((num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device)
        scale = torch.ones((num_kv_heads, num_blocks, block_size), dtype=torch.float32, device=device)
        return QuantizedKVCache(from_head_major(data), from_head_major(scale), out_dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def gather_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """(num_kv_heads, len(slots), head_dim) dequantized."""
        data, scale = slots_by_head(self.data), slots_by_head(self.scale)
        q = data.view(torch.uint8) if data.dtype != torch.int8 else data  # no float8 index kernel on CPU
        q = q.index_select(1, slots)
        return dequantize_kv(q.view(data.dtype), scale.index_select(1, slots), self.out_dtype)

    def gather_blocks(self, tables: torch.Tensor) -> torch.Tensor:
        """(num_kv_heads, num_seqs, num_blocks * block_size, head_dim) dequantized, like attention.gather_blocks."""
        block_size = self.data.shape[1]
        offsets = torch.arange(block_size, device=tables.device)
        slots = (tables[:, :, None] * block_size + offsets).flatten()
        out = self.gather_slots(slots)
        return out.view(out.shape[0], tables.shape[0], -1, out.shape[-1])

    def __getitem__(self, index) -> torch.Tensor:
        """Indexing the logical (num_blocks, block_size, num_kv_heads, head_dim) shape, dequantized."""
        return dequantize_kv(self.data[index], self.scale[index], self.out_dtype)

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize (num_tokens, num_kv_heads, head_dim) and store it at the given flat slots; a
        negative slot writes nothing (CUDA-graph padding and `capture_all`'s dummy rows).

        Skipping must not read the slots on the host (a sync, and no CUDA-graph capture), so rows
        are never dropped: a row with a negative slot instead repeats the row holding the largest
        slot, which writes the same bytes to the same slot again. With no slot at all, every row
        rewrites slot 0 with what it already holds."""
        if slot_mapping.shape[0] == 0:
            return
        q, scale = quantize_kv(x, self.data.dtype)
        # Indexing has no float8 kernel on the CPU; the bytes are the same through a uint8 view.
        flat = self.data.flatten(0, 1)  # (num_slots, num_kv_heads, head_dim)
        if flat.dtype != torch.int8:
            flat, q = flat.view(torch.uint8), q.view(torch.uint8)
        flat_scale = self.scale.flatten(0, 1)  # (num_slots, num_kv_heads)
        rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
        rows = torch.where(slot_mapping >= 0, rows, slot_mapping.argmax())  # (num_tokens,)
        slots = slot_mapping[rows]
        has_slot = slots >= 0  # False only where no row has a slot
        slots = slots.clamp(min=0)
        q = torch.where(has_slot[:, None, None], q[rows], flat[slots])
        scale = torch.where(has_slot[:, None], scale[rows], flat_scale[slots])
        # Duplicate slots carry identical rows, so whichever copy lands last, the result is the same.
        flat.index_copy_(0, slots, q)
        flat_scale.index_copy_(0, slots, scale)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def kv_bytes_per_token_head(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) costs for one head in the cache, scales included."""
    if kv_dtype in (torch.int8, torch.float8_e4m3fn):
        return head_dim + 4
    return head_dim * torch.finfo(kv_dtype).bits // 8
