"""Tool-call formats mlx-lm does not parse, recognized from the chat template.

- Llama 3.1 / 3.2 (``llama3_json``): the reply is the call, a bare JSON object
  ``{"name": "f", "parameters": {...}}`` (after ``<|python_tag|>`` in 3.1), several joined
  by ``;``.
- gpt-oss (``harmony``): a call is a message on the commentary channel addressed to the
  function, ``<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>``;
  ``<|call|>`` ends the reply, so the call runs to its end.

Example:
    >>> parse_llama3('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    [{'name': 'f', 'arguments': {'x': 1}}, {'name': 'g', 'arguments': {}}]
    >>> parse_harmony('get_weather <|constrain|>json<|message|>{"city": "Paris"}')
    {'name': 'get_weather', 'arguments': {'city': 'Paris'}}
"""

from __future__ import annotations

import json
import re
from typing import Any

LLAMA3_START = '{"name"'
HARMONY_START = " to=functions."
HARMONY_NOISE = ("<|start|>assistant", "<|channel|>final<|message|>", "<|channel|>commentary",
                 "<|return|>", "<|end|>")


def parse_llama3(text: str, tools: Any = None) -> list[dict]:
    """Calls of a Llama 3 reply; ``text`` is the reply from its first ``{"name"`` on."""
    text = text if text.startswith(LLAMA3_START) else LLAMA3_START + text
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        value, pos = decoder.raw_decode(text, pos)
        if not isinstance(value, dict) or "name" not in value:
            raise ValueError("not a function call")
        calls.append({"name": value["name"], "arguments": value.get("parameters", value.get("arguments", {}))})
        pos = _skip(text, pos, " \n;")
    return calls


def parse_harmony(text: str, tools: Any = None) -> dict:
    """A call from the text after ``to=functions.``: ``NAME [<|constrain|>json]<|message|>ARGS``."""
    match = re.match(r"([\w.-]+)[^<]*(?:<\|constrain\|>\w+)?\s*<\|message\|>(.*)", text, re.S)
    if match is None:
        raise ValueError("not a harmony function call")
    body = match.group(2).split("<|call|>")[0].strip()
    return {"name": match.group(1), "arguments": json.loads(body) if body else {}}


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def extra_format(tokenizer: Any):
    """The ``ToolFormat`` of a template that renders tools in a format mlx-lm does not
    parse, or None."""
    from kvserve.server.http.tools import ToolFormat

    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    if "<|channel|>" in template and "to=functions." in template:
        return ToolFormat("harmony", HARMONY_START, "", parse_harmony, True,
                          think=("<|channel|>analysis<|message|>", "<|end|>"), noise=HARMONY_NOISE)
    if "<|python_tag|>" in template or ("parameters" in template and "Given the following functions" in template):
        return ToolFormat("llama3_json", LLAMA3_START, "", parse_llama3, True)
    return None
