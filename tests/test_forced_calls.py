"""Forced tool calls in every call format, without a model: one tokenizer (the default
model's, with every family's markers added as the family's tokenizer has them), each
format as ``ToolFormat.of`` builds it from mlx-lm's parser or the chat template, the grammar
``tool_choice`` builds, and tokens drawn at random under its mask until the grammar allows
only the end of the reply. Whatever is drawn, the text parses with the format's own parser
into the forced call, with arguments that match the tool's schema, and nothing after it."""

from __future__ import annotations

import importlib
import json
import random
import shutil
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

from kvserve.server.http.structured import StructureError, tool_call_grammar
from kvserve.server.http.tool_grammars import forceable
from kvserve.server.http.tools import Call, ReplySplitter, Text, ToolFormat

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "hourly": {"type": "boolean"}},
    "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
# Arrays, objects, a union and an enum of numbers: JSON values even where arguments are text.
PLAN = {"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 2},
    "at": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "label": {"type": "string", "maxLength": 4}},
           "required": ["x"], "additionalProperties": False},
    "level": {"type": "integer", "enum": [1, 2, 3]},
    "note": {"type": ["string", "null"], "maxLength": 5}},
    "required": ["tags", "at", "level"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SAMPLES = 20

# family: (mlx-lm's parser for its template, or None where kvserve's own applies; what the
# template holds that tells the format or its dialect)
FAMILIES: dict[str, tuple[str | None, str]] = {
    "json_tools": ("json_tools", ""),
    "qwen3_coder": ("qwen3_coder", ""),
    "mistral": ("mistral", "[TOOL_CALLS]"),
    "mistral:args": ("mistral", "[TOOL_CALLS]{{ name }}[ARGS]"),
    "pythonic": ("pythonic", ""),
    "gemma4": ("gemma4", ""),
    "function_gemma": ("function_gemma", ""),
    "glm47": ("glm47", ""),
    "laguna": ("laguna", ""),  # mlx-lm's Laguna parser is GLM's: the format is glm47
    "longcat": ("longcat", ""),
    "kimi_k2": ("kimi_k2", ""),
    "kimi_k3": ("kimi_k3", ""),
    "minimax_m2": ("minimax_m2", ""),
    "minicpm5": ("minicpm5", ""),
    "muse_spark": ("muse_spark", ""),
    "harmony": (None, "<|channel|>commentary to=functions."),
    "llama3_json": (None, "<|python_tag|> Given the following functions"),
}
FORMAT = {"laguna": "glm47"}
# Markers as the families' tokenizers hold them: added tokens, special or not (Qwen's
# <tool_call> is not special); MiniCPM5's and Muse Spark's are ordinary text.
ADDED = [("<tool_call>", False), ("</tool_call>", False), ("<longcat_tool_call>", False),
         ("</longcat_tool_call>", False)] + [(t, True) for t in (
             "[TOOL_CALLS]", "[ARGS]", "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_call>", "<tool_call|>",
             '<|"|>', "<start_function_call>", "<end_function_call>", "<escape>", "<arg_key>", "</arg_key>",
             "<arg_value>", "</arg_value>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
             "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|open|>", "<|close|>",
             "<|sep|>", "<minimax:tool_call>", "</minimax:tool_call>", "<|start|>", "<|end|>", "<|message|>",
             "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>", "<|python_tag|>", "<|eom_id|>")]
EOS = ("<|call|>", "<|eom_id|>")  # gpt-oss's and Llama's end-of-call tokens end the reply


@pytest.fixture(scope="module")
def marked(default_model_dir, tmp_path_factory):
    """The default model's tokenizer with every family's markers, as mlx-lm loads it, and
    its ``Grammars``."""
    from mlx_lm.tokenizer_utils import load
    from transformers import AutoTokenizer

    from kvserve.server.engine.grammar import Grammars

    folder = tmp_path_factory.mktemp("marked")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, folder / name)
    hf = AutoTokenizer.from_pretrained(folder)
    hf.add_tokens([t for t, special in ADDED if not special])
    hf.add_special_tokens({"additional_special_tokens": [t for t, special in ADDED if special]})
    hf.save_pretrained(folder)
    tokenizer = load(folder)
    for marker in EOS:
        tokenizer.add_eos_token(marker)
    return tokenizer, Grammars(tokenizer, len(tokenizer._tokenizer))


def family_format(tokenizer, family: str) -> ToolFormat:
    """The format ``ToolFormat.of`` builds for ``family``'s tokenizer."""
    parser, template = FAMILIES[family]
    if parser is None:
        return ToolFormat.of(SimpleNamespace(has_tool_calling=False, chat_template=template))
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    return ToolFormat.of(SimpleNamespace(has_tool_calling=True, tool_parser=module.parse_tool_call,
                                         tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end,
                                         chat_template=template))


