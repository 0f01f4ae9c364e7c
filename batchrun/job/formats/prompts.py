"""Turning an input row into prompt token ids, or into a typed error saying why it cannot be one.

A job (conf/job/*.yaml) says how: an optional `prompt_template` over the row's columns, an optional
system prompt, and whether to apply the tokenizer's chat template. The text column may also hold an
OpenAI-style list of messages, which always goes through the chat template.

Embed and score jobs (job.task) read a text row as sentence-transformers and a classifier do:
tokenizer(text) with its special tokens, no chat template and no system prompt (the pipeline's
do_lower_case applied); a prompt_template, when set, is applied first (an instruction prefix such
as "query: {text}"). Conversations are rendered without a generation prompt, since the model scores
what is there: message rows, and text rows with data.response_column (the text the user turn, the
response the assistant turn, a system turn only with job.system_prompt). An embed prompt has no
length limit here: the engine truncates it to the model's input limit as sentence-transformers
does, and counts what it cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

from batchrun.job.config import DataConfig, JobConfig
from batchrun.job.errors import JobError
from batchrun.job.formats.reader import InputRow

# The typed errors a row can end with (the `error_type` column); engine_error comes from the engine.
NULL_PROMPT = "null_prompt"
EMPTY_PROMPT = "empty_prompt"
WRONG_TYPE = "wrong_type"
PROMPT_TOO_LONG = "prompt_too_long"
TEMPLATE_ERROR = "template_error"
# A data.uri that is a previous run's output: its error rows have nothing to score (row ids kept).
UPSTREAM_ERROR = "upstream_error"


@dataclass(frozen=True)
class Prompt:
    """A row's prompt, or why it has none. Exactly one of token_ids and error_type is set."""

    token_ids: Optional[list[int]] = None
    error_type: Optional[str] = None
    error_message: Optional[str] = None  # for ok rows: a note such as a truncation
    num_prompt_tokens: Optional[int] = None  # known also for prompt_too_long rows
    # What the engine is sent instead of token_ids, one request and result row each (sample_index
    # its position): an embed text, which the engine tokenizes as sentence-transformers does (the
    # pipeline's do_lower_case, default prompt and chat modality, truncation), or an OpenAI
    # /v1/embeddings request's inputs. token_ids is then the job's own tokenizing of the first,
    # for planning and the dry run's counts; result rows count the engine's tokens.
    engine_prompts: tuple[Union[str, list[int]], ...] = ()
    # Tokens the job cut itself (data.on_too_long=truncate); a pooled row adds them to the engine's.
    num_truncated_tokens: int = 0


