"""Engine events shaped as Anthropic messages: one JSON message, or the stream of events
Anthropic's clients expect, in its order:

    message_start
    content_block_start / content_block_delta ... / content_block_stop   (per block)
    message_delta (stop_reason, stop_sequence, usage)
    message_stop

A reply is split into blocks by the same splitter as OpenAI's chat (``ReplySplitter``):
reasoning becomes a ``thinking`` block, text a ``text`` block, each tool call a ``tool_use``
block. A call the splitter follows as it is written (the JSON formats: ``tool_stream.py``)
starts its block (``input: {}``) once its name is complete and its arguments have begun, and
streams them as ``input_json_delta`` pieces whose ``partial_json`` joins to its input; a call
that comes whole (other formats) has its input in one delta. A streamed call cut short (by
``max_tokens``) or malformed closes its block where it stopped, its text follows as a text
block, and the stop reason is not ``tool_use``.

Example:
    >>> from kvserve.server.engine.request import FinishReason
    >>> stop_reason(FinishReason.STOP, None, called=True), stop_reason(FinishReason.LENGTH, None, False)
    ('tool_use', 'max_tokens')
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator, Callable

from fastapi import Request as HTTPRequest

from kvserve.server.engine.request import FinishReason, TokenEvent, Usage
from kvserve.server.http.streams import EngineFailed, EventStream, engine_error
from kvserve.server.http.tools import Call, CallArgs, CallCut, CallStart, Piece, ReplySplitter, Text, merge_texts


def stop_reason(reason: FinishReason | None, stop: str | None, called: bool) -> str:
    if reason is FinishReason.LENGTH:
        return "max_tokens"
    if stop is not None:
        return "stop_sequence"
    return "tool_use" if called else "end_turn"


def usage_json(usage: Usage | None, prompt_tokens: int) -> dict:
    """Anthropic counts cached prompt tokens apart: ``input_tokens`` are the others."""
    if usage is None:
        return {"input_tokens": prompt_tokens, "output_tokens": 0,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0,  # the prefix cache writes for free
            "cache_read_input_tokens": usage.cached_tokens}


def block_json(piece: Piece) -> dict:
    """A piece as its content block.

    >>> block_json(Call("w", '{"city": "Paris"}', "call_1"))
    {'type': 'tool_use', 'id': 'toolu_1', 'name': 'w', 'input': {'city': 'Paris'}}
    >>> block_json(Text("hm", reasoning=True))
    {'type': 'thinking', 'thinking': 'hm', 'signature': ''}
    """
    if isinstance(piece, Call):
        return {"type": "tool_use", "id": tool_use_id(piece), "name": piece.name,
                "input": call_input(piece.arguments)}
    if piece.reasoning:
        return {"type": "thinking", "thinking": piece.text, "signature": ""}
    return {"type": "text", "text": piece.text}


def call_input(arguments: str) -> dict:
    """A call's arguments as the object ``input`` must be. Forced calls always parse (the
    grammar makes them); a free-running model may write a string or a list, kept under
    ``arguments`` rather than failing the whole reply.

    >>> call_input('{"a": 1}'), call_input(""), call_input("[1]"), call_input("{oops")
    ({'a': 1}, {}, {'arguments': [1]}, {'arguments': '{oops'})
    """
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def tool_use_id(call: Call | CallStart) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def new_message(model: str, prompt_tokens: int) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage_json(None, prompt_tokens)}


async def collect_message(stream: EventStream, http_request: HTTPRequest, splitter: ReplySplitter,
                          model: str, prompt_tokens: int) -> dict:
    """Wait for the reply and build the message (``EngineFailed`` if the engine failed)."""
    pieces: list[Piece] = []
    while not stream.finished:
        event = await stream.next(http_request)
        if event.error:
            raise EngineFailed(*engine_error(event))
        pieces += splitter.feed(event.text)
        if event.finish_reason is not None:
            last = event
    pieces = merge_texts(pieces + splitter.finish())
    message = new_message(model, prompt_tokens)
    message["content"] = [block_json(p) for p in pieces]
    message["stop_reason"] = stop_reason(last.finish_reason, last.stop, splitter.called)
    message["stop_sequence"] = last.stop
    message["usage"] = usage_json(last.usage, prompt_tokens)
    return message


def sse(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class _Blocks:
    """Which content block is open, so a piece either continues it or starts the next.

    >>> blocks, kinds = _Blocks(), lambda events: [e.split()[1] for e in events]
    >>> kinds(blocks.add(Text("Hi"))), kinds(blocks.add(Text("!")))
    (['content_block_start', 'content_block_delta'], ['content_block_delta'])
    >>> kinds(blocks.add(Call("w", "{}", "call_1")) + blocks.close())
    ['content_block_stop', 'content_block_start', 'content_block_delta', 'content_block_stop']
    >>> streamed = [CallStart("w", "call_2", 1), CallArgs("call_2", '{"a"', 1), CallArgs("call_2", ': 1}', 1),
    ...             Call("w", '{"a": 1}', "call_2", streamed=True)]
    >>> [kind for piece in streamed for kind in kinds(blocks.add(piece))]
    ['content_block_start', 'content_block_delta', 'content_block_delta', 'content_block_stop']
    """

    def __init__(self) -> None:
        self.index, self.open = -1, None  # open: "text" | "thinking" | "tool_use" | None

    def add(self, piece: Piece) -> list[str]:
        if isinstance(piece, (CallStart, CallArgs, CallCut)) or (isinstance(piece, Call) and piece.streamed):
            return self._follow(piece)
        kind = block_json(piece)["type"]
        out: list[str] = []
        if kind != self.open or kind == "tool_use":  # each call is a block of its own
            out += self.close()
            self.index += 1
            self.open = kind
            out.append(sse("content_block_start", {"index": self.index, "content_block": _empty(piece)}))
        out.append(sse("content_block_delta", {"index": self.index, "delta": _delta(piece)}))
        return out

    def _follow(self, piece: CallStart | CallArgs | CallCut | Call) -> list[str]:
        """A streamed call: its block opens at the start, each arguments piece is a delta, and
        it closes when the call completes or is cut."""
        if isinstance(piece, CallStart):
            block = {"type": "tool_use", "id": tool_use_id(piece), "name": piece.name, "input": {}}
            out = self.close()
            self.index, self.open = self.index + 1, "tool_use"
            return out + [sse("content_block_start", {"index": self.index, "content_block": block})]
        if isinstance(piece, CallArgs):
            delta = {"type": "input_json_delta", "partial_json": piece.text}
            return [sse("content_block_delta", {"index": self.index, "delta": delta})]
        return self.close()

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # clients expect one before the block ends; kvserve signs nothing
            delta = {"type": "signature_delta", "signature": ""}
            out.append(sse("content_block_delta", {"index": self.index, "delta": delta}))
        self.open = None
        return out + [sse("content_block_stop", {"index": self.index})]


def _empty(piece: Piece) -> dict:
    """The block as ``content_block_start`` announces it: everything but what deltas add."""
    block = block_json(piece)
    if block["type"] == "tool_use":
        return {**block, "input": {}}
    return {**block, block["type"]: ""}


def _delta(piece: Piece) -> dict:
    """A call's input goes whole, as one ``input_json_delta`` (calls are parsed when complete)."""
    if isinstance(piece, Call):
        return {"type": "input_json_delta", "partial_json": json.dumps(call_input(piece.arguments))}
    if piece.reasoning:
        return {"type": "thinking_delta", "thinking": piece.text}
    return {"type": "text_delta", "text": piece.text}


