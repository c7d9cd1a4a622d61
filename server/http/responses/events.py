"""Engine events shaped as a Responses ``response`` object, whole or as the stream of server-
sent events OpenAI's clients assemble, in the order OpenAI's API sends them:

    event: response.created                 {"response": {... "status": "in_progress"}}
    event: response.in_progress
    event: response.output_item.added       per output item (items.py) ...
    event: response.content_part.added
    event: response.output_text.delta       ...
    event: response.output_text.done
    event: response.content_part.done
    event: response.output_item.done
    event: response.completed               (or response.incomplete, or response.failed)

Every event's data carries its ``type`` and a ``sequence_number`` counting from 0; there
is no ``[DONE]`` line. Keep-alive comments fill silences, as on the chat route. A response
that is stored is stored before its last event is sent, so a client that has read it can
retrieve it or continue from it at once.

Example:
    >>> from kvserve.server.engine.request import FinishReason, Usage
    >>> status_of(FinishReason.LENGTH), status_of(FinishReason.STOP)
    ('incomplete', 'completed')
    >>> usage_json(Usage(10, 4, cached_tokens=6))["input_tokens_details"]
    {'cached_tokens': 6, 'cache_write_tokens': 0}
"""

from __future__ import annotations

import itertools
import json
import time
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request as HTTPRequest

from kvserve.server.engine.request import FinishReason, TokenEvent, Usage
from kvserve.server.http.responses.items import OutputItems, Reply, new_id
from kvserve.server.http.responses.schemas import FunctionChoice, ResponsesRequest
from kvserve.server.http.streams import KEEPALIVE, EngineFailed, EventStream, engine_error


# The end of a response that is kept (a failed one is not): its final state, to store.
OnEnd = Callable[[dict], Awaitable[None]]
ENDS = ("response.completed", "response.incomplete")


def new_response(body: ResponsesRequest, model: str, stored: bool = False) -> dict:
    """The response as it starts: the request's settings echoed, no output yet; ``stored``:
    whether it is kept when it ends."""
    fmt, choice = body.text_format, body.tool_choice
    return {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "completed_at": None, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
        "model": model, "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "service_tier": body.service_tier or "default", "store": stored,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
        "tools": [t.model_dump() for t in body.tools or ()], "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled", "usage": None, "user": body.user, "metadata": body.metadata or {},
    }


def status_of(reason: FinishReason | None) -> str:
    """Output cut by max_output_tokens (or by the server stopping) is incomplete."""
    return "incomplete" if reason in (FinishReason.LENGTH, FinishReason.ABORT) else "completed"


def usage_json(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def finished(start: dict, items: list[dict], last: TokenEvent) -> dict:
    status = status_of(last.finish_reason)
    details = None
    if status == "incomplete":  # an abort has no reason among OpenAI's
        details = {"reason": "max_output_tokens" if last.finish_reason is FinishReason.LENGTH else None}
    return {**start, "status": status, "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": details, "output": items, "usage": usage_json(last.usage)}


def failed(start: dict, items: list[dict], message: str) -> dict:
    return {**start, "status": "failed", "error": {"code": "server_error", "message": message},
            "output": items}


async def collect_response(start: dict, stream: EventStream, http_request: HTTPRequest, reply: Reply) -> dict:
    """Wait for the reply and build the whole response (``EngineFailed`` if the engine failed)."""
    out = OutputItems()
    while not stream.finished:
        event = await stream.next(http_request)
        if event.error:
            raise EngineFailed(*engine_error(event))
        for piece in reply.pieces(event):
            out.add(piece)
        if event.finish_reason is not None:
            last = event
    out.finish(status_of(last.finish_reason))
    return finished(start, out.items, last)


def sse(event: dict, sequence_number: int) -> str:
    payload = {"type": event["type"], "sequence_number": sequence_number,
               **{k: v for k, v in event.items() if k != "type"}}
    return f"event: {event['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def response_events(start: dict, stream: EventStream, reply: Reply, on_close: Callable[[], None],
                          keepalive_s: float | None = None, on_end: OnEnd | None = None) -> AsyncIterator[str]:
    """The server-sent events of one streamed response; ``on_end`` gets its final state
    (completed or incomplete) before the event that carries it is sent."""
    out, numbers = OutputItems(), itertools.count()
    try:
        for kind in ("response.created", "response.in_progress"):
            yield sse({"type": kind, "response": start}, next(numbers))
        while not stream.finished:
            event = await stream.next(idle_s=keepalive_s)
            if event is None:
                yield KEEPALIVE
                continue
            bodies = _event_bodies(start, out, reply, event)
            if on_end is not None and bodies and bodies[-1]["type"] in ENDS:
                await on_end(bodies[-1]["response"])
            for body in bodies:
                yield sse(body, next(numbers))
            if bodies and bodies[-1]["type"] == "response.failed":
                return
    finally:
        if not stream.finished:
            on_close()


def _event_bodies(start: dict, out: OutputItems, reply: Reply, event: TokenEvent) -> list[dict]:
    """One engine event as stream events: the items it builds, and the response's end."""
    if event.error:
        message = engine_error(event)[1]["error"]["message"]
        return [{"type": "response.failed", "response": failed(start, out.items, message)}]
    bodies = [body for piece in reply.pieces(event) for body in out.add(piece)]
    if event.finish_reason is None:
        return bodies
    bodies += out.finish(status_of(event.finish_reason))
    response = finished(start, out.items, event)
    return bodies + [{"type": f"response.{response['status']}", "response": response}]
