"""Reasoning models: the think tags around a trace, found once per engine.

A reasoning model (Qwen3, the R1 distills) writes `<think> trace </think> answer`. The opening tag
may come from the chat template's generation prompt (R1's templates end with `<think>\\n`) or be
the model's first token (Qwen3's). Both tags are single tokens of their tokenizers, so the engine
follows a trace token by token: it knows where the trace ends without decoding, counts its
tokens against `SamplingParams.max_thinking_tokens`, and holds a grammar back until the answer.

The separator is what the template writes between a closed trace and the answer (Qwen3's
template, with thinking off, ends the prompt with `<think>\\n\\n</think>\\n\\n`): the engine appends it
after a closing tag it forces, so the answer starts where the model would start it.
"""

from __future__ import annotations

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
                f"engine.think_tags: must be [open, close] (two non-empty strings) or [] (off), got {list(configured)!r}"
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
    return ThinkTags(open_text, close_text, open_id, close_id, separator, separator_ids)
