"""The Responses API (``POST /v1/responses``): the real default model (SmolLM2-135M-Instruct,
whose template has no tool calling: the Hermes convention applies) behind the real server,
driven by the official openai client, and its raw server-sent events read with httpx.

Every body and event is also validated against the openai package's own types, so the
client parses all of it. Sampled forced calls and JSON must validate every time: the
grammar, not the model, guarantees it. Stored responses are continued with
``previous_response_id`` from the prefix cache, read back and deleted; the store's own
laws (bound, damaged files) are in test_response_store.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from servers import ServerProcess
from together import together

from kvserve.server.engine.request import FinishReason, TokenEvent
from kvserve.server.http.responses.events import new_response, response_events
from kvserve.server.http.responses.items import OutputItems, Reply
from kvserve.server.http.responses.schemas import ResponsesRequest
from kvserve.server.http.streams import EventStream
from kvserve.server.http.tools import Call, Text

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast for a city",
          "parameters": WEATHER_PARAMS, "strict": True},
         {"type": "function", "name": "get_time", "description": "Local time in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
SYSTEM = "You are a helpful assistant."
ASK = "What will the weather be in Paris this week?"
CAT = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "indoor": {"type": "boolean"},
    "colors": {"type": "array", "items": {"type": "string", "enum": ["black", "white", "orange", "grey"]},
               "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "indoor", "colors"], "additionalProperties": False}
EVENT = TypeAdapter(ResponseStreamEvent)
TEXT_ITEM = ["response.output_item.added", "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_ITEM = ["response.output_item.added", "response.function_call_arguments.delta",
             "response.function_call_arguments.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("responses")
    proc = ServerProcess(default_model_dir, "--cache-dir", str(cache), "--kv-scheme", "fp16")
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def raw_events(server, **body) -> list[dict]:
    """The SSE events of a streamed response, each checked against the openai types: its
    ``event:`` line names its data's type, and sequence numbers count from 0."""
    payload = {"model": "default", "stream": True, **body}
    events, name = [], None
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=payload, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name and EVENT.validate_python(data).type == name
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def forced_call(client, **kwargs):
    return client.responses.create(model="default", instructions=SYSTEM, input=ASK, tools=TOOLS,
                                   tool_choice=FORCE_WEATHER, parallel_tool_calls=False,
                                   max_output_tokens=120, **kwargs)


def test_a_greedy_response_is_the_chat_routes_greedy_reply(client):
    reply = client.responses.create(model="default", instructions=SYSTEM, input="Tell me about owls.",
                                    temperature=0, max_output_tokens=24)
    chat = client.chat.completions.create(model="default", temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about owls."}])
    assert reply.output_text == chat.choices[0].message.content and reply.output_text
    assert reply.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    (message,) = reply.output
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.error is None
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert [(p.type, p.annotations) for p in message.content] == [("output_text", [])]
    echoed = (reply.temperature, reply.max_output_tokens, reply.tool_choice, reply.tools, reply.text.format.type,
              reply.parallel_tool_calls, reply.model)
    assert echoed == (0, 24, "auto", [], "text", True, client.models.list().data[0].id)
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    Response.model_validate(reply.to_dict())
    # The same conversation as items: a developer message and input_text parts.
    items = client.responses.create(model="default", temperature=0, max_output_tokens=24, input=[
        {"role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about owls."}]}])
    assert items.output_text == reply.output_text


def test_max_output_tokens_leaves_the_response_incomplete(client, server):
    ask = dict(input="Tell me a long story.", temperature=0, max_output_tokens=5)
    reply = client.responses.create(model="default", **ask)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 5 and reply.output[0].status == "incomplete"
    last = raw_events(server, **ask)[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["content"][0]["text"] == reply.output_text


def test_a_stream_assembles_the_whole_response_in_the_official_order(client, server):
    ask = dict(model="default", input="What is the capital of France?", temperature=0, max_output_tokens=40)
    whole = client.responses.create(**ask)
    assert whole.status == "completed"
    events = raw_events(server, **{k: v for k, v in ask.items() if k != "model"})
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", *TEXT_ITEM,
                                           *["response.output_text.delta"] * len(deltas), *TEXT_END,
                                           "response.completed"]
    assert "".join(deltas) == whole.output_text and len(deltas) > 1
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == final["id"]
    assert Response.model_validate(final).output_text == whole.output_text
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2]) and final["output"][0]["id"] == item_id
    with client.responses.stream(**ask) as stream:
        helper = stream.get_final_response()
    assert helper.output_text == whole.output_text and helper.status == "completed"
    assert [e.type for e in client.responses.create(**ask, stream=True)] == [e["type"] for e in events]


