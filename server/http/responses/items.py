"""A reply as Responses output items, built piece by piece together with the stream events
that build them, so a streamed response and a whole one always hold the same items.

Each piece of the reply (``ReplySplitter``'s content, reasoning or call) either continues
the item open at the end of ``output`` or starts the next one:

- text: a ``message`` item, one ``output_text`` part;
- reasoning: a ``reasoning`` item, one ``reasoning_text`` part (no summary);
- a call: a ``function_call`` item. A call the splitter follows as it is written (streamed
  replies, the JSON formats: ``tool_stream.py``) adds its item as soon as its name is
  complete and its arguments have begun, one ``function_call_arguments.delta`` per piece,
  then ``.done`` once the call is complete; a call cut short (``max_output_tokens``) or
  malformed ends its item ``incomplete`` and its text follows as a message. A call that
  comes whole has its arguments in one delta.

Example (the events of a reply that says something, then calls a function):
    >>> out = OutputItems()
    >>> events = out.add(Text("Let me look.")) + out.add(Call("f", '{"x": 1}', "call_1")) + out.finish("completed")
    >>> for e in events: print(e["type"])
    response.output_item.added
    response.content_part.added
    response.output_text.delta
    response.output_text.done
    response.content_part.done
    response.output_item.done
    response.output_item.added
    response.function_call_arguments.delta
    response.function_call_arguments.done
    response.output_item.done
    >>> [(i["type"], i["status"]) for i in out.items]
    [('message', 'completed'), ('function_call', 'completed')]
"""

from __future__ import annotations

import uuid
from typing import Callable

from kvserve.server.engine.request import TokenEvent
from kvserve.server.http.tools import Call, CallArgs, CallCut, CallStart, Piece, ReplySplitter, Text


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Reply:
    """The pieces of a reply as its text arrives: through the splitter when the chat can
    call tools or reason, else every bit of text as content, as soon as it comes.
    ``stream``: calls are followed as they are written (a streamed response)."""

    def __init__(self, splitter: Callable[..., ReplySplitter] | None, stream: bool = False):
        self._splitter = splitter(stream_calls=stream) if splitter is not None else None

    def pieces(self, event: TokenEvent) -> list[Piece]:
        if self._splitter is None:
            return [Text(event.text)] if event.text else []
        pieces = self._splitter.feed(event.text)
        if event.finish_reason is not None:
            pieces += self._splitter.finish()
        return [p for p in pieces if not (isinstance(p, Text) and not p.text)]


class OutputItems:
    """The output items of one reply; ``add`` and ``finish`` return the stream events (without
    sequence numbers) that build them. ``items`` holds the finished ones."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the message or reasoning item text streams into
        self._text: list[str] = []

    def add(self, piece: Piece) -> list[dict]:
        if isinstance(piece, CallStart):
            return self._close("completed") + self._call_start(piece)
        if isinstance(piece, CallArgs):
            self._text.append(piece.text)
            return [self._event("response.function_call_arguments.delta", delta=piece.text)]
        if isinstance(piece, CallCut) or (isinstance(piece, Call) and piece.streamed):
            return self._close("incomplete" if isinstance(piece, CallCut) else "completed")
        if isinstance(piece, Call):
            return self._close("completed") + self._call(piece)
        kind = "reasoning" if piece.reasoning else "message"
        events = []
        if self._open is None or self._open["type"] != kind:  # text of another kind starts an item
            events = self._close("completed") + self._start(kind)
        self._text.append(piece.text)
        return events + [self._event(_DELTA[kind], content_index=0, delta=piece.text, **_LOGPROBS[kind])]

    def finish(self, status: str) -> list[dict]:
        """The reply ended: the open item closes with ``status`` (``incomplete`` when the
        output was cut short). A reply with no output at all is one empty message."""
        events = self._close(status)
        if not self.items:
            events = self._start("message") + self._close(status)
        return events

    # ---- one item at a time --------------------------------------------------------------
    @property
    def _index(self) -> int:
        return len(self.items)

    def _event(self, kind: str, **fields) -> dict:
        return {"type": kind, "item_id": self._open["id"], "output_index": self._index, **fields}

    def _start(self, kind: str) -> list[dict]:
        if kind == "message":
            self._open = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                          "content": []}
        else:
            self._open = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
        self._text = []
        return [{"type": "response.output_item.added", "output_index": self._index, "item": dict(self._open)},
                self._event("response.content_part.added", content_index=0, part=_part(kind, ""))]

    def _close(self, status: str) -> list[dict]:
        if self._open is None:
            return []
        if self._open["type"] == "function_call":
            return self._call_done(status)
        kind, text = self._open["type"], "".join(self._text)
        part = _part(kind, text)
        item = {**self._open, "content": [part]}
        if kind == "message":
            item["status"] = status
        events = [self._event(_DONE[kind], content_index=0, text=text, **_LOGPROBS[kind]),
                  self._event("response.content_part.done", content_index=0, part=part),
                  {"type": "response.output_item.done", "output_index": self._index, "item": item}]
        self.items.append(item)
        self._open, self._text = None, []
        return events

    def _call_start(self, start: CallStart) -> list[dict]:
        """A streamed call's item, open for its arguments (``_text`` gathers them)."""
        self._open = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                      "call_id": start.id, "name": start.name}
        self._text = []
        return [{"type": "response.output_item.added", "output_index": self._index, "item": dict(self._open)}]

    def _call_done(self, status: str) -> list[dict]:
        arguments = "".join(self._text)
        item = {**self._open, "arguments": arguments, "status": status}
        events = [self._event("response.function_call_arguments.done", arguments=arguments),
                  {"type": "response.output_item.done", "output_index": self._index, "item": item}]
        self.items.append(item)
        self._open, self._text = None, []
        return events

    def _call(self, call: Call) -> list[dict]:
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                "call_id": call.id, "name": call.name}
        done = {**item, "arguments": call.arguments, "status": "completed"}
        at = {"item_id": item["id"], "output_index": self._index}
        events = [{"type": "response.output_item.added", "output_index": self._index, "item": item},
                  {"type": "response.function_call_arguments.delta", **at, "delta": call.arguments},
                  {"type": "response.function_call_arguments.done", **at, "arguments": call.arguments},
                  {"type": "response.output_item.done", "output_index": self._index, "item": done}]
        self.items.append(done)
        return events


_DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}
_LOGPROBS = {"message": {"logprobs": []}, "reasoning": {}}  # text events carry logprobs; none asked


def _part(kind: str, text: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "reasoning_text", "text": text}
