"""Turning an input row into prompt token ids, or into a typed error saying why it cannot be one.

A job (conf/job/*.yaml) says how: an optional `prompt_template` over the row's columns, an optional
system prompt, and whether to apply the tokenizer's chat template. The text column may also hold an
OpenAI-style list of messages, which always goes through the chat template.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from batchrun.job.config import DataConfig, JobConfig
from batchrun.job.errors import JobError
from batchrun.job.formats.reader import InputRow

# The typed errors a row can end with (the `error_type` column); engine_error comes from the engine.
NULL_PROMPT = "null_prompt"
EMPTY_PROMPT = "empty_prompt"
WRONG_TYPE = "wrong_type"
PROMPT_TOO_LONG = "prompt_too_long"
TEMPLATE_ERROR = "template_error"


@dataclass(frozen=True)
class Prompt:
    """A row's prompt, or why it has none. Exactly one of token_ids and error_type is set."""

    token_ids: Optional[list[int]] = None
    error_type: Optional[str] = None
    error_message: Optional[str] = None  # for ok rows: a note such as a truncation
    num_prompt_tokens: Optional[int] = None  # known also for prompt_too_long rows


class PromptBuilder:
    def __init__(self, job: JobConfig, data: DataConfig, tokenizer: Any, max_prompt_tokens: int) -> None:
        assert max_prompt_tokens > 0
        self.job = job
        self.text_column = data.text_column
        self.truncate = data.on_too_long == "truncate"
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        if job.chat_template == "always" and not has_chat_template:
            raise JobError("job.chat_template is 'always' but the model's tokenizer has no chat template")
        self.has_chat_template = has_chat_template
        self.use_chat_template = has_chat_template and job.chat_template != "never"

    def build(self, row: InputRow) -> Prompt:
        value = row.values.get(self.text_column)
        if value is None:
            return Prompt(error_type=NULL_PROMPT, error_message=f"column {self.text_column!r} is null")
        if isinstance(value, str):
            if not value.strip():
                return Prompt(error_type=EMPTY_PROMPT, error_message=f"column {self.text_column!r} is empty")
            return self._fit(lambda body: self._render_text(row, body), value)
        if isinstance(value, (list, tuple)):
            return self._build_messages(list(value))
        return Prompt(
            error_type=WRONG_TYPE,
            error_message=(
                f"column {self.text_column!r} holds {type(value).__name__}; expected a string or a list of messages"
            ),
        )

    # ---- text rows ----------------------------------------------------------------------------

    def _render_text(self, row: InputRow, body: str) -> list[int]:
        text = body
        if self.job.prompt_template is not None:
            fields = {k: ("" if v is None else v) for k, v in row.values.items()}
            fields["text"] = body
            text = self.job.prompt_template.format_map(fields)
        if self.use_chat_template:
            messages = [{"role": "user", "content": text}]
            if self.job.system_prompt:
                messages.insert(0, {"role": "system", "content": self.job.system_prompt})
            return self._apply_chat_template(messages)
        if self.job.system_prompt:
            text = f"{self.job.system_prompt}\n\n{text}"
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    # ---- message rows -------------------------------------------------------------------------

    def _build_messages(self, messages: list[Any]) -> Prompt:
        if not messages:
            return Prompt(error_type=EMPTY_PROMPT, error_message=f"column {self.text_column!r} has no messages")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return Prompt(
                    error_type=TEMPLATE_ERROR,
                    error_message=(f"messages[{i}] must be {{'role': str, 'content': str}}, got {_short(m)}"),
                )
        if not any(m["content"].strip() for m in messages):
            return Prompt(error_type=EMPTY_PROMPT, error_message="every message is empty")
        if not self.has_chat_template:
            return Prompt(
                error_type=TEMPLATE_ERROR, error_message="messages need a chat template; the tokenizer has none"
            )
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.job.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.job.system_prompt})
        # Truncation shortens the last message, which is the one carrying the row's content.
        return self._fit(
            lambda body: self._apply_chat_template([*messages[:-1], {**messages[-1], "content": body}]),
            messages[-1]["content"],
        )

    def _apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already wrote any BOS it wants; letting encode add another would double it.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- length -------------------------------------------------------------------------------

    def _fit(self, render: Callable[[str], list[int]], body: str) -> Prompt:
        """Render, then apply data.on_too_long: error, or cut the tail of `body` until it fits."""
        try:
            return self._fit_rendered(render, body)
        except Exception as e:  # str.format and jinja raise many kinds; all mean the template failed
            return Prompt(error_type=TEMPLATE_ERROR, error_message=f"{type(e).__name__}: {_short(e)}")

    def _fit_rendered(self, render: Callable[[str], list[int]], body: str) -> Prompt:
        ids = render(body)
        limit = self.max_prompt_tokens
        if len(ids) <= limit:
            return Prompt(token_ids=ids, num_prompt_tokens=len(ids))
        original = len(ids)
        if not self.truncate:
            return Prompt(
                error_type=PROMPT_TOO_LONG,
                num_prompt_tokens=original,
                error_message=(
                    f"prompt has {original} tokens; the limit is {limit} (max_model_len minus sampling.max_tokens)"
                ),
            )
        body_ids = self.tokenizer.encode(body, add_special_tokens=False)
        margin = 0
        # Re-tokenizing cut text can merge differently at the cut, so allow a few passes.
        for _ in range(4):
            keep = len(body_ids) - (len(ids) - limit) - margin
            if keep <= 0:
                break
            body_ids = body_ids[:keep]
            ids = render(self.tokenizer.decode(body_ids))
            if len(ids) <= limit:
                return Prompt(
                    token_ids=ids,
                    num_prompt_tokens=len(ids),
                    error_message=f"truncated from {original} to {len(ids)} prompt tokens",
                )
            margin += 4
        return Prompt(
            error_type=PROMPT_TOO_LONG,
            num_prompt_tokens=original,
            error_message=(
                f"prompt has {original} tokens and stays over the limit of {limit} even with "
                f"column {self.text_column!r} cut to nothing"
            ),
        )


def _short(value: Any, limit: int = 120) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