def test_a_forced_function_always_gives_valid_arguments(client):
    # One full batch (the default max_batch_size, 8): each sample checks the grammar's guarantee
    # alike; 16 took two waves through the batch. Temperature 2 (the API's most) flattens what the
    # grammar allows, so eight unseeded samples (this API takes no seed) all alike is too rare to
    # meet.
    replies = together([lambda: forced_call(client, temperature=2.0) for _ in range(8)])
    for reply in replies:
        assert reply.status == "completed" and reply.output_text == ""
        (call,) = reply.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert len({r.output[0].arguments for r in replies}) > 1  # sampled


def test_a_streamed_function_call_assembles_in_the_stream_helper(client, server):
    whole = forced_call(client, temperature=0).output[0]
    events = raw_events(server, instructions=SYSTEM, input=ASK, tools=TOOLS, tool_choice=FORCE_WEATHER,
                        parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) >= 6 and [e["type"] for e in events] == [  # the arguments stream as they are written
        "response.created", "response.in_progress", CALL_ITEM[0], *[CALL_ITEM[1]] * len(deltas), *CALL_ITEM[2:],
        "response.completed"]
    added, done = events[2]["item"], events[-2]["item"]
    assert (added["arguments"], added["status"], done["status"]) == ("", "in_progress", "completed")
    assert "".join(deltas) == events[-3]["arguments"] == done["arguments"] == whole.arguments
    for temperature in (0, 1.0):
        with client.responses.stream(model="default", instructions=SYSTEM, input=ASK, tools=TOOLS,
                                     tool_choice=FORCE_WEATHER, parallel_tool_calls=False, max_output_tokens=120,
                                     temperature=temperature) as stream:
            (call,) = stream.get_final_response().output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.parsed_arguments == json.loads(call.arguments)  # strict tools are parsed by the client
        jsonschema.validate(call.parsed_arguments, WEATHER_PARAMS)
        if temperature == 0:
            assert call.arguments == whole.arguments


