"""A request's output as text: whole at the end (`output_text`), and incrementally for stop strings.

Decoding a token list is not decoding its pieces one by one: a byte-level token can end inside a
UTF-8 character (it decodes to U+FFFD until the token that completes it arrives), and SentencePiece
decoders drop the leading space of whichever token comes first. So, as vLLM's detokenizer does,
two offsets into the output tokens are kept: `read_offset`, up to which the text is complete, and
`prefix_offset`, where the last complete piece started. Each step decodes only
`tokens[prefix_offset:]` and `tokens[prefix_offset:read_offset]`; the first minus the second is the
text beyond `read_offset`, with the same first token in both decodes so its quirks cancel. That
text becomes complete (the offsets move up) only when it is longer than before and does not end in
U+FFFD, that is, in a character whose remaining bytes are still to come.

A decoder that rewrites text across token boundaries (`clean_up_tokenization_spaces`: " ." -> ".")
is not incremental this way; `is_incremental` says so, and such a tokenizer's text is decoded whole.
`tests/engine/test_stop.py` checks over random token sequences that the text this gives is the full
decode's, for the test tokenizer and SmolLM2's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

INCOMPLETE = "\ufffd"  # what a decoder makes of a character whose bytes have not all arrived


def output_text(tokenizer: Any, token_ids: Sequence[int], stop: Sequence[str]) -> str:
    """The output's text, decoded whole, before the earliest of the stop strings in it."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def is_incremental(tokenizer: Any) -> bool:
    """Whether the tokenizer's decode is a concatenation of its pieces' (no cross-token clean-up)."""
    return not getattr(tokenizer, "clean_up_tokenization_spaces", False)


class IncrementalDetokenizer:
    """The output text of one request, kept as its last `keep` complete characters (the part a new
    match of a string of up to keep + 1 characters can start in) plus the offsets above."""

    def __init__(self, keep: int) -> None:
        self.keep = keep  # complete characters kept before the text in progress
        self.prefix_offset = 0  # output tokens before it are decoded into `tail`, and so is the piece after
        self.read_offset = 0  # output tokens before it make complete text
        self.tail = ""  # the last `keep` characters of the complete text (all of it if shorter)
        # False once a decode did not extend the one before (a decoder this module cannot follow):
        # from then on the caller decodes the whole output instead.
        self.is_exact = True

    def step(self, tokenizer: Any, token_ids: Sequence[int], start: int) -> Optional[str]:
        """After new tokens were appended: the kept tail followed by all text past `read_offset`
        (which may end in an incomplete character), so the whole output's text is the complete text
        before the tail plus this; None (and `is_exact` False) when the decoder rewrote text it had
        given before. `token_ids[start:]` are the output tokens (a request's token list and its
        number of prompt tokens)."""
        decode = tokenizer.decode
        piece = token_ids[start + self.prefix_offset :]
        before: str = decode(piece[: self.read_offset - self.prefix_offset], skip_special_tokens=True)
        text: str = decode(piece, skip_special_tokens=True)
        if not text.startswith(before):
            self.is_exact = False
            return None
        window = self.tail + text[len(before) :]
        if len(text) > len(before) and not text.endswith(INCOMPLETE):
            self.tail = window[-self.keep :] if self.keep else ""
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids) - start
        return window
