"""Where a request ends: one rule for every way, called from the scheduler's `update`.

As a step's results are handed over, in this order of priority:
  1. its grammar failed to compile: "error", with the request's error set (it produced no token);
  2. per token appended: one of its params' stop_token_ids, or an EOS id unless ignore_eos:
     "stop"; then max_tokens or max_model_len reached: "length" (the tokens a verification step
     produced after it are dropped);
  3. after all of the step's tokens: a stop string in its text, then a grammar that completed
     (its stop token was ignored under ignore_eos, or it ended without one): "stop".
A reasoning request (engine/reasoning.py) that reaches max_tokens or max_model_len with its trace
open ends with "thinking_length"; stop strings are looked for in its answer's text only.
So a token that reaches max_tokens and completes a stop string ends the request with "length"
(its text is still cut at the stop string: detokenizer.output_text). Only an abort ends a request
anywhere else (`Engine.abort_all`).

Stop strings are looked for in the text that can hold a new match, not in the whole output: the
text the step's tokens added (engine/detokenizer.py) plus the longest stop string's length minus
one characters before it. An earlier match would have ended the request at an earlier step.
"""

from __future__ import annotations

from typing import Any, Optional

from batchrun.engine.detokenizer import IncrementalDetokenizer, is_incremental
from batchrun.engine.request import Request


class StopRule:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int, tokenizer: Any = None) -> None:
        self.eos_token_ids = eos_token_ids  # end a request unless its params say ignore_eos
        self.max_model_len = max_model_len  # prompt + output tokens a request may reach
        self.tokenizer = tokenizer  # decodes outputs for stop strings (None: no request may have any)
        self.is_incremental = tokenizer is not None and is_incremental(tokenizer)

    @staticmethod
    def failed(req: Request, error: str) -> str:
        """Its grammar failed to compile: the request ends as an error, with the compiler's message."""
        req.error = error
        return "error"

    def after_token(self, req: Request, token: int) -> Optional[str]:
        """The reason `token`, just appended, ends the request, if it does."""
        p = req.params
        thinking = req.thinking
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            # a separator token the engine forced is the template's whitespace, not the model's stop
            if thinking is None or not thinking.separator_forced:
                return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "thinking_length" if thinking is not None and thinking.in_trace else "length"
        return None

    def after_step(self, req: Request) -> Optional[str]:
        """The reason the request ends once all of this step's tokens are appended, if it does."""
        if req.params.stop and (req.thinking is None or not req.thinking.in_trace) and self.hits_stop_string(req):
            return "stop"
        if req.grammar is not None and req.grammar.is_terminated:
            return "stop"
        return None

    def hits_stop_string(self, req: Request) -> bool:
        """Whether the request's output text (a reasoning request's answer) holds one of its stop
        strings (none did before)."""
        stop = req.params.stop
        # Where the text starts: the answer's first token past the separator, fixed before the
        # first check (checks start once the trace is closed and the separator is complete).
        start = req.num_prompt_tokens
        if req.thinking is not None:
            at = req.thinking.text_start(req.output_token_ids)
            if at is None:
                return False
            start += at
        assert self.tokenizer is not None, "stop strings need the tokenizer"
        detok = req.detokenizer
        if detok is None:
            detok = req.detokenizer = IncrementalDetokenizer(max(0, max(len(s) for s in stop) - 1))
        text = None
        if self.is_incremental and detok.is_exact:
            text = detok.step(self.tokenizer, req.token_ids, start)
        if text is None:  # a decoder the text tail cannot follow: the whole output, every step
            text = self.tokenizer.decode(req.token_ids[start:], skip_special_tokens=True)
        return any(s in text for s in stop)
