"""A chat as the model reads it: messages (tool calls and results included) and tools,
rendered by the model's own chat template into prompt tokens.

Both API dialects (OpenAI's chat completions, Anthropic's messages) reduce a request to
the message dicts Hugging Face templates take:

    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}

A template that renders tools natively gets them as ``tools=``. One that does not (no tool
calling in its family) gets the Hermes convention spelled out: the tools in the system
prompt, past calls as ``<tool_call>`` text in the assistant turn, results as user turns in
``<tool_response>`` tags. A past call is written exactly as a forced call is generated
(``json.dumps`` spacing), so the next turn's prompt starts with the tokens the prefix cache
already holds.

Example (a template without tools: the system prompt lists them):
    >>> msgs = render_messages([{"role": "user", "content": "hi"}],
    ...                        [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    ...                        ToolFormat.hermes())
    >>> msgs[0]["role"], "<tools>" in msgs[0]["content"], msgs[1]
    ('system', True, {'role': 'user', 'content': 'hi'})
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.server.http.tools import HERMES_END, HERMES_PROMPT, HERMES_START, ToolFormat


class TemplateError(ValueError):
    """The chat template refused the conversation (its message says why)."""


def render_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None, fmt: ToolFormat,
                  **template_kwargs: Any) -> list[int]:
    """Prompt tokens of ``messages`` (and ``tools``), ending where the assistant speaks."""
    messages = render_messages(messages, tools, fmt)
    kwargs = dict(template_kwargs)
    if tools and fmt.native:
        kwargs["tools"] = tools
    try:
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    except Exception as exc:  # templates raise on conversations they do not take
        raise TemplateError(f"cannot apply the chat template: {exc}") from None
    return list(tokens)


# Boundaries rendered per prompt: the first message (a system prompt, tools), and the last
# few (where a retry or an edited turn parts). Each costs one more template render.
FIRST_ENDS, LAST_ENDS = 1, 3


def message_ends(tokenizer: Any, messages: list[dict], tools: list[dict] | None, fmt: ToolFormat,
                 tokens: list[int], **template_kwargs: Any) -> tuple[int, ...]:
    """Prompt lengths where a message of ``messages`` ends in ``tokens`` (the rendered
    prompt): each earlier message rendered alone up to it, the length it shares with the
    prompt. A later prompt with the same start parts there, so the prefix cache keeps
    checkpoints of window and state layers at these lengths. Messages a template refuses
    to end on (some want a user turn last) give none.

        system prompt + tools | user turn 1 | assistant turn 1 | user turn 2 | <assistant>
                              ^ end 1                          ^ end 3
    """
    rendered = render_messages(messages, tools, fmt)
    kwargs = dict(template_kwargs)
    if tools and fmt.native:
        kwargs["tools"] = tools
    count = len(rendered)
    picks = sorted({*range(1, min(FIRST_ENDS, count - 1) + 1), *range(max(1, count - LAST_ENDS), count)})
    ends = set()
    for k in picks:
        try:
            head = tokenizer.apply_chat_template(rendered[:k], add_generation_prompt=False, **kwargs)
        except Exception:  # noqa: BLE001 - a template may refuse to end there; that end is skipped
            continue
        shared = next((i for i, (a, b) in enumerate(zip(head, tokens)) if a != b), min(len(head), len(tokens)))
        if 0 < shared < len(tokens):
            ends.add(shared)
    return tuple(sorted(ends))


def render_messages(messages: list[dict], tools: list[dict] | None, fmt: ToolFormat) -> list[dict]:
    """The messages the template gets: as they are for a native template, else in the
    Hermes convention (tools in the system prompt, calls and results as text)."""
    if fmt.native:
        return [_native(m) for m in messages]
    used = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not used:
        return [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
    out = [_as_text(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = HERMES_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return _merge_roles(out)


def hermes_call_text(name: str, arguments: Any) -> str:
    """One call as the Hermes convention writes it (and a forced call is generated).

    >>> hermes_call_text("f", {"x": 1})
    '<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>'
    """
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{HERMES_START}\n{body}\n{HERMES_END}"


def _native(message: dict) -> dict:
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    return out


def _as_text(message: dict) -> dict:
    role, content = message["role"], message.get("content") or ""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or []
    if calls:
        text = "\n".join(hermes_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)
        content = f"{content}\n{text}" if content else text
    return {"role": role, "content": content}


def _merge_roles(messages: list[dict]) -> list[dict]:
    """Consecutive messages of one role as one (parallel tool results are several user
    turns in a row, which strict templates refuse)."""
    out: list[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": f"{out[-1]['content']}\n{m['content']}"}
        else:
            out.append(m)
    return out
