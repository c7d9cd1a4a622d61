"""Bridging engine events into asyncio, and shaping them as OpenAI JSON or SSE chunks.

The engine thread calls ``EventStream.sink``; the handler awaits ``EventStream.next``.
A request whose client goes away is aborted in the engine, streaming or not. A stream with
nothing to send for ``keepalive_s`` seconds (queued, or in a long prefill) gets an SSE
comment line, which clients ignore and proxies count as traffic:

    data: {"id": "chatcmpl-...", "choices": [{"delta": {"role": "assistant", ...}}]}

    : keep-alive

    data: {"id": "chatcmpl-...", "choices": [{"delta": {"content": "Hello"}}]}
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from collections.abc import Sequence
from typing import AsyncIterator, Callable

from kvserve.server.http.tools import Call, CallArgs, CallStart, Piece, ReplySplitter, Text

from fastapi import Request as HTTPRequest

from kvserve.server.engine.request import FinishReason, TokenEvent, TokenLogprob, Usage
from kvserve.server.http.errors import error_body
from kvserve.server.http.logprobs import LogprobFormat

# How often a non-streaming handler checks whether its client is still there.
DISCONNECT_POLL_S = 0.5

# An SSE comment: clients skip it, proxies see bytes on an otherwise idle stream.
KEEPALIVE = ": keep-alive\n\n"


class ClientGone(Exception):
    pass


class EngineFailed(Exception):
    """The engine ended a request with an error; ``status`` and ``body`` answer it."""

    def __init__(self, status: int, body: dict):
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body


def engine_error(event: TokenEvent) -> tuple[int, dict]:
    """How a request the engine ended with an error is answered: a queue timeout is 503
    ``queue_timeout`` (of type ``server_error``), any other failure 500.

    >>> status, body = engine_error(TokenEvent("r", "", finish_reason=FinishReason.TIMEOUT, error="waited"))
    >>> status, body["error"]["type"], body["error"]["code"]
    (503, 'server_error', 'queue_timeout')
    >>> engine_error(TokenEvent("r", "", finish_reason=FinishReason.ERROR, error="boom"))[0]
    500
    """
    if event.finish_reason is FinishReason.TIMEOUT:
        return 503, error_body(event.error, status=503, code="queue_timeout", err_type="server_error")
    return 500, error_body(event.error or "engine error", status=500)


class EventStream:
    """An asyncio queue fed from the engine thread with the events of ``request_ids`` (the
    choices of one HTTP request); ``finished`` once every one of them has finished."""

    def __init__(self, request_ids: Sequence[str]) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.request_ids = list(request_ids)
        self._open = set(request_ids)

    @property
    def finished(self) -> bool:
        return not self._open

    def index(self, event: TokenEvent) -> int:
        return self.request_ids.index(event.request_id)

    def sink(self, event: TokenEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop already closed (server shutting down)
            pass

    async def next(self, http_request: HTTPRequest | None = None,
                   idle_s: float | None = None) -> TokenEvent | None:
        """The next event; with ``http_request``, raises ``ClientGone`` when it disconnects;
        with ``idle_s``, returns None once that many seconds passed without an event."""
        deadline = None if idle_s is None else self._loop.time() + idle_s
        while True:
            wait = DISCONNECT_POLL_S
            if deadline is not None:
                wait = min(wait, deadline - self._loop.time())
            try:
                if wait <= 0:
                    event = self._queue.get_nowait()
                else:
                    event = await asyncio.wait_for(self._queue.get(), wait)
            except asyncio.QueueEmpty:
                return None
            except asyncio.TimeoutError:
                if http_request is not None and await http_request.is_disconnected():
                    raise ClientGone() from None
                continue
            if event.finish_reason is not None:
                self._open.discard(event.request_id)
            return event


@dataclass(frozen=True)
class Shape:
    """How one endpoint names things: chat completions or text completions; ``logprobs``
    formats log-probabilities when the request asked for them."""

    chat: bool
    model: str
    id_prefix: str
    logprobs: LogprobFormat | None = None
    splitter: Callable[..., ReplySplitter] | None = None  # chat replies with tool calls or reasoning

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"

    def logprobs_json(self, records: list[TokenLogprob], offset: int) -> dict | None:
        if self.logprobs is None:
            return None
        return self.logprobs.chat(records) if self.chat else self.logprobs.legacy(records, offset)


def usage_json(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def finish_reason_json(reason: FinishReason | None, called: bool = False) -> str | None:
    # OpenAI knows "stop", "length" and "tool_calls"; an aborted or failed request ends as "stop".
    if reason is None:
        return None
    if reason is FinishReason.LENGTH:
        return "length"
    return "tool_calls" if called else "stop"


def tool_call_json(call: Call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def message_json(pieces: list[Piece]) -> dict:
    """A chat reply's message: content, reasoning_content and tool_calls from its pieces."""
    content = "".join(p.text for p in pieces if isinstance(p, Text) and not p.reasoning)
    reasoning = "".join(p.text for p in pieces if isinstance(p, Text) and p.reasoning)
    calls = [tool_call_json(p) for p in pieces if isinstance(p, Call)]
    message: dict = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _choice(shape: Shape, index: int, text: str, reason: FinishReason | None, logprobs: dict | None) -> dict:
    if shape.chat:
        pieces = [Text(text)]
        if shape.splitter is not None:
            splitter = shape.splitter()
            pieces = splitter.feed(text) + splitter.finish()
        message = message_json(pieces)
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason_json(reason, "tool_calls" in message)}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason_json(reason)}


