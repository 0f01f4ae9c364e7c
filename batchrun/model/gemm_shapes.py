"""The shapes start-up tuning measures (kernels/tuning.py), read from a prepared decoder's modules as
the kernel set bound them, so the list is exactly what the step's calls can ask the tuning for:

- `gemm_shapes`: the GEMMs its step runs through a Triton kernel: the fused projections its
  kernel set may fuse (a bf16/fp16 model's plain qkv, silu gate/up and LM-head projections; qkv
  only over a float KV cache) and its W8A16/W4A16 layers' dequantize-GEMMs.
- `cpu_linear_shapes` and `attention_shape`: on a bf16 CPU, the linears held in the native tiles
  (per kind: `linear_kind`) and the attention, which kernels/cpu_tuning.py times against torch's.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from batchrun.kernels.cpu_tuning import AttentionShape, LinearShape
from batchrun.kernels.gemm_tiles import group_constexpr, w4a16_group
from batchrun.kernels.tuning import GemmShape
from batchrun.model.decoder import MLP, Attention, DecoderLM
from batchrun.model.linear import NativeEmbedding, NativeLinear, NativeSiluMulLinear
from batchrun.model.quant.layers import Int4Linear, Int8Linear

_HALF = ("torch.bfloat16", "torch.float16")


def _is_plain(module: object) -> bool:
    return type(module) is nn.Linear


def gemm_shapes(model: DecoderLM) -> list[GemmShape]:
    """Each distinct (kernel, shape) of the model, in module order."""
    kernels = model.kernels
    shapes: list[GemmShape] = []
    fuses = kernels.binder == "triton" and kernels.options.fuse and str(kernels.dtype) in _HALF
    for module in model.modules():
        if fuses and isinstance(module, Attention) and _is_plain(module.qkv_proj):
            if kernels.options.kv_cache_dtype == "auto":
                s, proj = module.spec, module.qkv_proj
                heads = (s.num_heads, s.num_kv_heads, s.head_dim, proj.bias is not None, s.qk_norm, s.gemma_norms)
                shapes.append(GemmShape("qkv", proj.out_features, proj.in_features, heads=heads))
        elif fuses and isinstance(module, MLP) and not module.fused_act and isinstance(module.gate_up_proj, nn.Linear):
            gate_up = module.gate_up_proj
            if _is_plain(gate_up) and module.activation in ("silu", "swish") and gate_up.bias is None:
                shapes.append(GemmShape("silu_mul", gate_up.out_features, gate_up.in_features))
        elif isinstance(module, Int8Linear) and module.kernel.tile_kernel is not None:
            group_size = module.in_features // module.scales.shape[1]
            group = group_constexpr(group_size, module.in_features)
            shapes.append(GemmShape("w8a16", module.out_features, module.in_features, group, group_size))
        elif isinstance(module, Int4Linear) and module.kernel.tile_kernel is not None:
            group = w4a16_group(module.group_size, module.in_features)
            shapes.append(GemmShape("w4a16", module.out_features, module.in_features, group, module.group_size))
    head = model.lm_head
    if fuses and _is_plain(head) and head.bias is None:
        shapes.append(GemmShape("logits", head.out_features, head.in_features))
    return list(dict.fromkeys(shapes))


_KINDS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down", "lm_head": "lm_head"}


def linear_kind(name: str, module: nn.Module) -> str:
    """The kind a linear held under attribute `name` is measured and chosen as
    (kernels/cpu_choices.py: LinearChoice.kind): "qkv", "o", "gate_up" ("gate_up_silu" where the
    native kernel applies silu(gate) * up), "down", "lm_head", else the attribute's name."""
    kind = _KINDS.get(name, name)
    return kind + "_silu" if isinstance(module, NativeSiluMulLinear) else kind


def cpu_linear_shapes(model: DecoderLM) -> list[LinearShape]:
    """Each distinct (kind, shape) of the linears held in the native tiles, in module order."""
    shapes = []
    for _, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) in (NativeLinear, NativeSiluMulLinear):
                assert isinstance(child, NativeLinear)
                tied = child is model.lm_head and isinstance(model.embed_tokens, NativeEmbedding)
                n, k = child.packed_weight.shape
                shapes.append(LinearShape(linear_kind(name, child), n, k, child.silu_mul, tied, child.bias is not None))
    # the LM head last: the costliest to time, and the first to go if the measurement runs out of time
    return sorted(dict.fromkeys(shapes), key=lambda shape: shape.kind == "lm_head")


def attention_shape(model: DecoderLM, block_size: int) -> Optional[AttentionShape]:
    """The first layer's attention as the CPU kernels see it (None: a model without layers)."""
    s = model.spec
    if not s.num_layers:
        return None
    window = s.layer_windows[0]
    return AttentionShape(
        s.num_heads, s.num_kv_heads, s.head_dim, block_size, s.attn_scale, window, s.attn_logit_softcap
    )
