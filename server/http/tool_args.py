"""What the grammars of forced calls are built from: a tool's parameters, the way a format
holds its calls (``Shape``), and how a parser that reads arguments as text takes each
parameter's type (``kind``).

Example:
    >>> kind({"type": "string"}), kind({"enum": ["a", "b"]}), kind({"type": "integer"}), kind({})
    ('string', 'enum', 'json', 'text')
    >>> call_schema({"name": "f"}, "arguments")["properties"]["name"]
    {'const': 'f'}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from kvserve.server.http.lark_rules import Lark

JSON_TYPES = ("integer", "number", "boolean", "object", "array", "null")


class Unwritable(ValueError):
    """A tool the format cannot write a call to: a name or an argument its parser would not
    read back."""


@dataclass(frozen=True)
class Shape:
    """How a format holds its calls: ``call(g, function)`` writes the rule of one call to a
    tool; ``open``/``close`` surround all the calls of a reply, ``sep`` stands between two;
    ``parallel``: the format can hold more than one call in a reply."""

    call: Callable[[Lark, dict], str]
    open: str = ""
    close: str = ""
    sep: str = ""
    parallel: bool = True


def params(function: dict) -> dict:
    """A function's parameter schema (no parameters: an object without properties)."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def params_of(function: dict) -> tuple[list[tuple[str, dict]], set[str]]:
    """The properties of a function's parameters in their order, and the required names.

    >>> params_of({"parameters": {"properties": {"a": {}, "b": {}}, "required": ["b"]}})
    ([('a', {}), ('b', {})], {'b'})
    """
    schema = params(function)
    return list((schema.get("properties") or {}).items()), set(schema.get("required") or ())


def call_schema(function: dict, arguments: str) -> dict:
    """A JSON call ``{"name": ..., <arguments>: {...}}`` to ``function``."""
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments: params(function)},
            "required": ["name", arguments], "additionalProperties": False}


def named(function: dict, pattern: str, what: str = "tool name") -> str:
    """The function's name, where the format's parser reads back a name of ``pattern``.

    >>> try:
    ...     named({"name": "a b"}, r"\\w+")
    ... except Unwritable as exc:
    ...     print(exc)
    the tool name 'a b' cannot be written in this model's call format
    """
    name = function["name"]
    if not re.fullmatch(pattern, name):
        raise Unwritable(f"the {what} {name!r} cannot be written in this model's call format")
    return name


def kind(schema: dict) -> str:
    """How a value of ``schema`` is written where arguments are text: ``enum`` (strings to
    choose from), ``string`` (the text itself), ``json`` (a number, boolean, null, array or
    object, as JSON), ``text`` (no single type: text, typed as the parser guesses)."""
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices and all(isinstance(v, str) for v in choices):
        return "enum"
    if schema.get("type") == "string":
        return "string"
    if schema.get("type") in JSON_TYPES or choices:
        return "json"
    return "text"


def choices(schema: dict) -> list[str]:
    return schema.get("enum", [schema.get("const")])


def length(schema: dict) -> list[str]:
    """A string's ``minLength``/``maxLength`` as a regex for ``Lark.text_until``.

    >>> length({"maxLength": 40}), length({})
    (['/(?s:.){0,40}/'], [])
    """
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is None and hi is None:
        return []
    return [f"/(?s:.){{{lo or 0},{'' if hi is None else hi}}}/"]


def repeat(item: str, sep: str, schema: dict) -> str:
    """``item`` repeated as an array of ``schema`` holds it (``minItems``/``maxItems``),
    ``sep`` between two.

    >>> repeat("v", '","', {"minItems": 1, "maxItems": 3}), repeat("v", '","', {})
    ('v ("," v){0,2}', '(v ("," v){0,})?')
    """
    lo, hi = schema.get("minItems", 0), schema.get("maxItems")
    if hi == 0:
        return ""
    more = f'{{{max(lo - 1, 0)},{"" if hi is None else hi - 1}}}'
    body = f"{item} ({sep} {item}){more}"
    return body if lo >= 1 else f"({body})?"
