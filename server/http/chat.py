"""A chat request prepared for the engine: its prompt tokens (tools rendered), the grammar
its output must follow, and how its reply splits into content, reasoning and tool calls.

Shared by both dialects: OpenAI's chat completions and Anthropic's messages reduce their
bodies to template messages, tools in OpenAI's shape, a tool choice and a response format.

Example (a chat without tools calls none):
    >>> chat = ChatInput(messages=[{"role": "user", "content": "hi"}], tools=None)
    >>> chat.wants_calls, chat.tool_choice
    (False, 'auto')
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from kvserve.server.engine.grammar import Grammar, GrammarError, Grammars
from kvserve.server.engine.thinking import ThinkingBudget
from kvserve.server.http.conversation import TemplateError, message_ends, render_prompt
from kvserve.server.http.errors import APIError
from kvserve.server.http.structured import StructureError, response_format_grammar, tool_call_grammar
from kvserve.server.http.tools import ReplySplitter, ToolFormat


@dataclass(frozen=True)
class ChatInput:
    """A chat in the shape both dialects reduce to. ``tool_choice``: auto, none, required
    or ``{"type": "function", "function": {"name": ...}}``."""

    messages: list[dict]
    tools: list[dict] | None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    response_format: dict | None = None
    template_kwargs: dict = field(default_factory=dict)

    @property
    def wants_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True)
class PreparedChat:
    tokens: list[int]
    grammar: Grammar | None
    splitter: Callable[..., ReplySplitter] | None  # stream_calls=True: calls streamed as written
    tool_format: ToolFormat
    boundaries: tuple[int, ...] = ()  # where messages end in ``tokens`` (prefix-cache checkpoints)
    think_ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # reasoning markers' token ids
    opens_thinking: bool = False  # the prompt ends inside a reasoning block

    def thinking_budget(self, budget: int | None) -> ThinkingBudget | None:
        """The budget for the engine, where the model has reasoning markers (None: think
        freely, or a model that does not think)."""
        if budget is None or self.think_ids is None:
            return None
        return ThinkingBudget(budget, *self.think_ids, open=self.opens_thinking)


def prepare_chat(chat: ChatInput, tokenizer: Any, param: str = "messages", boundaries: bool = False) -> PreparedChat:
    """Render the prompt and build the output grammar; a conversation the template refuses
    or a structure that cannot be enforced is a 400. ``boundaries``: also where each message
    ends in the prompt (``message_ends``: for models whose prefix cache keeps checkpoints
    there, ``LoadedModel.message_ends``)."""
    fmt = ToolFormat.of(tokenizer)
    try:
        tokens = render_prompt(tokenizer, chat.messages, chat.tools, fmt, **chat.template_kwargs)
    except TemplateError as exc:
        raise APIError(400, str(exc), param=param) from None
    ends = message_ends(tokenizer, chat.messages, chat.tools, fmt, tokens, **chat.template_kwargs) if boundaries else ()
    think = _think_markers(tokenizer) or fmt.think
    thinking = think is not None and _opens_thinking(tokenizer, tokens, think[0])
    try:
        # A forced call closes the reasoning block the prompt opened: inside it, it is reasoning.
        grammar = tool_call_grammar(fmt, chat.tools or [], chat.tool_choice, chat.parallel_tool_calls,
                                    tokenizer, think[1] if thinking else "") if chat.wants_calls else None
        grammar = grammar or response_format_grammar(chat.response_format)
    except StructureError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except GrammarError as exc:
        raise APIError(400, str(exc), param="response_format") from None
    splitter = None
    if chat.wants_calls or think:
        splitter = partial(ReplySplitter, fmt if chat.wants_calls else None, chat.tools, think, thinking)
    return PreparedChat(tokens, grammar, splitter, fmt, ends, _think_ids(tokenizer, think), thinking)


async def check_grammar(grammars: Grammars | None, grammar: Grammar | None, param: str) -> None:
    """Compile the grammar once before the request is queued (in a worker thread: a large
    schema takes a while), so a schema the engine cannot take is a 400 with the reason."""
    if grammar is None:
        return
    if grammars is None:
        raise APIError(400, "structured output is not available for this model", param=param)
    try:
        await asyncio.to_thread(grammars.check, grammar)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=param) from None


def _think_markers(tokenizer: Any) -> tuple[str, str] | None:
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    return None


def _think_ids(tokenizer: Any, think: tuple[str, str] | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The token ids of the reasoning markers: mlx-lm's where it found them, else the tool
    format's (harmony's analysis channel) as the tokenizer encodes them."""
    if think is None:
        return None
    if getattr(tokenizer, "has_thinking", False) and tokenizer.think_end_tokens:
        return tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens)
    ids = tuple(tuple(tokenizer.encode(marker, add_special_tokens=False)) for marker in think)
    return ids if all(ids) else None


def _opens_thinking(tokenizer: Any, tokens: list[int], start: str) -> bool:
    """The template ended the prompt inside a reasoning block (``...<think>\\n``)."""
    tail = tokenizer.decode(tokens[-4:]) if tokens else ""
    return tail.rstrip().endswith(start)
