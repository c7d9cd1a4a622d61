"""OpenAI's Responses API on the same engine as chat completions: ``POST /v1/responses``
(JSON or streamed events), and the responses it keeps: ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A response is kept unless its request says ``store: false`` (OpenAI's default is to keep
it): when it ends (completed, or incomplete at ``max_output_tokens``; not when it failed or
its client left), ``store.py`` keeps the object its client got and the input items it
answered. A request with ``previous_response_id`` continues that conversation: its input is
appended to the stored one (each earlier turn's input items, then its output items) and the
whole is prepared as if the client had sent it, so the chat template renders the same
prefix and the prefix cache serves the earlier turns. As in OpenAI's API, the earlier
``instructions`` are not carried over (the new request's own apply; tools too are the new
request's). An id that is not stored (unknown, ``store: false``, deleted or evicted) is a
400 with code ``previous_response_not_found``, as OpenAI answers it.

Example (turn 2 sends only what is new; its prompt is turn 1's conversation plus it):
    POST /v1/responses {"input": "Name a city in Japan.", "instructions": "Be brief."}
        -> {"id": "resp_1", "output": [{"type": "message", ... "Tokyo."}], ...}
    POST /v1/responses {"input": "Its population?", "instructions": "Be brief.",
                        "previous_response_id": "resp_1"}
        renders system "Be brief.", user "Name a city in Japan.", assistant "Tokyo.",
        user "Its population?": the first four are turn 1's prompt and reply, cached.

Not served: ``background`` and ``conversation`` (400s that say so), ``POST
/v1/responses/{id}/cancel`` (nothing runs in the background), replaying a stored response
as events (``GET ...?stream=true``, a 400).

A request becomes the chat every dialect shares (``convert.py``), is prepared like a chat
completion (template, tools, grammar) and submitted to the engine through the same path,
so the same conversation gives the same tokens on both routes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import FastAPI, Query
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from kvserve.server.engine.loop import Engine
from kvserve.server.http.chat import PreparedChat, check_grammar, prepare_chat
from kvserve.server.http.errors import APIError
from kvserve.server.http.names import ModelNames
from kvserve.server.http.responses.convert import chat_input, renamed, sampling_fields
from kvserve.server.http.responses.events import OnEnd, collect_response, new_response, response_events
from kvserve.server.http.responses.inputs import Item, parse_input, stored_item
from kvserve.server.http.responses.items import Reply
from kvserve.server.http.responses.schemas import ResponsesRequest
from kvserve.server.http.responses.store import ResponseStore
from kvserve.server.http.streams import EventStream
from kvserve.server.http.submit import Submitted, answer, submit

PATH = "/v1/responses"
NOT_FOUND = {404: {"description": "no stored response has this id"}}
READ_ERRORS = {400: {"description": "a query parameter that is not served"}, **NOT_FOUND}


def install_responses_routes(app: FastAPI, engine: Engine, names: ModelNames, store: ResponseStore) -> None:
    """``names`` answers a model not served here with a 404, and names the reply; ``store``
    keeps the responses for the routes that read them and for ``previous_response_id``."""

    @app.post(PATH)
    async def responses(body: ResponsesRequest, http_request: HTTPRequest):
        name = names.check(body.model)
        turn = await _turn(body, store)
        chat = await _prepare(body, engine, turn)
        job = _submit(engine, body, chat, http_request)
        start, reply = new_response(body, name, stored=turn.stored), Reply(chat.splitter, stream=bool(body.stream))
        keep = _keeper(store, turn)
        events = (lambda: response_events(start, job.stream, reply, job.abort,
                                          http_request.app.state.sse_keepalive_s, keep)) if body.stream else None
        return await answer(job, http_request, events,
                            lambda: _collect(start, job.stream, http_request, reply, keep))

    install_stored_routes(app, store)


def install_stored_routes(app: FastAPI, store: ResponseStore) -> None:
    """The routes that read and delete what ``store`` keeps."""

    @app.get(PATH + "/{response_id}", responses=READ_ERRORS)
    async def retrieve(response_id: str, stream: bool = False):
        if stream:
            raise APIError(400, "a stored response is not replayed as events: retrieve it without stream",
                           param="stream", code="invalid_value")
        text = await asyncio.to_thread(store.response_text, response_id)
        if text is None:
            raise _unknown(response_id)
        return Response(text, media_type="application/json")  # the bytes its client got

    @app.delete(PATH + "/{response_id}", responses=NOT_FOUND)
    async def delete(response_id: str):
        if not await asyncio.to_thread(store.delete, response_id):
            raise _unknown(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get(PATH + "/{response_id}/input_items", responses=READ_ERRORS)
    async def input_items(response_id: str, order: Literal["asc", "desc"] = "desc",
                          limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None):
        items = await asyncio.to_thread(store.input_items, response_id)
        if items is None:
            raise _unknown(response_id)
        return item_page(items, order, limit, after)


@dataclass
class Turn:
    """What one request answers: ``items``, the stored conversation it continues (its first
    ``continued``) then its own input; ``stored_items``: the same as the response keeps them."""

    items: list[Item]
    continued: int
    stored_items: list[dict]
    stored: bool


async def _turn(body: ResponsesRequest, store: ResponseStore) -> Turn:
    """The request's input after the conversation it continues (400s that name the field)."""
    if body.store and not store.enabled:
        raise APIError(400, "this server keeps no responses (http.max_stored_responses is 0): store must be "
                            "false or absent", param="store", code="invalid_value")
    history: list[dict] = []
    if body.previous_response_id is not None:
        history = await asyncio.to_thread(store.conversation, body.previous_response_id)
        if history is None:
            raise APIError(400, f"Previous response with id {body.previous_response_id!r} not found.",
                           param="previous_response_id", code="previous_response_not_found")
    own = parse_input(body.input)
    return Turn(items=parse_input(history) + own, continued=len(history),
                stored_items=history + [stored_item(i) for i in own],
                stored=store.enabled and body.store is not False)


