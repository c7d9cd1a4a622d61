"""Tool calls: how a model's prompt shows its tools, how its replies call them, and how a
reply is split into content, reasoning and calls as it streams.

Each model family marks a call its own way; mlx-lm's tokenizer knows the family from the
chat template and ships the parser (``mlx_lm.tool_parsers``): ``<tool_call>{json}</tool_call>``
(Hermes, Qwen), ``[TOOL_CALLS]name[ARGS]{json}`` (Mistral), Gemma's, LFM2's pythonic calls,
and more. Formats it lacks are in ``tool_formats.py`` (Llama 3's bare JSON, gpt-oss's
harmony channels). A template that does not render tools at all (SmolLM2, Gemma 3) gets the
Hermes convention: the tools listed in the system prompt, calls in ``<tool_call>`` tags.

Example (a streamed reply, split as it arrives):
    >>> fmt = ToolFormat.hermes()
    >>> s = ReplySplitter(fmt)
    >>> s.feed('Let me look. <tool_') + s.feed('call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    [Text(text='Let me look. ', reasoning=False), Call(name='f', arguments='{"x": 1}')]
    >>> s.finish()
    []

With ``stream_calls`` (streamed replies), a call of a JSON format is followed as it is
written (``tool_stream.py``): its name once the arguments begin, then the arguments:
    >>> s = ReplySplitter(fmt, stream_calls=True, ids=lambda: "call_1")
    >>> for part in ['<tool_call>\\n{"name": "f", "argu', 'ments": {"x', '": 1', '}}', '\\n</tool_call>']:
    ...     print(s.feed(part))
    []
    [CallStart(name='f', id='call_1', index=0), CallArgs(id='call_1', text='{"x', index=0)]
    [CallArgs(id='call_1', text='": ', index=0)]
    [CallArgs(id='call_1', text='1}', index=0)]
    [Call(name='f', arguments='{"x": 1}')]
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from kvserve.server.http.tool_stream import Args, Extractor, Start, extractor_for

log = logging.getLogger("kvserve.http")

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"

# Tools in the system prompt, for templates that do not render them (Qwen 2.5's wording).
HERMES_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _hermes_parse(text: str, tools: Any = None) -> dict:
    return json.loads(text.strip())


@dataclass(frozen=True)
class ToolFormat:
    """How one model family calls tools: ``start`` opens a call, ``end`` closes it ("": the
    call runs to the end of the reply); ``parse(text, tools)`` reads the text between them
    into ``{"name", "arguments"}`` (or a list of them); ``native``: the chat template renders
    the tools itself. ``dialect``: which of the format's spellings the template uses, where
    it has two (Mistral: "args" for ``[TOOL_CALLS]name[ARGS]{...}``, else its JSON list),
    for the grammar of a forced call (``tool_grammars.py``). A format with its own
    reasoning markers names them in ``think``; ``noise`` is framing text dropped from the
    content."""

    name: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]
    native: bool
    dialect: str = ""
    think: tuple[str, str] | None = None
    noise: tuple[str, ...] = ()

    @classmethod
    def hermes(cls, native: bool = False) -> ToolFormat:
        return cls("json_tools", HERMES_START, HERMES_END, _hermes_parse, native)

    @classmethod
    def of(cls, tokenizer: Any) -> ToolFormat:
        """The tokenizer's own format (mlx-lm infers it from the chat template), one that
        ``tool_formats.py`` recognizes, else Hermes in the system prompt."""
        from kvserve.server.http.tool_formats import extra_format

        if getattr(tokenizer, "has_tool_calling", False):
            parser, start, end = tokenizer.tool_parser, tokenizer.tool_call_start, tokenizer.tool_call_end
            module = getattr(parser, "__module__", "") or ""
            name = module.rsplit(".", 1)[-1] or "mlx-lm"
            if name == "json_tools":
                return cls.hermes(native=True)
            return cls(name, start, end, parser, True, _dialect(name, tokenizer))
        return extra_format(tokenizer) or cls.hermes()


def _dialect(name: str, tokenizer: Any) -> str:
    # Mistral's templates since v11 write [TOOL_CALLS]name[ARGS]{...}, older ones a JSON list.
    template = getattr(tokenizer, "chat_template", None)
    return "args" if name == "mistral" and isinstance(template, str) and "[ARGS]" in template else ""


@dataclass(frozen=True)
class Text:
    text: str
    reasoning: bool = False


@dataclass(frozen=True)
class Call:
    """A complete call. ``index``: its place among the reply's calls (a streamed call keeps
    the one its ``CallStart`` had); ``streamed``: its ``CallStart`` and ``CallArgs`` went
    before, and ``arguments`` is their text joined."""

    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default="", compare=False, repr=False)
    index: int = field(default=0, compare=False, repr=False)
    streamed: bool = field(default=False, compare=False, repr=False)


@dataclass(frozen=True)
class CallStart:
    """A followed call begins: its name is complete and its arguments object has opened."""

    name: str
    id: str
    index: int


@dataclass(frozen=True)
class CallArgs:
    """More of a followed call's arguments (JSON text, in ``json.dumps``'s spelling)."""

    id: str
    text: str
    index: int


@dataclass(frozen=True)
class CallCut:
    """A followed call that did not complete: cut short or malformed. Its text follows as
    content; what was streamed of it cannot be taken back."""

    id: str
    index: int


Piece = Text | Call | CallStart | CallArgs | CallCut


class ReplySplitter:
    """Splits streamed reply text into ``Text`` (content or reasoning) and ``Call`` pieces.

    Text that may be the start of a marker is held back until it is known not to be; a
    call is emitted once its end marker arrives (or the reply ends). A call that does not
    parse (cut off by max_tokens) comes back as content, so no output is lost.
    ``think``: the reasoning markers (open, close); ``thinking``: the prompt already opened
    a reasoning block (templates that end the prompt with ``<think>``).

    ``stream_calls`` (streamed replies) follows the calls of the JSON formats as they are
    written (``tool_stream.py``; other formats' calls still come whole when they close):

    - a call starts (``CallStart``) once its name is complete and its arguments object has
      begun, never earlier, so a name is not announced for text that is not yet a call;
    - ``CallArgs`` pieces follow as the arguments arrive; joined, they are the call's
      arguments as ``json.dumps`` writes them, the same text an unstreamed reply gives;
    - the ``Call`` (``streamed``) completes it: when its end marker closes it (Hermes), or
      when its JSON closes (formats whose calls run to the end of the reply: Llama 3,
      Mistral, harmony; text after the last complete call that is no call is content);
    - a call that does not complete (cut by max_tokens, malformed, or its parse disagrees
      with what was streamed) is ``CallCut``: what went out cannot be taken back, so its
      text follows as content, as an unstreamed reply shows it, and the reply no longer
      counts as calling tools (``called``: finish reason stop or length, not tool_calls).
    """

    def __init__(self, fmt: ToolFormat | None, tools: Any = None, think: tuple[str, str] | None = None,
                 thinking: bool = False, ids: Callable[[], str] | None = None, stream_calls: bool = False):
        self.fmt, self.tools = fmt, tools
        self.think = think or (fmt.think if fmt is not None else None)
        self._mode = "reasoning" if thinking and think else "content"
        self._buffer = ""
        self._call = ""
        self._ids = ids or _call_id
        self._indexes = itertools.count()
        self._spacing, self._after_call = "", False
        self._extractor = extractor_for(fmt.name, fmt.start) if stream_calls and fmt is not None else None
        self._follower: CallFollower | None = None
        self._fed = 0  # how much of the buffer the follower has read
        self.calls = 0
        self.cut = 0

    @property
    def called(self) -> bool:
        """The reply calls tools: it holds a call, and no call it began to stream was cut."""
        return self.calls > 0 and not self.cut

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while True:
            piece, progressed = self._step(final=False)
            if piece is not None:
                out.extend(piece)
            if not progressed:
                return self._tally(self._hold_spacing(merge_texts(out)))

    def _hold_spacing(self, pieces: list[Piece]) -> list[Piece]:
        """Whitespace after a call (between parallel calls, before the end) is framing, not
        content: held until real content follows, dropped if none does."""
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, Call):
                self._spacing, self._after_call = "", True
            elif isinstance(p, Text) and not p.reasoning and self._after_call:
                if not p.text.strip():
                    self._spacing += p.text
                    continue
                p, self._spacing, self._after_call = Text(self._spacing + p.text), "", False
            out.append(p)
        return out

    def _tally(self, pieces: list[Piece]) -> list[Piece]:
        self.calls += sum(isinstance(p, Call) for p in pieces)
        self.cut += sum(isinstance(p, CallCut) for p in pieces)
        return pieces

    def finish(self) -> list[Piece]:
        """The reply ended: flush held-back text, close an open call (formats whose calls
        run to the end of the reply)."""
        out: list[Piece] = []
        while True:
            piece, progressed = self._step(final=True)
            if piece is not None:
                out.extend(piece)
            if not progressed:
                break
        if self._mode == "call":
            out.extend(self._close_call(self._call + self._buffer, ended=True))
        elif self._buffer:
            out.append(Text(self._buffer, self._mode == "reasoning"))
        self._buffer, self._call, self._fed = "", "", 0
        return self._tally(self._hold_spacing(merge_texts(out)))

    # ---- one transition at a time ------------------------------------------------------
    def _step(self, final: bool) -> tuple[list[Piece] | None, bool]:
        if self._mode == "call":
            return self._in_call(final)
        markers = self._markers()
        buf = self._buffer
        if not markers:  # nothing to look for: the text goes out as it comes
            self._buffer = ""
            return ([Text(buf, self._mode == "reasoning")] if buf else None), False
        hits = [(buf.find(m), m, mode) for m, mode in markers if m and buf.find(m) >= 0]
        if hits:
            at, marker, mode = min(hits)
            before, self._buffer = buf[:at], buf[at + len(marker):]
            out = [Text(before, self._mode == "reasoning")] if before else []
            self._mode = mode
            if mode == "call":
                self._open_call()
            return out, True
        if final:
            return None, False
        keep = max((_partial_suffix(buf, m) for m, _ in markers if m), default=0)
        text, self._buffer = buf[: len(buf) - keep], buf[len(buf) - keep:]
        return ([Text(text, self._mode == "reasoning")] if text else None), False

    def _markers(self) -> list[tuple[str, str]]:
        if self._mode == "reasoning":
            return [(self.think[1], "content")]
        out = []
        if self.think:
            out.append((self.think[0], "reasoning"))
        if self.fmt is not None:
            out.append((self.fmt.start, "call"))
            out.extend((n, "content") for n in self.fmt.noise)
        return out

    def _open_call(self) -> None:
        self._call, self._fed = "", 0
        if self._extractor is not None:
            self._follower = CallFollower(self._extractor(), not self.fmt.end, self._ids, self._indexes)

    def _in_call(self, final: bool) -> tuple[list[Piece] | None, bool]:
        out = self._follow()
        end = self.fmt.end
        if not end:  # the call runs to the end of the reply
            self._call += self._buffer
            self._buffer, self._fed = "", 0
            return out or None, False
        # The first end marker after which the call parses closes it: a string inside the
        # call may hold the marker itself ({"city": "Paris}}</tool_call> in"} is valid JSON,
        # and a grammar-forced call can sample it); a call that never parses ends as text.
        at = self._buffer.find(end)
        while at >= 0 and not self._parses(self._call + self._buffer[:at]):
            at = self._buffer.find(end, at + 1)
        if at < 0:
            keep = _partial_suffix(self._buffer, end)
            self._call += self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            self._fed = len(self._buffer)
            return out or None, False
        text, self._buffer = self._call + self._buffer[:at], self._buffer[at + len(end):]
        self._mode, self._call, self._fed = "content", "", 0
        return out + self._close_call(text, ended=False), True

    def _follow(self) -> list[Piece]:
        """The follower reads the call's text as soon as it arrives, held-back marker starts
        included: it knows where the JSON is, so arguments never wait on the end marker (the
        text after a call's JSON, the marker and beyond, it ignores)."""
        if self._follower is None:
            return []
        text, self._fed = self._buffer[self._fed:], len(self._buffer)
        return self._follower.feed(text)

    def _parses(self, text: str) -> bool:
        try:
            self.fmt.parse(text, self.tools)
        except Exception:  # noqa: BLE001 (any parse failure: not the end of the call yet)
            return False
        return True

    def _close_call(self, text: str, ended: bool) -> list[Piece]:
        self._mode = "content"
        follower, self._follower = self._follower, None
        calls = self._parse(text)
        raw = self.fmt.start + text + ("" if ended else self.fmt.end)
        if follower is not None and follower.started:
            out, calls = follower.close(text, calls, raw)
            return out + [self._whole(*c) for c in calls]
        if calls is None:
            return [Text(raw)]
        return [self._whole(*c) for c in calls]

    def _parse(self, text: str) -> list[tuple[str, str, str]] | None:
        """The calls in a call's text as (name, arguments JSON, the model's id or ""); None
        when it is cut short or malformed."""
        try:
            parsed = self.fmt.parse(text, self.tools)
        except Exception as exc:  # cut short or malformed: kept as text
            log.info("tool call did not parse (%s: %s)", type(exc).__name__, exc)
            return None
        out = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            args = call.get("arguments", {})
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out.append((call["name"], args, call.get("id") or ""))
        return out

    def _whole(self, name: str, arguments: str, model_id: str) -> Call:
        return Call(name, arguments, model_id or self._ids(), index=next(self._indexes))


class CallFollower:
    """The calls of one call region streamed as an extractor reads them (``tool_stream.py``),
    settled by the region's parse when it closes. ``early``: a call completes when its JSON
    closes (formats whose calls run to the end of the reply), else when the region closes
    (at its end marker, once the call parses)."""

    def __init__(self, extractor: Extractor, early: bool, ids: Callable[[], str], indexes: Iterator[int]):
        self._extractor, self._early, self._ids, self._indexes = extractor, early, ids, indexes
        self._open: CallStart | None = None
        self._args: list[str] = []
        self.done: list[Call] = []
        self.cut = False
        self._after = 0  # where, in the region, the text after the last completed call starts

    @property
    def started(self) -> bool:
        return self._open is not None or bool(self.done) or self.cut

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        for event in [] if self.cut else self._extractor.feed(text):
            if isinstance(event, Start):
                self._open, self._args = CallStart(event.name, self._ids(), next(self._indexes)), []
                out.append(self._open)
            elif isinstance(event, Args):
                self._args.append(event.text)
                out.append(CallArgs(self._open.id, event.text, self._open.index))
            elif self._early:  # End: the call's JSON closed
                out.append(self._complete(event.at) if event.ok else self._cut())
                if self.cut:
                    break
        return out

    def close(self, text: str, calls: list[tuple[str, str, str]] | None,
              raw: str) -> tuple[list[Piece], list[tuple[str, str, str]]]:
        """The region ended: ``calls`` is its parse (None: it did not parse), ``raw`` the
        region as content. Returns the pieces that settle the streamed calls, and the parsed
        calls left to come whole. Calls completed already stand; the open one completes if
        the parse agrees, else it is cut and the text after the completed calls is content."""
        k = len(self.done)
        agrees = not self.cut and calls is not None and len(calls) >= k \
            and all(_same(c, d.name, d.arguments) for c, d in zip(calls, self.done))
        out: list[Piece] = []
        if agrees and self._open is not None:
            if len(calls) > k and _same(calls[k], self._open.name, "".join(self._args)):
                out.append(self._complete(len(text)))
                k += 1
            else:
                agrees = False
        if agrees:
            return out, calls[k:]
        if self._open is not None:
            out.append(self._cut())
        return out + [Text(text[self._after:] if self.done else raw)], []

    def _complete(self, at: int) -> Call:
        start, self._open = self._open, None
        call = Call(start.name, "".join(self._args), start.id, index=start.index, streamed=True)
        self.done.append(call)
        self._after = at
        return call

    def _cut(self) -> CallCut:
        start, self._open, self.cut = self._open, None, True
        return CallCut(start.id, start.index)


def _same(parsed: tuple[str, str, str], name: str, arguments: str) -> bool:
    """A parsed call is the one streamed: the same name, and arguments that read the same
    (the streamed text is json.dumps's spelling; a duplicated key is how they may differ).

    >>> _same(("f", '{"a": 2}', ""), "f", '{"a": 1, "a": 2}'), _same(("f", "{}", ""), "g", "{}")
    (True, False)
    """
    return parsed[0] == name and (parsed[1] == arguments or _loads(parsed[1]) == _loads(arguments))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``.

    >>> _partial_suffix("abc<tool_", "<tool_call>"), _partial_suffix("abc", "<tool_call>")
    (6, 0)
    """
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def merge_texts(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text pieces of the same kind as one; empty text dropped.

    >>> merge_texts([Text("a"), Text("b"), Text(""), Call("w", "{}"), Text("c", reasoning=True)])
    [Text(text='ab', reasoning=False), Call(name='w', arguments='{}'), Text(text='c', reasoning=True)]
    """
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, Text) and out and isinstance(out[-1], Text) and out[-1].reasoning == p.reasoning:
            out[-1] = Text(out[-1].text + p.text, p.reasoning)
        elif not (isinstance(p, Text) and not p.text):
            out.append(p)
    return out


def _call_id() -> str:
    import uuid

    return f"call_{uuid.uuid4().hex[:24]}"
