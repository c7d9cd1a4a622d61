"""OpenAI's Responses API on the same engine as chat completions: ``POST /v1/responses``,
JSON or streamed events. Nothing is stored: there is no ``GET``, ``DELETE`` or ``cancel``
for a response id, and ``previous_response_id`` is a 400 (send the whole conversation).

A request becomes the chat every dialect shares (``convert.py``), is prepared like a chat
completion (template, tools, grammar) and submitted to the engine through the same path,
so the same conversation gives the same tokens on both routes.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from kvserve.server.engine.loop import Engine
from kvserve.server.http.chat import PreparedChat, check_grammar, prepare_chat
from kvserve.server.http.errors import APIError
from kvserve.server.http.names import ModelNames
from kvserve.server.http.responses.convert import chat_input, renamed, sampling_fields
from kvserve.server.http.responses.events import collect_response, new_response, response_events
from kvserve.server.http.responses.inputs import parse_input
from kvserve.server.http.responses.items import Reply
from kvserve.server.http.responses.schemas import ResponsesRequest
from kvserve.server.http.submit import Submitted, answer, submit

PATH = "/v1/responses"


def install_responses_routes(app: FastAPI, engine: Engine, names: ModelNames) -> None:
    """``names`` answers a model not served here with a 404, and names the reply."""
    model = engine.model

    @app.post(PATH)
    async def responses(body: ResponsesRequest, http_request: HTTPRequest):
        name = names.check(body.model)
        chat = await _prepare(body, engine)
        job = _submit(engine, body, chat, http_request)
        start, reply = new_response(body, name), Reply(chat.splitter)
        events = (lambda: response_events(start, job.stream, reply, job.abort,
                                          http_request.app.state.sse_keepalive_s)) if body.stream else None
        return await answer(job, http_request, events,
                            lambda: collect_response(start, job.stream, http_request, reply))


async def _prepare(body: ResponsesRequest, engine: Engine) -> PreparedChat:
    """Prompt tokens, grammar and reply splitter, as for a chat completion; errors name this
    API's fields."""
    model = engine.model
    try:
        chat = prepare_chat(chat_input(body, parse_input(body.input)), model.tokenizer, param="input",
                            boundaries=model.message_ends)
        await check_grammar(model.grammars, chat.grammar, "text.format" if body.text_format else "tool_choice")
    except APIError as exc:
        raise renamed(exc) from None
    return chat


def _submit(engine: Engine, body: ResponsesRequest, chat: PreparedChat, http_request: HTTPRequest) -> Submitted:
    try:
        return submit(engine, sampling_fields(body), chat.tokens, http_request, chat.grammar,
                      boundaries=chat.boundaries)
    except APIError as exc:
        raise renamed(exc) from None
