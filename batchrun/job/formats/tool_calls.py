"""Tool calls of OpenAI chat requests: `tools` and `tool_choice` into a prompt and a constraint, the
generated text back into `message.tool_calls`.

A request's tools reach the model through its chat template (`apply_chat_template(tools=...)`, the
tools in OpenAI's `{"type": "function", "function": {...}}` shape, which Hugging Face templates
take as they are). `tool_choice` decides what is generated:

- `none`: the tools are left out of the prompt and the output is plain content.
- `auto` (the default with tools): the model writes what it wants; its text is parsed for calls
  (`parse_calls`: Hermes/Qwen `<tool_call>{...}</tool_call>` blocks, or a whole output that is a
  Llama-3.1-style JSON call or list of calls). Text that holds no well-formed call of a listed tool
  stays content.
- `required`: the output is constrained to a JSON array of one or more calls (one call, no
  array, with `parallel_tool_calls: false`), each `{"name": <a listed tool>, "arguments": <that
  tool's parameters schema>}`, through the engine's json_schema structured output.
- a named function: the output is constrained to one such call of that tool.

A constrained call is the bare JSON (no `<tool_call>` tags around it): the grammar alone decides
where it ends, and the parse cannot fail unless max_tokens cut it (then finish_reason stays
`length` and the text stays content). Calls are re-serialized compactly for `function.arguments`;
their ids derive from the shard, line, choice and position, so a rerun writes the same ids.

A template that renders the same prompt with and without the tools cannot show them to the model:
such a request gets a `tools_unsupported` error, unless `job.tools_chat_template` gives a template
for tool requests (`chatml`: the ChatML template with a Hermes-style tools section below, which
ChatML models such as SmolLM2 and Qwen read; or a path to a Jinja file).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import pyarrow as pa

from batchrun.job.errors import ConfigError

TOOLS_UNSUPPORTED = "tools_unsupported"  # the chat template does not render tools

# message.tool_calls as a Parquet column: OpenAI's shape, arguments as JSON text.
TOOL_CALLS_TYPE = pa.list_(
    pa.struct(
        [
            ("id", pa.string()),
            ("type", pa.string()),
            ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
        ]
    )
)

ToolMode = Literal["none", "auto", "required", "named"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# A Hermes/Qwen call block; the last one may lack its closing tag when the model stopped there.
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 writes it before a call

# ChatML with a Hermes-style tools section (the layout Qwen2.5's template uses): the tools as JSON
# lines inside <tools></tools> in the system message, calls in <tool_call></tool_call>, results in
# <tool_response></tool_response> user turns.
CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}\
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}
{{- '<|im_start|>assistant' }}
{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}
{%- for call in message['tool_calls'] %}
{%- set call = call['function'] if call.get('function') else call %}
{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + (call['arguments'] | tojson) \
+ '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
BUILTIN_TEMPLATES = {"chatml": CHATML_TOOLS_TEMPLATE}


class ToolsError(ValueError):
    """Why a request's tools, tool_choice or tool messages are not usable; `code` is the error line's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON Schema of the arguments object
    spec: dict[str, Any]  # the request's tool entry, for the chat template


