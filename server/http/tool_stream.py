"""Following a tool call as the model writes it: the call's name once it is complete, then
its arguments, piece by piece, while the rest of the call is still being generated.

An *extractor* reads one call region (the text after a format's start marker) and reports
``Start(name)`` once the name is complete and the arguments object has opened, ``Args(text)``
as the arguments arrive, and ``End(ok, at)`` when the call's JSON closes. It sees each
character once: a JSON lexer with a few states, never a reparse of what came before. The
arguments come out as ``json.dumps`` writes them (``", "`` and ``": "``, strings re-escaped
with ``ensure_ascii=False``), so the pieces join to exactly the arguments text of the whole
call. Only a number or literal (its end is the next character) and a half-written escape
sequence are held back.

Formats followed (``extractor_for``): the JSON ones. Others (pythonic, XML-style) return
None and their calls come whole when they close.

- Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (``JsonCalls``)
- Llama 3 ``{"name": ..., "parameters": {...}}``, several joined by ``;`` (``JsonCalls``)
- Mistral ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (``JsonCalls``) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (``HeaderCalls``)
- harmony (gpt-oss) `` to=functions.NAME <|constrain|>json<|message|>{...}`` (``HeaderCalls``)

Example (a Hermes call region, one token at a time):
    >>> x = extractor_for("json_tools")()
    >>> for token in ['\\n{"', 'name', '": "', 'get', '_weather', '", "', 'arguments', '": {',
    ...               '"city', '": "', 'Paris', '", "days": ', '2', '}}', '\\n']:
    ...     print(repr(token), x.feed(token))
    '\\n{"' []
    'name' []
    '": "' []
    'get' []
    '_weather' []
    '", "' []
    'arguments' []
    '": {' [Start(name='get_weather'), Args(text='{')]
    '"city' [Args(text='"city')]
    '": "' [Args(text='": "')]
    'Paris' [Args(text='Paris')]
    '", "days": ' [Args(text='", "days": ')]
    '2' []
    '}}' [Args(text='2}'), End(ok=True, at=67)]
    '\\n' []
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple, Protocol


@dataclass(frozen=True)
class Start:
    """The call's name is complete and its arguments object has opened."""

    name: str


@dataclass(frozen=True)
class Args:
    """More of the arguments, as ``json.dumps`` writes them."""

    text: str


@dataclass(frozen=True)
class End:
    """The call's JSON closed at ``at`` (an offset in the region); ``ok``: it is well-formed
    and names one function with one arguments object."""

    ok: bool
    at: int


Event = Start | Args | End


class Extractor(Protocol):
    def feed(self, text: str) -> list[Event]: ...


def extractor_for(fmt_name: str, start: str = "") -> Callable[[], Extractor] | None:
    """A factory of extractors for the calls of the format named ``fmt_name`` (one per call
    region), or None for a format that is not followed as it streams. ``start``: the format's
    start marker (Llama 3's is the call's own first JSON, ``{"name"``)."""
    return {
        "json_tools": partial(JsonCalls, ("arguments",), many=False),
        "llama3_json": partial(JsonCalls, ("parameters", "arguments"), prime=start),
        "mistral": MistralCalls,
        "harmony": partial(HeaderCalls, "<|message|>", _HARMONY_HEAD, many=False),
    }.get(fmt_name)


# ---- JSON, one character at a time ------------------------------------------------------

class Token(NamedTuple):
    """One lexed piece of JSON. ``text``: as ``json.dumps`` writes it; ``value``: the raw
    character or scalar, or a string's decoded characters; ``depth``: the containers around
    it (a bracket: those outside it); ``at``: where it ends in the lexer's input; ``key``: part
    of an object key; ``bad``: it breaks JSON's grammar (``json.loads`` would refuse it)."""

    kind: str  # open close comma colon str_open str str_close scalar junk
    text: str
    value: str
    depth: int
    at: int
    key: bool = False
    bad: bool = False


_SCALAR = re.compile(r"[0-9A-Za-z+.\-]+")  # numbers, true/false/null (and NaN, Infinity)
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters that need no decoding
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_CLOSES = {"}": "{", "]": "["}
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


