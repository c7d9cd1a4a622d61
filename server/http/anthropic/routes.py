"""Anthropic's Messages API on the same engine as OpenAI's routes: ``POST /v1/messages``
(JSON or streamed events) and ``POST /v1/messages/count_tokens``. Errors on these paths
take Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.

``usage.cache_read_input_tokens`` is the part of the prompt the prefix cache served.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from kvserve.server.engine.loop import Engine
from kvserve.server.http.anthropic.convert import chat_input, sampling_fields
from kvserve.server.http.anthropic.replies import collect_message, error_json, message_events
from kvserve.server.http.anthropic.schemas import CountTokensRequest, MessagesRequest
from kvserve.server.http.chat import check_grammar, prepare_chat
from kvserve.server.http.errors import ERROR_SCHEMAS, ERROR_SHAPES
from kvserve.server.http.names import ModelNames
from kvserve.server.http.submit import answer, submit
from kvserve.server.http.tools import ReplySplitter

PREFIX = "/v1/messages"
ERROR_SCHEMA = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}


def install_anthropic_routes(app: FastAPI, engine: Engine, names: ModelNames) -> None:
    """``names`` answers a model not served here with a 404, and names the reply."""
    model = engine.model
    ERROR_SHAPES[PREFIX] = lambda status, message, param: error_json(status, _with_param(message, param))
    ERROR_SCHEMAS[PREFIX] = ERROR_SCHEMA

    @app.post(PREFIX)
    async def messages(body: MessagesRequest, http_request: HTTPRequest):
        name = names.check(body.model)
        chat = prepare_chat(chat_input(body), model.tokenizer, boundaries=model.message_ends)
        await check_grammar(model.grammars, chat.grammar, "tool_choice")
        splitter = chat.splitter(stream_calls=body.stream) if chat.splitter is not None else ReplySplitter(None)
        job = submit(engine, sampling_fields(body), chat.tokens, http_request, chat.grammar, "messages",
                     chat.boundaries, chat.thinking_budget(body.thinking_budget()))
        prompt = len(chat.tokens)
        events = (lambda: message_events(job.stream, splitter, name, prompt, job.abort,
                                         http_request.app.state.sse_keepalive_s)) if body.stream else None
        return await answer(job, http_request, events,
                            lambda: collect_message(job.stream, http_request, splitter, name, prompt),
                            lambda status, error: error_json(status, error["error"]["message"]))

    @app.post(f"{PREFIX}/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        names.check(body.model)
        chat = prepare_chat(chat_input(body), model.tokenizer)
        return {"input_tokens": len(chat.tokens)}


def _with_param(message: str, param: str | None) -> str:
    """Anthropic's errors have no ``param`` field: the message names it instead.

    >>> _with_param("Field required", "max_tokens"), _with_param("unknown route", None)
    ('max_tokens: Field required', 'unknown route')
    """
    if not param or message.startswith(param) or f"({param})" in message:
        return message
    return f"{param}: {message}"