@pytest.fixture(scope="module")
def families(marked):
    """family -> (tokenizer, Grammars, format)."""
    tokenizer, grammars = marked
    return lambda family: (tokenizer, grammars, family_format(tokenizer, family))


def draw(grammars, grammar, rng: random.Random, limit: int = 400) -> tuple[list[int], bool]:
    """Tokens drawn uniformly among those the grammar allows, until an end-of-sequence token
    (True) or ``limit`` tokens (False). Where the end is allowed beside other tokens (after
    a call, when more may follow) it is drawn half the time: drawn like any other token it
    would be one in thousands, and the calls would run on to the limit."""
    row = grammars.matcher(grammar)
    eos = sorted(grammars._eos)
    tokens: list[int] = []
    for _ in range(limit):
        mask = grammars.masks([row])[0]
        allowed, ends = np.flatnonzero(mask), [t for t in eos if mask[t]]
        token = ends[0] if ends and rng.random() < 0.5 else int(allowed[rng.randrange(len(allowed))])
        if token in eos:
            return tokens, True
        row.consume(token)
        tokens.append(token)
    return tokens, False


def detokenize(tokenizer, tokens: list[int]) -> str:
    """The reply's text as the server's detokenizer writes it."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def split(fmt: ToolFormat, text: str, tools: list[dict] = TOOLS) -> tuple[str, list[tuple[str, dict]]]:
    splitter = ReplySplitter(fmt, tools)
    pieces = splitter.feed(text) + splitter.finish()
    content = "".join(p.text for p in pieces if isinstance(p, Text) and not p.reasoning)
    return content, [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, Call)]


def sampled_calls(families, family: str, choice, parallel: bool, seed: int = 0, samples: int = SAMPLES,
                  tools: list[dict] = TOOLS):
    """The replies drawn under the grammar of ``choice``: (text, content, calls) each."""
    tokenizer, grammars, fmt = families(family)
    assert (fmt.name + (":" + fmt.dialect if fmt.dialect else "")) == FORMAT.get(family, family)
    grammar = tool_call_grammar(fmt, tools, choice, parallel, tokenizer)
    grammars.check(grammar)
    rng = random.Random(seed)
    out = []
    for _ in range(samples):
        tokens, ended = draw(grammars, grammar, rng)
        text = detokenize(tokenizer, tokens)
        assert ended, f"no end after {len(tokens)} tokens: {text!r}"
        out.append((text, *split(fmt, text, tools)))
    return out


def valid(name: str, arguments: dict) -> bool:
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in [*TOOLS, PLAN]}[name]
    jsonschema.validate(arguments, schema)
    return True


def test_every_family_is_covered():
    assert sorted({FORMAT.get(f, f).split(":")[0] for f in FAMILIES}) == forceable()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_named_choice_gives_one_valid_call_and_ends(families, family):
    """20 replies at random under the mask: each is exactly one call to the named tool, its
    arguments valid, no content, and the grammar ended it (parallel calls allowed: a named
    choice forces one all the same)."""
    replies = sampled_calls(families, family, NAMED, parallel=True)
    for text, content, calls in replies:
        assert content == "", text
        assert [name for name, _ in calls] == ["get_weather"], text
        assert valid(*calls[0]), text
    assert len({json.dumps(calls) for _, _, calls in replies}) > SAMPLES // 2  # sampled, not fixed


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_required_gives_calls_to_the_tools_and_ends(families, family):
    """``required`` with parallel calls: one or more calls (one where the format holds one
    per reply), each to one of the tools with valid arguments; without parallel calls
    exactly one."""
    replies = sampled_calls(families, family, "required", parallel=True, seed=1)
    for text, content, calls in replies:
        assert content == "" and calls, text
        assert all(valid(*call) for call in calls), text
    names = {name for _, _, calls in replies for name, _ in calls}
    assert names == {"get_weather", "get_time"}
    single = sampled_calls(families, family, "required", parallel=False, seed=2, samples=10)
    assert all(len(calls) == 1 for _, _, calls in single)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"function_gemma", "laguna"}))
def test_arrays_objects_and_unions_are_written_so_they_parse_back(families, family):
    """Where arguments are text, values that are not strings are written as JSON the parser
    reads back; a union ("string or null") is text the parser types as it reads it, so
    only its parse is certain, not its type."""
    plan = {"type": "function", "function": {"name": "plan"}}
    for text, content, calls in sampled_calls(families, family, plan, parallel=False, tools=[PLAN]):
        ((name, arguments),) = calls
        assert name == "plan" and content == "", text
        arguments.pop("note", None)
        assert valid(name, arguments), text


# --- exact texts ---

# One call to get_weather(city="Oslo", days=2) as each format writes it, and then a second
# call to get_time() after it (what only ``required`` with parallel calls allows).
EXAMPLES: dict[str, tuple[str, str]] = {
    "json_tools": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
                   '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                    "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
                None),
    "mistral:args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}', "[TOOL_CALLS]get_time[ARGS]{}"),
    "pythonic": ('<|tool_call_start|>[get_weather(city="Oslo", days=2)]<|tool_call_end|>', None),
    "gemma4": ('<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|>',
               "<|tool_call>call:get_time{}<tool_call|>"),
    "function_gemma": ("<start_function_call>call:get_weather{city:<escape>Oslo<escape>,days:2}<end_function_call>",
                       "<start_function_call>call:get_time{}<end_function_call>"),
    "glm47": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>"
              "\n<arg_value>2</arg_value>\n</tool_call>", "\n<tool_call>get_time</tool_call>"),
    "longcat": ("<longcat_tool_call>get_weather<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>Oslo"
                "</longcat_arg_value><longcat_arg_key>days</longcat_arg_key><longcat_arg_value>2</longcat_arg_value>"
                "</longcat_tool_call>", '\n<longcat_tool_call>{"name": "get_time", "arguments": {}}</longcat_tool_call>'),
    "kimi_k2": ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Oslo", "days": 2}<|tool_call_end|><|tool_calls_section_end|>', None),
    "kimi_k3": ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>json type="object"<|sep|>'
                '{"city": "Oslo", "days": 2}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>', None),
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
                   '<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>', None),
    "minicpm5": ('<function name="get_weather"><param name="city">Oslo</param><param name="days">2</param></function>',
                 '\n<function name="get_time"></function>'),
    "muse_spark": ('<atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">Oslo'
                   '</atem:parameter><atem:parameter name="days">2</atem:parameter></atem:invoke></atem:function_calls>',
                   None),
    "harmony": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "days": 2}',
                None),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
                    '; {"name": "get_time", "parameters": {}}'),
}


def accepts(tokenizer, grammars, grammar, text: str) -> bool:
    """The grammar takes the text, as the tokenizer encodes it, and then allows the end."""
    row = grammars.matcher(grammar)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return row.matcher.try_consume_tokens(tokens) == len(tokens) and row.matcher.is_accepting()


@pytest.mark.parametrize("family", sorted(EXAMPLES))
def test_each_format_takes_its_exact_call_text_and_nothing_more(families, family):
    tokenizer, grammars, fmt = families(family)
    one, more = EXAMPLES[family]
    named = tool_call_grammar(fmt, TOOLS, NAMED, True, tokenizer)
    assert accepts(tokenizer, grammars, named, one)
    assert split(fmt, one) == ("", [("get_weather", {"city": "Oslo", "days": 2})])
    assert not accepts(tokenizer, grammars, named, one.replace("Oslo", "Oslo is far too long"))  # maxLength 12
    required = tool_call_grammar(fmt, TOOLS, "required", True, tokenizer)
    if more is not None:  # formats that hold calls in one list: their second call is inside it
        assert not accepts(tokenizer, grammars, named, one + more)
        assert accepts(tokenizer, grammars, required, one + more)
        assert split(fmt, one + more)[1][1] == ("get_time", {})
        assert not accepts(tokenizer, grammars, tool_call_grammar(fmt, TOOLS, "required", False, tokenizer), one + more)


def test_markers_that_are_added_tokens_are_named_by_id():
    """llguidance takes every added token for a special one, which no quoted string matches:
    Qwen's <tool_call> (an added, not special, token) is written as its id."""
    from kvserve.server.http.tool_grammars import call_grammar

    lark = call_grammar("json_tools", "", [TIME["function"]], False, {"<tool_call>": 7, "</tool_call>": 8})
    assert 'call_2: <[7]> "\\n" json_1 "\\n" <[8]>' in lark.splitlines()


