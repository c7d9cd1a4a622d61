"""An Anthropic message request as the chat both dialects share (``ChatInput``) and the
sampling fields the engine takes.

Blocks map one to one: text blocks are the message's text; an assistant's ``tool_use``
blocks are its tool calls; a user's ``tool_result`` blocks are tool messages, before the
user's own text. ``tool_choice`` ``any`` is OpenAI's ``required``, ``tool`` a named function.

Example:
    >>> from kvserve.server.http.anthropic.schemas import MessagesRequest
    >>> body = MessagesRequest(model="m", max_tokens=8, system="Be brief.", messages=[
    ...     {"role": "user", "content": "Weather?"},
    ...     {"role": "assistant", "content": [
    ...         {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "P"}}]},
    ...     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18 C"}]}])
    >>> [m["role"] for m in chat_messages(body)]
    ['system', 'user', 'assistant', 'tool']
"""

from __future__ import annotations

from kvserve.server.http.anthropic.schemas import CountTokensRequest, MessagesRequest, ToolChoice
from kvserve.server.http.chat import ChatInput
from kvserve.server.http.schemas import SamplingFields


def chat_input(body: MessagesRequest | CountTokensRequest) -> ChatInput:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools or ()]
    choice, parallel = _tool_choice(body.tool_choice)
    output = body.output_config.format if body.output_config is not None else None
    response_format = {"type": "json_schema", "json_schema": {"schema": output.schema_}} if output else None
    return ChatInput(messages=chat_messages(body), tools=tools or None, tool_choice=choice,
                     parallel_tool_calls=parallel, response_format=response_format,
                     template_kwargs=body.thinking.template_kwargs if body.thinking is not None else {})


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": body.system_text()})
    for message in body.messages:
        out.extend(_message(message.role, message.content))
    return out


def sampling_fields(body: MessagesRequest) -> SamplingFields:
    """The request's sampling as the engine's validation takes it (OpenAI's field names)."""
    return SamplingFields(model=body.model, max_tokens=body.max_tokens, temperature=body.temperature,
                          top_p=body.top_p if body.top_p is not None else 1.0, top_k=body.top_k or 0,
                          stop=list(body.stop_sequences or []), stream=body.stream)


def _message(role: str, content) -> list[dict]:
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    text = "".join(b.text for b in content if b.type == "text")
    if role == "assistant":
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in content if b.type == "tool_use"]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    # A failed call's result says so: templates have no field for it.
    results = [{"role": "tool", "tool_call_id": b.tool_use_id,
                "content": ("Error: " if b.is_error else "") + b.text()}
               for b in content if b.type == "tool_result"]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _tool_choice(choice: ToolChoice | None) -> tuple[object, bool]:
    if choice is None:
        return "auto", True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "any":
        return "required", parallel
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return choice.type, parallel
