"""What a request's output must look like, as a grammar: OpenAI's ``response_format``
(a JSON object, or one matching a JSON schema) and a forced tool call (``tool_choice``
``required`` or a named function: the call's text around arguments that match the tool's
parameter schema).

Example (a named tool forced in the Hermes format):
    >>> from kvserve.server.http.tools import ToolFormat
    >>> tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    >>> g = tool_call_grammar(ToolFormat.hermes(), tools, {"type": "function", "function": {"name": "f"}}, True)
    >>> g.kind
    'tool_call'
    >>> tool_call_grammar(ToolFormat.hermes(), tools, "auto", True) is None
    True
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.server.engine.grammar import JSON_OPTIONS, Grammar
from kvserve.server.http.tools import ToolFormat


class StructureError(ValueError):
    """A request whose structure cannot be enforced; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def response_format_grammar(response_format: dict | None) -> Grammar | None:
    """``{"type": "text"}`` (or none): free text; ``json_object``: any JSON object;
    ``json_schema``: a document matching ``json_schema.schema``."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.from_json_schema({"type": "object"}, kind="json_object")
    spec = response_format.get("json_schema") or {}
    schema = spec.get("schema", {"type": "object"})
    return Grammar.from_json_schema(schema)


def tool_call_grammar(fmt: ToolFormat, tools: list[dict], choice: Any, parallel: bool) -> Grammar | None:
    """The grammar of the calls ``tool_choice`` forces, None when the model chooses freely.
    ``required``: one call (or several when ``parallel``) to any of the tools; a named
    function: exactly one call to it, whatever ``parallel`` says (OpenAI and Anthropic force
    one; a grammar that let the model open another call after it ran on to ``max_tokens``)."""
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise StructureError("tool_choice needs tools", "tool_choice")
    if isinstance(choice, dict):
        name, parallel = choice["function"]["name"], False
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise StructureError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    if fmt.grammar_call is None:
        raise StructureError(f"this model's tool-call format ({fmt.name}) cannot be forced; "
                             "use tool_choice 'auto'", "tool_choice")
    schemas = [_call_schema(t["function"]) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    before, after = fmt.grammar_call
    if fmt.name == "mistral":  # one list holds every call
        body = f"{json.dumps(before)} call ({json.dumps(', ')} call)* {json.dumps(after)}" if parallel \
            else f"{json.dumps(before)} call {json.dumps(after)}"
        lark = f"start: {body}\ncall: %json {json.dumps(schema)}\n"
    else:
        repeat = ' ("\\n" call)*' if parallel else ""
        lark = f"start: call{repeat}\ncall: {json.dumps(before)} %json {json.dumps(schema)} {json.dumps(after)}\n"
    return Grammar.from_lark(lark, kind="tool_call")


def _call_schema(function: dict) -> dict:
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}
