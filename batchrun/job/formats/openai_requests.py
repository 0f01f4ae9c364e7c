"""OpenAI batch requests: one input line checked into a request, and the output line it answers with.

Input (one JSON object per line, as OpenAI's Batch API takes it):

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": "..."}], "max_tokens": 32}}

`url` is /v1/chat/completions (body.messages, rendered with the model's chat template) or
/v1/completions (body.prompt: a string, one-string list or token ids, sent as is) for a generation
engine, /v1/embeddings (openai_embeddings.py) for an embed engine; a line for the other kind of
engine is that line's error, the rest go on. Body fields that
batchrun honors override the job's `sampling.*` for that request: max_tokens /
max_completion_tokens, temperature, top_p, stop, seed, n (that many choices in the one output line,
sampled from one prefill) and response_format (json_schema / json_object as structured output).
logprobs (chat: logprobs + top_logprobs; completions: logprobs) adds each choice's token
logprobs in OpenAI's shape. Chat requests' tools, tool_choice and parallel_tool_calls go through
tool_calls.py (the tools into the prompt, a required or named call into a JSON-schema constraint,
the output back into message.tool_calls). A chat request's chat_template_kwargs (vLLM's extension:
variables for the chat template, such as enable_thinking) are merged over job.chat_template_kwargs.
Fields that would change the answer in ways batchrun does
not implement (penalties, ...) make the request an error line rather than being silently ignored;
fields that change nothing (user, metadata, store, stream=false, ...) are accepted.

Output lines follow OpenAI's batch output format: successes

    {"id": "batch_req_...", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": <chat.completion or text_completion>}}

A reasoning model's choice (the engine recognises think tags) carries its trace as
message.reasoning_content (null without one), usage.completion_tokens_details.reasoning_tokens
counts the traces' tokens, and finish_reason `thinking_length` (max_tokens inside the trace) is
OpenAI's `length`.

and failures (the errors file) `{"id", "custom_id", "response": null, "error": {"code", "message"}}`
with `code` one of batchrun's typed error names. Ids are derived from the shard and line, so a
rerun writes the same ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from batchrun.engine import RequestOutput, SamplingParams
from batchrun.job.config import reserved_template_kwargs
from batchrun.job.formats.logprobs import TokenTexts, logprob_entries
from batchrun.job.formats.openai_embeddings import EMBEDDINGS_URL, embedding_body, embedding_inputs
from batchrun.job.formats.prompts import Prompt
from batchrun.job.formats.reader import InputRow
from batchrun.job.formats.tool_calls import (
    ToolsError,
    ToolSpec,
    chat_choice,
    render,
    result_columns,
    template_messages,
    tool_spec,
)
from batchrun.job.formats.writer import THINKING_LENGTH, TRUNCATED_STRUCTURED_OUTPUT, is_truncated_structured

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

# Error codes (the results' error_type and the errors file's error.code).
INVALID_JSON = "invalid_json"  # the line is not one JSON object
INVALID_REQUEST = "invalid_request"  # missing or ill-typed fields, wrong method or url
MODEL_NOT_FOUND = "model_not_found"  # body.model is not the loaded model (OpenAI's code for it)
UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a body field batchrun does not implement
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over max_model_len (OpenAI's code)

# Body fields that never change a completion's tokens: accepted and ignored.
_IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "stream_options"})
# Fields batchrun does not implement, accepted only at the value that means "off".
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}
_MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_MAX_STOP_STRINGS = 4  # OpenAI's limit
_MAX_N = 128  # OpenAI's limit on body.n
_MAX_TOP_LOGPROBS_CHAT = 20  # OpenAI's limits on body.top_logprobs (chat) and body.logprobs (completions)
_MAX_LOGPROBS_COMPLETIONS = 5


@dataclass(frozen=True)
class RequestError:
    """Why a line or request gets an error line instead of a completion."""

    code: str  # one of the codes above
    message: str


@dataclass(frozen=True)
class BatchRequest:
    """One well-formed request line."""

    custom_id: str
    url: str  # CHAT_URL, COMPLETIONS_URL or EMBEDDINGS_URL
    model: str  # as the request names it; echoed in the response
    body: dict[str, Any]
    # a chat request's tools (tool_calls.tool_spec of its body), set once its body was checked
    tools: Optional[ToolSpec] = None

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL

    @property
    def is_embeddings(self) -> bool:
        return self.url == EMBEDDINGS_URL


def parse_line(line: bytes) -> tuple[Optional[dict[str, Any]], Optional[RequestError]]:
    """The line's JSON object, or why it is not one."""
    try:
        obj = json.loads(line)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        return None, RequestError(INVALID_JSON, f"not valid JSON: {_short(e)}")
    if not isinstance(obj, dict):
        return None, RequestError(INVALID_JSON, f"expected a JSON object, got {type(obj).__name__}")
    return obj, None


