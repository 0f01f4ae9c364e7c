"""Read a GGUF file's quantized blocks as our formats, without a round trip through float.

Q8_0 -> int8 in groups of 32 (w = d * q); Q4_1 -> int4 in groups of 32 (w = d * q + m);
Q4_0 -> int4 with min = -8 * d. The block scales are float16 in both formats, so the mapping is
exact: dequantizing our tensors gives the same float32 values as gguf's own dequantizer (tested).
Other block types (K-quants, IQ*, floats) are left to the float path in `loader`.

llama.cpp's converter permutes the rows of Llama's q and k projections (rotary pairs interleaved
instead of split in halves); transformers undoes that when it loads a GGUF, so the same row
permutation is undone here. It moves whole rows, so it applies to quantized rows unchanged.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import numpy as np
import torch

from batchrun.kernels.quant.formats import pack_int4
from batchrun.model.quant.weights import QuantizedWeight

GGUF_BLOCK_SIZE = 32
# GGUF tensor name -> module name in our decoder's HF naming, without the "model." prefix.
_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens", "output.weight": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")
# Architectures whose converter permutes q/k rows (transformers' LlamaTensorProcessor).
_PERMUTED_QK_ARCHS = ("llama",)


def gguf_module_name(gguf_name: str) -> Optional[str]:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _blocks(raw: np.ndarray, num_rows: int, block_bytes: int) -> np.ndarray:
    """(rows, bytes) uint8 -> (rows, num_blocks, block_bytes)."""
    return np.ascontiguousarray(raw).reshape(num_rows, -1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block: (rows, num_blocks)."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].copy())


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """GGUF 4-bit block bytes (rows, blocks, 16) -> values (rows, blocks * 32) in element order:
    byte j holds element j in its low nibble and element j + 16 in its high nibble."""
    q = np.concatenate((qs & 0xF, qs >> 4), axis=-1)  # (rows, blocks, 32)
    return torch.from_numpy(q.reshape(q.shape[0], -1).copy())


def blocks_to_weight(raw: np.ndarray, type_name: str, num_rows: int, num_cols: int) -> QuantizedWeight:
    """One GGUF tensor's bytes (rows, bytes per row) -> QuantizedWeight (rows, num_cols)."""
    if type_name == "Q8_0":
        b = _blocks(raw, num_rows, 2 + GGUF_BLOCK_SIZE)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(num_rows, num_cols).copy())
        return QuantizedWeight("int8", q, _f16(b, 0).float(), None, num_cols)
    if type_name == "Q4_1":
        b = _blocks(raw, num_rows, 4 + GGUF_BLOCK_SIZE // 2)
        return QuantizedWeight("int4", pack_int4(_nibbles(b[..., 4:])), _f16(b, 0), _f16(b, 2), num_cols)
    if type_name == "Q4_0":
        b = _blocks(raw, num_rows, 2 + GGUF_BLOCK_SIZE // 2)
        d = _f16(b, 0)
        return QuantizedWeight("int4", pack_int4(_nibbles(b[..., 2:])), d, d * -8.0, num_cols)
    raise ValueError(f"GGUF type {type_name} has no native mapping")


NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def _field(reader: Any, key: str) -> Optional[Any]:
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    value = f.parts[f.data[0]]
    return value.tobytes().decode() if value.dtype == np.uint8 else value[0].item()


def unpermute_rows(w: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """Undo llama.cpp's rotary row permutation of a q or k projection (whole rows move)."""
    rows = w.out_features
    perm = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)
    return QuantizedWeight(
        w.format, w.qweight[perm], w.scales[perm], None if w.mins is None else w.mins[perm], w.in_features
    )


def read_gguf_weights(path: str) -> dict[str, QuantizedWeight]:
    """Module name -> QuantizedWeight for every Q8_0/Q4_0/Q4_1 tensor we have a name for."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or num_heads
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        name = gguf_module_name(t.name)
        type_name = t.tensor_type.name
        if name is None or type_name not in NATIVE_TYPES:
            continue
        num_cols, num_rows = int(t.shape[0]), int(t.shape[1])  # GGUF lists dims innermost first
        w = blocks_to_weight(np.asarray(t.data), type_name, num_rows, num_cols)
        if arch in _PERMUTED_QK_ARCHS and num_heads:
            if name.endswith("self_attn.q_proj"):
                w = unpermute_rows(w, num_heads)
            elif name.endswith("self_attn.k_proj"):
                assert num_kv_heads
                w = unpermute_rows(w, num_kv_heads)
        out[name] = w
    return out
