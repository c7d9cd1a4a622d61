"""Tool calls without a model: each family's call text parsed into exact calls, streamed in
any chunking, rendered back into prompts, and forced by grammars that accept exactly the
calls a tool's schema allows."""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest

from kvserve.server.http.conversation import hermes_call_text, render_messages
from kvserve.server.http.structured import StructureError, response_format_grammar, tool_call_grammar
from kvserve.server.http.tools import Call, ReplySplitter, Text, ToolFormat, merge_texts

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "days": {"type": "integer", "minimum": 1}},
                          "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def mlx_lm_format(parser: str) -> ToolFormat:
    """The format ``ToolFormat.of`` builds for a tokenizer whose template mlx-lm maps to ``parser``."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    tokenizer = SimpleNamespace(has_tool_calling=True, tool_parser=module.parse_tool_call,
                                tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end,
                                chat_template="")
    return ToolFormat.of(tokenizer)


def template_format(template: str) -> ToolFormat:
    """The format of a template mlx-lm does not parse (``tool_formats.py``)."""
    return ToolFormat.of(SimpleNamespace(has_tool_calling=False, chat_template=template))


# (format, model output, expected content, expected calls as (name, arguments))
REPLIES = {
    "hermes": (lambda: mlx_lm_format("json_tools"),
               'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
               "Checking.", [("get_weather", {"city": "Paris", "days": 2})]),
    "hermes-parallel": (lambda: mlx_lm_format("json_tools"),
                        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>',
                        "", [("get_time", {}), ("get_weather", {"city": "Oslo", "days": 1})]),
    "mistral": (lambda: mlx_lm_format("mistral"),
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}',
                "", [("get_weather", {"city": "Rome", "days": 3})]),
    "mistral-json-list": (lambda: mlx_lm_format("mistral"),
                          '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}]',
                          "", [("get_time", {}), ("get_weather", {"city": "Rome", "days": 1})]),
    "pythonic-lfm2": (lambda: mlx_lm_format("pythonic"),
                      'Sure. <|tool_call_start|>[get_weather(city="Lima", days=4)]<|tool_call_end|>',
                      "Sure. ", [("get_weather", {"city": "Lima", "days": 4})]),
    "qwen3-coder-xml": (lambda: mlx_lm_format("qwen3_coder"),
                        "<tool_call>\n<function=get_weather>\n<parameter=city>\nKyiv\n</parameter>\n"
                        "<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>",
                        "", [("get_weather", {"city": "Kyiv", "days": 5})]),
    "gemma4": (lambda: mlx_lm_format("gemma4"),
               '<|tool_call>call:get_weather{city:<|"|>Bern<|"|>,days:2}<tool_call|>',
               "", [("get_weather", {"city": "Bern", "days": 2})]),
    "function-gemma": (lambda: mlx_lm_format("function_gemma"),
                       "<start_function_call>call:get_weather{city:<escape>Nice<escape>,days:1}<end_function_call>",
                       "", [("get_weather", {"city": "Nice", "days": 1})]),
    "llama3-json": (lambda: template_format("{{ '<|python_tag|>' }} Given the following functions"),
                    '{"name": "get_weather", "parameters": {"city": "Quito", "days": 2}}',
                    "", [("get_weather", {"city": "Quito", "days": 2})]),
    "gpt-oss-harmony": (lambda: template_format("<|channel|>commentary to=functions.{{ name }}"),
                        "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
                        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Lagos", "days": 1}',
                        "", [("get_weather", {"city": "Lagos", "days": 1})]),
}


def split(fmt: ToolFormat, text: str, size: int) -> list:
    splitter = ReplySplitter(fmt, [WEATHER, TIME])
    pieces = []
    for i in range(0, len(text), size):
        pieces += splitter.feed(text[i:i + size])
    return pieces + splitter.finish()


def summary(pieces: list) -> tuple[str, list]:
    content = "".join(p.text for p in pieces if isinstance(p, Text) and not p.reasoning)
    return content, [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, Call)]


@pytest.mark.parametrize("case", sorted(REPLIES))
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_each_format_parses_to_the_exact_calls_in_any_chunking(case, size):
    make, text, content, calls = REPLIES[case]
    assert summary(split(make(), text, size)) == (content, calls)


def test_format_names_follow_the_template():
    assert [mlx_lm_format(p).name for p in ("json_tools", "qwen3_coder", "mistral")] == \
        ["json_tools", "qwen3_coder", "mistral"]
    assert template_format("{{ messages }}").name == "json_tools"  # no tool calling: Hermes in the prompt
    assert not template_format("{{ messages }}").native


def test_harmony_reasoning_and_final_channel_split():
    fmt = REPLIES["gpt-oss-harmony"][0]()
    pieces = split(fmt, "<|channel|>analysis<|message|>Easy one.<|end|><|start|>assistant"
                        "<|channel|>final<|message|>It is 18 C.", 4)
    assert merge_texts(pieces) == [Text("Easy one.", reasoning=True), Text("It is 18 C.")]


def test_think_blocks_become_reasoning_and_an_open_block_continues():
    splitter = ReplySplitter(None, think=("<think>", "</think>"))
    assert splitter.feed("<think>Let me") + splitter.feed(" see.</thi") + splitter.feed("nk>Yes.") \
        + splitter.finish() == [Text("Let me", True), Text(" see.", True), Text("Yes.")]
    opened = ReplySplitter(None, think=("<think>", "</think>"), thinking=True)
    assert opened.feed("hmm</think>ok") + opened.finish() == [Text("hmm", True), Text("ok")]


def test_without_markers_text_goes_out_as_it_comes():
    splitter = ReplySplitter(None)
    assert splitter.feed("Hel") == [Text("Hel")] and splitter.feed("lo") == [Text("lo")] and splitter.finish() == []


def test_a_call_cut_short_comes_back_as_text():
    fmt = ToolFormat.hermes()
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert split(fmt, text, 5) == [Text(text)]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_an_end_marker_inside_a_string_does_not_end_the_call(size):
    """A forced call's string may hold the end marker (a sampled reply held
    "Paris}}</tool_call>  # in"): the call ends at the marker after which it parses."""
    args = {"city": "Paris}}</tool_call>  # in", "days": 2}
    text = f'<tool_call>\n{json.dumps({"name": "get_weather", "arguments": args})}\n</tool_call> Done.'
    assert summary(split(ToolFormat.hermes(), text, size)) == (" Done.", [("get_weather", args)])


def test_a_call_that_never_parses_comes_back_as_text_whole():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }</tool_call> more'
    assert merge_texts(split(ToolFormat.hermes(), text, 3)) == [Text(text)]


def test_text_that_only_looks_like_a_marker_start_is_released():
    assert merge_texts(split(ToolFormat.hermes(), "a < b and <tool is not a tag", 2)) == [Text("a < b and <tool is not a tag")]


# --- prompts ---

def test_a_template_without_tools_gets_them_in_the_system_prompt_and_calls_as_text():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
                {"role": "tool", "tool_call_id": "c2", "content": "19 C"}]
    out = render_messages(messages, [WEATHER], ToolFormat.hermes())
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == hermes_call_text("get_weather", {"city": "Paris", "days": 1})
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n19 C\n</tool_response>"


THINKING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
                     "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")


# Unset, mlx-lm's tokenizer wrapper passes ``enable_thinking`` = whether the tokenizer has
# reasoning markers (the default model's has none).
@pytest.mark.parametrize("fields, closed", [({}, True), ({"reasoning_effort": "none"}, True),
                                            ({"reasoning_effort": "high"}, False),
                                            ({"chat_template_kwargs": {"enable_thinking": False}}, True),
                                            ({"reasoning_effort": "none",
                                              "chat_template_kwargs": {"enable_thinking": True}}, False)])
def test_reasoning_fields_reach_the_chat_template(default_model_dir, fields, closed):
    """``reasoning_effort`` and ``chat_template_kwargs`` become the template's keyword
    arguments (a Qwen3-style template closes its think block when told not to think);
    ``chat_template_kwargs`` wins where both say something."""
    from mlx_lm.tokenizer_utils import load

    from kvserve.server.http.app import openai_chat
    from kvserve.server.http.chat import prepare_chat
    from kvserve.server.http.schemas import ChatCompletionRequest

    tokenizer = load(default_model_dir)
    tokenizer._tokenizer.chat_template = THINKING_TEMPLATE
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    text = tokenizer.decode(prepare_chat(openai_chat(body), tokenizer).tokens)
    assert text.endswith("<assistant><think></think>") == closed, text


def test_a_native_template_gets_the_messages_as_they_are():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert render_messages(messages, [WEATHER], mlx_lm_format("json_tools")) == \
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]


# --- grammars ---

@pytest.fixture(scope="module")
def grammars(default_model_dir):
    from mlx_lm.tokenizer_utils import load

    from kvserve.server.engine.grammar import Grammars

    return Grammars(load(default_model_dir), 49152)


def accepts(grammars, grammar, text: str) -> bool:
    """Whether the grammar's matcher takes the tokens of ``text`` and can then end."""
    row = grammars.matcher(grammar)
    tokens = grammars.tokenizer.tokenize_str(text)
    return row.matcher.try_consume_tokens(tokens) == len(tokens) and row.matcher.is_accepting()


