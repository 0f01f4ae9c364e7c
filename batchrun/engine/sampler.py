"""Turns the last-position logits of a step into tokens: greedy, temperature, top-k, top-p.

Greedy rows are one vectorized argmax. Sampled rows draw with their own request's generator, so
a seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import torch

from batchrun.engine.config import SamplingParams

log = logging.getLogger(__name__)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the logits outside the top-k and outside the smallest top-p nucleus.

    logits: (vocab_size,) or (batch, vocab_size), float32. The most likely token always survives.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        keep = torch.topk(logits, top_k, dim=-1).indices
        drop = torch.ones_like(logits, dtype=torch.bool).scatter(-1, keep, False)  # exactly k survive, even with ties
        logits = logits.masked_fill(drop, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # A token is dropped when the mass strictly before it already reaches top_p.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: (vocab_size,) float32."""
    masked = apply_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    return torch.softmax(masked, dim=-1)


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,  # (num_rows, vocab_size) float32
        params: Sequence[SamplingParams],
        generators: Sequence[Optional[torch.Generator]],
    ) -> tuple[list[int], Optional[list[dict[int, float]]]]:
        """Return one token per row, and per-row top-N logprobs when any row asks for them."""
        assert logits.shape[0] == len(params) == len(generators)
        tokens = logits.argmax(dim=-1).tolist()
        for row, (p, gen) in enumerate(zip(params, generators)):
            if p.is_greedy:
                continue
            probs = sampling_probs(logits[row], p)
            tokens[row] = int(torch.multinomial(probs, 1, generator=gen))
        logprobs = None
        if any(p.logprobs is not None for p in params):
            logprobs = []
            lp_all = torch.log_softmax(logits, dim=-1)
            for row, p in enumerate(params):
                if p.logprobs is None:
                    logprobs.append({})
                    continue
                lp = lp_all[row]
                entry = {tokens[row]: float(lp[tokens[row]])}
                if p.logprobs > 0:
                    vals, idx = torch.topk(lp, min(p.logprobs, lp.shape[-1]))
                    entry.update({int(i): float(v) for v, i in zip(vals, idx)})
                logprobs.append(entry)
        return tokens, logprobs