@dataclass(frozen=True)
class ToolSpec:
    """A chat request's tools and what tool_choice asks of them."""

    tools: tuple[Tool, ...]
    mode: ToolMode
    name: Optional[str] = None  # the named tool (mode "named")
    parallel: bool = True  # parallel_tool_calls: several calls in one choice

    @property
    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools the prompt shows; None with tool_choice none."""
        return None if self.mode == "none" else [t.spec for t in self.tools]

    @property
    def constraint(self) -> Optional[dict[str, Any]]:
        """The JSON Schema the whole output must follow (required and named), else None."""
        if self.mode == "named":
            return _call_schema(next(t for t in self.tools if t.name == self.name))
        if self.mode != "required":
            return None
        calls = [_call_schema(t) for t in self.tools]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {"type": "array", "items": one, "minItems": 1} if self.parallel else one


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_spec(body: Mapping[str, Any]) -> Optional[ToolSpec]:
    """The tools of a chat request's body (None without tools and tool_choice, or with an empty
    list); ToolsError when they are malformed."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolsError("invalid_request", f"body.parallel_tool_calls must be true or false, got {_short(parallel)}")
    if tools is None or tools == []:
        if choice is not None and choice != "none":
            raise ToolsError("invalid_request", "body.tool_choice needs body.tools")
        return None
    if not isinstance(tools, list):
        raise ToolsError("invalid_request", f"body.tools must be a list, got {type(tools).__name__}")
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ToolsError("invalid_request", f"body.tools: function names must be unique, got {', '.join(names)}")
    mode: ToolMode
    name = None
    if choice is None or choice in ("none", "auto", "required"):
        mode = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise ToolsError(
                "invalid_request", f"body.tool_choice names function {_short(name)}, which is not in body.tools"
            )
        mode = "named"
    elif isinstance(choice, dict) and isinstance(choice.get("type"), str):
        raise ToolsError("unsupported_parameter", f"body.tool_choice of type {choice['type']!r} is not supported")
    else:
        raise ToolsError(
            "invalid_request",
            f"body.tool_choice must be none, auto, required or {{type: function, function: {{name}}}}, "
            f"got {_short(choice)}",
        )
    return ToolSpec(parsed, mode, name, parallel is not False)


def _tool(i: int, entry: Any) -> Tool:
    kind = entry.get("type") if isinstance(entry, dict) else None
    if kind != "function":
        if isinstance(kind, str):
            raise ToolsError("unsupported_parameter", f"body.tools[{i}]: tools of type {kind!r} are not supported")
        raise ToolsError("invalid_request", f"body.tools[{i}] must be {{type: function, function: {{...}}}}")
    function = entry.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(name, str) and _NAME.match(name)):
        raise ToolsError(
            "invalid_request",
            f"body.tools[{i}].function.name must be 1-64 of a-z, A-Z, 0-9, _ and -, got {_short(name)}",
        )
    assert isinstance(function, dict)
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _NO_PARAMETERS  # OpenAI: an omitted schema is an empty parameter list
    if not (isinstance(parameters, dict) and parameters.get("type", "object") == "object"):
        raise ToolsError("invalid_request", f"body.tools[{i}].function.parameters must be a JSON Schema of an object")
    return Tool(name, parameters, {"type": "function", "function": {**function, "parameters": parameters}})


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The tool parts of OpenAI messages in Hugging Face's chat-template shape: an assistant's
    tool_calls with `arguments` parsed from JSON text into an object (templates write it with
    tojson), a tool message's tool_call_id kept. ToolsError when a call is malformed."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise ToolsError("invalid_request", f"messages[{i}].tool_calls must be a list on an assistant message")
            m["tool_calls"] = [_history_call(i, j, c) for j, c in enumerate(calls)]
        out.append(m)
    return out


def _history_call(i: int, j: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ToolsError(
            "invalid_request", f"messages[{i}].tool_calls[{j}] must be {{function: {{name, arguments: JSON text}}}}"
        )
    try:
        parsed = json.loads(arguments)
    except ValueError:
        raise ToolsError("invalid_request", f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
    out = {"type": "function", "function": {"name": name, "arguments": parsed}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    spec: Optional[ToolSpec],
    template: Optional[str],
    template_kwargs: Optional[Mapping[str, Any]] = None,
) -> str:
    """The prompt text of chat messages with the request's tools. `template`: the job's template for
    tool requests (job.tools_chat_template), None for the model's own. `template_kwargs`: the
    template's extra variables (job.chat_template_kwargs, enable_thinking, the request's own).
    ToolsError when the template does not show the tools to the model."""
    tools = spec.template_tools if spec is not None else None
    extra = dict(template_kwargs or {})
    if tools is None:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra))
    kwargs: dict[str, Any] = {**extra, "tokenize": False, "add_generation_prompt": True}
    if template is not None:
        kwargs["chat_template"] = template
    text = str(tokenizer.apply_chat_template(messages, tools=tools, **kwargs))
    if text == tokenizer.apply_chat_template(messages, **kwargs):
        raise ToolsError(
            TOOLS_UNSUPPORTED,
            "the chat template does not render tools; set job.tools_chat_template "
            "(chatml, or a Jinja template file) for requests with tools",
        )
    return text


