"""Calibration for W8A8: each projection's input range on real text, SmoothQuant, and the input
channels that stay in float (see docs/quantization.md for why each step is there)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batchrun.kernels import quant as qk

PROJECTION_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def split_outlier_channels(
    weight: torch.Tensor, input_absmax: torch.Tensor, num_channels: int
) -> tuple[torch.Tensor, qk.OutlierChannels]:
    """The `num_channels` input channels (at most an eighth of them) with the largest calibrated |x|
    (after SmoothQuant) kept in float: (the weight with their columns zeroed, for int8 per channel,
    and the OutlierChannels).

    Why: with per-token int8 activations one step serves a whole token, and the few channels that
    stay large after smoothing set that step for all the others. Keeping them in float is what
    brings W8A8 within the int8 quality bound (tests/engine/test_quant_quality.py, docs/quantization.md).
    """
    k = min(num_channels, max(1, weight.shape[1] // 8))
    index = torch.sort(input_absmax.to(weight.device).topk(k).indices).values
    skip = torch.zeros(weight.shape[1], dtype=torch.bool, device=weight.device)
    skip[index] = True
    return (weight.masked_fill(skip[None, :], 0.0), qk.OutlierChannels(index, skip, weight[:, index].t().contiguous()))


def calibration_token_ids(tokenizer, num_seqs: int = 2, seq_len: int = 512) -> list[list[int]]:
    """Real English text shipped with CPython (pydoc topics), taken from the END of the sorted list
    so it stays disjoint from the text the quality tests and benchmark evaluate on (the start)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics, reverse=True):
        ids = tokenizer.encode(topics[key], add_special_tokens=False)
        if len(ids) >= seq_len:
            out.append(ids[:seq_len])
        if len(out) == num_seqs:
            break
    return out


def projections(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every float projection quantization applies to, in module order."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTION_NAMES
    ]


@torch.inference_mode()
def collect_input_absmax(
    model: nn.Module, run_forward: Callable[[list[int]], None], sequences: list[list[int]]
) -> dict[str, torch.Tensor]:
    """Module name -> (in_features,) largest |x| per input channel of each projection, over
    `run_forward(token_ids)` of every sequence (hooks on the projections' inputs)."""
    absmax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, linear in projections(model):

        def hook(_module, inputs, _output, name=name):
            a = inputs[0].reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
            absmax[name] = torch.maximum(absmax[name], a) if name in absmax else a

        hooks.append(linear.register_forward_hook(hook))
    try:
        for ids in sequences:
            run_forward(ids)
    finally:
        for h in hooks:
            h.remove()
    return absmax


def smooth_activations(model: nn.Module, input_absmax: dict[str, torch.Tensor], alpha: float = 0.5) -> int:
    """SmoothQuant: move activation outliers into the weights before W8A8 quantizes both.

    For a projection fed by a norm, x_j is divided by s_j = max|x_j|^alpha / max|W_j|^(1-alpha) and
    W's column j multiplied by it, the division folded into the norm's weight; for down_proj it is
    folded into up_proj's rows (down's input is act(gate) * up). Exact in real arithmetic; it
    evens out per-token int8 steps (a few input channels dominate each token's range otherwise).
    Returns the number of projections smoothed.
    """
    modules = dict(model.named_modules())
    count = 0

    def factors(name: str, linear: nn.Linear) -> torch.Tensor:
        a = input_absmax[name].clamp(min=1e-5)
        w = linear.weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
        return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp(min=1e-5)  # (in_features,)

    def apply(name: str, linear: nn.Linear, s: torch.Tensor) -> None:
        nonlocal count
        with torch.no_grad():
            linear.weight.mul_(s.to(linear.weight.dtype)[None, :])
        input_absmax[name] = input_absmax[name] / s
        count += 1

    def fold_into_norm(norm: nn.Module, s: torch.Tensor) -> None:
        weight = norm.weight
        assert isinstance(weight, torch.Tensor)
        with torch.no_grad():
            if getattr(norm, "is_gemma", False):  # scales by (1 + w)
                weight.copy_(((1.0 + weight.float()) / s - 1.0).to(weight.dtype))
            else:
                weight.copy_((weight.float() / s).to(weight.dtype))

    for prefix, layer in ((n, m) for n, m in modules.items() if n.startswith("layers.") and n.count(".") == 1):
        qkv_name = f"{prefix}.self_attn.qkv_proj"
        if qkv_name in input_absmax:
            qkv = modules[qkv_name]
            s = factors(qkv_name, qkv)
            fold_into_norm(layer.input_layernorm, s)
            apply(qkv_name, qkv, s)
        gate_up_name, down_name = f"{prefix}.mlp.gate_up_proj", f"{prefix}.mlp.down_proj"
        if gate_up_name in input_absmax and down_name in input_absmax:
            gate_up, down = modules[gate_up_name], modules[down_name]
            norm = (
                layer.pre_feedforward_layernorm
                if hasattr(layer, "pre_feedforward_layernorm")
                else layer.post_attention_layernorm
            )
            s = factors(gate_up_name, gate_up)
            fold_into_norm(norm, s)
            apply(gate_up_name, gate_up, s)
            s = factors(down_name, down)
            with torch.no_grad():  # the up half of gate_up's rows feeds down's input channels
                gate_up.weight[down.in_features :].div_(s.to(gate_up.weight.dtype)[:, None])
            apply(down_name, down, s)
    return count
