"""Reasoning models: the think tags around a trace, found once per engine.

A reasoning model (Qwen3, the R1 distills) writes `<think> trace </think> answer`. The opening tag
may come from the chat template's generation prompt (R1's templates end with `<think>\\n`) or be
the model's first token (Qwen3's). Both tags are single tokens of their tokenizers, so the engine
follows a trace token by token: it knows where the trace ends without decoding, counts its
tokens against `SamplingParams.max_thinking_tokens`, and holds a grammar back until the answer.

The separator is what the template writes between a closed trace and the answer (Qwen3's
template, with thinking off, ends the prompt with `<think>\\n\\n</think>\\n\\n`): the engine appends it
after a closing tag it forces, so the answer starts where the model would start it.

A request's `ThinkingState` follows its output token by token (advanced only by the scheduler's
`update`, as tokens are appended: so preemption, chunked prefill, followers and verification steps
see one state). The phases:
  start   no token yet and the prompt has no open trace: the first token may open one (`open_id`);
          any other first token means no trace;
  trace   between the tags: no grammar applies, stop strings are not looked for;
  answer  after the closing tag (or without a trace, or from the start when the prompt ends with
          a closed trace: thinking off): everything applies as for any model.
Forced tokens (the closing tag once the budget is spent, the separator after a closing tag in a
constrained request) are queued here; the step sampler masks the request's row to the first of them
(engine/runners/sampling.py), and such a request is never drafted or sampled blind on the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from batchrun.engine.config import EngineConfigError

DEFAULT_TAGS = ("<think>", "</think>")
DEFAULT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class ThinkTags:
    open: str
    close: str
    open_id: int
    close_id: int
    separator: str  # the template's text between the closing tag and the answer
    separator_ids: tuple[int, ...]  # its tokens
    # Whitespace tokens (newlines, spaces): what may follow an opening tag a template ends the
    # generation prompt with (R1's `<think>\n`); an opening tag followed by anything else in the
    # prompt is text of a turn (a user asking about `<think>`) and opens nothing.
    whitespace_ids: frozenset[int] = frozenset()

    @property
    def close_ids(self) -> tuple[int, ...]:
        """What the engine appends when a trace's budget is spent: the closing tag, then the separator."""
        return (self.close_id, *self.separator_ids)


