"""OpenAI batch `/v1/embeddings` requests (an embed engine's lines) and the output line they answer with.

    {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
     "body": {"model": "...", "input": "some text", "encoding_format": "float"}}

body.input is a string, a list of strings, a list of token ids or a list of token-id lists; each
input is one engine request and one result row (its `sample_index` the input's position), and the
line answers them together in OpenAI's shape:

    {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}, ...],
     "model": "...", "usage": {"prompt_tokens": N, "total_tokens": N}}

Text inputs go to the engine as text: it tokenizes them as sentence-transformers does (the
pipeline's special tokens, do_lower_case, default prompt and chat modality). Token-id inputs run
as given: no special tokens, prompt or chat template are added, unlike text. An input longer than
the model's limit is truncated to it as sentence-transformers truncates (counted in the row's
num_truncated_tokens); OpenAI's API does not truncate, it refuses such a request with a 400.
encoding_format base64 gives each embedding as the base64 of its little-endian float32 bytes (what
OpenAI's clients decode); `dimensions` is accepted only at the model's own dimension (batchrun
does not shorten embeddings).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from batchrun.engine import RequestOutput

EMBEDDINGS_URL = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs
_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


def embedding_inputs(
    body: dict[str, Any], vocab_size: int, embedding_dim: Optional[int]
) -> Union[list[Union[str, list[int]]], tuple[str, str]]:
    """The request's inputs (texts, or token ids), or (error code, message) of a body batchrun
    cannot answer."""
    unknown = sorted(k for k, v in body.items() if k not in _FIELDS and v is not None)
    if unknown:
        return "unsupported_parameter", f"body field(s) {', '.join(unknown)} are not supported for {EMBEDDINGS_URL}"
    encoding = body.get("encoding_format")
    if encoding not in (None, "float", "base64"):
        return "invalid_request", f"body.encoding_format must be float or base64, got {encoding!r}"
    dimensions = body.get("dimensions")
    if dimensions is not None and dimensions != embedding_dim:
        return "unsupported_parameter", f"body.dimensions: the model's embeddings have {embedding_dim} dimensions"
    value = body.get("input")
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        return "invalid_request", "body.input must be a string, a list of strings or token ids, or a list of those"
    if len(items) > MAX_INPUTS:
        return "invalid_request", f"body.input has {len(items)} inputs; at most {MAX_INPUTS} per request"
    out: list[Union[str, list[int]]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item.strip():
                return "invalid_request", f"body.input[{i}] is empty"
            out.append(item)
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            if not all(0 <= t < vocab_size for t in item):
                return "invalid_request", f"body.input[{i}] has token ids outside [0, {vocab_size})"
            out.append(list(item))
        else:
            return "invalid_request", f"body.input[{i}] must be a non-empty string or list of token ids"
    return out


def embedding_body(model: str, encoding_format: Optional[str], outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The response body of an embeddings request whose inputs' outputs are `outs`, in input order."""
    data = []
    for i, out in enumerate(outs):
        assert out.pooled is not None, "only answered outputs have a line"
        vector = np.asarray(out.pooled, dtype=np.float32).reshape(-1)
        encoded: Any = vector.tolist()
        if encoding_format == "base64":
            encoded = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    num_prompt = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt},
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