def custom_id_of(obj: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The line's custom_id when it is a usable one (a non-empty string)."""
    value = (obj or {}).get("custom_id")
    return value if isinstance(value, str) and value else None


def check_request(obj: Mapping[str, Any], model_names: frozenset[str]) -> Union[BatchRequest, RequestError]:
    """The request of a parsed line with a custom_id, or why it is not a valid one for this model."""
    custom_id = custom_id_of(obj)
    assert custom_id is not None, "lines without a custom_id are rejected before"
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return RequestError(INVALID_REQUEST, f"unknown field(s) {', '.join(unknown)} in the request line")
    if obj.get("method") != "POST":
        return RequestError(INVALID_REQUEST, f"method must be POST, got {_short(obj.get('method'))}")
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL):
        return RequestError(
            INVALID_REQUEST, f"url must be {CHAT_URL}, {COMPLETIONS_URL} or {EMBEDDINGS_URL}, got {_short(url)}"
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return RequestError(INVALID_REQUEST, f"body must be an object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str):
        return RequestError(INVALID_REQUEST, "body.model must be a string")
    if model not in model_names:
        return RequestError(
            MODEL_NOT_FOUND, f"model {model!r} is not the loaded model (accepted: {', '.join(sorted(model_names))})"
        )
    key = {CHAT_URL: "messages", COMPLETIONS_URL: "prompt", EMBEDDINGS_URL: "input"}[url]
    if body.get(key) is None:
        return RequestError(INVALID_REQUEST, f"body.{key} is required for {url}")
    return BatchRequest(custom_id, url, model, dict(body))


def sampling_params(request: BatchRequest, defaults: SamplingParams) -> Union[SamplingParams, RequestError]:
    """The request's decoding settings: the job's `defaults`, overridden by the body's fields.

    Every body field is read here and nowhere else: a field the engine learns later (n, a JSON
    schema) is wired by replacing its error below with a `changes[...] =` line.
    """
    body = {k: v for k, v in request.body.items() if v is not None}  # null means "not set", as in OpenAI's API
    body.pop("model")
    body.pop("messages" if request.is_chat else "prompt")
    changes: dict[str, Any] = {}
    tokens_key = "max_completion_tokens" if request.is_chat and "max_completion_tokens" in body else "max_tokens"
    for key in ("max_completion_tokens", "max_tokens"):
        if key not in body:
            continue
        value = body.pop(key)
        if key == "max_completion_tokens" and not request.is_chat:
            return RequestError(UNSUPPORTED_PARAMETER, f"max_completion_tokens is for {CHAT_URL}; use max_tokens")
        if not _is_int(value) or value < 1:
            return RequestError(INVALID_REQUEST, f"body.{key} must be an integer >= 1, got {_short(value)}")
        if key == tokens_key:
            changes["max_tokens"] = value
    if "temperature" in body:
        value = body.pop("temperature")
        if not _is_number(value) or not 0 <= value <= 2:
            return RequestError(INVALID_REQUEST, f"body.temperature must be a number in [0, 2], got {_short(value)}")
        changes["temperature"] = float(value)
    if "top_p" in body:
        value = body.pop("top_p")
        if not _is_number(value) or not 0 < value <= 1:
            return RequestError(INVALID_REQUEST, f"body.top_p must be a number in (0, 1], got {_short(value)}")
        changes["top_p"] = float(value)
    if "stop" in body:
        value = body.pop("stop")
        stops = [value] if isinstance(value, str) else value
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            return RequestError(
                INVALID_REQUEST, f"body.stop must be a string or a list of strings, got {_short(value)}"
            )
        if len(stops) > _MAX_STOP_STRINGS:
            return RequestError(INVALID_REQUEST, f"body.stop takes at most {_MAX_STOP_STRINGS} strings")
        changes["stop"] = tuple(stops)
    if "seed" in body:
        value = body.pop("seed")
        if not _is_int(value):
            return RequestError(INVALID_REQUEST, f"body.seed must be an integer, got {_short(value)}")
        changes["seed"] = value
    if "n" in body:
        value = body.pop("n")
        if not _is_int(value) or value < 1:
            return RequestError(INVALID_REQUEST, f"body.n must be an integer >= 1, got {_short(value)}")
        if value > _MAX_N:
            return RequestError(INVALID_REQUEST, f"body.n={value}: at most {_MAX_N} choices per request")
        changes["n"] = value
    logprobs = _requested_logprobs(request, body)  # pops logprobs / top_logprobs
    if isinstance(logprobs, RequestError):
        return logprobs
    if logprobs is not None:
        changes["logprobs"] = logprobs
    tool_keys = ("tools", "tool_choice", "parallel_tool_calls")
    if not request.is_chat and any(k in body for k in tool_keys):
        key = next(k for k in tool_keys if k in body)
        return RequestError(UNSUPPORTED_PARAMETER, f"body.{key} is for {CHAT_URL}")
    try:
        tools = tool_spec(body) if request.is_chat else None
    except ToolsError as e:
        return RequestError(e.code, e.message)
    for key in tool_keys:
        body.pop(key, None)
    if "chat_template_kwargs" in body:  # read by template_kwargs; checked here with the other fields
        value = body.pop("chat_template_kwargs")
        if not request.is_chat:
            return RequestError(UNSUPPORTED_PARAMETER, f"body.chat_template_kwargs is for {CHAT_URL}")
        if not isinstance(value, dict):
            return RequestError(
                INVALID_REQUEST, f"body.chat_template_kwargs must be an object, got {type(value).__name__}"
            )
        reserved = reserved_template_kwargs(value)
        if reserved:
            return RequestError(
                INVALID_REQUEST, f"body.chat_template_kwargs: {', '.join(reserved)} is set by batchrun, not here"
            )
    tool_constraint = tools.constraint if tools is not None else None
    if tool_constraint is not None:
        changes.update(json_schema=tool_constraint, regex=None, choice=())
    if "response_format" in body:
        value = body.pop("response_format")
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            return RequestError(INVALID_REQUEST, f"body.response_format must be {{'type': ...}}, got {_short(value)}")
        if kind == "json_object":  # any JSON object, as OpenAI's JSON mode
            changes.update(json_schema={"type": "object"}, regex=None, choice=())
        elif kind == "json_schema":
            spec = value.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                return RequestError(
                    INVALID_REQUEST, "body.response_format.json_schema.schema must be a JSON Schema object"
                )
            changes.update(json_schema=schema, regex=None, choice=())
        if kind != "text" and tools is not None and tools.mode != "none":
            return RequestError(
                UNSUPPORTED_PARAMETER, "body.response_format with body.tools: only with tool_choice none"
            )
    for key, value in body.items():
        if key in _IGNORED_FIELDS:
            continue
        if key in _OFF_VALUES and any(_same(value, off) for off in _OFF_VALUES[key]):
            continue
        return RequestError(UNSUPPORTED_PARAMETER, f"body.{key}={_short(value)} is not supported")
    try:
        return dataclasses.replace(defaults, **changes)
    except ValueError as e:  # SamplingParams' own checks
        return RequestError(INVALID_REQUEST, str(e))


def _requested_logprobs(request: BatchRequest, body: dict[str, Any]) -> Union[int, None, RequestError]:
    """The top-N the body asks for per output token (None: no logprobs), as OpenAI spells it:
    chat `logprobs: true` with `top_logprobs` 0..20; completions `logprobs` 0..5 (0: the chosen
    token's alone)."""
    value, top = body.pop("logprobs", None), body.pop("top_logprobs", None)
    if request.is_chat:
        if value is not None and not isinstance(value, bool):
            return RequestError(INVALID_REQUEST, f"body.logprobs must be true or false, got {_short(value)}")
        if top is not None and (not _is_int(top) or not 0 <= top <= _MAX_TOP_LOGPROBS_CHAT):
            return RequestError(
                INVALID_REQUEST,
                f"body.top_logprobs must be an integer in [0, {_MAX_TOP_LOGPROBS_CHAT}], got {_short(top)}",
            )
        if not value:
            if top:
                return RequestError(INVALID_REQUEST, "body.top_logprobs needs body.logprobs: true")
            return None
        return top or 0
    if top is not None:
        return RequestError(UNSUPPORTED_PARAMETER, f"body.top_logprobs is for {CHAT_URL}; use logprobs")
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= _MAX_LOGPROBS_COMPLETIONS:
        return RequestError(
            INVALID_REQUEST,
            f"body.logprobs must be an integer in [0, {_MAX_LOGPROBS_COMPLETIONS}], got {_short(value)}",
        )
    return int(value)


def chat_messages(request: BatchRequest) -> Union[list[dict[str, Any]], RequestError]:
    """body.messages as {role, content} text messages for a chat template; content given as a list
    of text parts is joined. `developer` is OpenAI's newer name for `system`. A conversation with
    tool calls keeps them: an assistant message's tool_calls (its content may then be null) and a
    tool message's tool_call_id (tool_calls.template_messages)."""
    messages = request.body["messages"]
    if not isinstance(messages, list) or not messages:
        return RequestError(INVALID_REQUEST, "body.messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _MESSAGE_ROLES:
            return RequestError(
                INVALID_REQUEST, f"messages[{i}].role must be one of {', '.join(sorted(_MESSAGE_ROLES))}"
            )
        content = m.get("content")
        calls = m.get("tool_calls") if role == "assistant" else None
        if content is None and calls:
            content = ""
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                return RequestError(UNSUPPORTED_PARAMETER, f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            return RequestError(INVALID_REQUEST, f"messages[{i}].content must be a string or a list of text parts")
        message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if calls is not None:
            message["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                return RequestError(INVALID_REQUEST, f"messages[{i}].tool_call_id must be a string")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        return RequestError(INVALID_REQUEST, "every message is empty")
    try:
        return template_messages(out)
    except ToolsError as e:
        return RequestError(e.code, e.message)


def completion_prompt(request: BatchRequest, vocab_size: int) -> Union[str, list[int], RequestError]:
    """body.prompt as text, or as token ids when it is a list of them."""
    prompt = request.body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt.strip():
            return RequestError(INVALID_REQUEST, "body.prompt is empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            return RequestError(INVALID_REQUEST, f"body.prompt has token ids outside [0, {vocab_size})")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        return RequestError(UNSUPPORTED_PARAMETER, "body.prompt: one prompt per request (a list of several is not)")
    return RequestError(INVALID_REQUEST, "body.prompt must be a string or a list of token ids")


class RequestBuilder:
    """Rows of a batch file (openai_files.BatchFileReader) into prompts and their sampling params."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        model_names: frozenset[str],
        defaults: SamplingParams,
        system_prompt: Optional[str] = None,
        tools_template: Optional[str] = None,
        task: str = "generate",
        embedding_dim: Optional[int] = None,
        template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """`tools_template`: the chat template text for requests with tools (job.tools_chat_template
        resolved by tool_calls.resolve_template); None renders them with the model's own. `task`:
        what the engine serves (embed answers /v1/embeddings lines, generate the others).
        `template_kwargs`: the job's chat template variables (JobConfig.template_kwargs)."""
        self.template_kwargs = dict(template_kwargs or {})
        self.task = task
        self.embedding_dim = embedding_dim
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_names = model_names
        self.defaults = defaults
        self.system_prompt = system_prompt
        self.tools_template = tools_template
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def check_line(self, row: InputRow) -> Optional[Prompt]:
        """The error of a line that is no request at all (not JSON, no custom_id); checked before
        the custom_id's uniqueness, which needs one."""
        error = row.values["error"]
        if error is None and row.id is None:
            value = row.values["line"].get("custom_id")
            error = RequestError(INVALID_REQUEST, f"custom_id must be a non-empty string, got {_short(value)}")
        if error is None:
            return None
        return Prompt(error_type=error.code, error_message=f"line {row.values['line_no']}: {error.message}")

    def build(self, row: InputRow) -> tuple[Prompt, Optional[SamplingParams], Optional[BatchRequest]]:
        """The row's prompt (or its error, its message naming the line), its sampling params and its
        request."""
        prompt, params, request = self._build(row)
        if prompt.error_message is not None and prompt.token_ids is None:
            prompt = dataclasses.replace(prompt, error_message=f"line {row.values['line_no']}: {prompt.error_message}")
        return prompt, params, request

    def _build(self, row: InputRow) -> tuple[Prompt, Optional[SamplingParams], Optional[BatchRequest]]:
        request = check_request(row.values["line"], self.model_names)
        if isinstance(request, RequestError):
            return _failed(request), None, None
        wanted = "embed" if request.is_embeddings else "generate"
        if wanted != self.task:
            hint = f"; use {EMBEDDINGS_URL}" if self.task == "embed" else ""
            message = f"{request.url} is for {wanted} models; this engine serves {self.task} (engine.task){hint}"
            return (
                _failed(RequestError(INVALID_REQUEST, message)),
                None,
                request,
            )
        if request.is_embeddings:
            inputs = embedding_inputs(request.body, len(self.tokenizer), self.embedding_dim)
            if isinstance(inputs, tuple):
                return _failed(RequestError(*inputs)), None, request
            counts = [len(x) if isinstance(x, list) else len(self.tokenizer.encode(x, verbose=False)) for x in inputs]
            first = inputs[0] if isinstance(inputs[0], list) else list(self.tokenizer.encode(inputs[0], verbose=False))
            prompt = Prompt(token_ids=first, num_prompt_tokens=sum(counts), engine_prompts=tuple(inputs))
            return prompt, None, request
        params = sampling_params(request, self.defaults)
        if isinstance(params, RequestError):
            return _failed(params), None, request
        if request.is_chat:  # checked by sampling_params: no ToolsError now
            request = dataclasses.replace(request, tools=tool_spec(request.body))
        ids = self._token_ids(request)
        if isinstance(ids, RequestError):
            return _failed(ids), None, request
        if len(ids) + params.max_tokens > self.max_model_len:
            return (
                Prompt(
                    error_type=CONTEXT_LENGTH_EXCEEDED,
                    num_prompt_tokens=len(ids),
                    error_message=(
                        f"{len(ids)} prompt tokens plus max_tokens={params.max_tokens} exceed the model's "
                        f"max_model_len={self.max_model_len}"
                    ),
                ),
                None,
                request,
            )
        return Prompt(token_ids=ids, num_prompt_tokens=len(ids)), params, request

    def _token_ids(self, request: BatchRequest) -> Union[list[int], RequestError]:
        if not request.is_chat:
            prompt = completion_prompt(request, len(self.tokenizer))
            if isinstance(prompt, (RequestError, list)):
                return prompt
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        messages = chat_messages(request)
        if isinstance(messages, RequestError):
            return messages
        with_tools = request.tools is not None and request.tools.template_tools is not None
        if not self.has_chat_template and not (with_tools and self.tools_template is not None):
            return RequestError(INVALID_REQUEST, f"the model's tokenizer has no chat template; use {COMPLETIONS_URL}")
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        try:
            text = render(self.tokenizer, messages, request.tools, self.tools_template, self._template_kwargs(request))
        except ToolsError as e:
            return RequestError(e.code, e.message)
        except Exception as e:  # jinja raises many kinds (a template that rejects a role order, ...)
            return RequestError(INVALID_REQUEST, f"the chat template failed: {type(e).__name__}: {_short(e)}")
        # The template already wrote any BOS it wants; letting encode add another would double it.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _template_kwargs(self, request: BatchRequest) -> dict[str, Any]:
        """The job's chat template variables with the request's body.chat_template_kwargs over them
        (checked to be an object by sampling_params). A request's enable_thinking replaces the
        job's whichever of its keys set it."""
        own = request.body.get("chat_template_kwargs") or {}
        return {**self.template_kwargs, **own}


def _failed(error: RequestError) -> Prompt:
    return Prompt(error_type=error.code, error_message=error.message)


# ---- output lines ---------------------------------------------------------------------------


def line_ids(shard: str, index: int) -> tuple[str, str, str]:
    """(line id, request id, completion id suffix): stable per shard and line across reruns."""
    digest = hashlib.blake2b(f"{shard}\0{index}".encode(), digest_size=18).hexdigest()
    return f"batch_req_{digest[:24]}", f"req_{digest[12:36]}", digest[:24]


def response_line(
    shard: str,
    index: int,
    request: BatchRequest,
    outs: Sequence[RequestOutput],
    top_logprobs: Optional[int] = None,
    texts: Optional[TokenTexts] = None,
    reasoning: bool = False,
) -> dict[str, Any]:
    """The output-file line of a request the engine answered: one choice per sample, in sample
    order (each finished with stop or length, or tool_calls when a chat choice holds calls; a
    constrained choice cut by max_tokens also carries `error_type: truncated_structured_output`); usage
    counts the prompt once and every choice's tokens, as OpenAI's API does for n > 1.
    `top_logprobs`: the request asked for logprobs with that many alternatives per token (`texts`
    decodes the tokens). `reasoning`: the engine has think tags: each choice carries its trace as
    reasoning_content and usage counts the traces' tokens."""
    assert outs and all(o.finish_reason in ("stop", "length", THINKING_LENGTH) for o in outs), [
        o.finish_reason for o in outs
    ]
    line_id, request_id, suffix = line_ids(shard, index)
    choices: list[dict[str, Any]] = []
    for i, out in enumerate(outs):
        logprobs = None
        if top_logprobs is not None:
            assert texts is not None
            entries = logprob_entries(out.token_ids, out.logprobs, top_logprobs, texts) or []
            logprobs = _chat_logprobs(entries) if request.is_chat else _completion_logprobs(entries)
        # OpenAI has no reason for a trace that max_tokens cut: it is `length` (reasoning_content says where)
        reason = "length" if out.finish_reason == THINKING_LENGTH else out.finish_reason
        if request.is_chat:
            message, finish_reason = chat_choice(request.tools, out.text, reason, shard, index, i)
            if reasoning:
                message["reasoning_content"] = out.reasoning
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        else:
            choices.append({"index": i, "text": out.text, "logprobs": logprobs, "finish_reason": reason})
            if reasoning:  # not in OpenAI's text_completion, but the trace is the row's too
                choices[-1]["reasoning_content"] = out.reasoning
        if is_truncated_structured(out):  # cut inside its constraint: typed, as its Parquet row is
            choices[-1]["error_type"] = TRUNCATED_STRUCTURED_OUTPUT
    if request.is_chat:
        body: dict[str, Any] = {"id": f"chatcmpl-{suffix}", "object": "chat.completion"}
    else:
        body = {"id": f"cmpl-{suffix}", "object": "text_completion"}
    num_prompt = len(outs[0].prompt_token_ids)
    num_completion = sum(len(o.token_ids) for o in outs)
    usage: dict[str, Any] = {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        # the prompt's tokens served from cache for the first choice (the others share its blocks)
        "prompt_tokens_details": {"cached_tokens": outs[0].metrics.num_cached_tokens or 0},
    }
    if reasoning:  # completion_tokens counts them too, as OpenAI's does
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(o.num_reasoning_tokens for o in outs)}
    body.update(created=int(time.time()), model=request.model, choices=choices, usage=usage)
    return {
        "id": line_id,
        "custom_id": request.custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def embeddings_line(shard: str, index: int, request: BatchRequest, outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The output-file line of an embeddings request: one embedding per input, in input order."""
    line_id, request_id, _ = line_ids(shard, index)
    body = embedding_body(request.model, request.body.get("encoding_format"), outs)
    return {
        "id": line_id,
        "custom_id": request.custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def tool_columns(request: BatchRequest, out: RequestOutput, shard: str, index: int) -> dict[str, Any]:
    """The Parquet result row's tool_calls (and finish_reason tool_calls) of one sample, the same
    calls and ids as its choice in the output line; {} when it holds no calls."""
    return result_columns(request.tools, out.text, out.finish_reason, shard, index, out.sample_index)


def _chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """chat.completion's choice.logprobs: per token its text, logprob, UTF-8 bytes and top list.
    A token that is part of a multi-byte character decodes alone to U+FFFD, so its bytes are
    those of that text, not the raw byte piece."""

    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**token(e["token"], e["logprob"]), "top_logprobs": [token(t["token"], t["logprob"]) for t in e["top"]]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """text_completion's choice.logprobs: parallel lists; top_logprobs maps text -> logprob (two
    alternatives that decode to the same text keep the larger), text_offset counts characters from
    the completion's start."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    tops = []
    for e in entries:
        top: dict[str, float] = {}
        for t in e["top"]:
            top.setdefault(t["token"], t["logprob"])
        tops.append(top)
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def error_line(shard: str, index: int, custom_id: Optional[str], code: str, message: str) -> dict[str, Any]:
    """The errors-file line of a line or request that got no completion."""
    return {
        "id": line_ids(shard, index)[0],
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(value: Any, off: Any) -> bool:
    return type(value) is type(off) and value == off or (_is_number(value) and _is_number(off) and value == off)


def _short(value: Any, limit: int = 80) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
