"""What one bf16 decode step launches on the GPU dispatch path, counted on the CPU.

An interpreted child (TRITON_INTERPRET=1) runs the engine's graphed decode step over the kernel set
of a simulated sm_90 GPU (kernels/target.py, kernels/bind_triton.py: CPU tensors take the GPU's
kernels, launchers size for an H100/H200), counting each Triton launch and each torch op that issues a CUDA kernel
(benchmarks.gpu_launches). The counts are pinned by kernel, per layer and per step, so a kernel
added to the step fails here; the 28-layer figure (Qwen3-0.6B's depth) must stay within the limit.
Sampling is not part of the step counted.

The fused path (kernels/fused_projections.py: the qkv and gate/up GEMMs with their elementwise
kernels, the embedding with layer 0's norm) is what the count takes; on a GPU it runs where start-up
tuning measured it faster, else the unfused kernels, whose count is pinned too.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.interpreted import interpreted_rows

pytest.importorskip("triton")

# Qwen3 (q/k-norm, GQA, silu MLP), bf16, one decode split.
PER_LAYER = {
    "aten:linear": 2,  # o and down projections (cuBLAS)
    "triton:_gemm_qkv_kernel": 1,  # qkv projection + q/k-norm, rotary and the KV write
    "triton:_rms_norm_kernel": 2,  # residual add + norm before attention (layers 1..) and before the MLP
    "triton:_decode_kernel": 1,
    "triton:_gemm_silu_mul_kernel": 1,  # gate/up projection + silu(gate) * up
}
PER_STEP = {
    "aten:copy_": 1,  # the uploaded block tables into the graphs' static table (the other inputs are read in place)
    "triton:_embed_rms_norm_kernel": 1,  # the embedding and layer 0's norm (the final norm is counted per layer)
    "triton:_gemm_logits_kernel": 1,  # LM head with the logits' float32 cast
}  # rotary's cos/sin: read from tables made at load by the qkv kernel, nothing per step
LIMIT_28_LAYERS = 200  # the fused path launches 28 * 7 + 3 = 199
# The unfused path (a kernel set bound with fuse=False; on a GPU, each fusion where it measured slower)
UNFUSED_PER_LAYER = {
    "aten:linear": 4,  # qkv, o, gate_up, down projections
    "triton:_rms_norm_kernel": 2,
    "triton:_qkv_kernel": 1,  # q/k-norm, rotary and the KV write
    "triton:_decode_kernel": 1,
    "triton:_silu_mul_kernel": 1,
}
UNFUSED_PER_STEP = {"aten:copy_": 1, "aten:embedding": 1, "triton:_rms_norm_kernel": 1, "aten:linear": 1, "aten:to": 1}


def test_decode_step_kernel_count_interpreted():
    result = interpreted_rows(__file__, timeout=600)[-1]
    assert result["per_layer"] == PER_LAYER, result
    assert result["per_step"] == PER_STEP, result
    # the extrapolation is what a deeper model launches: checked directly at 4 layers
    assert result["four_layers"] == sum(PER_STEP.values()) + 4 * sum(PER_LAYER.values()), result
    assert result["copies"] == 1 and result["syncs"] == 0, result  # one upload, nothing read back
    assert result["total_28"] <= LIMIT_28_LAYERS, result
    want = {
        n: UNFUSED_PER_STEP.get(n, 0) + 2 * UNFUSED_PER_LAYER.get(n, 0)
        for n in {**UNFUSED_PER_STEP, **UNFUSED_PER_LAYER}
    }
    assert result["unfused_two_layers"] == want, result
    # the same step's logits, fused and unfused (same weights, same inputs): the fusions change
    # only GEMM sum orders, so bf16 logits agree to a few units in their last place
    assert result["logits_max_diff"] <= 4 * 2**-8 * result["logits_max"], result
    assert result["same_argmax"], result


def _child() -> dict:
    import torch

    from benchmarks.gpu_launches import decode_step_launches, format_figures, launch_figures, tiny_decoder

    figures = launch_figures("qwen3", 28, torch.bfloat16)
    print(format_figures(figures, "qwen3 bf16"), file=sys.stderr)
    four = decode_step_launches(tiny_decoder("qwen3", 4, torch.bfloat16))
    fused = decode_step_launches(tiny_decoder("qwen3", 2, torch.bfloat16)).logits
    unfused = decode_step_launches(tiny_decoder("qwen3", 2, torch.bfloat16, fuse=False))
    assert fused is not None and unfused.logits is not None
    return {
        "logits_max_diff": float((fused - unfused.logits).abs().max()),
        "logits_max": float(unfused.logits.abs().max()),
        "same_argmax": bool(torch.equal(fused.argmax(-1), unfused.logits.argmax(-1))),
        "unfused_two_layers": dict(unfused.kernels),
        "per_layer": dict(figures.per_layer),
        "per_step": dict(figures.per_step),
        "total_28": figures.total,
        "four_layers": four.total,
        "copies": four.copies,
        "syncs": four.syncs,
    }


if __name__ == "__main__":
    print(json.dumps(_child()), flush=True)
