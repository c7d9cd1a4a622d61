"""What a request's output must look like, as a grammar: OpenAI's ``response_format``
(a JSON object, or one matching a JSON schema) and a forced tool call (``tool_choice``
``required`` or a named function: a call in the model's own format, which its parser reads
back as a call of the tool; ``tool_grammars.py``).

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

from typing import Any

from kvserve.server.engine.grammar import Grammar
from kvserve.server.http.tool_args import Unwritable
from kvserve.server.http.tool_grammars import call_grammar
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


def tool_call_grammar(fmt: ToolFormat, tools: list[dict], choice: Any, parallel: bool,
                      tokenizer: Any = None, preamble: str = "") -> Grammar | None:
    """The grammar of the calls ``tool_choice`` forces, None when the model chooses freely.
    ``required``: one call (or several when ``parallel``) to any of the tools; a named
    function: exactly one call to it, whatever ``parallel`` says (OpenAI and Anthropic force
    one; a grammar that let the model open another call after it ran on to ``max_tokens``).
    The grammar ends after the calls, so the reply does (``tool_grammars.py`` writes each
    format's calls, its markers as the ``tokenizer`` spells them). ``preamble``: text
    before the calls (where the prompt opened a reasoning block, its end: the calls must
    not land inside it)."""
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise StructureError("tool_choice needs tools", "tool_choice")
    if isinstance(choice, dict):
        name, parallel = choice["function"]["name"], False
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise StructureError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    try:
        lark = call_grammar(fmt.name, fmt.dialect, [t["function"] for t in tools], parallel, _added(tokenizer),
                            preamble)
    except Unwritable as exc:
        raise StructureError(f"{exc}; use tool_choice 'auto'", "tool_choice") from None
    if lark is None:
        raise StructureError(f"this model's tool-call format ({fmt.name}) cannot be forced; "
                             "use tool_choice 'auto'", "tool_choice")
    return Grammar.from_lark(lark, kind="tool_call")


def _added(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens (``<tool_call>``, ``<|channel|>``, ...) by their text:
    llguidance takes each for a special token, which the grammar names by id."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {getattr(token, "content", str(token)): i for i, token in decoder.items()}
