"""Anthropic's Messages API over HTTP: the real default model behind the real server, driven
by the official anthropic client (whose current version sends no sampling fields: the API's
default, temperature 1, applies; greedy requests pass temperature through extra_body)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from servers import ServerProcess
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
    proc = ServerProcess(default_model_dir, "--cache-dir", str(cache), "--kv-scheme", "fp16",
                         "--prompt-cache-dir", str(cache / "prompts"))
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def test_a_greedy_message_equals_the_openai_chat_reply(server, client):
    message = client.messages.create(model="default", max_tokens=24, system="Be brief.",
                                     messages=[{"role": "user", "content": "Name a large city."}], **GREEDY)
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused").chat.completions.create(
        model="default", max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a large city."}])
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.id.startswith("msg_") and message.role == "assistant" and message.type == "message"


def test_the_stream_assembles_the_same_message_in_anthropics_event_order(server, client):
    kwargs = dict(model="default", max_tokens=20, messages=[{"role": "user", "content": "Say hello."}])
    whole = client.messages.create(**kwargs, **GREEDY)
    with client.messages.stream(**kwargs, **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    body = {**kwargs, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json=body, timeout=60) as response:
        kinds = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas >= 1


def forced(client, stream: bool = False):
    kwargs = dict(model="default", max_tokens=120, messages=ASK, tools=TOOLS, tool_choice=FORCE)
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_forced_tool_always_gives_input_that_validates(client, stream):
    messages = together([lambda: forced(client, stream) for _ in range(12)])  # temperature 1
    for message in messages:
        assert message.stop_reason == "tool_use", message.model_dump_json()
        (block,) = [b for b in message.content if b.type == "tool_use"]
        assert block.name == "get_weather" and block.id.startswith("toolu_")
        jsonschema.validate(block.input, WEATHER)


def test_a_tool_result_round_trip_is_answered_and_reuses_the_cached_turn(client):
    first = forced(client)
    call = next(b for b in first.content if b.type == "tool_use")
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]}]
    second = client.messages.create(model="default", max_tokens=24, messages=history, tools=TOOLS, **GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    total_first = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > total_first  # the first prompt and part of the call


def test_count_tokens_equals_the_prompt_a_message_reports(client):
    kwargs = dict(model="default", system="Be brief.", messages=ASK, tools=TOOLS)
    counted = client.messages.count_tokens(**kwargs).input_tokens
    usage = client.messages.create(max_tokens=4, **kwargs, **GREEDY).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens
    again = client.messages.create(max_tokens=4, **kwargs, **GREEDY).usage
    assert again.cache_read_input_tokens >= counted - 1


def test_a_stop_sequence_is_reported(client):
    message = client.messages.create(model="default", max_tokens=40, stop_sequences=[" ", "\n"],
                                     messages=[{"role": "user", "content": "Write a sentence about the sea."}], **GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence in (" ", "\n")
    assert " " not in message.content[0].text if message.content else True


def test_output_config_json_schema_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"], "additionalProperties": False}
    messages = together([lambda: client.messages.create(
        model="default", max_tokens=60, messages=[{"role": "user", "content": "An animal, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}) for _ in range(6)])
    for message in messages:
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.parametrize("body, status, needle", [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "'image' are not supported"),
    ({"max_tokens": 4, "messages": ASK, "model": "other"}, 404, "not served here"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "x"}}, 400,
     "not among the tools"),
    ({"max_tokens": 4, "messages": ASK, "container": "c1"}, 400, "container"),
])
def test_errors_take_anthropics_shape(server, body, status, needle):
    reply = httpx.post(f"{server.base_url}/v1/messages", json={"model": "default", **body}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert error["type"] == "error" and needle in error["error"]["message"]
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_the_client_raises_its_typed_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="default", max_tokens=4, messages=[{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}])
