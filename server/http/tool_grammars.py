"""Grammars of forced tool calls, one per call format: the text that the format's own parser
reads back as calls of the given tools, and then nothing but the end of the reply.

One call to ``get_weather(city: str, days: int)`` as each grammar writes it (``\\n``: a
newline; ``structured.tool_call_grammar`` chooses the tools and how many calls):

    json_tools      <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\\n</tool_call>
    mistral         [TOOL_CALLS][{"name": "get_weather", "arguments": {...}}]
      [ARGS] dialect  [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}
    llama3_json     {"name": "get_weather", "parameters": {...}}
    harmony         <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}
    kimi_k2         <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
                    <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>
    kimi_k3         <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>json
                    type="object"<|sep|>{...}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>
    pythonic        <|tool_call_start|>[get_weather(city="Oslo", days=2)]<|tool_call_end|>
    gemma4          <|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|>
    function_gemma  <start_function_call>call:get_weather{city:<escape>Oslo<escape>,days:2}<end_function_call>
    (the XML formats of ``tag_formats.py``: qwen3_coder, glm47 (mlx-lm reads Laguna's calls
    with it), longcat, minimax_m2, minicpm5, muse_spark)

Where the arguments are JSON (the first six), they match the tool's ``parameters`` schema.
Elsewhere each argument is one of the schema's properties, in its order, every required one
present; a value is written as the parser reads its type back (``values.kind``): strings
as text the parser keeps as it is, numbers, booleans, arrays and objects as JSON matching
their schema. Nothing follows the last call but the end of the reply: after it the
grammar is complete, and a complete grammar allows only the end-of-sequence tokens (gpt-oss
ends a call with ``<|call|>``, one of those).

Example (Hermes, one tool, parallel calls):
    >>> f = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    >>> print(call_grammar("json_tools", "", [f], parallel=True), end="")  # doctest: +ELLIPSIS
    start: call_2 ("\\n" call_2)*
    json_1: %json {"type": "object", "properties": {"name": {"const": "f"}, ...}
    call_2: "<tool_call>\\n" json_1 "\\n</tool_call>"
"""

from __future__ import annotations

import keyword
import re
from typing import Mapping

from kvserve.server.http.lark_rules import Lark, none_of, ordered
from kvserve.server.http.tag_formats import TAG_SHAPES
from kvserve.server.http.tool_args import (Shape, Unwritable, call_schema, choices, kind, length, named, params,
                                           params_of, repeat)


def call_grammar(fmt: str, dialect: str, functions: list[dict], parallel: bool,
                 added: Mapping[str, int] | None = None, preamble: str = "") -> str | None:
    """The Lark grammar of one call (several where ``parallel``) to any of ``functions`` in
    format ``fmt``, None for a format no grammar here writes. ``added``: the tokenizer's
    added tokens by text; ``preamble``: text the reply opens with (the end of a reasoning
    block the prompt opened). Raises ``Unwritable`` for a tool the format cannot name."""
    shape = shape_of(fmt, dialect)
    if shape is None:
        return None
    g = Lark(added)
    call = g.rule("call", " | ".join(shape.call(g, f) for f in functions))
    if parallel and shape.parallel:
        sep = g.lit(shape.sep)
        call = f"{call} ({sep} {call})*" if sep else f"{call}+"
    return g.text(" ".join(p for p in (g.lit(preamble), g.lit(shape.open), call, g.lit(shape.close)) if p))


def shape_of(fmt: str, dialect: str = "") -> Shape | None:
    return SHAPES.get(f"{fmt}:{dialect}" if dialect else fmt) or TAG_SHAPES.get(fmt)


def forceable() -> list[str]:
    """The formats a forced call can be written in (docs/agents.md lists them).

    >>> "qwen3_coder" in forceable() and "harmony" in forceable()
    True
    """
    return sorted({k.split(":")[0] for k in SHAPES} | set(TAG_SHAPES))


# ---- formats whose arguments are JSON --------------------------------------------------
def _hermes(g: Lark, f: dict) -> str:
    return " ".join([g.lit("<tool_call>\n"), g.json(call_schema(f, "arguments")), g.lit("\n</tool_call>")])


def _mistral_list(g: Lark, f: dict) -> str:
    return g.json(call_schema(f, "arguments"))


def _mistral_args(g: Lark, f: dict) -> str:
    name = named(f, r"[\w-]+")
    return f"{g.lit(f'[TOOL_CALLS]{name}[ARGS]')} {g.json(params(f))}"


def _llama3(g: Lark, f: dict) -> str:
    return g.json(call_schema(f, "parameters"))


def _harmony(g: Lark, f: dict) -> str:
    name = named(f, r"[\w.-]+")
    return f"{g.lit(f'<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>')} {g.json(params(f))}"


def _kimi_k2(g: Lark, f: dict) -> str:
    # The number after the name is the call's index; Kimi counts calls across the
    # conversation, which a grammar cannot know, so any short number goes.
    name = named(f, r"[^\s:<]+")
    return " ".join([g.lit(f"<|tool_call_begin|>functions.{name}:"), g.terminal("index", "/[0-9]{1,3}/"),
                     g.lit("<|tool_call_argument_begin|>"), g.json(params(f)), g.lit("<|tool_call_end|>")])


def _kimi_k3(g: Lark, f: dict) -> str:
    name = named(f, r".+").replace("&", "&amp;").replace('"', "&quot;")
    return " ".join([g.lit(f'<|open|>call tool="{name}" index="'), g.terminal("index", "/[1-9][0-9]{0,2}/"),
                     g.lit('"<|sep|><|open|>json type="object"<|sep|>'), g.json(params(f)),
                     g.lit("<|close|>json<|sep|><|close|>call<|sep|>")])


