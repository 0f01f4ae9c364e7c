"""Teacher-forced quality of a model against another (top-1 agreement, perplexity), and an engine
per quantization mode: shared by the quantization benchmark and the quality tests.

A library module (no `__main__`): the tests import from here, never from benchmarks.quant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from batchrun.engine import Engine, EngineConfig, SamplingParams
from batchrun.engine.request import Request
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.testing import sample_texts


@dataclass
class TeacherForced:
    """Per predicted position (every token but each sequence's last), concatenated over sequences."""

    argmax: torch.Tensor  # (num_predicted,) int64: the model's top-1 next token
    nll: torch.Tensor  # (num_predicted,) float64: -log p(actual next token)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())


def agreement(base: TeacherForced, other: TeacherForced) -> float:
    """Fraction of positions where both models pick the same top-1 token."""
    return (base.argmax == other.argmax).double().mean().item()


def quality_sequences(tokenizer, num_seqs: int = 8, seq_len: int = 512) -> list[list[int]]:
    """The first `seq_len` tokens of the first `num_seqs` pydoc topics at least that long."""
    out = []
    for text in sample_texts():
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= seq_len:
            out.append(ids[:seq_len])
        if len(out) == num_seqs:
            return out
    raise ValueError(f"only {len(out)} sample texts have {seq_len} tokens")


@torch.inference_mode()
def teacher_forced(model, runner, sequences: list[list[int]], logits_rows: int = 256) -> TeacherForced:
    """Run the sequences through a model and its runner's paged KV cache (the engine must be idle:
    this writes to the cache's first blocks)."""
    bs = runner.block_size
    reqs, next_block = [], 0
    for i, ids in enumerate(sequences):
        num_blocks = -(-len(ids) // bs)
        req = Request(i, i, list(ids), SamplingParams(temperature=0.0), 0.0)
        req.block_ids = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        reqs.append(req)
    assert next_block <= runner.kv_caches[0][0].shape[0], f"needs {next_block} KV blocks"
    hidden: list[list[torch.Tensor]] = [[] for _ in sequences]
    for lens in ([1] * len(sequences), [len(s) - 1 for s in sequences]):
        input_ids, positions, meta = runner.prepare(ScheduledBatch(reqs, lens))[:3]
        h = model(input_ids, positions, runner.kv_caches, meta)  # (num_tokens, hidden_size)
        for i, part in enumerate(h.split(lens)):
            hidden[i].append(part)
            reqs[i].num_computed_tokens += lens[i]
    argmax, nll = [], []
    for ids, parts in zip(sequences, hidden):
        h = torch.cat(parts)[:-1]
        targets = torch.tensor(ids[1:], device=h.device)
        for start in range(0, h.shape[0], logits_rows):
            logp = torch.log_softmax(model.compute_logits(h[start : start + logits_rows]), dim=-1)
            argmax.append(logp.argmax(dim=-1).cpu())
            nll.append(-logp.gather(1, targets[start : start + logits_rows, None])[:, 0].double().cpu())
    return TeacherForced(torch.cat(argmax), torch.cat(nll))


def engine_teacher_forced(engine: Engine, sequences: list[list[int]]) -> TeacherForced:
    return teacher_forced(engine.model, engine.runner, sequences)


def make_engine(
    quantization: str = "none",
    dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
    cache_dir: Optional[str] = None,
    threads: Optional[int] = None,
    kv_cache_memory: float = 256 << 20,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    group_size: int = 32,
) -> Engine:
    """An engine for one mode. `quantization` may carry a setting after "@": "int4@64" is int4 in
    groups of 64, "w8a8@0" is W8A8 with no input channels kept in float."""
    quantization, _, setting = quantization.partition("@")
    extra: dict[str, Any] = {}
    if setting and quantization == "w8a8":
        extra["w8a8_outlier_channels"] = int(setting)
    elif setting:
        group_size = int(setting)
    # Fixed batch limits: the start-up profile would pick per mode and blur the comparison.
    return Engine(
        EngineConfig(
            model="smollm2-135m",
            dtype=dtype,
            device="cpu",
            quantization=quantization,
            quant_group_size=group_size,
            **extra,
            kv_cache_dtype=kv_cache_dtype,
            cache_dir=cache_dir,
            num_threads=threads,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )
