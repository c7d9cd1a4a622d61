"""Tool calls and structured output over HTTP: the real default model (SmolLM2-135M-Instruct,
whose template has no tool calling: the Hermes convention applies) behind the real server,
driven by the official openai client. Sampled outputs must validate every time: the grammar,
not the model, guarantees it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from inprocess import InProcessServer
from together import together

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What will the weather be in Paris this week?"}]
CAT = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "indoor": {"type": "boolean"},
    "colors": {"type": "array", "items": {"type": "string", "enum": ["black", "white", "orange", "grey"]},
               "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "indoor", "colors"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("structured")
    # In this process (tests/inprocess.py): the routes and the grammars are what is checked.
    proc = InProcessServer(default_model_dir, "--cache-dir", str(cache), "--kv-scheme", "affine8",
                         "--prompt-cache-dir", str(cache / "prompts"))
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def forced_call(client, seed: int, **kwargs):
    kwargs = {"max_tokens": 120, **kwargs}
    return client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice=FORCE_WEATHER,
                                          temperature=1.0, seed=seed, **kwargs)


def test_a_named_tool_choice_always_gives_valid_arguments(client):
    """One call that validates, then the end, at temperature 1 and with parallel calls allowed
    (the default): a named choice forces exactly one call, not a call the model may follow
    with more until max_tokens."""
    # 8 seeds, one full batch (the default max_batch_size): the grammar's guarantee is checked
    # by each sample alike, and 16 took two waves through the batch for no other behaviour.
    replies = together([lambda s=s: forced_call(client, s, max_tokens=80) for s in range(8)])
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, reply.model_dump_json()
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert len({r.choices[0].message.tool_calls[0].function.arguments for r in replies}) > 1  # sampled


def test_json_schema_output_always_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}}
    replies = together([lambda s=s: client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format=fmt, temperature=1.0, seed=s, max_tokens=100) for s in range(8)])  # one full batch
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), CAT)
    obj = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "A cat?"}],
                                         response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_a_streamed_tool_call_assembles_in_the_client_as_the_whole_reply(client):
    whole = forced_call(client, 7, parallel_tool_calls=False).choices[0]
    state = ChatCompletionStreamState()
    for chunk in forced_call(client, 7, parallel_tool_calls=False, stream=True):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert not streamed.message.content


GREEDY_CALL = dict(model="default", messages=ASK, tools=TOOLS, tool_choice=FORCE_WEATHER, temperature=0,
                   parallel_tool_calls=False)


def test_a_streamed_call_sends_its_name_then_its_arguments_as_they_are_written(client):
    """OpenAI's shape: a first ``tool_calls`` delta with index, id, type, name and empty
    arguments, then argument pieces as the model writes them (one per token here, not the
    whole at the end), then the finish. Joined, the pieces are the unstreamed reply's
    arguments for the same greedy request."""
    whole = client.chat.completions.create(**GREEDY_CALL, max_tokens=120).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**GREEDY_CALL, max_tokens=120, stream=True)]
    assert chunks[0].delta.role == "assistant" and not chunks[0].delta.tool_calls
    assert (chunks[-1].finish_reason, chunks[-1].delta.tool_calls) == ("tool_calls", None)
    deltas = [c.delta.tool_calls for c in chunks[1:-1]]
    assert all(len(d) == 1 for d in deltas) and not any(c.delta.content for c in chunks)
    (first,), pieces = deltas[0], [d[0] for d in deltas[1:]]
    assert (first.index, first.type, first.function.name, first.function.arguments) == \
        (0, "function", "get_weather", "")
    assert first.id.startswith("call_")
    assert all((p.index, p.id, p.type, p.function.name) == (0, None, None, None) for p in pieces)
    arguments = whole.message.tool_calls[0].function.arguments
    assert "".join(p.function.arguments for p in pieces) == arguments
    assert len(pieces) >= len(json.loads(arguments)) * 3  # each key and value as it came


def test_a_streamed_call_cut_by_max_tokens_ends_as_content_and_length(client):
    """Cut inside its arguments: what was sent of the call cannot be taken back, so it stays
    in ``tool_calls``, but the call's text follows as content (the content the unstreamed
    reply has) and the finish is ``length``, not ``tool_calls``."""
    tokens = client.chat.completions.create(**GREEDY_CALL, max_tokens=120).usage.completion_tokens
    whole = client.chat.completions.create(**GREEDY_CALL, max_tokens=tokens // 2).choices[0]
    assert whole.finish_reason == "length" and '"arguments": {"' in whole.message.content  # cut inside them
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**GREEDY_CALL, max_tokens=tokens // 2, stream=True):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]  # the final one raises at "length"
    assert streamed.finish_reason == "length" and streamed.message.content == whole.message.content
    (call,) = streamed.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    assert call.function.arguments in whole.message.content


def test_rows_without_a_grammar_decode_as_alone_beside_constrained_rows(client):
    def free(topic):
        return client.chat.completions.create(model="default", messages=[{"role": "user", "content": topic}],
                                              temperature=0, max_tokens=24).choices[0].message.content

    topics = ["Tell me about owls.", "Tell me about rivers."]
    alone = [free(t) for t in topics]
    mixed = together([lambda: forced_call(client, 1, parallel_tool_calls=False), lambda: free(topics[0]),
                      lambda: forced_call(client, 2, parallel_tool_calls=False), lambda: free(topics[1])])
    assert [mixed[1], mixed[3]] == alone
    assert all(m.choices[0].finish_reason == "tool_calls" for m in (mixed[0], mixed[2]))


def test_a_seeded_constrained_request_samples_the_same_alone_and_batched(client):
    def args(seed):
        return forced_call(client, seed, parallel_tool_calls=False).choices[0].message.tool_calls[0].function.arguments

    alone = [args(s) for s in (11, 12, 13)]
    assert together([lambda s=s: args(s) for s in (11, 12, 13)]) == alone


def test_tool_results_round_trip_and_the_next_turn_reuses_the_cached_call(client):
    first = forced_call(client, 3, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high": 24}'}]
    second = client.chat.completions.create(model="default", messages=history, tools=TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=30)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content
    # The call is rendered back as it was generated (json.dumps spacing), so the cache covers
    # the first prompt and the call's text up to where the sampled tokens left the canonical
    # tokenization of that text (a grammar lets the model spell a string in other tokens).
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens + 8 <= cached < second.usage.prompt_tokens


def test_a_call_cut_by_max_tokens_comes_back_as_text(client):
    reply = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice=FORCE_WEATHER,
                                           temperature=0, max_tokens=6)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "not among the tools"),
    ({"tool_choice": "required"}, None, "tool_choice needs tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "cannot compile the json schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"functions": [{"name": "f"}]}, "functions", "Extra inputs are not permitted"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0", "not valid JSON"),
])
def test_structures_that_cannot_be_served_are_400s_that_say_why(server, body, param, needle):
    payload = {"model": "default", "messages": ASK, "max_tokens": 4, **body}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
