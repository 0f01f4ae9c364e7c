"""Structured output: a grammar matcher per constrained request, and the batched logit mask.

A request with `json_schema`, `regex` or `choice` gets a grammar (xgrammar). Its compilation
against the vocabulary runs in a background thread from the moment the request is added, so it
overlaps the request's prefill; compiled grammars are cached by (kind, canonical text), so rows
sharing a schema compile it once. Before each sampling step every constrained row's matcher fills
one row of a token bitmask on the host; the bitmask goes to the logits' device and masks all
constrained rows in one op. The sampled token advances the matcher. The grammar's stop tokens are
the engine's EOS ids, which it allows only once the output is complete; accepting one terminates
the matcher and the request.

xgrammar rather than llguidance: both compile a nested schema in milliseconds, but xgrammar fills
a batch of masks several times faster, and mask filling is paid every step while compilation is
paid once per schema (`python -m benchmarks.structured --only libraries`; docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

MAX_CACHED_GRAMMARS = 512  # compiled grammars kept (least recently used dropped first)
# A string length bound up to this is spelled out as one grammar position per character (fast masks,
# one vocabulary scan per position at compile time); a longer one keeps xgrammar's repetition.
MAX_SPELLED_REPETITION = 256
# Compact JSON with a space after separators: no free whitespace, so a model cannot spin in it.
JSON_SEPARATORS = (", ", ": ")
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Bit j of a bitmask word is token 32 * word + j; 1 << 31 wraps to the int32 sign bit.
_BITS = torch.tensor([1 << j for j in range(32)], dtype=torch.int64).to(torch.int32)  # (32,)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # an optional extra: the engine runs without it until a constraint is asked for
        raise ImportError("structured output needs xgrammar: pip install 'batchrun[structured]'") from e
    return xgrammar


def constraint_key(json_schema: Optional[str], regex: Optional[str], choice: Sequence[str]) -> tuple[str, str]:
    """(kind, text) of a constraint (SamplingParams' three fields; this module does not import it,
    which imports this): its grammar's cache key."""
    if json_schema is not None:
        return "json_schema", json_schema
    if regex is not None:
        return "regex", regex
    return "choice", choice_ebnf(choice)


def choice_ebnf(choices: Sequence[str]) -> str:
    """A grammar whose language is exactly the choice strings."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    body = "".join(escapes.get(ch, ch) if ch >= " " or ch in escapes else f"\\x{ord(ch):02x}" for ch in text)
    return f'"{body}"'


def _message(error: Exception) -> str:
    """xgrammar's message without the C++ source location in front of it."""
    return _CPP_PREFIX.sub("", str(error).strip())


# xgrammar (through 0.2.9, its issue #800) lowers a string with minLength/maxLength to a repetition
# of this class: it admits raw control characters, which JSON forbids in strings (strict parsers
# reject the output), and no escapes. Each repetition is replaced by one JSON character: an
# unescaped code point other than U+0000-U+001F, quote and backslash, or one escape (so a surrogate
# pair written as two \u escapes counts twice; written raw it counts once).
_BOUNDED_STRING_CHAR = r"(([^\"\\\r\n]))"
_JSON_STRING_CHAR = (
    r'(([^\0-\x1f\"\\]) | ("\\" [\"\\/bfnrt]) | ("\\u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
)


# A repetition `name{min, max}` in xgrammar's printed EBNF (max -1: unbounded).
_REPETITION = re.compile(r"\b(\w+)\{(\d+), (-?\d+)\}")


def _unroll_bounded(ebnf: str, names: set[str]) -> str:
    """Each repetition `name{m, n}` of the given rules, spelled out as a chain of rules of the
    same language: `name_m_n ::= name name_{m-1}_{n-1}` down to m = 0, then
    `name_0_k ::= "" | name name_0_{k-1}` down to `name_0_0 ::= ""` (unbounded n:
    `name_0_inf ::= "" | name name_0_inf`).

    xgrammar runs a repetition of a rule (rather than of one character class) through its parser
    token by token at every step: in a string of the JSON character rule that costs a scan of the
    whole vocabulary per row per step, far longer than the forward pass. Spelled out, each count
    still to go is a grammar position of its own, whose token mask xgrammar precomputes at compile
    time (one vocabulary scan per position, paid once per schema)."""
    rules: dict[str, str] = {}

    def rule(name: str, low: int, high: int) -> str:
        """The rule of `name{low, high}` (high -1: unbounded), defined with the chain below it."""
        tail = "inf" if high < 0 else None
        chain = [(low - i, tail or str(high - i)) for i in range(low + 1)]  # (min, max) down to min 0
        last = chain[-1]
        if tail is None:
            chain += [(0, str(k)) for k in range(int(last[1]) - 1, -1, -1)]
        reps = [f"{name}_{lo}_{hi}" for lo, hi in chain]
        for i, (lo, hi) in enumerate(chain):
            if reps[i] in rules:
                break  # the rest of the chain is defined already
            if lo > 0:
                rules[reps[i]] = f"({name} {reps[i + 1]})"
            elif hi == "inf":
                rules[reps[i]] = f'("" | ({name} {reps[i]}))'
            elif hi == "0":
                rules[reps[i]] = '("")'
            else:
                rules[reps[i]] = f'("" | ({name} {reps[i + 1]}))'
        return reps[0]

    def spell(match: re.Match[str]) -> str:
        name, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        if name not in names or max(low, high) > MAX_SPELLED_REPETITION:
            return str(match.group(0))  # past the cap: xgrammar's own repetition, slow to mask but compiled fast
        return rule(name, low, high)

    body = _REPETITION.sub(spell, ebnf)
    return body + "\n" + "".join(f"{rep} ::= {text}\n" for rep, text in rules.items())


