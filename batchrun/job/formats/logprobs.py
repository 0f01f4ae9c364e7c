"""Logprob columns of the results: the engine's per-token {token_id: logprob} maps as Parquet
list<struct> entries, with each token's text.

An entry holds the token (id, text, logprob) and its top-N alternatives in rank order; the engine
reports the top N plus the chosen token when that is not among them, so the N largest of its map
are the alternatives. Logprobs are of the model's own distribution (raw logits, before temperature
and top-k/top-p), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

TOKEN_TYPE = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())])
ENTRY_TYPE = pa.struct(
    [("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64()), ("top", pa.list_(TOKEN_TYPE))]
)
LOGPROBS_TYPE = pa.list_(ENTRY_TYPE)


class TokenTexts:
    """Each token id's own decoded text, decoded once per id (a shard repeats the same tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            # Alone, a token holding part of a multi-byte character decodes to U+FFFD; token_id is exact.
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def logprob_entries(
    token_ids: list[int], logprobs: Optional[list[dict[int, float]]], top_n: int, texts: TokenTexts
) -> Optional[list[dict[str, Any]]]:
    """One entry per token of `token_ids`, from the engine's maps (one per token, same order)."""
    if logprobs is None:
        return None
    assert len(logprobs) == len(token_ids), "one logprob map per token"
    entries = []
    for token_id, candidates in zip(token_ids, logprobs):
        top = sorted(candidates.items(), key=lambda kv: -kv[1])[:top_n]
        entries.append(
            {
                "token_id": token_id,
                "token": texts(token_id),
                "logprob": candidates[token_id],
                "top": [{"token_id": t, "token": texts(t), "logprob": lp} for t, lp in top],
            }
        )
    return entries


def cumulative_logprob(entries: Optional[list[dict[str, Any]]]) -> Optional[float]:
    """The sum of the tokens' logprobs: the log-probability of the whole output under the model."""
    return None if entries is None else float(sum(e["logprob"] for e in entries))