@pytest.mark.parametrize("family, tool, message", [
    ("pythonic", {"name": "f", "parameters": {"properties": {"class": {"type": "string"}}}},
     "'class' of 'f' is not a Python keyword argument"),
    ("function_gemma", {"name": "f", "parameters": {"properties": {"xs": {"type": "array"}}}},
     "cannot hold the argument 'xs' of 'f'"),
    ("gemma4", {"name": "get weather", "parameters": {}}, "the tool name 'get weather' cannot be written"),
    ("qwen3_coder", {"name": "f", "parameters": {"properties": {"a b": {"type": "string"}}}},
     "the argument name 'a b' cannot be written"),
])
def test_calls_a_format_cannot_write_are_refused_with_the_reason(family, tool, message):
    from mlx_lm.tool_parsers import function_gemma, gemma4, pythonic, qwen3_coder  # noqa: F401

    module = {"pythonic": pythonic, "function_gemma": function_gemma, "gemma4": gemma4, "qwen3_coder": qwen3_coder}
    fmt = ToolFormat(family, "", "", module[family].parse_tool_call, True)
    with pytest.raises(StructureError, match=message):
        tool_call_grammar(fmt, [{"type": "function", "function": tool}], "required", True)


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "<|im_start|>assistant\n<think>\n{# <tool_call> tool_call.name #}")