async def _prepare(body: ResponsesRequest, engine: Engine, turn: Turn) -> PreparedChat:
    """Prompt tokens, grammar and reply splitter, as for a chat completion; errors name this
    API's fields."""
    model = engine.model
    try:
        chat = prepare_chat(chat_input(body, turn.items, turn.continued), model.tokenizer, param="input",
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


def _keeper(store: ResponseStore, turn: Turn) -> OnEnd | None:
    """What stores the response when it ends (None: it is not kept). The write runs in a
    worker thread: the event loop never waits on the disk."""
    if not turn.stored:
        return None

    async def keep(response: dict) -> None:
        await asyncio.to_thread(store.put, response, turn.stored_items)

    return keep


async def _collect(start: dict, stream: EventStream, http_request: HTTPRequest, reply: Reply,
                   keep: OnEnd | None) -> dict:
    """The whole response, stored (when it is kept) before it is returned."""
    response = await collect_response(start, stream, http_request, reply)
    if keep is not None:
        await keep(response)
    return response


def _unknown(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.")


def item_page(items: list[dict], order: str, limit: int, after: str | None) -> dict:
    """One page of a response's input items, as OpenAI lists them: ``desc`` (its default)
    puts the newest first; ``after`` is the id of the item the page starts after.

    >>> items = [{"id": f"i{n}"} for n in range(5)]
    >>> page = item_page(items, "desc", 2, None)
    >>> [i["id"] for i in page["data"]], page["first_id"], page["last_id"], page["has_more"]
    (['i4', 'i3'], 'i4', 'i3', True)
    >>> [i["id"] for i in item_page(items, "desc", 2, "i1")["data"]], item_page(items, "asc", 9, "i3")["has_more"]
    (['i0'], False)
    """
    ordered = items[::-1] if order == "desc" else list(items)
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise APIError(400, f"no input item of this response has id {after!r}", param="after",
                           code="invalid_value")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}