def test_a_named_tool_choice_accepts_its_calls_only(grammars):
    g = tool_call_grammar(ToolFormat.hermes(), [WEATHER, TIME],
                          {"type": "function", "function": {"name": "get_weather"}}, parallel=False)
    grammars.check(g)
    assert accepts(grammars, g, hermes_call_text("get_weather", {"city": "Paris", "days": 2}))
    assert not accepts(grammars, g, hermes_call_text("get_weather", {"city": "Paris"}))  # days required
    assert not accepts(grammars, g, hermes_call_text("get_weather", {"city": "Paris", "days": 0}))  # minimum 1
    assert not accepts(grammars, g, hermes_call_text("get_time", {}))
    two = hermes_call_text("get_weather", {"city": "A", "days": 1}) + "\n" + hermes_call_text("get_weather", {"city": "B", "days": 1})
    assert not accepts(grammars, g, two)  # parallel calls off
    parallel = tool_call_grammar(ToolFormat.hermes(), [WEATHER, TIME], "required", parallel=True)
    assert accepts(grammars, parallel, two) and accepts(grammars, parallel, hermes_call_text("get_time", {}))


def test_forced_calls_in_formats_without_a_grammar_are_refused():
    """Every format mlx-lm parses has a grammar (tests/test_forced_calls.py); a parser it
    adds later does not until one is written."""
    unknown = ToolFormat("new_parser", "<call>", "</call>", lambda text, tools: {}, True)
    with pytest.raises(StructureError, match="new_parser.*cannot be forced"):
        tool_call_grammar(unknown, [WEATHER], "required", True)
    assert tool_call_grammar(unknown, [WEATHER], "auto", True) is None


def test_response_formats(grammars):
    assert response_format_grammar(None) is None and response_format_grammar({"type": "text"}) is None
    obj = response_format_grammar({"type": "json_object"})
    assert accepts(grammars, obj, '{"a": [1, 2]}') and not accepts(grammars, obj, "[1]")
    schema = {"type": "object", "properties": {"n": {"type": "string", "enum": ["x", "y"]}}, "required": ["n"]}
    g = response_format_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert accepts(grammars, g, '{"n": "x"}') and not accepts(grammars, g, '{"n": "z"}')
    assert not accepts(grammars, g, '{"n":"x"}')  # one spacing: what json.dumps writes


def test_a_schema_that_cannot_compile_names_the_reason(grammars):
    from kvserve.server.engine.grammar import GrammarError

    g = response_format_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}})
    with pytest.raises(GrammarError, match="cannot compile the json schema"):
        grammars.check(g)