async def message_events(stream: EventStream, splitter: ReplySplitter, model: str, prompt_tokens: int,
                         on_close: Callable[[], None], keepalive_s: float | None) -> AsyncIterator[str]:
    """The SSE events of one streamed message; a ``ping`` after every ``keepalive_s`` seconds
    without one (queued, or in a long prefill), as proxies need traffic and clients skip it."""
    blocks = _Blocks()
    try:
        yield sse("message_start", {"message": new_message(model, prompt_tokens)})
        while not stream.finished:
            event = await stream.next(idle_s=keepalive_s)
            if event is None:
                yield sse("ping", {})
                continue
            if event.error:  # the status line is long gone: the error travels as an event
                status, body = engine_error(event)
                yield sse("error", error_json(status, body["error"]["message"]))
                return
            for out in _event_blocks(blocks, splitter, event):
                yield out
            if event.finish_reason is not None:
                reason = stop_reason(event.finish_reason, event.stop, splitter.called)
                yield sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": event.stop},
                                            "usage": usage_json(event.usage, prompt_tokens)})
                yield sse("message_stop", {})
    finally:
        if not stream.finished:  # the client left mid-stream: free the engine's work
            on_close()


def _event_blocks(blocks: _Blocks, splitter: ReplySplitter, event: TokenEvent) -> list[str]:
    pieces = splitter.feed(event.text)
    if event.finish_reason is not None:
        pieces += splitter.finish()
    out = [line for p in pieces if not (isinstance(p, Text) and not p.text) for line in blocks.add(p)]
    return out + (blocks.close() if event.finish_reason is not None else [])


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_json(status: int, message: str) -> dict:
    """Anthropic's error body.

    >>> error_json(404, "no such model")["error"]["type"]
    'not_found_error'
    """
    return {"type": "error", "error": {"type": error_type(status), "message": message}}

