"""The baseline everyone has: HF transformers `generate` in static batches, timed per step.

Used by the benchmark job (throughput.py) and the GPU check's HF ratio (gpu.py). The model is
loaded by transformers itself from the engine's model path (an HF directory, or a GGUF file that
transformers dequantizes), so nothing of batchrun's model code is in the baseline. Batches are
formed in prompt order, `batch_size` at a time, left padded; every batch runs until all its
sequences end (or max_new_tokens), as static batching does.

Timing, per batch: TTFT is the time from the start of `generate` to the first sampled token (the
batch's prefill), and ITL is the mean time per decode step after it; every request of the batch
gets those two values.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from batchrun.benchmark.timing import TimedRun


def load_hf_model(model_path: str, dtype: torch.dtype = torch.float32, device: Any = None) -> Any:
    """HF transformers' own model for an HF directory or a .gguf file (dequantized), in `dtype` (float32
    by default), moved to `device` when one is given."""
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path),
            gguf_file=os.path.basename(model_path),
            dtype=dtype,
            local_files_only=True,
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True)
    return (model if device is None else model.to(device)).eval()


def cast_model(model: Any, dtype: torch.dtype) -> Any:
    """A copy of `model` in `dtype` (the float32 one stays as it is)."""
    return copy.deepcopy(model).to(dtype)


def count_parameters(hf_config: Any) -> int:
    """Parameters of the model `hf_config` describes (tied weights once), without allocating them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


class _StepTimer:
    """A generate() streamer: `put` is called once with the prompt, then once per sampled step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(
    model: Any,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    batch_size: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    ignore_eos: bool = False,
) -> TimedRun:
    """Greedy `generate` over `prompts` in static batches; outputs trimmed after each sequence's EOS.
    Inputs go to the model's device; reading the outputs back waits for it, so wall_s is complete."""
    from transformers import GenerationConfig

    # An empty EOS list makes generate run to max_new_tokens without suppressing EOS, which is
    # what ignore_eos means in the engine (min_new_tokens would forbid EOS and change the text).
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
        eos_token_id=[] if ignore_eos else list(eos_token_ids),
    )
    eos = set() if ignore_eos else set(eos_token_ids)
    device = next(model.parameters()).device
    run = TimedRun(0.0, [], sum(map(len, prompts)), 0, 0, 0)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in batch])  # (batch, width)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])  # (batch, width)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        timer = _StepTimer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config, streamer=timer
            )
        step_times = timer.times[1:]  # the first put() is the prompt itself
        ttft = step_times[0] - t0
        itl: Optional[float] = (step_times[-1] - step_times[0]) / (len(step_times) - 1) if len(step_times) > 1 else None
        for row in out[:, width:].tolist():
            tokens = _until_eos(row, eos)
            run.token_ids.append(tokens)
            run.num_output_tokens += len(tokens)
            run.ttfts_s.append(ttft)
            if itl is not None and len(tokens) > 1:
                run.itls_s.append(itl)
        run.num_computed_tokens += len(batch) * (width + len(step_times) - 1)
    run.wall_s = time.perf_counter() - start
    return run


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens
