"""Anthropic's Messages API over HTTP: the real default model behind the real server, driven
by the official anthropic client (whose current version sends no sampling fields: the API's
default, temperature 1, applies; greedy requests pass temperature through extra_body)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from inprocess import InProcessServer
from together import together

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
FORCE = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("anthropic")
    # In this process (tests/inprocess.py): the routes' shapes are what is checked.
    proc = InProcessServer(default_model_dir, "--cache-dir", str(cache), "--kv-scheme", "fp16",
                         "--prompt-cache-dir", str(cache / "prompts"), "--served-model-name", "claude-*")
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def anthropic():
    """The official client's package, imported by the worker that runs this file: its import
    takes about 1.5 s of CPU, which every pytest-xdist worker would pay collecting the file."""
    import anthropic

    return anthropic


@pytest.fixture(scope="module")
def client(server, anthropic):
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)


def test_a_greedy_message_equals_the_openai_chat_reply(server, client):
    question = "Name a large city."
    message = client.messages.create(model="default", max_tokens=24, system="Be brief.",
                                     messages=[{"role": "user", "content": question}], **GREEDY)
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x").chat.completions.create(
        model="default", max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}])
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert message.stop_sequence is None
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert message.usage.cache_creation_input_tokens == 0
    assert message.id.startswith("msg_") and message.role == "assistant" and message.type == "message"
    assert message.model == httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]


def sse_kinds(server, body: dict, path: str = "/v1/messages", headers: dict | None = None) -> tuple[list[str], list[dict]]:
    """The event names of a raw streamed reply (pings left out) and their data."""
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, headers=headers, timeout=300) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert len(kinds) == len(data) and [d["type"] for d in data] == kinds  # each event names itself
    return [k for k in kinds if k != "ping"], [d for d in data if d["type"] != "ping"]


def test_the_stream_assembles_the_same_message_in_anthropics_event_order(server, client):
    kwargs = dict(model="default", max_tokens=20, messages=[{"role": "user", "content": "Say hello."}])
    whole = client.messages.create(**kwargs, **GREEDY)
    with client.messages.stream(**kwargs, **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in whole.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    kinds, data = sse_kinds(server, {**kwargs, "temperature": 0, "stream": True})
    deltas = kinds.count("content_block_delta")  # text streams as it is generated, not at the end
    assert deltas > 2 and kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]
    start = data[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert data[1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(d["delta"]["text"] for d in data[2:-3]) == whole.content[0].text
    assert data[-2]["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}


def forced(client, stream: bool = False, max_tokens: int = 120):
    kwargs = dict(model="default", max_tokens=max_tokens, messages=ASK, tools=TOOLS, tool_choice=FORCE)
    if not stream:
        return client.messages.create(**kwargs)  # temperature 1
    with client.messages.stream(**kwargs) as s:
        return s.get_final_message()


def check_call(message) -> None:
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER)


# A full batch (the default max_batch_size, 8) of sampled calls: the grammar, not the model,
# guarantees each one, so 8 check it as 20 did (three waves through the batch) at 40% of the
# decoding.
@pytest.mark.parametrize("stream, count", [(False, 8), (True, 6)], ids=["create", "stream"])
def test_a_forced_tool_always_gives_input_that_validates(client, stream, count):
    for message in together([lambda: forced(client, stream) for _ in range(count)]):
        check_call(message)


def test_a_streamed_tool_call_streams_its_input_as_it_is_written(server, client):
    """The ``tool_use`` block starts (``input: {}``) once the name is complete and the input
    has begun, then ``input_json_delta`` pieces as the model writes them; joined, they parse
    to the input of the unstreamed message for the same greedy request, as the official
    client's stream assembles it."""
    kwargs = dict(model="default", max_tokens=120, messages=ASK, tools=TOOLS, tool_choice=FORCE)
    whole = client.messages.create(**kwargs, **GREEDY)
    kinds, data = sse_kinds(server, {**kwargs, "temperature": 0, "stream": True})
    deltas = kinds.count("content_block_delta")
    assert deltas >= 6 and kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]
    block = data[1]["content_block"]
    assert block["type"] == "tool_use" and block["input"] == {} and block["name"] == "get_weather"
    assert {d["delta"]["type"] for d in data[2:-3]} == {"input_json_delta"}
    streamed = json.loads("".join(d["delta"]["partial_json"] for d in data[2:-3]))
    assert streamed == whole.content[0].input and data[-2]["delta"]["stop_reason"] == whole.stop_reason == "tool_use"
    with client.messages.stream(**kwargs, **GREEDY) as stream:
        assert stream.get_final_message().content[0].input == whole.content[0].input


def test_a_streamed_tool_call_cut_by_max_tokens_ends_as_text(server, client):
    """Cut inside its input: the ``tool_use`` block stops where the input stopped, the call's
    text follows as a text block (the text of the unstreamed message), and the stop reason is
    ``max_tokens``."""
    kwargs = dict(model="default", messages=ASK, tools=TOOLS, tool_choice=FORCE)
    tokens = client.messages.create(**kwargs, max_tokens=120, **GREEDY).usage.output_tokens
    whole = client.messages.create(**kwargs, max_tokens=tokens // 2, **GREEDY)
    (text,) = whole.content
    assert whole.stop_reason == "max_tokens" and '"arguments": {"' in text.text  # cut inside the input
    kinds, data = sse_kinds(server, {**kwargs, "max_tokens": tokens // 2, "temperature": 0, "stream": True})
    deltas = kinds.count("content_block_delta") - 1
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas, "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert data[1]["content_block"]["type"] == "tool_use" and data[-4]["delta"] == {"type": "text_delta",
                                                                                    "text": text.text}
    assert data[-2]["delta"]["stop_reason"] == "max_tokens"


def test_a_tool_result_round_trip_is_answered_and_reuses_the_cached_turn(client):
    first = forced(client)
    call = next(b for b in first.content if b.type == "tool_use")
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    second = client.messages.create(model="default", max_tokens=24, messages=history, tools=TOOLS, **GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    assert second.content[0].text.strip()
    total_first = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > total_first  # the first prompt and part of the call


def test_count_tokens_equals_the_prompt_of_the_same_request_and_a_repeat_reads_the_cache(client):
    # As Anthropic counts, input_tokens leaves out the prompt tokens read from the cache.
    kwargs = dict(model="default", system="You forecast weather tersely.", messages=ASK, tools=TOOLS)
    counted = client.messages.count_tokens(**kwargs).input_tokens
    first = client.messages.create(max_tokens=4, **kwargs, **GREEDY).usage
    assert first.input_tokens + first.cache_read_input_tokens == counted
    assert first.input_tokens > counted // 2  # only the template's opening can have been cached
    again = client.messages.create(max_tokens=4, **kwargs, **GREEDY).usage
    assert again.input_tokens + again.cache_read_input_tokens == counted
    assert again.cache_read_input_tokens == counted - 1  # all of it: the last token is always computed
    assert client.messages.count_tokens(model="default", messages=ASK).input_tokens < counted  # tools count


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 50}, {"type": "adaptive"},
                                      {"type": "disabled"}])
def test_thinking_is_accepted_and_a_model_without_reasoning_answers_as_without(client, thinking):
    """Claude Code sends ``thinking`` when the user turns it on, and its past thinking blocks
    back: the default model has no reasoning, so the reply is the one without thinking."""
    history = [{"role": "user", "content": "Hi."},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "A greeting.", "signature": "s"},
                                                 {"type": "text", "text": "Hello!"}]},
               {"role": "user", "content": "Name a large city."}]
    plain = client.messages.create(model="default", max_tokens=1100, messages=history, **GREEDY)
    thought = client.messages.create(model="default", max_tokens=1100, messages=history, thinking=thinking, **GREEDY)
    assert [b.type for b in thought.content] == ["text"]
    assert thought.content[0].text == plain.content[0].text and thought.stop_reason == "end_turn"


def test_a_stop_sequence_is_reported(client):
    message = client.messages.create(model="default", max_tokens=40, stop_sequences=["zzz", " "],
                                     messages=[{"role": "user", "content": "Write a sentence about the sea."}],
                                     **GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " ")
    assert all(" " not in b.text for b in message.content)


def test_output_config_json_schema_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"], "additionalProperties": False}
    messages = together([lambda: client.messages.create(
        model="default", max_tokens=60, messages=[{"role": "user", "content": "An animal, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}) for _ in range(4)])
    for message in messages:
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), schema)


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize("body, status, needle", [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [IMAGE]}]}, 400, "'image' are not supported"),
    ({"max_tokens": 4, "messages": ASK, "model": "other"}, 404, "not served here"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "x"}}, 400,
     "not among the tools"),
    ({"max_tokens": 4, "messages": ASK, "container": "c1"}, 400, "container"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "must be less than max_tokens"),
    ({"max_tokens": 2048, "messages": ASK, "thinking": {"type": "enabled"}}, 400, "budget_tokens is required"),
    ({"max_tokens": 2048, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 0}}, 400,
     "budget_tokens"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, 400, "temperature"),
])
def test_errors_take_anthropics_shape(server, body, status, needle):
    reply = httpx.post(f"{server.base_url}/v1/messages", json={"model": "default", **body}, timeout=60)
    assert reply.status_code == status, reply.text
    assert reply.json() == {"type": "error", "error": {
        "type": "not_found_error" if status == 404 else "invalid_request_error",
        "message": reply.json()["error"]["message"]}}
    assert needle in reply.json()["error"]["message"]


def test_openai_paths_keep_their_error_shape(server):
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "other", "messages": ASK})
    assert reply.status_code == 404 and set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_the_client_raises_its_typed_errors(client, anthropic):
    with pytest.raises(anthropic.BadRequestError) as missing:  # the typed client always sends max_tokens
        client.post("/v1/messages", body={"model": "default", "messages": ASK}, cast_to=object)
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="other", max_tokens=4, messages=ASK)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}])
    with pytest.raises(anthropic.BadRequestError, match="tool_result"):
        client.messages.create(model="default", max_tokens=4, messages=[{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}])


