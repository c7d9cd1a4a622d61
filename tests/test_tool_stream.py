"""Tool calls followed as they are written, without a model: the reply splitter fed one
token (or one character) at a time in streaming mode, and the OpenAI, Anthropic and
Responses stream shapes built from its pieces. The end-to-end counterparts, with the real
model behind the real server and the official clients, are in test_structured_output.py,
test_anthropic.py and test_responses.py."""

from __future__ import annotations

import json
import re

import pytest
from test_tools import REPLIES, TIME, WEATHER, mlx_lm_format, template_format

from kvserve.server.engine.request import FinishReason, TokenEvent
from kvserve.server.http.anthropic.replies import _Blocks
from kvserve.server.http.responses.items import OutputItems
from kvserve.server.http.streams import _split_chunks
from kvserve.server.http.tool_stream import Args, End, JsonLexer, Start, extractor_for
from kvserve.server.http.tools import Call, CallArgs, CallCut, CallStart, ReplySplitter, Text, ToolFormat

# Replies with several calls in one region (Mistral and Llama 3 calls run to the reply's end).
REPLIES = {**REPLIES,
           "mistral-two-headers": (lambda: mlx_lm_format("mistral"), "[TOOL_CALLS]get_time[ARGS]{}"
                                   '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 1}', "", None),
           "llama3-two-calls": (REPLIES["llama3-json"][0], '{"name": "get_time", "parameters": {}}; '
                                '{"name": "get_weather", "parameters": {"days": 1}}', "", None)}
FOLLOWED = {"hermes", "hermes-parallel", "mistral", "mistral-json-list", "llama3-json", "gpt-oss-harmony",
            "mistral-two-headers", "llama3-two-calls"}


def stream(fmt: ToolFormat, parts: list[str]) -> tuple[list[list], ReplySplitter]:
    """The pieces each part brings (the last list: ``finish``), streaming mode."""
    splitter = ReplySplitter(fmt, [WEATHER, TIME], stream_calls=True, ids=iter(f"call_{i}" for i in range(9)).__next__)
    return [splitter.feed(p) for p in parts] + [splitter.finish()], splitter


def whole(fmt: ToolFormat, text: str) -> list:
    splitter = ReplySplitter(fmt, [WEATHER, TIME])
    return splitter.feed(text) + splitter.finish()


def chars(text: str) -> list[str]:
    return list(text)


def flat(chunks: list[list]) -> list:
    return [p for chunk in chunks for p in chunk]


def content(pieces: list) -> str:
    return "".join(p.text for p in pieces if isinstance(p, Text) and not p.reasoning)


def joined(pieces: list) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in pieces:
        if isinstance(p, CallArgs):
            out[p.id] = out.get(p.id, "") + p.text
    return out


def kinds(chunk: list) -> list[str]:
    return [type(p).__name__ for p in chunk if not (isinstance(p, Text) and not p.text)]


def complete(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def runs(pieces: list) -> list[str]:
    """The kinds of the pieces, a run of one kind as one."""
    return [k for i, k in enumerate(kinds(pieces)) if i == 0 or k != kinds(pieces)[i - 1]]


# ---- the splitter ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(REPLIES))
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_streamed_reply_has_the_calls_and_content_of_the_whole_one(case, size):
    """Every format, any chunking: the same calls (exact arguments text) and content as the
    reply split whole; a followed format streams each call and its pieces join to the call's
    arguments; the others bring each call whole."""
    make, text, _, _ = REPLIES[case]
    fmt = make()
    chunks, splitter = stream(fmt, [text[i:i + size] for i in range(0, len(text), size)])
    pieces, reference = flat(chunks), whole(fmt, text)
    calls = [p for p in pieces if isinstance(p, Call)]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in reference if isinstance(c, Call)]
    assert content(pieces) == content(reference)
    assert all(c.streamed for c in calls) == (case in FOLLOWED) and splitter.called
    assert joined(pieces) == {c.id: c.arguments for c in calls if c.streamed}
    starts = [p for p in pieces if isinstance(p, CallStart)]
    assert [(s.name, s.id, s.index) for s in starts] == [(c.name, c.id, c.index) for c in calls if c.streamed]
    assert [c.index for c in calls] == list(range(len(calls)))