class JsonLexer:
    """JSON text as ``Token``s, fed in pieces of any size; values at the top level may
    follow one another with anything between them (Llama 3 joins calls with ``;``).

    >>> lexer = JsonLexer()
    >>> "".join(t.text for t in lexer.feed('{"a" :[1.50,"\\\\u00e9\\\\n"],') + lexer.feed(' "b":true}'))
    '{"a": [1.5, "é\\\\n"], "b": true}'
    >>> [t.bad for t in JsonLexer().feed('{"a" 1}')]
    [False, False, False, False, True, False]
    """

    def __init__(self, start: int = 0):
        self.pos = start  # where the next character sits in the caller's text
        self._stack: list[str] = []
        self._expect = "value"  # value | key | colon | next (a comma or the container's end)
        self._opened = False  # a container just opened: it may close at once
        self._string = self._is_key = False
        self._escape = ""  # an escape sequence under way, from its backslash
        self._high = ""  # a high surrogate waiting for its low half (json.loads pairs them)
        self._scalar = ""

    def feed(self, text: str) -> list[Token]:
        out: list[Token] = []
        i = 0
        while i < len(text):
            i = self._in_string(text, i, out) if self._string else self._outside(text, i, out)
        self.pos += len(text)
        return out

    # ---- outside strings -----------------------------------------------------------------
    def _outside(self, text: str, i: int, out: list[Token]) -> int:
        run = _SCALAR.match(text, i)
        if run:
            self._scalar += run.group()
            return run.end()
        self._end_scalar(i, out)
        ch, at = text[i], self.pos + i + 1
        if ch in " \t\n\r":
            return i + 1
        if ch == '"':
            bad = self._starts(string=True)
            self._string = True
            out.append(Token("str_open", '"', ch, len(self._stack), at, self._is_key, bad))
        elif ch in "{[":
            bad = self._starts(string=False)
            out.append(Token("open", ch, ch, len(self._stack), at, False, bad))
            self._stack.append(ch)
            self._expect, self._opened = ("key" if ch == "{" else "value"), True
        elif ch in "}]":
            out.append(self._close(ch, at))
        elif ch in ",:" and self._stack:
            out.append(self._separator(ch, at))
        else:  # between top-level values anything goes; inside a container nothing else
            out.append(Token("junk", ch, ch, len(self._stack), at, False, bool(self._stack)))
            self._opened = False
        return i + 1

    def _starts(self, string: bool) -> bool:
        """A value (or, where an object expects one, a key) starts: whether that is bad."""
        self._is_key = string and self._expect == "key"
        ok = not self._stack or self._expect == "value" or self._is_key
        self._opened = False
        return not ok

    def _done(self) -> None:
        self._expect = "next" if self._stack else "value"

    def _close(self, ch: str, at: int) -> Token:
        ok = bool(self._stack) and self._stack[-1] == _CLOSES[ch] and (self._expect == "next" or self._opened)
        if self._stack:
            self._stack.pop()
        self._opened = False
        self._done()
        return Token("close", ch, ch, len(self._stack), at, False, not ok)

    def _separator(self, ch: str, at: int) -> Token:
        if ch == ",":
            ok = self._expect == "next"
            self._expect = "key" if self._stack[-1] == "{" else "value"
        else:
            ok = self._expect == "colon"
            self._expect = "value"
        self._opened = False
        return Token("comma" if ch == "," else "colon", ch + " ", ch, len(self._stack), at, False, not ok)

    def _end_scalar(self, i: int, out: list[Token]) -> None:
        if not self._scalar:
            return
        raw, self._scalar = self._scalar, ""
        bad = self._starts(string=False)
        try:  # the spelling json.dumps gives the value json.loads reads ("1.50" -> "1.5")
            text = json.dumps(json.loads(raw))
        except ValueError:
            text, bad = raw, True
        self._done()
        out.append(Token("scalar", text, raw, len(self._stack), self.pos + i, False, bad))

    # ---- inside strings ------------------------------------------------------------------
    def _in_string(self, text: str, i: int, out: list[Token]) -> int:
        if self._escape:
            return self._escaping(text, i, out)
        run = _PLAIN.match(text, i)
        if run:
            self._chars(run.group(), run.end(), out)
            return run.end()
        ch = text[i]
        if ch == "\\":
            self._escape = ch
        elif ch == '"':
            self._chars("", i, out)
            self._string = False
            out.append(Token("str_close", '"', ch, len(self._stack), self.pos + i + 1, self._is_key))
            if self._is_key:
                self._expect = "colon"
            else:
                self._done()
        else:  # a raw control character: json.loads refuses it
            self._chars(ch, i + 1, out, bad=True)
        return i + 1

    def _escaping(self, text: str, i: int, out: list[Token]) -> int:
        self._escape += text[i]
        esc = self._escape
        if esc[1] != "u":
            self._escape = ""
            self._chars(_ESCAPES.get(esc[1], esc[1]), i + 1, out, bad=esc[1] not in _ESCAPES)
        elif len(esc) == 6:
            self._escape = ""
            if _HEX4.fullmatch(esc[2:]):
                self._code_point(int(esc[2:], 16), i + 1, out)
            else:
                self._chars("", i + 1, out, bad=True)
        return i + 1

    def _code_point(self, code: int, end: int, out: list[Token]) -> None:
        if 0xDC00 <= code <= 0xDFFF and self._high:  # the low half of a pair
            high, self._high = ord(self._high), ""
            self._chars(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)), end, out)
        elif 0xD800 <= code <= 0xDBFF:
            self._chars("", end, out)  # an earlier high half stays alone
            self._high = chr(code)
        else:
            self._chars(chr(code), end, out)

    def _chars(self, decoded: str, end: int, out: list[Token], bad: bool = False) -> None:
        """Decoded string characters out (after a high surrogate that was not paired)."""
        decoded, self._high = self._high + decoded, ""
        if decoded or bad:
            text = json.dumps(decoded, ensure_ascii=False)[1:-1]
            out.append(Token("str", text, decoded, len(self._stack), self.pos + end, self._is_key, bad))