def test_a_prompt_that_opens_reasoning_gets_it_closed_before_the_call(default_model_dir, tmp_path):
    """A template that ends the prompt inside <think> (Qwen3 thinking): the forced reply
    closes the block first, or its call would be read as reasoning."""
    from mlx_lm.tokenizer_utils import load
    from transformers import AutoTokenizer

    from kvserve.server.engine.grammar import Grammars
    from kvserve.server.http.chat import ChatInput, prepare_chat

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    hf.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    hf.chat_template = THINKING_TEMPLATE
    hf.save_pretrained(tmp_path)
    tokenizer = load(tmp_path)
    grammars = Grammars(tokenizer, len(tokenizer._tokenizer))
    chat = prepare_chat(ChatInput([{"role": "user", "content": "Weather?"}], TOOLS, NAMED), tokenizer)
    assert chat.opens_thinking and chat.tool_format.name == "json_tools"
    rng = random.Random(3)
    for _ in range(5):
        tokens, ended = draw(grammars, chat.grammar, rng)
        text = detokenize(tokenizer, tokens)
        assert ended and text.startswith("</think><tool_call>\n{"), text
        splitter = chat.splitter()
        pieces = splitter.feed(text) + splitter.finish()
        assert [type(p) for p in pieces] == [Call] and pieces[0].name == "get_weather", pieces


# --- end to end: a tiny random model with a Qwen3-Coder template behind the server ---

CODER_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n{# <tool_call>\n<function= #}")


@pytest.fixture(scope="module")
def coder_server(tiny_model_dir, tmp_path_factory):
    """``kvserve serve`` (in this process) on the tiny llama whose template mlx-lm reads as
    Qwen3-Coder's (its markers ordinary text: the model's vocabulary stays as it is)."""
    from inprocess import InProcessServer

    folder = tmp_path_factory.mktemp("coder")
    shutil.copytree(tiny_model_dir, folder / "m")
    config = folder / "m" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": CODER_TEMPLATE}))
    server = InProcessServer(folder / "m", "--cache-dir", str(folder / "cache"))
    yield server.wait_ready()
    assert server.stop() == 0, server.output()


def test_forced_calls_end_with_the_call_through_both_apis(coder_server):
    """At temperature 1, parallel calls allowed: OpenAI's named choice ends "tool_calls"
    with one valid call; Anthropic's "tool" choice ends "tool_use" with one valid block;
    ``required`` (Anthropic's "any") without parallel calls gives exactly one."""
    import httpx

    from together import together

    url = coder_server.base_url
    ask = [{"role": "user", "content": "Weather in Oslo?"}]

    def openai(seed, choice, parallel=True):
        body = {"model": "default", "messages": ask, "tools": TOOLS, "tool_choice": choice, "temperature": 1.0,
                "seed": seed, "max_tokens": 150, "parallel_tool_calls": parallel}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]

    def anthropic(choice):
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
        body = {"model": "default", "messages": ask, "tools": tools, "tool_choice": choice, "max_tokens": 150}
        return httpx.post(f"{url}/v1/messages", json=body, timeout=120).json()

    named = together([lambda s=s: openai(s, NAMED) for s in range(6)])
    for choice in named:
        (call,) = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather", choice
        assert valid("get_weather", json.loads(call["function"]["arguments"]))
    single = openai(9, "required", parallel=False)
    assert single["finish_reason"] == "tool_calls" and len(single["message"]["tool_calls"]) == 1, single
    replies = together([lambda: anthropic({"type": "tool", "name": "get_weather"}) for _ in range(4)]
                       + [lambda: anthropic({"type": "any", "disable_parallel_tool_use": True})])
    for message in replies:
        blocks = [b for b in message["content"] if b["type"] == "tool_use"]
        assert message["stop_reason"] == "tool_use" and len(blocks) == 1, message
        assert valid(blocks[0]["name"], blocks[0]["input"])
    assert all(m["content"][0]["name"] == "get_weather" for m in replies[:4])
    cut = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": ask, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 16}).json()
    assert cut["choices"][0]["finish_reason"] == "length"  # the call's text so far, in Qwen3-Coder's form
    assert cut["choices"][0]["message"]["content"].startswith("<tool_call>\n<function=get_weather>\n")