def _piece_delta(piece: Piece) -> dict | None:
    """A piece as a chat delta. A streamed call goes as OpenAI streams one: a first delta with
    its id, name and empty arguments, then argument pieces, which clients join; its ``Call``
    and a ``CallCut`` add nothing (a cut call's text follows as content).

    >>> _piece_delta(CallStart("f", "call_1", 0))["tool_calls"]
    [{'index': 0, 'id': 'call_1', 'type': 'function', 'function': {'name': 'f', 'arguments': ''}}]
    >>> _piece_delta(CallArgs("call_1", '{"x', 0))
    {'tool_calls': [{'index': 0, 'function': {'arguments': '{"x'}}]}
    """
    if isinstance(piece, CallStart):
        call = {"index": piece.index, "id": piece.id, "type": "function",
                "function": {"name": piece.name, "arguments": ""}}
        return {"tool_calls": [call]}
    if isinstance(piece, CallArgs):
        return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}
    if isinstance(piece, Call):
        return None if piece.streamed else {"tool_calls": [tool_call_json(piece, piece.index)]}
    if not isinstance(piece, Text):  # CallCut
        return None
    return {"reasoning_content": piece.text} if piece.reasoning else {"content": piece.text}


def _delta(shape: Shape, index: int, text: str, reason: str | None, first: bool = False,
           logprobs: dict | None = None) -> dict:
    if shape.chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def _split_chunks(splitter: ReplySplitter, index: int, event: TokenEvent, logprobs: dict | None) -> list[dict]:
    """A chat event through the reply splitter: one chunk per piece (content, reasoning, a
    call's start or arguments, a call that came whole), the logprobs on the first, the
    finish reason on a last empty one."""
    pieces = splitter.feed(event.text)
    if event.finish_reason is not None:
        pieces += splitter.finish()
    out = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
           for delta in map(_piece_delta, pieces) if delta is not None]
    if logprobs is not None:
        if out:
            out[0]["logprobs"] = logprobs
        else:
            out.append({"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": None})
    if event.finish_reason is not None:
        out.append({"index": index, "delta": {}, "logprobs": None,
                    "finish_reason": finish_reason_json(event.finish_reason, splitter.called)})
    return out


def total_usage(usages: list[Usage | None]) -> Usage | None:
    """The choices share one prompt: it counts once, their completions add up."""
    known = [u for u in usages if u is not None]
    if not known:
        return None
    return Usage(known[0].prompt_tokens, sum(u.completion_tokens for u in known), known[0].cached_tokens)


async def collect(shape: Shape, stream: EventStream, http_request: HTTPRequest, prefix: str = "") -> dict:
    """Wait for every choice to finish and build the non-streaming response body."""
    n = len(stream.request_ids)
    parts: list[list[str]] = [[prefix] for _ in range(n)]
    records: list[list[TokenLogprob]] = [[] for _ in range(n)]
    reasons: list[FinishReason | None] = [None] * n
    usages: list[Usage | None] = [None] * n
    while not stream.finished:
        event = await stream.next(http_request)
        if event.error:
            raise EngineFailed(*engine_error(event))
        i = stream.index(event)
        parts[i].append(event.text)
        records[i].extend(event.logprobs)
        if event.finish_reason is not None:
            reasons[i], usages[i] = event.finish_reason, event.usage
    choices = [_choice(shape, i, "".join(parts[i]), reasons[i], shape.logprobs_json(records[i], len(prefix)))
               for i in range(n)]
    return {"id": shape.new_id(), "object": shape.object, "created": int(time.time()),
            "model": shape.model, "choices": choices, "usage": usage_json(total_usage(usages))}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_events(shape: Shape, stream: EventStream, include_usage: bool,
                     on_close: Callable[[], None], prefix: str = "",
                     keepalive_s: float | None = None) -> AsyncIterator[str]:
    """Server-sent events: a first chunk per choice, one chunk per text event (``KEEPALIVE``
    after every ``keepalive_s`` seconds without one), each choice's finish or error, then
    usage and [DONE]."""
    chunk_id, created = shape.new_id(), int(time.time())
    obj = "chat.completion.chunk" if shape.chat else "text_completion"
    n = len(stream.request_ids)
    offsets = [len(prefix)] * n  # legacy logprobs count characters per choice
    usages: list[Usage | None] = [None] * n
    splitters = [shape.splitter(stream_calls=True) for _ in range(n)] if shape.splitter is not None else None

    def chunk(choices: list, usage: dict | None = None) -> str:
        body = {"id": chunk_id, "object": obj, "created": created, "model": shape.model,
                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return _sse(body)

    try:
        if shape.chat or prefix:
            for i in range(n):
                yield chunk([_delta(shape, i, prefix, None, first=True)])
        while not stream.finished:
            event = await stream.next(idle_s=keepalive_s)
            if event is None:
                yield KEEPALIVE
                continue
            i = stream.index(event)
            if event.error:
                yield _sse(engine_error(event)[1])
            elif splitters is not None:
                for body in _split_chunks(splitters[i], i, event, shape.logprobs_json(list(event.logprobs), 0)):
                    yield chunk([body])
            elif event.text or event.finish_reason or event.logprobs:
                logprobs = shape.logprobs_json(list(event.logprobs), offsets[i])
                reason = finish_reason_json(event.finish_reason)
                yield chunk([_delta(shape, i, event.text, reason, logprobs=logprobs)])
            offsets[i] += len(event.text)
            reason = event.finish_reason
            if reason is not None:
                usages[i] = event.usage
        if include_usage:
            yield chunk([], usage_json(total_usage(usages)))
        yield "data: [DONE]\n\n"
    finally:
        if not stream.finished:
            on_close()