def single_token(tokenizer: Any, text: str) -> Optional[int]:
    """The id of `text` when the tokenizer has it as one token (an added or a vocabulary token)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def template_separator(tokenizer: Any, close: str) -> str:
    """What the chat template writes after `close` in a generation prompt with thinking off (the
    Qwen3 convention: enable_thinking=False closes an empty trace in the prompt), when that is
    whitespace; else DEFAULT_SEPARATOR."""
    if not getattr(tokenizer, "chat_template", None):
        return DEFAULT_SEPARATOR
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    except Exception:  # a template that cannot render a bare user turn: nothing to learn from it
        return DEFAULT_SEPARATOR
    text = str(text)
    at = text.rfind(close)
    if at < 0:
        return DEFAULT_SEPARATOR
    tail = text[at + len(close) :]
    return tail if tail and not tail.strip() else DEFAULT_SEPARATOR


def find_think_tags(tokenizer: Any, configured: Optional[Sequence[str]]) -> Optional[ThinkTags]:
    """The engine's think tags: `configured` is engine.think_tags (None: the defaults when the
    tokenizer has each as one token, else None; []: None, off; [open, close]: these, each one
    token, else EngineConfigError naming engine.think_tags)."""
    if configured is not None and len(configured) == 0:
        return None
    if configured is None:
        open_text, close_text = DEFAULT_TAGS
    else:
        if len(configured) != 2 or not all(isinstance(t, str) and t for t in configured):
            raise EngineConfigError(
                "engine.think_tags: must be [open, close] (two non-empty strings) or [] (off), "
                f"got {list(configured)!r}"
            )
        open_text, close_text = configured
    if tokenizer is None:
        return None
    open_id, close_id = single_token(tokenizer, open_text), single_token(tokenizer, close_text)
    if open_id is None or close_id is None or open_id == close_id:
        if configured is None:
            return None
        bad = open_text if open_id is None else close_text
        raise EngineConfigError(
            f"engine.think_tags: {bad!r} is not one token of the model's tokenizer (each tag must be one token)"
        )
    separator = template_separator(tokenizer, close_text)
    separator_ids = tuple(int(t) for t in tokenizer.encode(separator, add_special_tokens=False))
    return ThinkTags(
        open_text, close_text, open_id, close_id, separator, separator_ids, whitespace_ids(tokenizer, separator_ids)
    )


def whitespace_ids(tokenizer: Any, separator_ids: Sequence[int]) -> frozenset[int]:
    """The tokens of the whitespace a template writes after a tag (each decoding to whitespace)."""
    ids = set(separator_ids)
    for text in ("\n", "\n\n", "\n\n\n", " ", "  ", "\t", "\r\n"):
        for t in tokenizer.encode(text, add_special_tokens=False):
            if not tokenizer.decode([int(t)]).strip():
                ids.add(int(t))
    return frozenset(ids)


START, TRACE, ANSWER = "start", "trace", "answer"


class ThinkingState:
    """Where one request's output stands with respect to its trace. Output indices count from
    the first generated token; the trace's tokens are output[trace_start:trace_end] (to the end
    while it is open), the answer's output[trace_end + 1:]."""

    __slots__ = (
        "tags",
        "budget",
        "constrained",
        "phase",
        "trace_start",
        "trace_end",
        "num_trace_tokens",
        "forced",
        "separator_forced",
    )

    def __init__(self, tags: ThinkTags, budget: Optional[int], constrained: bool, opened_by_prompt: bool) -> None:
        self.tags = tags
        self.budget = budget  # SamplingParams.max_thinking_tokens
        self.constrained = constrained  # a grammar applies to the answer: the separator is forced after the tag
        self.phase = TRACE if opened_by_prompt else START
        self.trace_start = 0 if opened_by_prompt else -1  # output index of the first trace token; -1: no trace
        self.trace_end = -1  # output index of the closing tag; -1: not closed (or no trace)
        self.num_trace_tokens = 0
        self.forced: deque[int] = deque()  # the next output tokens, whatever the model says
        # The token just appended was a separator token the engine forced: no stop token id or EOS
        # ends the request at it (engine/stop.py), as no stop string matches it.
        self.separator_forced = False

    @classmethod
    def for_prompt(
        cls, tags: ThinkTags, prompt: Sequence[int], budget: Optional[int], constrained: bool
    ) -> ThinkingState:
        """The prompt opens the trace when its last `open_id` comes after its last `close_id` with
        only whitespace after it (a template that ends the generation prompt with the opening tag;
        one in a turn's text opens nothing). A prompt that ends with the
        closing tag (and the separator, or a part of it) closed this turn's trace itself (Qwen3's
        template with thinking off): the output is all answer, and no grammar lets a trace open."""
        opened = closed = False
        for at in range(len(prompt) - 1, -1, -1):
            token = prompt[at]
            if token == tags.close_id:
                tail = tuple(prompt[at + 1 :])
                closed = tail == tags.separator_ids[: len(tail)]
                break
            if token == tags.open_id:
                blank = tags.whitespace_ids or frozenset(tags.separator_ids)
                opened = all(t in blank for t in prompt[at + 1 :])
                break
        state = cls(tags, budget, constrained, opened)
        if closed:
            state.phase = ANSWER
        return state

    @property
    def has_trace(self) -> bool:
        return self.trace_start >= 0

    @property
    def in_trace(self) -> bool:
        """The trace is open (a closing tag is at most queued): max_tokens here is "thinking_length"."""
        return self.phase == TRACE

    @property
    def answer_start(self) -> int:
        """Output index of the answer's first token (0 without a trace)."""
        return self.trace_end + 1 if self.has_trace else 0

    def text_start(self, output: Sequence[int]) -> Optional[int]:
        """Output index where the answer's text starts for stop strings and the final text: past
        the separator when the answer begins with it (forced or the model's own), so that a stop
        string of whitespace does not match the template's separator. None while the answer so far
        is the separator or a part of it (nothing to look for a stop string in yet). An output
        without a trace is all text from its first token, as on an engine without tags."""
        if not self.has_trace:
            return 0
        start = self.answer_start
        sep = self.tags.separator_ids
        head = tuple(output[start : start + len(sep)])
        if head == sep:
            return start + len(sep)
        if len(head) < len(sep) and head == sep[: len(head)]:
            return None
        return start

    @property
    def grammar_applies(self) -> bool:
        """Whether a grammar masks the next token: at the start (with `open_id` allowed too) and in
        the answer once no forced token is queued; never in the trace."""
        return self.phase != TRACE and not self.forced

    @property
    def runs_blind(self) -> bool:
        """Whether the token after the next one needs no mask whatever the next one is, so a step
        may be sampled on the device and the step after it launched before its token is read
        (engine/runners/gpu.py): nothing is forced now, and the next token cannot spend the budget.
        (A closing tag from the model forces only in constrained requests, which never run blind.)"""
        if self.forced:
            return False
        return self.phase != TRACE or self.budget is None or self.num_trace_tokens + 1 < self.budget

    def append(self, token: int, index: int) -> bool:
        """Advance past output token `index` (`token`), just appended. True when tokens are now
        forced, so later tokens of the same step (a verification step's) are dropped."""
        tags = self.tags
        self.separator_forced = False
        if self.forced:
            expected = self.forced.popleft()
            assert token == expected, f"forced token {expected} came out as {token}"
            self.separator_forced = token != tags.close_id
            if token == tags.close_id and self.phase == TRACE:
                self.phase, self.trace_end = ANSWER, index
            return False
        if self.phase == START:
            if token == tags.open_id:
                self.phase, self.trace_start = TRACE, index + 1
            else:
                self.phase = ANSWER
            return False
        if self.phase == TRACE:
            if token == tags.close_id:
                self.phase, self.trace_end = ANSWER, index
                if self.constrained:
                    self.forced.extend(tags.separator_ids)
                return bool(self.forced)
            self.num_trace_tokens += 1
            if self.budget is not None and self.num_trace_tokens >= self.budget:
                self.forced.extend(tags.close_ids)
                return True
        return False