# ---- calls as JSON objects ----------------------------------------------------------------

class JsonCalls:
    """Calls written as JSON objects ``{"name": ..., "<key>": {...}}``: one (``many`` False),
    a sequence (Llama 3), or the items of a list (``base`` 1: Mistral). ``keys``: the names
    of the arguments member, first preferred; ``prime``: JSON the start marker consumed.

    A call is followed once its name (a string) is complete and its arguments object opens.
    A call this cannot follow (the arguments first, or a string) stops the following for the
    rest of the region: its calls then come whole, in order, when the region closes.
    """

    def __init__(self, keys: tuple[str, ...], many: bool = True, base: int = 0, prime: str = ""):
        self.keys, self.many, self.base = keys, many, base
        self._lexer = JsonLexer(start=-len(prime))
        self._phase = "seek"  # seek | head | args | tail | off
        self._key, self._name, self._parts, self._bad = "", None, [], False
        self.feed(prime)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._phase == "off":
            return out
        for tok in self._lexer.feed(text):
            getattr(self, "_" + self._phase)(tok, out)
            if self._phase == "off":
                break
        return merge_args(out)

    def _seek(self, tok: Token, out: list[Event]) -> None:
        """Between calls: the next object opens, separators pass, anything else stops."""
        if tok.depth == self.base and tok.kind == "open" and tok.value == "{":
            self._phase, self._key, self._name, self._bad = "head", "", None, tok.bad
        elif tok.depth == self.base and tok.kind in ("comma", "junk") and tok.value in ",;":
            pass
        elif not (tok.depth < self.base and tok.kind == "open" and tok.value == "["):
            self._phase = "off"

    def _head(self, tok: Token, out: list[Event]) -> None:
        """Before the arguments: the keys at the call's level, and the name's value."""
        self._bad |= tok.bad
        if tok.depth == self.base:  # the object closed with no arguments object
            self._phase = "off"
        elif tok.depth > self.base + 1 or tok.kind in ("comma", "colon"):
            return
        elif tok.key:
            self._key = self._key_text(tok)
        elif self._key == "name":
            self._name_token(tok)
        elif self._key in self.keys:
            if tok.kind == "open" and tok.value == "{" and self._name is not None:
                out += [Start(self._name), Args(tok.text)]
                self._phase = "args"
            else:
                self._phase = "off"

    def _key_text(self, tok: Token) -> str:
        return "" if tok.kind == "str_open" else self._key + (tok.value if tok.kind == "str" else "")

    def _name_token(self, tok: Token) -> None:
        if tok.kind == "str_open":
            self._parts = []
        elif tok.kind == "str":
            self._parts.append(tok.value)
        elif tok.kind == "str_close":
            self._name = "".join(self._parts)
        else:  # a name that is not a string
            self._phase = "off"

    def _args(self, tok: Token, out: list[Event]) -> None:
        self._bad |= tok.bad
        out.append(Args(tok.text))
        if tok.kind == "close" and tok.depth == self.base + 1:
            self._phase = "tail"

    def _tail(self, tok: Token, out: list[Event]) -> None:
        """After the arguments: a second name or arguments member makes the call ambiguous."""
        self._bad |= tok.bad
        if tok.key and tok.depth == self.base + 1:
            self._key = self._key_text(tok)
            if tok.kind == "str_close" and (self._key == "name" or self._key in self.keys):
                self._bad = True
        elif tok.depth == self.base and tok.kind == "close":
            out.append(End(not self._bad, tok.at))
            self._phase = "seek" if self.many else "off"