KEY = "sk-test-0123456789"


def stub_http(api_key: str):
    """The app on an engine stub (no model): enough to reach the guard and the model check."""
    from fastapi.testclient import TestClient

    from kvserve.configs import HTTPConfig
    from kvserve.server.http.app import create_app

    info = SimpleNamespace(model_id="stub", context_length=64, weight_format="-", blas="-", kv_scheme="fp16",
                           vocab_size=100)
    engine = SimpleNamespace(model=SimpleNamespace(info=info, tokenizer=None, device=None), inflight=0,
                             config=SimpleNamespace(max_tokens=8, max_tokens_limit=16, max_batch_size=8),
                             metrics=SimpleNamespace(render=lambda: ""), health=lambda: (True, "ok"))
    return TestClient(create_app(engine, HTTPConfig(api_key=api_key)), raise_server_exceptions=False)


def test_the_client_authenticates_with_x_api_key(anthropic):
    http = stub_http(KEY)
    keyed = anthropic.Anthropic(base_url="http://testserver", api_key=KEY, http_client=http, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):  # past the guard: the stub serves another model
        keyed.messages.create(model="other", max_tokens=4, messages=ASK)
    wrong = anthropic.Anthropic(base_url="http://testserver", api_key=KEY + "x", http_client=http, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model="stub", max_tokens=4, messages=ASK)
    assert denied.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "missing or invalid API key (Authorization: Bearer ...)"}}
    assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert http.get("/v1/models").json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape elsewhere


# ---- a Claude-Code-shaped session ---------------------------------------------------------

CLAUDE_CODE_HEADERS = {"anthropic-version": "2023-06-01", "x-app": "cli", "user-agent": "claude-cli/2.0.14 (external, cli)",
                       "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                         "fine-grained-tool-streaming-2025-05-14"}
BASH = {"name": "Bash", "description": "Run a shell command", "input_schema": {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
    "properties": {"command": {"type": "string", "maxLength": 40}, "description": {"type": "string", "maxLength": 40}},
    "required": ["command"]}}
SYSTEM = [{"type": "text", "text": "You are Claude Code, a CLI for coding."},
          {"type": "text", "text": "Answer tersely.", "cache_control": {"type": "ephemeral"}}]


def _claude_code(server, body: dict, path: str = "/v1/messages?beta=true") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=CLAUDE_CODE_HEADERS, timeout=300)


def test_a_claude_code_session_is_answered_in_anthropics_shapes(server):
    """What Claude Code sends, as it sends it: ``?beta=true`` and its beta headers, a
    ``claude-...`` model name, system blocks with ``cache_control``, a tool schema with
    ``$schema``, ``max_tokens`` 32000 (past the model's context), thinking enabled, a streamed
    forced call, then the call's ``tool_result`` marked ``is_error``, counted first; and a
    side call under another model name. Every request is a 200 in Anthropic's shapes."""
    turn = [{"role": "user", "content": [{"type": "text", "text": "List the files here.",
                                          "cache_control": {"type": "ephemeral"}}]}]
    body = {"model": "claude-sonnet-4-5-20250929", "max_tokens": 32000, "system": SYSTEM, "messages": turn,
            "tools": [BASH], "tool_choice": {"type": "tool", "name": "Bash"}, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "user_abc"}}
    kinds, data = sse_kinds(server, body, "/v1/messages?beta=true", CLAUDE_CODE_HEADERS)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert data[0]["message"]["model"] == "claude-sonnet-4-5-20250929"
    starts = [d["content_block"] for d in data if d["type"] == "content_block_start"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(starts)
    call = next(b for b in starts if b["type"] == "tool_use")
    arguments = "".join(d["delta"]["partial_json"] for d in data
                        if d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    jsonschema.validate(json.loads(arguments), BASH["input_schema"])
    assert data[-2]["delta"]["stop_reason"] == "tool_use"
    history = [*turn, {"role": "assistant", "content": [{**call, "input": json.loads(arguments)}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "is_error": True,
                                             "content": "ls: permission denied"}]}]
    follow = {"model": "claude-sonnet-4-5-20250929", "system": SYSTEM, "messages": history, "tools": [BASH]}
    counted = _claude_code(server, follow, "/v1/messages/count_tokens?beta=true")
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    reply = _claude_code(server, {**follow, "max_tokens": 16, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["type"] == "message" and reply.json()["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    side = _claude_code(server, {"model": "claude-3-5-haiku-20241022", "max_tokens": 8, "messages": turn,
                                 "system": [{"type": "text", "text": "Summarize the topic in 3 words."}]})
    assert side.status_code == 200 and side.json()["model"] == "claude-3-5-haiku-20241022"