def test_the_deltas_of_a_hermes_call_token_by_token():
    """The name goes out with the first argument byte, in the token that opens the arguments;
    each later token's argument text in that token's chunk (a number waits for the character
    after it); the call completes at its end marker."""
    tokens = ["Sure", ".", "<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_weather", '",', ' "',
              "arguments", '":', ' {"', "city", '":', ' "', "Par", "is", '",', ' "', "days", '":', " ", "2",
              "}}", "\n", "</tool_call>"]
    chunks, splitter = stream(ToolFormat.hermes(), tokens)
    at = tokens.index(' {"')
    assert [kinds(c) for c in chunks[:at]] == [["Text"], ["Text"]] + [[]] * (at - 2)
    assert chunks[at] == [CallStart("get_weather", "call_0", 0), CallArgs("call_0", '{"', 0)]
    args = [c[0].text if c else None for c in chunks[at + 1:-3]]  # spaced as json.dumps spaces
    assert args == ["city", '": ', '"', "Par", "is", '", ', '"', "days", '": ', None, None, "2}"]
    assert chunks[-4] == [CallArgs("call_0", "2}", 0)]  # the number, once "}" ends it
    assert chunks[-3:] == [[], [Call("get_weather", '{"city": "Paris", "days": 2}')], []]
    assert chunks[-2][0].streamed and splitter.called


@pytest.mark.parametrize("case", sorted(FOLLOWED))
def test_argument_text_goes_out_in_the_chunk_that_brings_it(case):
    """One character per chunk: the call starts in the chunk of the ``{`` that opens its
    arguments, and after every chunk the arguments sent are all those received but a number
    or literal still being written, give or take the space json.dumps writes after a ``:`` or
    ``,`` (the examples are spelled as json.dumps writes them)."""
    make, text, _, _ = REPLIES[case]
    chunks, _ = stream(make(), chars(text))
    starts = [i for i, chunk in enumerate(chunks) for p in chunk if isinstance(p, CallStart)]
    for i in starts:
        assert text[i] == "{" and kinds(chunks[i])[:2] == ["CallStart", "CallArgs"]
        assert chunks[i][1].text == "{"
    sent, open_at = "", None
    for i, chunk in enumerate(chunks[:-1]):
        for p in chunk:
            if isinstance(p, CallStart):
                sent, open_at = "", i
            elif isinstance(p, CallArgs):
                sent += p.text
        if open_at is not None:
            received = text[open_at:i + 1]
            ahead = sent[:-1] if sent.endswith(" ") and received.endswith((":", ",")) else sent
            assert received.startswith(ahead) and re.fullmatch(r"[0-9a-z.\-]*", received[len(ahead):]), (i, sent)
            if received == ahead and complete(sent):
                open_at = None  # the arguments are out: what follows is the call's framing


def test_a_call_that_cannot_be_followed_comes_whole_as_before():
    """The arguments before the name, arguments written as a string, a list of calls in one
    tag: nothing is streamed; each call comes whole when its tag closes."""
    fmt = ToolFormat.hermes()
    for body in ['{"arguments": {"city": "Oslo"}, "name": "get_time"}', '{"name": "get_time", "arguments": "{}"}',
                 '[{"name": "get_time", "arguments": {}}]']:
        text = f"<tool_call>\n{body}\n</tool_call>"
        chunks, splitter = stream(fmt, chars(text))
        (call,) = [c for c in chunks if c]
        assert kinds(call) == ["Call"] and not call[0].streamed and chunks[len(text) - 1] == call
        assert call == whole(fmt, text) and splitter.called


# ---- calls that do not complete ----------------------------------------------------------------

def test_a_streamed_call_cut_by_max_tokens_is_cut_and_its_text_is_content():
    """What was streamed stays streamed; the call is cut, its text follows as content (as the
    whole reply has it), and the reply does not count as calling (finish: length or stop)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    chunks, splitter = stream(ToolFormat.hermes(), chars(text))
    pieces = flat(chunks)
    assert kinds(pieces)[:2] == ["CallStart", "CallArgs"] and joined(pieces) == {"call_0": '{"city": "Par'}
    assert chunks[-1] == [CallCut("call_0", 0), Text(text)]
    assert content(pieces) == content(whole(ToolFormat.hermes(), text)) == text
    assert (splitter.calls, splitter.cut, splitter.called) == (0, 1, False)


def test_a_call_cut_before_its_arguments_begin_streams_nothing():
    text = '<tool_call>\n{"name": "get_weather", "argu'
    chunks, splitter = stream(ToolFormat.hermes(), chars(text))
    assert flat(chunks) == [Text(text)] and not splitter.cut


def test_a_streamed_call_whose_json_breaks_after_its_arguments_is_cut():
    """The arguments closed, then the call went wrong: it never parses, so it is no call."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {}, }\n</tool_call> ok'
    chunks, splitter = stream(ToolFormat.hermes(), chars(text))
    assert runs(flat(chunks)) == ["CallStart", "CallArgs", "CallCut", "Text"]
    assert content(flat(chunks)) == text and not splitter.called


