"""Bridging engine events into asyncio, and shaping them as OpenAI JSON or SSE chunks.

The engine thread calls ``EventStream.sink``; the handler awaits ``EventStream.next``.
A request whose client goes away is aborted in the engine, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request as HTTPRequest

from kvserve.server.engine.request import FinishReason, TokenEvent, Usage

# How often a non-streaming handler checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


class ClientGone(Exception):
    pass


class EventStream:
    """An asyncio queue fed from the engine thread."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.finished = False

    def sink(self, event: TokenEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop already closed (server shutting down)
            pass

    async def next(self, http_request: HTTPRequest | None = None) -> TokenEvent:
        """The next event; with ``http_request``, raises ``ClientGone`` when it disconnects."""
        while True:
            try:
                event = await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if http_request is not None and await http_request.is_disconnected():
                    raise ClientGone() from None
                continue
            self.finished = event.finish_reason is not None
            return event


@dataclass(frozen=True)
class Shape:
    """How one endpoint names things: chat completions or text completions."""

    chat: bool
    model: str
    id_prefix: str

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"


def usage_json(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def finish_reason_json(reason: FinishReason | None) -> str | None:
    # OpenAI knows "stop" and "length"; an aborted or failed request ends as "stop".
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


def _choice(shape: Shape, text: str, reason: str | None) -> dict:
    if shape.chat:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": reason}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


def _delta(shape: Shape, text: str, reason: str | None, first: bool = False) -> dict:
    if shape.chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


async def collect(shape: Shape, stream: EventStream, http_request: HTTPRequest, prefix: str = "") -> dict:
    """Wait for the whole generation and build the non-streaming response body."""
    parts = [prefix]
    while True:
        event = await stream.next(http_request)
        parts.append(event.text)
        if event.finish_reason is not None:
            break
    if event.error:
        raise RuntimeError(event.error)
    return {
        "id": shape.new_id(), "object": shape.object, "created": int(time.time()),
        "model": shape.model,
        "choices": [_choice(shape, "".join(parts), finish_reason_json(event.finish_reason))],
        "usage": usage_json(event.usage),
    }


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_events(shape: Shape, stream: EventStream, include_usage: bool,
                     on_close: Callable[[], None], prefix: str = "") -> AsyncIterator[str]:
    """Server-sent events: a first chunk, one chunk per text event, the finish, usage, [DONE]."""
    chunk_id, created = shape.new_id(), int(time.time())
    obj = "chat.completion.chunk" if shape.chat else "text_completion"

    def chunk(choices: list, usage: dict | None = None) -> str:
        body = {"id": chunk_id, "object": obj, "created": created, "model": shape.model,
                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return _sse(body)

    try:
        if shape.chat or prefix:
            yield chunk([_delta(shape, prefix, None, first=True)])
        while True:
            event = await stream.next()
            reason = finish_reason_json(event.finish_reason)
            if event.error:
                yield _sse({"error": {"message": event.error, "type": "server_error",
                                      "param": None, "code": None}})
            elif event.text or reason:
                yield chunk([_delta(shape, event.text, reason)])
            if reason is not None:
                break
        if include_usage:
            yield chunk([], usage_json(event.usage))
        yield "data: [DONE]\n\n"
    finally:
        if not stream.finished:
            on_close()
