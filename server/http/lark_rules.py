"""Writing llguidance Lark grammars: literal text with a tokenizer's added tokens, free-text
values that end where a format's parser ends them, and ordered argument lists.

llguidance reads every added token of a tokenizer (``<tool_call>`` in Qwen's, ``<|channel|>``
in gpt-oss's) as a special token, which no quoted string matches: a literal written as a
string would make the model spell the marker out in ordinary tokens, text it was never
trained to write. So literal text names each added token it holds by id.

Example (``<|call|>`` is added token 7 of some tokenizer):
    >>> g = Lark({"<|call|>": 7})
    >>> g.lit('x = 1<|call|>')
    '"x = 1" <[7]>'
    >>> g.rule("pair", g.lit("a") + " " + g.lit("b"))
    'pair_1'
    >>> print(g.text("pair_1"), end="")
    start: pair_1
    pair_1: "a" "b"
"""

from __future__ import annotations

import json
import re
from typing import Mapping

from kvserve.server.engine.grammar import JSON_OPTIONS

ANY = "(?s:.*)"
_META = set("\\.^$|?*+()[]{}/-")


class Lark:
    """Rules being written for one grammar. ``added``: the tokenizer's added tokens by text."""

    def __init__(self, added: Mapping[str, int] | None = None):
        self._added = {text: i for text, i in (added or {}).items() if text}
        longest = sorted(self._added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest)) + ")") if longest else None
        self._lines: list[str] = []
        self._count = 0

    def lit(self, text: str) -> str:
        """``text`` as Lark: quoted strings, added tokens by id ("" for no text)."""
        pieces = self._split.split(text) if self._split else [text]
        return " ".join(f"<[{self._added[p]}]>" if p in self._added else json.dumps(p) for p in pieces if p)

    def plain_prefix(self, text: str) -> tuple[str, str]:
        """``text`` split before its first added token.

        >>> Lark({"<|call|>": 7}).plain_prefix("ab<|call|>c")
        ('ab', '<|call|>c')
        """
        match = self._split.search(text) if self._split else None
        at = match.start() if match else len(text)
        return text[:at], text[at:]

    def rule(self, stem: str, body: str, options: str = "") -> str:
        self._count += 1
        name = f"{stem}_{self._count}"
        self._lines.append(f"{name}{options}: {body}")
        return name

    def terminal(self, stem: str, body: str) -> str:
        return self.rule(stem.upper(), body)

    def json(self, schema: dict) -> str:
        """A JSON value matching ``schema``, spaced as ``json.dumps`` writes it."""
        return self.rule("json", f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")

    def text_until(self, regexes: list[str], end: str) -> str:
        """Free text (every regex in ``regexes`` holds for it), then ``end``: the text ends at
        the first ``end``, where the format's parser ends it too. Where ``end`` opens with
        ordinary text, that text is matched lazily with the value (llguidance's lexer
        extends a lexeme while it can, and would swallow the start of ``end``).

        >>> g = Lark()
        >>> g.text_until([], "</p>")
        'v_2'
        >>> print(g.text("v_2"), end="")
        start: v_2
        TEXT_1: /(?s:.*)/ & ~/(?s:.*)<\\/p>(?s:.*)/
        v_2[lazy]: TEXT_1 "</p>"
        """
        plain, rest = self.plain_prefix(end)
        parts = [f"/{ANY}/", *regexes] + ([f"~/{ANY}{regex(plain)}{ANY}/"] if plain else [])
        term = self.terminal("text", " & ".join(parts))
        if not plain:
            return f"{term} {self.lit(rest)}"
        lazy = self.rule("v", f"{term} {self.lit(plain)}", "[lazy]")
        return f"{lazy} {self.lit(rest)}".strip()

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self._lines]) + "\n"


def regex(text: str) -> str:
    """``text`` as a regex inside Lark's ``/.../`` (control characters as ``\\xNN``: a raw
    newline cannot stand in it).

    >>> print(regex("</a.b>\\n"))
    <\\/a\\.b>\\x0a
    """
    return "".join("\\" + c if c in _META else f"\\x{ord(c):02x}" if ord(c) < 32 or c == "\x7f" else c
                   for c in text)


def none_of(texts: list[str]) -> str:
    """A regex (for ``text_until``) of text that holds none of ``texts``.

    >>> none_of(["</a>", "<b"])
    '~/(?s:.*)(<\\\\/a>|<b)(?s:.*)/'
    """
    return f"~/{ANY}({'|'.join(regex(t) for t in texts)}){ANY}/"


def ordered(items: list[tuple[str, bool]], sep: str) -> str:
    """Items in the given order, each required one always present, an optional one present or
    not, ``sep`` between two present ones ("" where the items delimit themselves).

    >>> ordered([("a", False), ("b", True), ("c", False)], '","')
    '(a "," b | b) ("," c)?'
    >>> ordered([("a", False)], '","'), ordered([("a", True), ("b", False)], "")
    ('(a)?', 'a b?')
    """
    if not items:
        return ""
    if not sep:
        return " ".join(body if required else f"{body}?" for body, required in items)
    first = next((i for i, (_, required) in enumerate(items) if required), None)
    last = len(items) - 1 if first is None else first

    def tail(lo: int, hi: int) -> list[str]:
        return [f"{sep} {b}" if r else f"({sep} {b})?" for b, r in items[lo:hi + 1]]

    # The first item present is one of those up to the first required one.
    heads = [" ".join([items[k][0], *tail(k + 1, last)]) for k in range(last + 1)]
    choice = f"({' | '.join(heads)})" if len(heads) > 1 or first is None else heads[0]
    if first is None:
        return choice + "?"
    return " ".join([choice, *tail(first + 1, len(items) - 1)])
