"""Admission: turns what a caller streams in (a prompt, or an EngineRequest) into engine Requests.

One item becomes params.n Requests, one per sample, with consecutive seq_ids. Each sampled request
gets its sampling seed here, once: the caller's SamplingParams.seed, else one derived from the
engine seed and the first sample's seq_id; sample i's seed is `sample_seed(base, i)`, so sample 0
draws what a lone request with that seed draws. A prompt that can never run (bad token ids, empty,
longer than max_model_len, an adapter not in engine.lora_adapters, a thinking budget on an engine
without think tags) yields requests already finished with an error, never an exception. With
think tags each sample gets its own trace state (engine/reasoning.py), its phase read off the prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

from batchrun.engine.config import SamplingParams
from batchrun.engine.grammar import GrammarCompiler
from batchrun.engine.outputs import EngineRequest
from batchrun.engine.reasoning import ThinkingState, ThinkTags
from batchrun.engine.request import Request
from batchrun.engine.sampler import sample_seed

SEED_STRIDE = 1_000_003  # unseeded requests: seed = engine seed * SEED_STRIDE + first seq_id


class Admission:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        engine_seed: int,
        grammars: GrammarCompiler,
        adapter_names: Sequence[str] = (),
        think_tags: Optional[ThinkTags] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.engine_seed = engine_seed
        self.grammars = grammars
        self.adapter_names = frozenset(adapter_names)  # engine.lora_adapters' names
        self._known_adapters = ", ".join(sorted(adapter_names)) or "none"
        self.next_seq_id = 0  # seq_ids are engine-unique and increasing: the admission order
        # The engine's think tags (engine/reasoning.py): each request gets a trace state; None: none does.
        self.think_tags = think_tags

    def build(self, item: Any, index: int, default_params: SamplingParams) -> list[Request]:
        """The params.n sample requests of one item; when the prompt can never run, every one is
        already finished with finish_reason "error" and nothing else is set up for them."""
        adapter: Optional[str] = None
        if isinstance(item, EngineRequest):
            request_id, prompt, params = item.request_id, item.prompt, item.params or default_params
            adapter = item.adapter
        else:
            request_id, prompt, params = index, item, default_params
        now = time.perf_counter()
        first_seq_id = self.next_seq_id
        self.next_seq_id += params.n
        base_seed: Optional[int] = None
        if not params.is_greedy:
            base_seed = params.seed if params.seed is not None else self.engine_seed * SEED_STRIDE + first_seq_id
        token_ids, error = self._tokenize(prompt)
        if error is None and adapter is not None and adapter not in self.adapter_names:
            error = f"unknown adapter {adapter!r} (known: {self._known_adapters})"
        tags = self.think_tags
        if error is None and params.max_thinking_tokens is not None and tags is None:
            error = "max_thinking_tokens: the model's tokenizer has no think tags (set engine.think_tags)"
        samples = []
        for i in range(params.n):
            seed = sample_seed(base_seed, i) if base_seed is not None else None
            samples.append(Request(first_seq_id + i, request_id, token_ids, params, now, seed, i, adapter))
        if error is not None:
            for req in samples:
                req.finish_reason, req.error = "error", error
            return samples
        if params.is_constrained:
            for req in samples:  # compiles while the prompt is prefilled; each sample its own matcher
                req.grammar = self.grammars.new_state(params.constraint_key)
        if tags is not None:
            budget, constrained = params.max_thinking_tokens, params.is_constrained
            for req in samples:
                req.thinking = ThinkingState.for_prompt(tags, token_ids, budget, constrained)
        return samples

    def _tokenize(self, prompt: Any) -> tuple[list[int], Optional[str]]:
        """(token ids, None), or (whatever ids there are, why the prompt can never run)."""
        token_ids: list[int] = []
        error = None
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
            if any(t < 0 or t >= self.vocab_size for t in token_ids):
                error = f"prompt token ids must be in [0, {self.vocab_size})"
        else:
            error = f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}"
        if error is None and not token_ids:
            error = "prompt is empty (no tokens)"
        if error is None and len(token_ids) + 1 > self.max_model_len:
            error = (
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)"
            )
        return token_ids, error
