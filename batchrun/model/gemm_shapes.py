"""`gemm_shapes`: the GEMMs a prepared decoder's step runs through a Triton kernel whose choice start-up
tuning makes (kernels/tuning.py): the fused projections its kernel set may fuse (a bf16/fp16
model's plain qkv, silu gate/up and LM-head projections; qkv only over a float KV cache) and its
W8A16/W4A16 layers' dequantize-GEMMs. Read from the modules as the kernel set bound them, so the
list is exactly what the step's calls can ask the tuning for.
"""

from __future__ import annotations

from torch import nn

from batchrun.kernels.gemm_tiles import group_constexpr, w4a16_group
from batchrun.kernels.tuning import GemmShape
from batchrun.model.decoder import MLP, Attention, DecoderLM
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
