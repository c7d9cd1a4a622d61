"""The FastAPI application: OpenAI routes in front of the engine thread.

Handlers validate, tokenize (chat template included), check the context length and post a
``Request`` to the engine; they never touch MLX. Token events come back through an
``EventStream`` and leave as JSON or server-sent events.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import PlainTextResponse

from kvserve.configs import HTTPConfig
from kvserve.server.engine.grammar import Grammar
from kvserve.server.engine.loop import Engine
from kvserve.server.http.anthropic import install_anthropic_routes
from kvserve.server.http.chat import ChatInput, check_grammar, prepare_chat
from kvserve.server.http.errors import APIError, document_errors, error_response, install_error_handlers
from kvserve.server.http.guard import Gate, GuardMiddleware
from kvserve.server.http.logprobs import LogprobFormat
from kvserve.server.http.responses import install_responses_routes
from kvserve.server.http.responses.store import ResponseStore
from kvserve.server.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvserve.server.http.streams import Shape, collect, sse_events
from kvserve.server.http.names import ModelNames
from kvserve.server.http.submit import answer, submit


def create_app(engine: Engine, http: HTTPConfig | None = None, gate: Gate | None = None,
               responses: ResponseStore | None = None) -> FastAPI:
    """``engine`` must already be started (its model loaded); ``gate`` closes admission
    when the server drains (``app.state.gate``); ``responses`` keeps the Responses API's
    responses (the server's is a file in its cache folder; None: kept in memory)."""
    model = engine.model
    http = http or HTTPConfig()
    responses = responses or ResponseStore(None, http.max_stored_responses)
    app = FastAPI(title="kvserve", version="0.1.0")
    app.state.gate = gate = gate or Gate()
    app.state.sse_keepalive_s = http.sse_keepalive_s
    install_error_handlers(app)
    document_errors(app)
    install_guards(app, http, gate)
    logprobs = LogprobFormat(model.tokenizer)
    names = ModelNames(model.info.model_id, http.served_model_names)
    install_info_routes(app, engine, gate, names)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest):
        name = names.check(body.model)
        chat = prepare_chat(openai_chat(body), model.tokenizer, boundaries=model.message_ends)
        await check_grammar(model.grammars, chat.grammar,
                            "response_format" if body.response_format else "tool_choice")
        shape = Shape(chat=True, model=name, id_prefix="chatcmpl",
                      logprobs=logprobs if body.logprob_request()[0] else None, splitter=chat.splitter)
        return await _generate(engine, body, chat.tokens, shape, http_request, grammar=chat.grammar,
                               boundaries=chat.boundaries)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http_request: HTTPRequest):
        name = names.check(body.model)
        tokens = _prompt_tokens(model.tokenizer, body.prompt, model.info.vocab_size)
        prefix = body.prompt if body.echo and isinstance(body.prompt, str) else ""
        shape = Shape(chat=False, model=name, id_prefix="cmpl",
                      logprobs=logprobs if body.logprob_request()[0] else None)
        return await _generate(engine, body, tokens, shape, http_request, prefix)

    install_anthropic_routes(app, engine, names)
    install_responses_routes(app, engine, names, responses)
    return app


def install_info_routes(app: FastAPI, engine: Engine, gate: Gate, names: ModelNames) -> None:
    """``/metrics``, ``/health`` and ``/v1/models``: what the server is and how it does."""
    model = engine.model
    created = int(time.time())

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health():
        ok, reason = engine.health()
        if not ok:
            return error_response(503, reason)
        if gate.draining:
            return error_response(503, "the server is shutting down", code="server_draining")
        return {"status": "ok", "inflight": engine.inflight}

    @app.get("/v1/models")
    async def models():
        info = model.info
        card = {"object": "model", "created": created, "owned_by": "kvserve",
                "context_length": info.context_length, "weight_format": info.weight_format,
                "blas": info.blas, "kv_scheme": info.kv_scheme}
        if model.device is not None:
            card["device"] = model.device.card()
        return {"object": "list", "data": [{"id": name, **card} for name in names.listed()]}


def install_guards(app: FastAPI, http: HTTPConfig, gate: Gate) -> None:
    """Guards run before routing; CORS wraps them so even a 401 carries its headers."""
    app.add_middleware(GuardMiddleware, gate=gate, max_body_bytes=http.max_body_bytes,
                       max_header_bytes=http.max_header_bytes, api_key=http.api_key)
    if http.cors_origins:  # off unless configured: browsers then refuse cross-origin calls
        from kvserve.server.http.guard import OpenAICORSMiddleware

        app.add_middleware(OpenAICORSMiddleware, allow_origins=list(http.cors_origins),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"])


def openai_chat(body: ChatCompletionRequest) -> ChatInput:
    return ChatInput(messages=body.template_messages(), tools=body.tool_dicts(),
                     tool_choice=body.tool_choice_value() or "auto",
                     parallel_tool_calls=body.parallel_tool_calls,
                     response_format=body.response_format.as_dict() if body.response_format else None,
                     template_kwargs=body.template_kwargs())


def _prompt_tokens(tokenizer: Any, prompt: str | list[int], vocab: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        tokens = list(tokenizer.encode(prompt))
        if not tokens:  # e.g. only control characters the vocabulary drops: nothing to condition on
            raise APIError(400, "prompt encodes to no tokens", param="prompt")
        return tokens
    if any(t >= vocab for t in prompt):
        raise APIError(400, f"prompt token ids must be below the vocabulary size {vocab}", param="prompt")
    return list(prompt)


async def _generate(engine: Engine, body: SamplingFields, tokens: list[int], shape: Shape,
                    http_request: HTTPRequest, prefix: str = "", grammar: Grammar | None = None,
                    boundaries: tuple[int, ...] = ()):
    job = submit(engine, body, tokens, http_request, grammar, boundaries=boundaries)
    events = (lambda: sse_events(shape, job.stream, body.include_usage, job.abort, prefix,
                                 http_request.app.state.sse_keepalive_s)) if body.stream else None
    return await answer(job, http_request, events, lambda: collect(shape, job.stream, http_request, prefix))