class PromptBuilder:
    def __init__(
        self,
        job: JobConfig,
        data: DataConfig,
        tokenizer: Any,
        max_prompt_tokens: Optional[int],
        task: str = "generate",
        embed_limit: Optional[int] = None,
    ) -> None:
        """`max_prompt_tokens`: None for no limit (embed: the engine truncates); `task`: the
        engine's (generate, embed, score); `embed_limit`: the embed engine's input limit, where
        the job's own count of an embed text stops (the engine cuts the text there)."""
        self.embeds_text = task == "embed"
        self.embed_limit = embed_limit
        assert max_prompt_tokens is None or max_prompt_tokens > 0
        self.job = job
        self.text_column = data.text_column
        self.response_column = data.response_column
        self.truncate = data.on_too_long == "truncate"
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.is_pooling = task != "generate"
        has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        if job.chat_template == "always" and not has_chat_template:
            raise JobError("job.chat_template is 'always' but the model's tokenizer has no chat template")
        self.has_chat_template = has_chat_template
        self.use_chat_template = has_chat_template and job.chat_template != "never" and not self.is_pooling

    def build(self, row: InputRow) -> Prompt:
        value = row.values.get(self.text_column)
        if value is None:
            return Prompt(error_type=NULL_PROMPT, error_message=f"column {self.text_column!r} is null")
        if isinstance(value, str):
            if not value.strip():
                return Prompt(error_type=EMPTY_PROMPT, error_message=f"column {self.text_column!r} is empty")
            if self.response_column is not None:
                return self._build_pair(row, value)
            if self.embeds_text:
                return self._embed_text(row, value)
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

    def _templated(self, row: InputRow, body: str) -> str:
        if self.job.prompt_template is None:
            return body
        fields = {k: ("" if v is None else v) for k, v in row.values.items()}
        fields["text"] = body
        return self.job.prompt_template.format_map(fields)

    def _render_text(self, row: InputRow, body: str) -> list[int]:
        text = self._templated(row, body)
        if self.is_pooling:  # as a classifier reads a text: tokenizer(text), its special tokens included
            return list(self.tokenizer.encode(text, add_special_tokens=True))
        if self.use_chat_template:
            messages = [{"role": "user", "content": text}]
            if self.job.system_prompt:
                messages.insert(0, {"role": "system", "content": self.job.system_prompt})
            return self._apply_chat_template(messages)
        if self.job.system_prompt:
            text = f"{self.job.system_prompt}\n\n{text}"
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def _embed_text(self, row: InputRow, body: str) -> Prompt:
        """An embed text row: the text goes to the engine, which tokenizes it as sentence-transformers
        does and truncates it to the model's limit."""
        try:
            text = self._templated(row, body)
        except Exception as e:  # str.format raises many kinds
            return Prompt(error_type=TEMPLATE_ERROR, error_message=f"{type(e).__name__}: {_short(e)}")
        ids = list(self.tokenizer.encode(text, add_special_tokens=True, verbose=False))
        note = None
        if self.embed_limit is not None and len(ids) > self.embed_limit:
            note = f"about {len(ids)} tokens: the engine truncates it to the model's limit of {self.embed_limit}"
            ids = ids[: self.embed_limit]
        return Prompt(token_ids=ids, error_message=note, num_prompt_tokens=len(ids), engine_prompts=(text,))

    def _build_pair(self, row: InputRow, text: str) -> Prompt:
        """A (prompt, response) row as a conversation: what a reward model scores."""
        assert self.response_column is not None
        response = row.values.get(self.response_column)
        if response is None:
            return Prompt(error_type=NULL_PROMPT, error_message=f"response column {self.response_column!r} is null")
        if not isinstance(response, str):
            return Prompt(
                error_type=WRONG_TYPE,
                error_message=(
                    f"response column {self.response_column!r} holds {type(response).__name__}; expected a string"
                ),
            )
        if not response.strip():
            return Prompt(error_type=EMPTY_PROMPT, error_message=f"response column {self.response_column!r} is empty")
        if not self.has_chat_template:
            return Prompt(
                error_type=TEMPLATE_ERROR,
                error_message="data.response_column needs a chat template; the tokenizer has none",
            )
        messages = [{"role": "user", "content": self._templated(row, text)}]
        if self.job.system_prompt:
            messages.insert(0, {"role": "system", "content": self.job.system_prompt})
        # Truncation (score, data.on_too_long=truncate) shortens the response: the last turn.
        return self._fit(
            lambda body: self._apply_chat_template([*messages, {"role": "assistant", "content": body}]), response
        )

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
        # A pooling model reads the conversation as it is; a generator is asked for the next turn.
        # job.enable_thinking and job.chat_template_kwargs: a reasoning template's switches
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not self.is_pooling, **self.job.template_kwargs
        )
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
        if limit is None or len(ids) <= limit:
            return Prompt(token_ids=ids, num_prompt_tokens=len(ids))
        original = len(ids)
        if not self.truncate:
            return Prompt(
                error_type=PROMPT_TOO_LONG,
                num_prompt_tokens=original,
                error_message=(
                    f"prompt has {original} tokens; the limit is {limit} "
                    + ("(max_model_len)" if self.is_pooling else "(max_model_len minus sampling.max_tokens)")
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
                    num_truncated_tokens=original - len(ids),
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
