"""Giving a freshly loaded model its linear backends for the engine's settings (`engine.quantization`)
and kernel set, with the calibration pass W8A8 needs first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.request import Request
from batchrun.engine.runners import ModelRunner
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.kernels.kernel_set import KernelSet
from batchrun.model.decoder import DecoderLM
from batchrun.model.invariant import use_invariant_linears
from batchrun.model.prepare import prepare_linears
from batchrun.model.quant import QuantizationSummary, QuantizedWeight, calibration_token_ids, collect_input_absmax


def prefill_forward(
    model: DecoderLM, block_size: int, dtype: torch.dtype, device: torch.device
) -> Callable[[list[int]], None]:
    """A function that runs one token list through the model as a fresh prompt (for hooks)."""

    def run(token_ids: list[int]) -> None:
        num_blocks = -(-len(token_ids) // block_size)
        runner = ModelRunner(model, num_blocks, block_size, dtype, device)
        req = Request(0, 0, list(token_ids), SamplingParams(temperature=0.0), 0.0)
        req.block_ids = list(range(num_blocks))
        runner.forward(ScheduledBatch([req], [len(token_ids)]))

    return run


def prepare_linears_for_engine(
    model: DecoderLM,
    config: EngineConfig,
    tokenizer: Any,
    gguf_weights: Optional[dict[str, QuantizedWeight]],
    kernels: KernelSet,
) -> QuantizationSummary:
    """prepare_linears with the engine's settings and kernel set. W8A8 first measures each
    projection's input range on 1k tokens of built-in text, with the float model, so SmoothQuant can
    even out the activations. With engine.batch_invariant where the kernel set has a batch-invariant
    matmul (a GPU's Triton set: cuBLAS's rows depend on the batch), every linear runs it instead
    (model/invariant.py); the quantized GEMMs there pick tiles and split-K by row count, so that
    combination is refused. A GPU without Triton has no such matmul: refused too."""
    target, dtype = kernels.target, kernels.dtype
    if config.batch_invariant and target.gpu is not None and kernels.invariant_matmul is None:
        raise ValueError(
            "engine.batch_invariant=true needs triton on a GPU (its linears run a Triton matmul, cuBLAS's "
            "rows depend on the batch); install triton or turn engine.batch_invariant off"
        )
    if config.batch_invariant and kernels.invariant_matmul is not None:
        if config.quantization != "none":
            raise ValueError(
                f"engine.batch_invariant=true is not supported with engine.quantization={config.quantization} on a "
                "GPU (its GEMMs pick tiles and split-K by row count); set engine.quantization=none or turn it off"
            )
        summary = prepare_linears(model, "none", kernels=kernels)  # the float layers stay nn.Linear: swapped below
        use_invariant_linears(model, kernels.invariant_matmul)
        return summary
    input_absmax = None
    if config.quantization == "w8a8":
        run = prefill_forward(model, config.block_size, dtype, target.device)
        # calibration prompts no longer than the model's positions (its rope table's rows)
        seq_len = min(512, model.spec.max_position_embeddings)
        input_absmax = collect_input_absmax(model, run, calibration_token_ids(tokenizer, seq_len=seq_len))
    return prepare_linears(
        model,
        config.quantization,
        target.device,
        dtype,
        group_size=config.quant_group_size,
        prequantized=gguf_weights,
        input_absmax=input_absmax,
        outlier_channels=config.w8a8_outlier_channels,
        kernels=kernels,
    )