def test_a_call_whose_parse_disagrees_with_what_was_streamed_is_cut():
    text = '<tool_call>\n{"name": "get_time", "arguments": {}, "arguments": {"city": "Rome"}}\n</tool_call>'
    chunks, splitter = stream(ToolFormat.hermes(), chars(text))
    assert runs(flat(chunks)) == ["CallStart", "CallArgs", "CallCut", "Text"] and not splitter.called


def test_a_run_to_the_end_format_keeps_its_complete_calls_when_a_later_one_is_cut():
    """Llama 3: a call completes when its JSON closes; the one cut after it is content."""
    fmt = REPLIES["llama3-json"][0]()
    first = '{"name": "get_time", "parameters": {}}'
    text = first + '; {"name": "get_weather", "parameters": {"city": "Li'
    chunks, splitter = stream(fmt, chars(text))
    at = len(first) - 1  # the call's closing brace completes it, before the reply ends
    assert chunks[at - 1:at + 1] == [[CallArgs("call_0", "}", 0)], [Call("get_time", "{}")]]
    assert chunks[-1] == [CallCut("call_1", 1), Text('; {"name": "get_weather", "parameters": {"city": "Li')]
    assert joined(flat(chunks))["call_1"] == '{"city": "Li' and (splitter.calls, splitter.cut) == (1, 1)


def test_a_harmony_call_cut_short_is_cut():
    fmt = REPLIES["gpt-oss-harmony"][0]()
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "La'
    chunks, splitter = stream(fmt, chars(text))
    assert runs(flat(chunks)) == ["CallStart", "CallArgs", "CallCut", "Text"]
    assert flat(chunks)[0] == CallStart("get_weather", "call_0", 0) and not splitter.called


# ---- the extractor ---------------------------------------------------------------------------

def test_the_arguments_stream_in_json_dumps_spelling_whatever_the_model_wrote():
    """Spacing, escapes, surrogate pairs, numbers: the pieces join to what json.dumps writes
    of the parsed arguments, the text an unstreamed reply carries."""
    args = '{ "a" :[1.50 ,-0, 1E2,true,null],"\\u00e9\\/":"x\\ud83d\\ude00\\n\\"y","b":{ } }'
    text = '{"name":"f","arguments":' + args + '}'
    x = extractor_for("json_tools")()
    events = [e for ch in text for e in x.feed(ch)]
    assert events[0] == Start("f") and events[-1] == End(True, len(text))
    pieces = "".join(e.text for e in events if isinstance(e, Args))
    assert pieces == json.dumps(json.loads(args), ensure_ascii=False)
    assert pieces == '{"a": [1.5, 0, 100.0, true, null], "é/": "x😀\\n\\"y", "b": {}}'


@pytest.mark.parametrize("bad", ['{"a" 1}', '{"a": 1,}', '{"a": tru}', '{"a": "x\\q"}', '{"a": 01}',
                                 '{"a": "\x01"}', '{"a":: 1}', '{"a": 1 "b": 2}', '{"a": "\\u12g4"}'])
def test_json_that_json_loads_refuses_is_flagged(bad):
    with pytest.raises(ValueError):
        json.loads(bad)
    assert any(t.bad for t in JsonLexer().feed(bad))


def test_a_long_string_argument_is_one_piece_per_feed_and_nothing_is_reread():
    """Each feed's characters are lexed once: the 5,000th piece of a long string goes out as
    the first did, by itself (nothing before it is parsed again, nothing waits)."""
    splitter = ReplySplitter(ToolFormat.hermes(), stream_calls=True)
    assert kinds(splitter.feed('<tool_call>\n{"name": "f", "arguments": {"text": "')) == ["CallStart", "CallArgs"]
    assert all([p.text for p in splitter.feed("abc ")] == ["abc "] for _ in range(5000))
    end, call = splitter.feed('"}}\n</tool_call>')
    assert end.text == '"}' and call.arguments == '{"text": "' + "abc " * 5000 + '"}' and call.streamed


# ---- the stream shapes -------------------------------------------------------------------------

