"""Forced calls in the XML-like formats, where a call is a tag around its name and each
argument a tag around its value, written as text (``tool_grammars.py`` has the others).

One call to ``get_weather(city: str, days: int)`` as each grammar writes it (``\\n``: a
newline; ``[\\n]``: one the model may write or not):

    qwen3_coder  <tool_call>\\n<function=get_weather>\\n<parameter=city>\\nOslo\\n</parameter>\\n
                 <parameter=days>\\n2\\n</parameter>\\n</function>\\n</tool_call>
    glm47 (and   <tool_call>get_weather[\\n]<arg_key>city</arg_key>[\\n]<arg_value>Oslo</arg_value>
     Laguna's)   [\\n]<arg_key>days</arg_key>[\\n]<arg_value>2</arg_value>[\\n]</tool_call>
    longcat      as glm47 with longcat_ tags; a call without arguments as JSON,
                 <longcat_tool_call>{"name": "get_time", "arguments": {}}</longcat_tool_call>
    minimax_m2   <minimax:tool_call>\\n<invoke name="get_weather">\\n<parameter name="city">Oslo</parameter>\\n
                 <parameter name="days">2</parameter>\\n</invoke>\\n</minimax:tool_call>
    minicpm5     <function name="get_weather"><param name="city">Oslo</param><param name="days">2</param></function>
    muse_spark   <atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">Oslo
                 </atem:parameter>...</atem:invoke></atem:function_calls>

A string value is text that the parser gives back exactly: it holds no tag that would end
it early, no surrounding whitespace where the parser strips it, is not "null" where the
parser reads that as null; MiniCPM5 takes text with ``<``, ``&`` or a newline only inside
``<![CDATA[...]]>``; Muse Spark reads any value that parses as JSON as JSON, so its strings are
text that does not, or a JSON string. Numbers, booleans, arrays and objects are JSON that
matches their schema; enums one of their strings.

Example (the value of a string parameter in Qwen3-Coder's format):
    >>> from kvserve.server.http.lark_rules import Lark
    >>> g = Lark()
    >>> print(g.text(_value(g, QWEN3_CODER, {"type": "string", "maxLength": 9})), end="")
    start: v_2
    TEXT_1: /(?s:.*)/ & ~/(?s:.*)(<\\/parameter>|<\\/function>|<\\/tool_call>|<parameter=|<function=)(?s:.*)/ & ~/(?i:null)/ & /(?s:.){0,9}/ & ~/(?s:.*)\\x0a<\\/parameter>\\x0a(?s:.*)/
    v_2[lazy]: TEXT_1 "\\n</parameter>\\n"
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.server.http.lark_rules import Lark, none_of, ordered
from kvserve.server.http.tool_args import Shape, choices, kind, length, named, params_of

_STRIPPED = r"/(\S((?s:.)*\S)?)?/"  # no whitespace at either end
_NOT_NULL = "~/(?i:null)/"
# Text that json.loads reads as JSON: what starts as a JSON value does, as do these words.
_NOT_JSON = r'~/[\s"\[{0-9-](?s:.)*/ & ~/(true|false|null|NaN|Infinity)/'


@dataclass(frozen=True)
class Tags:
    """An XML-like call format. ``head``/``tail`` surround a call (``{name}``: the tool);
    ``key`` opens an argument (``{name}``: the parameter; its parts are joined where the
    format allows a newline) and ``end`` closes its value. ``names``: a regex of the tool
    and parameter names the parser reads back; ``stops``: text that would end a value or
    a call early in the parser. ``strip``: the parser strips a value's whitespace;
    ``nulls``: it reads "null" in any case as null; ``gap``: a newline may stand between
    blocks; ``cdata``: strings with ``<&`` or newlines go in CDATA; ``json_first``: a
    value that parses as JSON is read as JSON; ``needs_args``: a call without arguments
    does not parse in tag form (it is written as JSON)."""

    head: str
    tail: str
    key: tuple[str, ...]
    end: str
    names: str
    stops: tuple[str, ...]
    strip: bool = True
    nulls: bool = False
    gap: bool = False
    cdata: bool = False
    json_first: bool = False
    needs_args: bool = False


def tag_call(tags: Tags, g: Lark, f: dict) -> str:
    """The rule of one call to ``f``: its arguments in the schema's order, the required
    ones always."""
    name = named(f, tags.names)
    props, required = params_of(f)
    gap = '"\\n"?' if tags.gap else ""
    items = [(_argument(g, tags, key, schema, gap), key in required) for key, schema in props]
    head, tail = g.lit(tags.head.format(name=name)), g.lit(tags.tail)
    if not tags.needs_args:
        return _seq(head, ordered(items, ""), gap, tail)
    empty = g.lit(tags.head.format(name="") + json.dumps({"name": name, "arguments": {}}) + tags.tail)
    some = [_seq(head, _at_least_one(items), gap, tail)] if items else []
    return " | ".join(some + ([empty] if not required else []))


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _at_least_one(items: list[tuple[str, bool]]) -> str:
    """``ordered(items, "")`` without the empty choice.

    >>> _at_least_one([("a", False), ("b", False)]), _at_least_one([("a", False), ("b", True)])
    ('(a b? | b)', 'a? b')
    """
    if any(required for _, required in items):
        return ordered(items, "")
    heads = [" ".join([items[k][0], *(f"{b}?" for b, _ in items[k + 1:])]) for k in range(len(items))]
    return f"({' | '.join(heads)})"


def _argument(g: Lark, tags: Tags, key: str, schema: dict, gap: str) -> str:
    named({"name": key}, tags.names, "argument name")
    opening = _seq(*(_seq(gap if i else "", g.lit(part.format(name=key))) for i, part in enumerate(tags.key)))
    return g.rule("arg", _seq(gap, opening, f"({_value(g, tags, schema)})"))


def _value(g: Lark, tags: Tags, schema: dict) -> str:
    """An argument's value and the text that closes it."""
    k = kind(schema)
    end = g.lit(tags.end)
    if k == "enum":
        return "(" + " | ".join(g.lit(_enum_text(tags, v)) for v in choices(schema)) + f") {end}"
    if k == "json" or (tags.json_first and k != "string"):  # Muse Spark reads JSON back exactly
        return f"{g.json(schema)} {end}"
    if k == "text":  # no single type: text as the parser types it, within any length given
        return g.text_until([*_framing(tags), *length(schema)], tags.end)
    return " | ".join(_strings(g, tags, schema)) if (tags.cdata or tags.json_first) \
        else g.text_until(_string(tags, schema), tags.end)


