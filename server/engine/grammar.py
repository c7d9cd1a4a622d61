"""Constrained decoding: a grammar per request, a token mask per row and step (llguidance).

A request that asks for structured output (a JSON schema, a tool call's arguments) carries a
``Grammar``: llguidance's grammar text, compiled once per request into a matcher that follows
the tokens it is fed. Before a constrained row samples, its matcher writes a bitmask of the
tokens that keep the output inside the grammar; the logits of every other token become -inf.
When the grammar is complete, only end-of-sequence stays allowed, so the reply ends there.

Rows without a grammar never reach this module. The masks of a batch's constrained rows are
computed together, in parallel threads (``LLExecutor``), straight into one numpy bitmask.

Why llguidance (``docs/benchmarks/grammar-engines.md`` has the measurements): it compiles a
JSON schema in about a millisecond (each request brings its own), masks a 49K vocabulary in
tens of microseconds, refuses the keywords it cannot enforce instead of ignoring them, and is
one wheel with no dependencies (xgrammar needs torch; outlines-core compiles for seconds).

Example (a grammar that allows "yes" or "no" only):
    >>> g = Grammar.from_regex("yes|no")
    >>> g.kind, "yes|no" in g.text
    ('regex', True)
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

# JSON as Python's json.dumps writes it (", " and ": "), no other whitespace: a reply that
# is fed back to the model next turn (a tool call's arguments) renders to the same tokens,
# so the prefix cache still covers it; and a small model cannot loop on newlines.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message says why (a 400 for the client)."""


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match: llguidance's grammar ``text`` and the ``kind`` it
    came from (json_schema, json_object, lark, regex; for metrics and messages)."""

    kind: str
    text: str

    @classmethod
    def from_json_schema(cls, schema: dict[str, Any] | bool, kind: str = "json_schema") -> Grammar:
        from llguidance import LLMatcher

        try:
            text = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
        return cls(kind, text)

    @classmethod
    def from_lark(cls, lark: str, kind: str = "lark") -> Grammar:
        from llguidance import LLMatcher

        return cls(kind, LLMatcher.grammar_from_lark(lark))

    @classmethod
    def from_regex(cls, regex: str) -> Grammar:
        from llguidance import LLMatcher

        return cls("regex", LLMatcher.grammar_from_regex(regex))


class Grammars:
    """Per model: llguidance's view of the tokenizer (built on first use, about a second for
    a 49K vocabulary) and the thread pool that fills masks. Safe to share across threads:
    the HTTP layer checks grammars with it, the engine thread builds matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, threads: int = 2):
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper, or a HF one
        self._eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [self._hf.eos_token_id])
        self.vocab_size = vocab_size
        self._threads = threads
        self._lock = threading.Lock()
        self._tokenizer = None
        self._executor = None

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLExecutor
                from llguidance.hf import from_tokenizer

                try:
                    self._tokenizer = from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self._eos)
                except Exception as exc:  # e.g. a slow (Python) tokenizer: no byte-level vocabulary
                    raise GrammarError(f"structured output is not available for this tokenizer: {exc}") from None
                self._executor = LLExecutor(self._threads)
            return self._tokenizer

    def check(self, grammar: Grammar) -> None:
        """Raise ``GrammarError`` with llguidance's reason when ``grammar`` cannot compile."""
        from llguidance import LLMatcher

        message = LLMatcher.validate_grammar(grammar.text, self.tokenizer)
        if message:
            raise GrammarError(f"cannot compile the {grammar.kind.replace('_', ' ')}: {message}")

    def matcher(self, grammar: Grammar) -> RowGrammar:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar.text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"cannot compile the {grammar.kind}: {matcher.get_error()}")
        return RowGrammar(matcher)

    def masks(self, rows: list[RowGrammar]) -> np.ndarray:
        """Allowed tokens of each row, as booleans (len(rows), vocab_size), filled in parallel."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

        self.tokenizer  # noqa: B018 - builds the executor on first use
        bits = allocate_token_bitmask(len(rows), self.vocab_size)
        fill_next_token_bitmask_par(self._executor, [(r.matcher, i) for i, r in enumerate(rows)], bits)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return allowed[:, : self.vocab_size].astype(bool)


class RowGrammar:
    """One request's matcher: it consumes every token the request samples."""

    def __init__(self, matcher):
        self.matcher = matcher

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):  # never after a masked draw
            raise GrammarError(f"token {token} breaks the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: only end-of-sequence remains allowed."""
        return self.matcher.is_stopped()