# ---- pythonic (LFM2): keyword arguments as Python literals -----------------------------
# A Python string in double quotes with the escapes json and Python read alike; a raw
# newline would end the literal, and JSON's \/ and \uXXXX pairs mean other text in Python.
_PY_CHAR = r'([^"\\\x00-\x1f]|\\["\\nt])'


def _pythonic(g: Lark, f: dict) -> str:
    name = named(f, r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
    props, required = params_of(f)
    items = []
    for key, schema in props:
        if not key.isidentifier() or keyword.iskeyword(key):
            raise Unwritable(f"the argument name {key!r} of {name!r} is not a Python keyword argument")
        items.append((g.rule("arg", f"{g.lit(key + '=')} {_py_value(g, schema)}"), key in required))
    return " ".join(p for p in (g.lit(name + "("), ordered(items, g.lit(", ")), g.lit(")")) if p)


def _py_value(g: Lark, schema: dict) -> str:
    """A string as a Python literal; anything else as JSON (the parser reads JSON's true,
    false and null as Python's)."""
    k = kind(schema)
    if k == "enum":
        return "(" + " | ".join(g.lit(_py_str(v)) for v in choices(schema)) + ")"
    if k == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", "")
        return g.terminal("pystr", f'/"{_PY_CHAR}{{{lo},{hi}}}"/')
    return g.json(schema)


def _py_str(value: str) -> str:
    r"""``value`` as a double-quoted Python literal.

    >>> print(_py_str('say "hi"\n'))
    "say \"hi\"\n"
    """
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t") + '"'


# ---- Gemma 4: JSON with bare keys and <|"|> around strings -----------------------------
_GEMMA_QUOTE = '<|"|>'


def _gemma4(g: Lark, f: dict) -> str:
    name = named(f, r"[\w-]+")
    return " ".join([g.lit(f"<|tool_call>call:{name}"), _gemma_object(g, params(f)), g.lit("<tool_call|>")])


def _gemma_object(g: Lark, schema: dict) -> str:
    props, required = params_of({"parameters": schema})
    items = [(g.rule("arg", f"{g.lit(_key(k) + ':')} {_gemma_value(g, s)}"), k in required) for k, s in props]
    return " ".join(p for p in (g.lit("{"), ordered(items, g.lit(",")), g.lit("}")) if p)


def _gemma_value(g: Lark, schema: dict) -> str:
    k = kind(schema)
    if k == "enum":
        return "(" + " | ".join(g.lit(_GEMMA_QUOTE + v + _GEMMA_QUOTE) for v in choices(schema)) + ")"
    if k == "string":
        return f"{g.lit(_GEMMA_QUOTE)} {g.text_until(length(schema), _GEMMA_QUOTE)}"
    if schema.get("type") == "object" and schema.get("properties"):
        return _gemma_object(g, schema)
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        item = g.rule("item", _gemma_value(g, schema["items"]))
        return " ".join(p for p in (g.lit("["), repeat(item, g.lit(","), schema), g.lit("]")) if p)
    # Numbers, booleans, null, and values of no single type: JSON, which the parser takes as
    # it is (but for a quoted string holding ",word:", whose key-quoting rewrites it).
    return g.json(schema)


def _key(key: str) -> str:
    if not re.fullmatch(r"\w+", key):
        raise Unwritable(f"the argument name {key!r} cannot be written as a bare key")
    return key


# ---- FunctionGemma: key:value pairs, strings between <escape> --------------------------
def _function_gemma(g: Lark, f: dict) -> str:
    name = named(f, r"\w+")
    props, required = params_of(f)
    items = [(g.rule("arg", f"{g.lit(_key(k) + ':')} {_escape_value(g, name, k, s)}"), k in required)
             for k, s in props]
    inner = ordered(items, g.lit(","))
    return " ".join(p for p in (g.lit(f"<start_function_call>call:{name}{{"), inner,
                                g.lit("}<end_function_call>")) if p)


def _escape_value(g: Lark, name: str, key: str, schema: dict) -> str:
    """The parser ends the arguments at the first ``}`` and a bare value at the next comma:
    strings go between ``<escape>`` and hold no ``}``; only scalars can be written."""
    k = kind(schema)
    if k == "enum":
        return "(" + " | ".join(g.lit(f"<escape>{v}<escape>") for v in choices(schema)) + ")"
    if schema.get("type") in ("object", "array"):
        raise Unwritable(f"FunctionGemma calls cannot hold the argument {key!r} of {name!r} (an object or array)")
    if k == "json":
        return g.json(schema)
    return f"{g.lit('<escape>')} {g.text_until([*length(schema), none_of(['}'])], '<escape>')}"


SHAPES: dict[str, Shape] = {
    "json_tools": Shape(_hermes, sep="\n"),
    "mistral": Shape(_mistral_list, open="[TOOL_CALLS][", close="]", sep=", "),
    "mistral:args": Shape(_mistral_args),
    "llama3_json": Shape(_llama3, sep="; "),
    "harmony": Shape(_harmony, parallel=False),  # a call ends the reply (<|call|>)
    "kimi_k2": Shape(_kimi_k2, open="<|tool_calls_section_begin|>", close="<|tool_calls_section_end|>"),
    "kimi_k3": Shape(_kimi_k3, open="<|open|>tools<|sep|>", close="<|close|>tools<|sep|>"),
    "pythonic": Shape(_pythonic, open="<|tool_call_start|>[", close="]<|tool_call_end|>", sep=", "),
    "gemma4": Shape(_gemma4),
    "function_gemma": Shape(_function_gemma),
}
