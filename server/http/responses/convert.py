"""A Responses request as the chat every dialect reduces to (``ChatInput``) and the sampling
fields the engine takes.

``instructions`` is a system message first; ``developer`` is the system role; function
calls are the tool calls of an assistant turn (joined to the assistant's text just before
them); a function call's output is a tool message. The same conversation sent to chat
completions renders the same prompt.

Example:
    >>> from kvserve.server.http.responses.inputs import parse_input
    >>> items = parse_input([
    ...     {"role": "user", "content": "Weather in Paris?"},
    ...     {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
    ...     {"type": "function_call_output", "call_id": "c1", "output": "18 C"}])
    >>> for m in chat_messages("Be brief.", items): print(m)
    {'role': 'system', 'content': 'Be brief.'}
    {'role': 'user', 'content': 'Weather in Paris?'}
    {'role': 'assistant', 'content': '', 'tool_calls': [{'id': 'c1', 'type': 'function', 'function': {...}}]}
    {'role': 'tool', 'content': '18 C', 'tool_call_id': 'c1', 'name': 'w'}
"""

from __future__ import annotations

import re

from kvserve.server.http.chat import ChatInput
from kvserve.server.http.errors import APIError
from kvserve.server.http.responses.inputs import (FunctionCallItem, FunctionCallOutputItem, Item,
                                                  MessageItem)
from kvserve.server.http.responses.schemas import ResponsesRequest
from kvserve.server.http.schemas import SamplingFields


def chat_input(body: ResponsesRequest, items: list[Item], first: int = 0) -> ChatInput:
    """``items[first:]`` are the request's own input; the ones before, the stored conversation
    it continues (``previous_response_id``)."""
    tools = [t.chat_dict() for t in body.tools] if body.tools else None
    return ChatInput(messages=chat_messages(body.instructions, items, first), tools=tools,
                     tool_choice=body.tool_choice_value(),
                     parallel_tool_calls=body.parallel_tool_calls is not False,
                     response_format=body.response_format())


def chat_messages(instructions: str | None, items: list[Item], first: int = 0) -> list[dict]:
    """An error names the item by its index in the request's input, which starts at ``first``."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}  # call_id -> function name, for the outputs that answer them
    for index, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            _add_call(out, item)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                raise APIError(400, f"no function_call item before it has call_id {item.call_id!r}",
                               param=f"input.{index - first}.call_id", code="invalid_value")
            out.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id,
                        "name": names[item.call_id]})
        # A reasoning item is a past turn's thinking: not shown to the model again.
    return out


def _add_call(messages: list[dict], item: FunctionCallItem) -> None:
    """A call joins the assistant turn right before it (its text, or the calls made in
    parallel with it), else starts one."""
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.parsed_arguments()}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def sampling_fields(body: ResponsesRequest) -> SamplingFields:
    """The request's sampling as the engine's validation takes it (chat's field names)."""
    return SamplingFields(model=body.model, max_tokens=body.max_output_tokens,
                          temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, stream=bool(body.stream))


# Chat's field names in errors from the shared path, and what this API calls them.
RENAMED = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}


def renamed(exc: APIError) -> APIError:
    """``exc`` naming this API's fields instead of chat's.

    >>> e = renamed(APIError(400, "max_tokens must be at most 8", param="max_tokens"))
    >>> e.param, e.message
    ('max_output_tokens', 'max_output_tokens must be at most 8')
    """
    message = re.sub(r"\b(max_tokens|response_format)\b", lambda m: RENAMED[m.group(1)], exc.message)
    return APIError(exc.status, message, param=RENAMED.get(exc.param or "", exc.param), code=exc.code,
                    headers=exc.headers)
