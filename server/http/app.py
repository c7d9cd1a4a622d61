"""The FastAPI application: OpenAI routes in front of the engine thread.

Handlers validate, tokenize (chat template included), check the context length and post a
``Request`` to the engine; they never touch MLX. Token events come back through an
``EventStream`` and leave as JSON or server-sent events.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvserve.configs import EngineConfig, HTTPConfig
from kvserve.server.engine.grammar import Grammar
from kvserve.server.engine.loop import Engine
from kvserve.server.engine.request import Request, SamplingParams
from kvserve.server.engine.scheduler import QueueFull
from kvserve.server.http.chat import ChatInput, check_grammar, prepare_chat
from kvserve.server.http.errors import APIError, document_errors, error_response, install_error_handlers
from kvserve.server.http.guard import Gate, GuardMiddleware
from kvserve.server.http.logprobs import LogprobFormat
from kvserve.server.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvserve.server.http.streams import ClientGone, EngineFailed, EventStream, Shape, collect, sse_events


def create_app(engine: Engine, http: HTTPConfig | None = None, gate: Gate | None = None) -> FastAPI:
    """``engine`` must already be started (its model loaded); ``gate`` closes admission
    when the server drains (``app.state.gate``)."""
    model = engine.model
    http = http or HTTPConfig()
    app = FastAPI(title="kvserve", version="0.1.0")
    app.state.gate = gate = gate or Gate()
    app.state.sse_keepalive_s = http.sse_keepalive_s
    install_error_handlers(app)
    document_errors(app)
    install_guards(app, http, gate)
    created = int(time.time())
    logprobs = LogprobFormat(model.tokenizer)

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
        card = {"id": info.model_id, "object": "model", "created": created, "owned_by": "kvserve",
                "context_length": info.context_length, "weight_format": info.weight_format,
                "blas": info.blas, "kv_scheme": info.kv_scheme}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest):
        _check_model(body.model, model.info.model_id)
        chat = prepare_chat(openai_chat(body), model.tokenizer)
        await check_grammar(model.grammars, chat.grammar,
                            "response_format" if body.response_format else "tool_choice")
        shape = Shape(chat=True, model=model.info.model_id, id_prefix="chatcmpl",
                      logprobs=logprobs if body.logprob_request()[0] else None, splitter=chat.splitter)
        return await _generate(engine, body, chat.tokens, shape, http_request, grammar=chat.grammar)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http_request: HTTPRequest):
        _check_model(body.model, model.info.model_id)
        tokens = _prompt_tokens(model.tokenizer, body.prompt, model.info.vocab_size)
        prefix = body.prompt if body.echo and isinstance(body.prompt, str) else ""
        shape = Shape(chat=False, model=model.info.model_id, id_prefix="cmpl",
                      logprobs=logprobs if body.logprob_request()[0] else None)
        return await _generate(engine, body, tokens, shape, http_request, prefix)

    return app


def install_guards(app: FastAPI, http: HTTPConfig, gate: Gate) -> None:
    """Guards run before routing; CORS wraps them so even a 401 carries its headers."""
    app.add_middleware(GuardMiddleware, gate=gate, max_body_bytes=http.max_body_bytes,
                       max_header_bytes=http.max_header_bytes, api_key=http.api_key)
    if http.cors_origins:  # off unless configured: browsers then refuse cross-origin calls
        from kvserve.server.http.guard import OpenAICORSMiddleware

        app.add_middleware(OpenAICORSMiddleware, allow_origins=list(http.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])


def _check_model(requested: str, served: str) -> None:
    if requested not in (served, "default"):
        shown = requested if len(requested) <= 64 else requested[:64] + "..."  # never echo a megabyte
        raise APIError(404, f"model {shown!r} is not served here; this server serves '{served}'",
                       param="model", code="model_not_found")


def openai_chat(body: ChatCompletionRequest) -> ChatInput:
    return ChatInput(messages=body.template_messages(), tools=body.tool_dicts(),
                     tool_choice=body.tool_choice_value() or "auto",
                     parallel_tool_calls=body.parallel_tool_calls,
                     response_format=body.response_format.as_dict() if body.response_format else None)


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


def sampling_params(body: SamplingFields, prompt_len: int, context: int, limits: EngineConfig,
                    vocab_size: int, grammar: Grammar | None = None) -> SamplingParams:
    """Validate lengths and token ids against the model and build the sampling parameters."""
    room = context - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {context}",
                       param="messages" if hasattr(body, "messages") else "prompt",
                       code="context_length_exceeded")
    requested = body.requested_max_tokens()
    if requested is not None and requested > limits.max_tokens_limit:
        raise APIError(400, f"max_tokens must be at most {limits.max_tokens_limit}", param="max_tokens")
    if requested is not None and requested > room:
        raise APIError(400, f"prompt ({prompt_len} tokens) plus max_tokens ({requested}) exceeds "
                       f"this model's context of {context}", param="max_tokens",
                       code="context_length_exceeded")
    if body.n > limits.max_batch_size:
        raise APIError(400, f"n must be at most {limits.max_batch_size} (the batch size)", param="n")
    bias = body.bias_pairs()
    if any(token >= vocab_size for token, _ in bias):
        raise APIError(400, f"logit_bias token ids must be below the vocabulary size {vocab_size}",
                       param="logit_bias")
    logprobs, top = body.logprob_request()
    return SamplingParams(max_tokens=min(requested or limits.max_tokens, room),
                          temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          min_p=body.min_p, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, logit_bias=bias,
                          seed=None if body.seed is None else body.seed % SEED_SPAN,
                          stop=body.stop_list(), logprobs=logprobs, top_logprobs=top, grammar=grammar)


# OpenAI seeds are signed 64-bit; MLX's PRNG takes unsigned 64-bit, so seeds wrap into it
# (-1 -> 2**64 - 1), as do the seeds of choices 2..n past the top.
SEED_SPAN = 2**64


def make_request(tokens: list[int], params: SamplingParams, n: int) -> Request:
    """One engine request; choices 2..n are its forks (seeded ones with seeds s+1, s+2, ...).

    >>> r = make_request([1, 2], SamplingParams(seed=7), 3)
    >>> [f.params.seed for f in r.forks], r.forks[0].fork_of == r.request_id
    ([8, 9], True)
    """
    leader = Request(prompt_tokens=tokens, params=params)
    for i in range(1, n):
        seed = None if params.seed is None else (params.seed + i) % SEED_SPAN
        fork_params = dataclasses.replace(params, seed=seed)
        leader.forks.append(Request(prompt_tokens=tokens, params=fork_params, fork_of=leader.request_id))
    return leader


async def _generate(engine: Engine, body: SamplingFields, tokens: list[int], shape: Shape,
                    http_request: HTTPRequest, prefix: str = "", grammar: Grammar | None = None):
    params = sampling_params(body, len(tokens), engine.model.info.context_length, engine.config,
                             engine.model.info.vocab_size, grammar)
    request = make_request(tokens, params, body.n)
    members = [request, *request.forks]
    stream = EventStream([r.request_id for r in members])
    try:
        engine.submit(request, stream.sink)
    except QueueFull:
        raise APIError(429, "the server is at capacity; retry shortly", code="queue_full",
                       headers={"Retry-After": "1"}) from None

    def abort() -> None:
        for member in members:
            engine.abort(member.request_id)

    gate: Gate = http_request.app.state.gate
    handle = gate.track(abort)  # a drain that runs out of time aborts what is left
    if body.stream:
        events = _untracked_after(sse_events(shape, stream, body.include_usage, abort, prefix,
                                             http_request.app.state.sse_keepalive_s), gate, handle)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        return JSONResponse(await collect(shape, stream, http_request, prefix))
    except ClientGone:
        return error_response(400, "client disconnected")
    except EngineFailed as exc:  # the engine failed on this request, or it waited too long
        return JSONResponse(exc.body, status_code=exc.status)
    finally:
        gate.untrack(handle)
        if not stream.finished:  # disconnected or cancelled: free the engine's work
            abort()


async def _untracked_after(events: AsyncIterator[str], gate: Gate, handle: int) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        gate.untrack(handle)