HERMES_TOKENS = ["<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_time", '",', ' "', "arguments", '":',
                 ' {"', "city", '":', ' "', "Rome", '"}}', "\n", "</tool_call>"]


def events_of(tokens: list[str], reason: FinishReason = FinishReason.STOP) -> list[TokenEvent]:
    return [TokenEvent("r", t) for t in tokens[:-1]] + [TokenEvent("r", tokens[-1], finish_reason=reason)]


def test_openai_chunks_carry_the_call_as_openai_streams_one():
    splitter = ReplySplitter(ToolFormat.hermes(), stream_calls=True, ids=lambda: "call_1")
    deltas = [c for e in events_of(HERMES_TOKENS) for c in _split_chunks(splitter, 0, e, None)]
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    assert deltas[0]["delta"] == {"tool_calls": [first]}
    pieces = [d["delta"]["tool_calls"][0]["function"]["arguments"] for d in deltas[1:-1]]
    assert pieces == ['{"', "city", '": ', '"', "Rome", '"}'] and "".join(pieces) == '{"city": "Rome"}'
    assert all(set(d["delta"]["tool_calls"][0]) == {"index", "function"} for d in deltas[1:-1])
    assert (deltas[-1]["delta"], deltas[-1]["finish_reason"]) == ({}, "tool_calls")


def test_an_openai_stream_whose_call_is_cut_ends_with_its_text_and_length():
    splitter = ReplySplitter(ToolFormat.hermes(), stream_calls=True, ids=lambda: "call_1")
    cut = HERMES_TOKENS[:16]
    deltas = [c for e in events_of(cut, FinishReason.LENGTH) for c in _split_chunks(splitter, 0, e, None)]
    assert [list(d["delta"]) for d in deltas] == [["tool_calls"]] * 5 + [["content"], []]
    assert deltas[-2]["delta"]["content"] == "".join(cut) and deltas[-1]["finish_reason"] == "length"


def test_anthropic_events_open_the_block_then_stream_partial_json():
    splitter, blocks = ReplySplitter(ToolFormat.hermes(), stream_calls=True, ids=lambda: "call_1"), _Blocks()
    lines = [line for t in HERMES_TOKENS for p in splitter.feed(t) for line in blocks.add(p)]
    lines += [line for p in splitter.finish() for line in blocks.add(p)] + blocks.close()
    data = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert [d["type"] for d in data] == ["content_block_start"] + ["content_block_delta"] * 6 + ["content_block_stop"]
    assert data[0]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}
    assert json.loads("".join(d["delta"]["partial_json"] for d in data[1:-1])) == {"city": "Rome"}


def test_responses_events_stream_the_arguments_and_a_cut_call_ends_incomplete():
    out, splitter = OutputItems(), ReplySplitter(ToolFormat.hermes(), stream_calls=True, ids=lambda: "call_1")
    events = [e for t in HERMES_TOKENS for p in splitter.feed(t) for e in out.add(p)]
    assert [e["type"] for e in events] == ["response.output_item.added"] + \
        ["response.function_call_arguments.delta"] * 6 + ["response.function_call_arguments.done",
                                                          "response.output_item.done"]
    assert "".join(e["delta"] for e in events[1:7]) == events[7]["arguments"] == '{"city": "Rome"}'
    assert events[-1]["item"]["status"] == "completed"
    cut, splitter = OutputItems(), ReplySplitter(ToolFormat.hermes(), stream_calls=True, ids=lambda: "call_2")
    events = [e for t in HERMES_TOKENS[:16] for p in splitter.feed(t) for e in cut.add(p)]
    events += [e for p in splitter.finish() for e in cut.add(p)] + cut.finish("incomplete")
    assert [(i["type"], i["status"]) for i in cut.items] == [("function_call", "incomplete"), ("message", "incomplete")]
    assert cut.items[1]["content"][0]["text"] == "".join(HERMES_TOKENS[:16])


def test_llama3_is_followed_from_its_start_marker():
    """Llama 3's start marker is the call's own first JSON (``{"name"``)."""
    fmt = template_format("{{ '<|python_tag|>' }} Given the following functions")
    chunks, _ = stream(fmt, ['{"name"', ': "get_time"', ', "parameters": {', "}}"])
    assert chunks[2] == [CallStart("get_time", "call_0", 0), CallArgs("call_0", "{", 0)]
    assert chunks[3] == [CallArgs("call_0", "}", 0), Call("get_time", "{}")]
