"""What a runner hands on: a forward's logits (to its sampler) and a step pending on the device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from batchrun.engine.scheduler import ScheduledBatch, StepResult


@dataclass
class ForwardOutput:
    # (num_rows, vocab_size) float32 on the model's device (the sampler, the drafter and verification
    # all work there; only token ids come back): per request in `sample_seq_ids`, the row of its last
    # real token followed by one row per draft token it carried (1 + num_spec rows)
    logits: torch.Tensor
    sample_seq_ids: list[int]  # seq_id of each request whose token list was fully computed this step
    num_rows: list[int]  # rows of `logits` per request in sample_seq_ids
    # Requests scoring their prompt (SamplingParams.prompt_logprobs): seq_id -> (index of the first
    # prompt token scored this step minus one, per scored token {token_id: logprob} of it and the top-N)
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    graphed: bool = False  # replayed from a CUDA graph (runners/cuda_graphs.py)


@dataclass
class PendingStep:
    """A decode step whose tokens are on the device, on their way to the host (the GPU runner with
    engine.async_scheduling): one plain token per request, nothing else to report."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # (num_seqs,) int64 on the device: row i is batch.requests[i]'s token
    host: torch.Tensor  # (num_seqs,) int64, pinned on a GPU: where the tokens are copied
    ready: Optional[torch.cuda.Event]  # recorded after the copy; None on the CPU (the copy is done)
    rows: dict[int, int] = field(default_factory=dict)  # seq_id -> its row of `tokens`
    held: bool = False  # a step ahead was scheduled from it: its requests' places are held

    def wait(self) -> list[int]:
        """The tokens on the host (waits for this step, not for the steps launched after it)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def result(self) -> StepResult:
        tokens = self.wait()
        return StepResult(self.batch, {r.seq_id: [t] for r, t in zip(self.batch.requests, tokens)}, held=self.held)