def _enum_text(tags: Tags, value: str) -> str:
    """A string to choose, as written: quoted where Muse Spark would read the bare text as JSON.

    >>> _enum_text(MUSE, "celsius"), _enum_text(MUSE, "true"), _enum_text(GLM, "true")
    ('celsius', '"true"', 'true')
    """
    if not tags.json_first:
        return value
    try:
        json.loads(value)
    except ValueError:
        return value if value == value.strip() else json.dumps(value)
    return json.dumps(value)


def _framing(tags: Tags) -> list[str]:
    return [none_of(list(tags.stops)), *([_STRIPPED] if tags.strip else [])]


def _string(tags: Tags, schema: dict) -> list[str]:
    return [*_framing(tags), *([_NOT_NULL] if tags.nulls else []), *length(schema)]


def _strings(g: Lark, tags: Tags, schema: dict) -> list[str]:
    """The two ways MiniCPM5 (plain or CDATA) and Muse Spark (text or a JSON string) write one."""
    if tags.cdata:
        plain = g.text_until([*_string(tags, schema), "/[^<&\\n]*/"], tags.end)
        inner = [none_of(list(tags.stops)), *([_NOT_NULL] if tags.nulls else []), *length(schema)]
        cdata = f'{g.lit("<![CDATA[")} {g.text_until(inner, "]]>" + tags.end)}'
        return [plain, cdata]
    text = g.text_until([*_string(tags, schema), _NOT_JSON], tags.end)
    quoted = f"{g.json(schema)} {g.lit(tags.end)}"
    return [text, quoted]


QWEN3_CODER = Tags("<tool_call>\n<function={name}>\n", "</function>\n</tool_call>", ("<parameter={name}>\n",),
                   "\n</parameter>\n", names=r"[^\s<>]+", strip=False, nulls=True,
                   stops=("</parameter>", "</function>", "</tool_call>", "<parameter=", "<function="))
GLM = Tags("<tool_call>{name}", "</tool_call>", ("<arg_key>{name}</arg_key>", "<arg_value>"), "</arg_value>",
           names=r"[^\s<>]+", gap=True, stops=("</arg_value>", "<arg_key>", "</tool_call>"))
LONGCAT = Tags("<longcat_tool_call>{name}", "</longcat_tool_call>",
               ("<longcat_arg_key>{name}</longcat_arg_key>", "<longcat_arg_value>"), "</longcat_arg_value>",
               names=r"[^\s<>]+", gap=True, needs_args=True,
               stops=("</longcat_arg_value>", "<longcat_arg_key>", "</longcat_tool_call>"))
MINIMAX = Tags('<invoke name="{name}">\n', "</invoke>\n", ('<parameter name="{name}">',), "</parameter>\n",
               names=r'[^\s"<>]+', nulls=True, stops=("</parameter>", "</invoke>", "</minimax:tool_call>"))
MINICPM = Tags('<function name="{name}">', "</function>", ('<param name="{name}">',), "</param>",
               names=r'[^\s"<>]+', nulls=True, cdata=True, stops=("</param>", "</function>"))
MUSE = Tags('<atem:invoke name="{name}">', "</atem:invoke>", ('<atem:parameter name="{name}">',),
            "</atem:parameter>", names=r'[^"<>]+', json_first=True,
            stops=("</atem:parameter>", "</atem:invoke>", "</atem:function_calls>"))


def _shape(tags: Tags, **kw) -> Shape:
    return Shape(lambda g, f: tag_call(tags, g, f), **kw)


TAG_SHAPES: dict[str, Shape] = {
    "qwen3_coder": _shape(QWEN3_CODER, sep="\n"),
    "glm47": _shape(GLM, sep="\n"),
    "longcat": _shape(LONGCAT, sep="\n"),
    "minimax_m2": _shape(MINIMAX, open="<minimax:tool_call>\n", close="</minimax:tool_call>"),
    "minicpm5": _shape(MINICPM, sep="\n"),
    "muse_spark": _shape(MUSE, open="<atem:function_calls>", close="</atem:function_calls>"),
}