def resolve_template(value: Optional[str]) -> Optional[str]:
    """job.tools_chat_template as template text: a built-in name or a Jinja file's content."""
    if value is None:
        return None
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(
            "job.tools_chat_template",
            f"neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) nor a readable file: {e}",
        ) from None


# ---- output -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # compact JSON text of the arguments object


@dataclass(frozen=True)
class ParsedOutput:
    content: Optional[str]
    calls: tuple[Call, ...]
    finish_reason: str  # tool_calls when there are calls, else the engine's


def parse_output(spec: Optional[ToolSpec], text: str, finish_reason: str) -> ParsedOutput:
    """A choice's text as content and calls. Only an output that finished (stop) holds calls."""
    if spec is None or spec.mode == "none" or finish_reason != "stop":
        return ParsedOutput(text, (), finish_reason)
    names = {t.name for t in spec.tools}
    if spec.constraint is not None:
        calls = _calls_of_json(text, names)
        content = None
    else:
        content, calls = parse_calls(text, names)
    if not calls:
        return ParsedOutput(text, (), finish_reason)
    return ParsedOutput(content, calls if spec.parallel else calls[:1], "tool_calls")


def parse_calls(text: str, names: set[str]) -> tuple[Optional[str], tuple[Call, ...]]:
    """(content, calls) of a free output: Hermes `<tool_call>` blocks after optional content, or
    an output that is all one JSON call or list of calls (Llama 3.1, optionally after
    <|python_tag|>). An output with a malformed call, or a call of an unlisted tool, is content."""
    blocks = list(_TOOL_CALL_BLOCK.finditer(text))
    if blocks:
        per_block = [_calls_of_json(b.group(1), names) for b in blocks]
        if not all(len(c) == 1 for c in per_block):
            return text, ()
        content = text[: blocks[0].start()].strip()
        return content or None, tuple(c[0] for c in per_block)
    stripped = text.strip()
    if stripped.startswith(_PYTHON_TAG):
        stripped = stripped[len(_PYTHON_TAG) :].strip()
    if not stripped.startswith(("{", "[")):
        return text, ()
    calls = _calls_of_json(stripped, names)
    return (None, calls) if calls else (text, ())


def _calls_of_json(text: str, names: set[str]) -> tuple[Call, ...]:
    """The calls a JSON text holds (one call object or a list of them); () when it is not that."""
    try:
        value = json.loads(text)
    except ValueError:
        return ()
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return ()
        name = item.get("name")
        arguments = item.get("arguments", item.get("parameters"))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return ()
        if name not in names or not isinstance(arguments, dict):
            return ()
        calls.append(Call(name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))))
    return tuple(calls)


def call_id(shard: str, index: int, choice: int, position: int) -> str:
    """A tool call's id: stable per shard, line, choice and position across reruns."""
    digest = hashlib.blake2b(f"{shard}\0{index}\0{choice}\0{position}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


def openai_tool_calls(parsed: ParsedOutput, shard: str, index: int, choice: int) -> list[dict[str, Any]]:
    """message.tool_calls of a parsed choice (also the Parquet tool_calls column's value)."""
    return [
        {
            "id": call_id(shard, index, choice, k),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for k, c in enumerate(parsed.calls)
    ]


def chat_choice(
    spec: Optional[ToolSpec], text: str, finish_reason: str, shard: str, index: int, choice: int
) -> tuple[dict[str, Any], str]:
    """(message, finish_reason) of one chat.completion choice; `tool_calls` only when there are some."""
    parsed = parse_output(spec, text, finish_reason)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
    if parsed.calls:
        message["tool_calls"] = openai_tool_calls(parsed, shard, index, choice)
    return message, parsed.finish_reason


def result_columns(
    spec: Optional[ToolSpec], text: Optional[str], finish_reason: str, shard: str, index: int, choice: int
) -> dict[str, Any]:
    """The Parquet result row's tool columns: `tool_calls` (null without calls) and the finish reason
    `tool_calls` when there are calls; {} for rows that asked for no tools or failed."""
    if spec is None or text is None or finish_reason == "error":
        return {}
    parsed = parse_output(spec, text, finish_reason)
    if not parsed.calls:
        return {}
    return {"tool_calls": openai_tool_calls(parsed, shard, index, choice), "finish_reason": parsed.finish_reason}


def _short(value: Any, limit: int = 80) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