def test_a_streamed_function_call_cut_short_ends_incomplete_and_its_text_is_a_message(client, server):
    """Cut inside its arguments: the call's item ends ``incomplete`` with what was streamed,
    and the call's text follows as a message, the one the unstreamed response has."""
    ask = dict(instructions=SYSTEM, input=ASK, tools=TOOLS, tool_choice=FORCE_WEATHER, parallel_tool_calls=False,
               temperature=0)
    tokens = client.responses.create(model="default", **ask, max_output_tokens=120).usage.output_tokens
    whole = client.responses.create(model="default", **ask, max_output_tokens=tokens // 2)
    assert whole.status == "incomplete" and '"arguments": {"' in whole.output_text  # cut inside them
    events = raw_events(server, **ask, max_output_tokens=tokens // 2)
    assert events[-1]["type"] == "response.incomplete"
    call, message = events[-1]["response"]["output"]
    assert (call["type"], call["status"], message["status"]) == ("function_call", "incomplete", "incomplete")
    assert message["content"][0]["text"] == whole.output_text and call["arguments"] in whole.output_text


def test_a_function_call_output_round_trip_is_answered(client):
    first = forced_call(client, temperature=0)
    (call,) = first.output
    result = '{"forecast": "sunny", "high": 24}'
    history = [{"role": "user", "content": ASK}, *first.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    second = client.responses.create(model="default", instructions=SYSTEM, input=history, tools=TOOLS,
                                     tool_choice="none", temperature=0, max_output_tokens=30)
    assert second.output_text and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the first turn's prompt
    chat = client.chat.completions.create(model="default", tools=CHAT_TOOLS, tool_choice="none", temperature=0,
                                          max_tokens=30, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert second.output_text == chat.choices[0].message.content
    # The answer goes back too (a message with its id, status and empty annotations).
    history += [*second.output, {"role": "user", "content": "Thanks!"}]
    third = client.responses.create(model="default", input=history, temperature=0, max_output_tokens=8)
    assert third.output_text


def test_a_json_schema_text_format_always_validates(client):
    fmt = {"type": "json_schema", "name": "cat", "schema": CAT, "strict": True}
    replies = together([lambda: client.responses.create(
        model="default", input="Describe a cat as JSON.", text={"format": fmt}, temperature=1.0,
        max_output_tokens=100) for _ in range(8)])
    for reply in replies:
        assert reply.status == "completed" and reply.text.format.type == "json_schema"
        jsonschema.validate(json.loads(reply.output_text), CAT)
    obj = client.responses.create(model="default", input="A cat?", text={"format": {"type": "json_object"}},
                                  temperature=0, max_output_tokens=60)
    assert isinstance(json.loads(obj.output_text), dict)


IMAGE = {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/cat.png"}]}
FILE = {"role": "user", "content": [{"type": "input_text", "text": "Read"},
                                    {"type": "input_file", "file_id": "file_1"}]}


@pytest.mark.parametrize("body, param, needle", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "Previous response with id 'resp_1' not found"),
    ({"conversation": "conv_1"}, "conversation", "conversation objects are not served"),
    ({"background": True}, "background", "background responses are not served"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "no extra output"),
    ({"truncation": "auto"}, "truncation", "never truncated"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning effort cannot be set"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "reasoning summary cannot be set"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "no built-in tools"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools.0", "no built-in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search' is not served"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, None, "not among the tools"),
    ({"tool_choice": "required"}, None, "tool_choice needs tools"),
    ({"top_logprobs": 2}, "top_logprobs", "Extra inputs are not permitted"),
    ({"max_tool_calls": 2}, "max_tool_calls", "Extra inputs are not permitted"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate", "Extra inputs are not permitted"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity cannot be set"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation", "not padded"),
    ({"input": [IMAGE]}, "input.0.content.0", "'input_image' are not served"),
    ({"input": [FILE]}, "input.0.content.1", "'input_file' are not served"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "not looked up by id"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type", "are not served"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input.0.call_id", "'c9'"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{oops"}]},
     "input.0", "not valid JSON"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format", "json schema"),
])
def test_what_cannot_be_served_is_a_400_naming_it(client, body, param, needle):
    kwargs = {"model": "default", "input": "Hi", "max_output_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert needle in error["message"] and error["param"] == param, error


# ---- stored responses: previous_response_id, GET, DELETE, input items ---------------------

CITIES = ["What is the capital of France?", "And of Italy?", "Which one is bigger?"]
GREEDY = dict(model="default", instructions=SYSTEM, temperature=0, max_output_tokens=20)


def covered(reply, previous) -> bool:
    """Whether ``reply``'s prompt came from the prefix cache as far as ``previous``'s prompt
    and reply, less at most one token: the last token generated is never fed to the model,
    so a reply cut short is cached but for its last token (one that stopped, up to the end
    marker it generated, which output_tokens does not count)."""
    now, before = _usage(reply), _usage(previous)
    return now["input_tokens_details"]["cached_tokens"] >= before["input_tokens"] + before["output_tokens"] - 1


def _usage(response) -> dict:
    """A response's usage, from the client's object or from raw JSON."""
    return response["usage"] if isinstance(response, dict) else response.usage.to_dict()


def assert_error(call, kind: type, param: str | None, code: str | None) -> dict:
    with pytest.raises(kind) as caught:
        call()
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"} and (error["param"], error["code"]) == (param, code)
    return error


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(client):
    chained, previous = [], None
    for text in CITIES:
        reply = client.responses.create(**GREEDY, input=text, previous_response_id=previous)
        assert reply.store is True and reply.previous_response_id == previous  # kept by default, as OpenAI
        assert not chained or covered(reply, chained[-1]), (reply.usage, chained[-1].usage)
        chained.append(reply)
        previous = reply.id
    assert [r.status for r in chained] == ["completed"] * 3  # each reply ends with its end marker
    # The same conversation sent whole: the same prompt, the same greedy reply.
    history = []
    for text, reply in zip(CITIES, chained):
        history.append({"role": "user", "content": text})
        whole = client.responses.create(**GREEDY, input=history, store=False)
        assert (whole.output_text, whole.usage.input_tokens) == (reply.output_text, reply.usage.input_tokens)
        history += [item.to_dict() for item in reply.output]
    # The last turn's input items: the whole conversation, newest first (OpenAI's default).
    items = list(client.responses.input_items.list(chained[-1].id))
    assert [(i.type, i.role, i.content[0].text) for i in items] == [
        ("message", "user", CITIES[2]), ("message", "assistant", chained[1].output_text),
        ("message", "user", CITIES[1]), ("message", "assistant", chained[0].output_text),
        ("message", "user", CITIES[0])]
    assert items[1].id == chained[1].output[0].id and items[0].id.startswith("msg_")
    paged = client.responses.input_items.list(chained[-1].id, order="asc", limit=2)
    assert (len(paged.data), paged.has_more) == (2, True)
    assert [i.id for i in paged] == [i.id for i in reversed(items)]  # the client follows after=


def test_a_function_call_output_answers_the_call_of_the_previous_response(client):
    first = forced_call(client, temperature=0)
    (call,) = first.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "rain"}'}
    ask = dict(model="default", instructions=SYSTEM, tools=TOOLS, tool_choice="none", temperature=0,
               max_output_tokens=20)
    second = client.responses.create(**ask, input=[output], previous_response_id=first.id)
    whole = client.responses.create(**ask, input=[{"role": "user", "content": ASK}, call.to_dict(), output],
                                    store=False)
    assert (second.output_text, second.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    assert second.output_text and second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # The call is answered in this request's input: an output that answers no call names its index there.
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**ask, input=[{**output, "call_id": "call_nope"}], previous_response_id=first.id)
    assert caught.value.body["param"] == "input.0.call_id"


def test_the_previous_instructions_are_not_carried_over(client):
    first = client.responses.create(model="default", instructions="Answer in French.", input="Hello!",
                                    temperature=0, max_output_tokens=4)
    ask = dict(model="default", temperature=0, max_output_tokens=1, store=False)
    second = client.responses.create(**ask, input="Thanks.", previous_response_id=first.id)
    history = [{"role": "user", "content": "Hello!"}, *[i.to_dict() for i in first.output],
               {"role": "user", "content": "Thanks."}]
    without = client.responses.create(**ask, input=history)
    instructed = client.responses.create(**ask, input=history, instructions="Answer in French.")
    assert second.instructions is None
    assert second.usage.input_tokens == without.usage.input_tokens != instructed.usage.input_tokens


def test_a_response_is_retrieved_as_it_was_returned_until_deleted(server, client):
    url = f"{server.base_url}/v1/responses"
    created = httpx.post(url, json={"model": "default", "input": "Say hi.", "temperature": 0,
                                    "max_output_tokens": 6}, timeout=120)
    response_id = created.json()["id"]
    fetched = httpx.get(f"{url}/{response_id}", timeout=30)
    assert fetched.status_code == 200 and fetched.content == created.content  # the very bytes
    assert client.responses.retrieve(response_id).to_dict() == Response.model_validate(created.json()).to_dict()
    deleted = httpx.delete(f"{url}/{response_id}", timeout=30)
    assert deleted.status_code == 200 and deleted.json() == {"id": response_id, "object": "response", "deleted": True}
    for call in (lambda: client.responses.retrieve(response_id), lambda: client.responses.delete(response_id),
                 lambda: client.responses.input_items.list(response_id)):
        error = assert_error(call, openai.NotFoundError, None, None)
        assert response_id in error["message"]
    assert_error(lambda: client.responses.create(model="default", input="Hi", previous_response_id=response_id),
                 openai.BadRequestError, "previous_response_id", "previous_response_not_found")


def test_a_response_with_store_false_is_not_kept(client):
    reply = client.responses.create(model="default", input="Hi", store=False, max_output_tokens=2)
    assert reply.store is False
    assert_error(lambda: client.responses.retrieve(reply.id), openai.NotFoundError, None, None)
    assert_error(lambda: client.responses.create(model="default", input="Hi", previous_response_id=reply.id),
                 openai.BadRequestError, "previous_response_id", "previous_response_not_found")


def test_a_streamed_response_is_kept_as_it_ended_and_continued(server):
    events = raw_events(server, input=CITIES[0], instructions=SYSTEM, temperature=0, max_output_tokens=4)
    first = events[-1]["response"]
    assert events[0]["response"]["store"] is True and events[-1]["type"] == "response.incomplete"
    assert httpx.get(f"{server.base_url}/v1/responses/{first['id']}", timeout=30).json() == first
    more = raw_events(server, input=CITIES[1], instructions=SYSTEM, temperature=0, max_output_tokens=4,
                      previous_response_id=first["id"])
    second = more[-1]["response"]
    assert more[0]["response"]["previous_response_id"] == second["previous_response_id"] == first["id"]
    assert covered(second, first), (second["usage"], first["usage"])
    assert httpx.get(f"{server.base_url}/v1/responses/{second['id']}", timeout=30).json() == second


@pytest.mark.parametrize("query, param", [
    ("/input_items?limit=0", "limit"), ("/input_items?limit=101", "limit"), ("/input_items?order=sideways", "order"),
    ("/input_items?after=msg_nope", "after"), ("?stream=true", "stream")])
def test_the_stored_routes_refuse_what_they_do_not_serve(server, client, query, param):
    stored = client.responses.create(model="default", input="Hi", max_output_tokens=1)
    reply = httpx.get(f"{server.base_url}/v1/responses/{stored.id}{query}", timeout=30)
    error = reply.json()["error"]
    assert reply.status_code == 400 and (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_stored_responses_outlive_the_server(server, client, default_model_dir):
    """Last of the server tests: it stops the module's server (a clean stop flushes the
    prefix cache's disk writer), then a second one on the same cache folder retrieves the
    response and continues from it, its prompt read from the prefix cache's files."""
    first = client.responses.create(**GREEDY, input=CITIES[0])
    items = [i.to_dict() for i in client.responses.input_items.list(first.id)]
    assert server.stop() == 0, server.output()
    again = ServerProcess(default_model_dir, *server.args).wait_ready()
    try:
        restarted = openai.OpenAI(base_url=f"{again.base_url}/v1", api_key="unused", max_retries=0)
        assert restarted.responses.retrieve(first.id).to_dict() == first.to_dict()
        assert [i.to_dict() for i in restarted.responses.input_items.list(first.id)] == items
        second = restarted.responses.create(**GREEDY, input=CITIES[1], previous_response_id=first.id)
        assert covered(second, first), (second.usage, first.usage)
        whole = restarted.responses.create(**GREEDY, store=False, input=[
            {"role": "user", "content": CITIES[0]}, *[i.to_dict() for i in first.output],
            {"role": "user", "content": CITIES[1]}])
        assert whole.output_text == second.output_text
    finally:
        assert again.stop() == 0, again.output()


# ---- without a server: what the real model never produces ---------------------------------

def test_reasoning_streams_as_a_reasoning_item_before_the_message():
    out = OutputItems()
    events = out.add(Text("Think. ", reasoning=True)) + out.add(Text("Hmm.", reasoning=True)) \
        + out.add(Text("Paris.")) + out.add(Call("f", "{}", "call_1")) + out.finish("completed")
    types = [e["type"] for e in events]
    assert types == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done", *TEXT_ITEM, "response.output_text.delta", *TEXT_END, *CALL_ITEM]
    for number, event in enumerate(events):
        EVENT.validate_python({**event, "sequence_number": number})
    reasoning, message, call = out.items
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Think. Hmm."}]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    response = Response.model_validate({**new_response(ResponsesRequest(model="m", input="hi"), "m"),
                                        "status": "completed", "output": out.items})
    assert response.output_text == "Paris." and call["call_id"] == "call_1"


def test_an_empty_reply_is_one_empty_message():
    out = OutputItems()
    assert [e["type"] for e in out.finish("completed")] == [*TEXT_ITEM, *TEXT_END]
    assert out.items[0]["content"][0]["text"] == "" and out.items[0]["status"] == "completed"


def test_an_engine_failure_mid_stream_fails_the_response():
    async def stream_of(*events: TokenEvent) -> list[str]:
        stream = EventStream(["r"])
        for event in events:
            stream.sink(event)
        start = new_response(ResponsesRequest(model="m", input="hi"), "m")
        return [chunk async for chunk in response_events(start, stream, Reply(None), lambda: None)]

    chunks = asyncio.run(stream_of(TokenEvent("r", "Hel"),
                                   TokenEvent("r", "", finish_reason=FinishReason.ERROR, error="boom")))
    events = [json.loads(c.split("data: ", 1)[1]) for c in chunks]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", *TEXT_ITEM,
                                           "response.output_text.delta", "response.failed"]
    failed = EVENT.validate_python(events[-1]).response
    assert failed.status == "failed" and (failed.error.code, failed.error.message) == ("server_error", "boom")