def _json_schema_grammar(xgr: Any, text: str) -> Any:
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
    ebnf = str(grammar)
    if _BOUNDED_STRING_CHAR not in ebnf:
        return grammar
    names = set(re.findall(rf"^(\w+) ::= {re.escape(_BOUNDED_STRING_CHAR)}$", ebnf, re.MULTILINE))
    ebnf = _unroll_bounded(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR), names)
    return xgr.Grammar.from_ebnf(ebnf)


def build_grammar(kind: str, text: str) -> Any:
    """The xgrammar Grammar of a constraint (no vocabulary needed); ValueError naming the key."""
    xgr = _xgrammar()
    try:
        if kind == "json_schema":
            return _json_schema_grammar(xgr, text)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except RuntimeError as e:
        what = {"json_schema": "not a JSON Schema this engine supports", "regex": "not a supported regex"}
        raise ValueError(f"{kind}: {what.get(kind, 'cannot be compiled')}: {_message(e)}") from None


@functools.lru_cache(maxsize=1024)
def _check(kind: str, text: str) -> None:
    build_grammar(kind, text)


def check_constraint(json_schema: Optional[str], regex: Optional[str], choice: Sequence[str]) -> None:
    """ValueError, naming the key, when the constraint is malformed (SamplingParams calls this)."""
    given = {"json_schema": json_schema is not None, "regex": regex is not None, "choice": bool(choice)}
    set_kinds = [k for k, is_set in given.items() if is_set]
    if len(set_kinds) > 1:
        raise ValueError(f"{set_kinds[1]}: set at most one of json_schema, regex and choice (also set: {set_kinds[0]})")
    if choice and not all(isinstance(c, str) and c for c in choice):
        raise ValueError("choice: every choice must be a non-empty string")
    _check(*constraint_key(json_schema, regex, choice))


class GrammarCompiler:
    """Compiles constraints against the model's vocabulary in one background thread, with a cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None  # built by the first compile, in the thread: the vocabulary scan takes a while
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()

    def submit(self, key: tuple[str, str]) -> Future[Any]:
        """A future of the compiled grammar of a `constraint_key`; the same future for every request
        with this constraint."""
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(self._compile, *key)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return future

    def _compile(self, kind: str, text: str) -> Any:
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
            )
            # Our own cache holds the results; xgrammar's would keep a second copy.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(build_grammar(kind, text))

    def new_state(self, key: tuple[str, str]) -> GrammarState:
        return GrammarState(self.submit(key), self.vocab_size)


class GrammarState:
    """One request's matcher, made once its grammar is compiled."""

    def __init__(self, compiled: Future[Any], vocab_size: int) -> None:
        self._compiled = compiled
        self.vocab_size = vocab_size
        self.matcher: Any = None
        self.error: Optional[str] = None

    def ready(self) -> bool:
        """Wait for the grammar; False (with `error` set) when it failed to compile."""
        if self.matcher is None and self.error is None:
            try:
                self.matcher = _xgrammar().GrammarMatcher(self._compiled.result())
            except Exception as e:
                self.error = _message(e)
        return self.matcher is not None

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


def fill_bitmask(states: Sequence[GrammarState], vocab_size: int) -> tuple[torch.Tensor, list[bool]]:
    """The allowed next tokens of each state, one bit per token: (len(states), ceil(vocab / 32))
    int32 on the host, and per state whether its row blocks any token (False: the state admits
    every token, so masking that row is a no-op and is skipped). Reads the matchers, never
    advances them; xgrammar releases the GIL while it fills, so this may run in a worker thread
    while the forward pass runs."""
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)  # (n, ceil(V / 32)) int32, on the host
    return bitmask, [bool(s.matcher.fill_next_token_bitmask(bitmask, i)) for i, s in enumerate(states)]


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """The logits with -inf for the tokens the bitmask disallows in the given rows (a new tensor).

    logits: (num_rows, vocab_size) on any device; bitmask: (len(rows), ceil(vocab_size / 32)) int32."""
    num, vocab = len(rows), logits.shape[-1]
    assert bitmask.shape[0] == num and bitmask.shape[1] * 32 >= vocab
    bitmask = bitmask.to(logits.device, non_blocking=True)
    blocked = ((bitmask[:, :, None] & _BITS.to(logits.device)) == 0).view(num, -1)[:, :vocab]  # (n, V) bool
    if num != logits.shape[0] or list(rows) != list(range(num)):
        every_row = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)  # (num_rows, V)
        every_row[torch.tensor(list(rows), device=logits.device)] = blocked
        blocked = every_row
    return logits.masked_fill(blocked, float("-inf"))