# ---- calls as a header, then a JSON object --------------------------------------------------

_HARMONY_HEAD = re.compile(r"([\w.-]+)[^<]*(?:<\|constrain\|>\w+)?\s*")  # what parse_harmony accepts
_MISTRAL_HEAD = re.compile(r"(?:.*?)([\w-]+)\s*", re.S)  # mlx-lm's: the word before [ARGS]
_LONGEST_HEAD = 256  # a header that long without its marker is not one


class HeaderCalls:
    """Calls written as a header that names the function up to ``marker``, then a JSON object:
    harmony's ``NAME <|constrain|>json<|message|>{...}``, Mistral's ``NAME[ARGS]{...}``.
    ``head``: the pattern the text before the marker must match (group 1 the name);
    ``many``: another header may follow each call."""

    def __init__(self, marker: str, head: re.Pattern, many: bool = True):
        self.marker, self.head, self.many = marker, head, many
        self._phase = "head"  # head | body | args | off
        self._text, self._text_at, self._pos = "", 0, 0
        self._name, self._lexer, self._bad = "", JsonLexer(), False

    def feed(self, text: str) -> list[Event]:
        at, self._pos = self._pos, self._pos + len(text)
        return merge_args(self._read(text, at))

    def _read(self, text: str, at: int) -> list[Event]:
        if self._phase == "head":
            return self._read_head(text, at)
        if self._phase == "body":
            return self._read_body(text, at)
        return self._read_args(text, at) if self._phase == "args" else []

    def _read_head(self, text: str, at: int) -> list[Event]:
        if not self._text:
            self._text_at = at
        self._text += text
        i = self._text.find(self.marker)
        if i < 0:
            if len(self._text) > _LONGEST_HEAD:
                self._phase = "off"
            return []
        match = self.head.fullmatch(self._text[:i])
        if match is None:
            self._phase = "off"
            return []
        rest = self._text[i + len(self.marker):]
        self._name, self._text, self._phase = match.group(1), "", "body"
        return self._read_body(rest, self._text_at + i + len(self.marker))

    def _read_body(self, text: str, at: int) -> list[Event]:
        body = text.lstrip()
        if not body:
            return []
        if body[0] != "{":  # arguments that are not an object: the call comes whole
            self._phase = "off"
            return []
        at += len(text) - len(body)
        self._lexer, self._bad, self._phase = JsonLexer(start=at), False, "args"
        return [Start(self._name)] + self._read_args(body, at)

    def _read_args(self, text: str, at: int) -> list[Event]:
        out: list[Event] = []
        for tok in self._lexer.feed(text):
            self._bad |= tok.bad
            out.append(Args(tok.text))
            if tok.kind == "close" and tok.depth == 0:
                out.append(End(not self._bad, tok.at))
                self._phase = "head" if self.many else "off"
                return out + (self._read(text[tok.at - at:], tok.at) if self.many else [])
        return out


class MistralCalls:
    """Mistral's two spellings after ``[TOOL_CALLS]``: a JSON list of calls, or
    ``NAME[ARGS]{...}`` repeated; the first character that is not a space tells which."""

    def __init__(self) -> None:
        self._inner: Extractor | None = None
        self._seen = ""

    def feed(self, text: str) -> list[Event]:
        if self._inner is None:
            self._seen += text
            lead = self._seen.lstrip()
            if not lead:
                return []
            self._inner = JsonCalls(("arguments",), base=1) if lead[0] == "[" \
                else HeaderCalls("[ARGS]", _MISTRAL_HEAD)
            text, self._seen = self._seen, ""
        return self._inner.feed(text)


def merge_args(events: list[Event]) -> list[Event]:
    """Adjacent argument pieces as one.

    >>> merge_args([Start("f"), Args("{"), Args('"a"'), End(True, 9)])
    [Start(name='f'), Args(text='{"a"'), End(ok=True, at=9)]
    """
    out: list[Event] = []
    for e in events:
        if isinstance(e, Args) and out and isinstance(out[-1], Args):
            out[-1] = Args(out[-1].text + e.text)
        else:
            out.append(e)
    return out
