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
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

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
    the tools itself. ``grammar_call`` is the literal text around one JSON call, for the
    formats whose calls can be forced with a grammar (``None``: cannot). A format with its
    own reasoning markers names them in ``think``; ``noise`` is framing text dropped from
    the content."""

    name: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]
    native: bool
    grammar_call: tuple[str, str] | None = None
    think: tuple[str, str] | None = None
    noise: tuple[str, ...] = ()

    @classmethod
    def hermes(cls, native: bool = False) -> ToolFormat:
        return cls("json_tools", HERMES_START, HERMES_END, _hermes_parse, native,
                   (HERMES_START + "\n", "\n" + HERMES_END))

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
            return cls(name, start, end, parser, True, _json_list_call(name))
        return extra_format(tokenizer) or cls.hermes()


def _json_list_call(name: str) -> tuple[str, str] | None:
    # Mistral's JSON list form: [TOOL_CALLS][{"name": ..., "arguments": ...}]
    return ("[TOOL_CALLS][", "]") if name == "mistral" else None


@dataclass(frozen=True)
class Text:
    text: str
    reasoning: bool = False


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default="", compare=False, repr=False)


Piece = Text | Call


class ReplySplitter:
    """Splits streamed reply text into ``Text`` (content or reasoning) and ``Call`` pieces.

    Text that may be the start of a marker is held back until it is known not to be; a
    call is emitted once its end marker arrives (or the reply ends). A call that does not
    parse (cut off by max_tokens) comes back as content, so no output is lost.
    ``think``: the reasoning markers (open, close); ``thinking``: the prompt already opened
    a reasoning block (templates that end the prompt with ``<think>``).
    """

    def __init__(self, fmt: ToolFormat | None, tools: Any = None,
                 think: tuple[str, str] | None = None, thinking: bool = False, ids: Callable[[], str] | None = None):
        self.fmt, self.tools = fmt, tools
        self.think = think or (fmt.think if fmt is not None else None)
        self._mode = "reasoning" if thinking and think else "content"
        self._buffer = ""
        self._call = ""
        self._ids = ids or _call_id
        self._spacing, self._after_call = "", False
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while True:
            piece, progressed = self._step(final=False)
            if piece is not None:
                out.extend(piece)
            if not progressed:
                return self._hold_spacing(merge_texts(out))

    def _hold_spacing(self, pieces: list[Piece]) -> list[Piece]:
        """Whitespace after a call (between parallel calls, before the end) is framing, not
        content: held until real content follows, dropped if none does."""
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, Call):
                self._spacing, self._after_call = "", True
            elif not p.reasoning and self._after_call:
                if not p.text.strip():
                    self._spacing += p.text
                    continue
                p, self._spacing, self._after_call = Text(self._spacing + p.text), "", False
            out.append(p)
        return out

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
        self._buffer, self._call = "", ""
        return self._hold_spacing(merge_texts(out))

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
                self._call = ""
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

    def _in_call(self, final: bool) -> tuple[list[Piece] | None, bool]:
        end = self.fmt.end
        if not end:  # the call runs to the end of the reply
            self._call += self._buffer
            self._buffer = ""
            return None, False
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
            return None, False
        text, self._buffer = self._call + self._buffer[:at], self._buffer[at + len(end):]
        self._mode, self._call = "content", ""
        return self._close_call(text, ended=False), True

    def _parses(self, text: str) -> bool:
        try:
            self.fmt.parse(text, self.tools)
        except Exception:  # noqa: BLE001 (any parse failure: not the end of the call yet)
            return False
        return True

    def _close_call(self, text: str, ended: bool) -> list[Piece]:
        self._mode = "content"
        try:
            parsed = self.fmt.parse(text, self.tools)
        except Exception as exc:  # cut short or malformed: keep it as text
            log.info("tool call did not parse (%s: %s)", type(exc).__name__, exc)
            return [Text(self.fmt.start + text + ("" if ended else self.fmt.end))]
        calls = parsed if isinstance(parsed, list) else [parsed]
        out: list[Piece] = []
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return [Text(self.fmt.start + text + ("" if ended else self.fmt.end))]
            args = call.get("arguments", {})
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out.append(Call(call["name"], args, call.get("id") or self._ids()))
        self.calls += len(out)
        return out


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
