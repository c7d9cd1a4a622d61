"""From a validated body to a request in the engine: lengths and token ids checked against
the model, sampling parameters built, the request queued (429 when the queue is full) and
tracked by the drain gate. Every API dialect submits through here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.configs import EngineConfig
from kvserve.server.engine.grammar import Grammar
from kvserve.server.engine.loop import Engine, EngineDown
from kvserve.server.engine.request import Request, SamplingParams
from kvserve.server.engine.scheduler import QueueFull
from kvserve.server.engine.thinking import ThinkingBudget
from kvserve.server.http.errors import APIError, error_body
from kvserve.server.http.guard import Gate
from kvserve.server.http.schemas import SamplingFields
from kvserve.server.http.streams import ClientGone, EngineFailed, EventStream


def sampling_params(body: SamplingFields, prompt_len: int, context: int, limits: EngineConfig,
                    vocab_size: int, grammar: Grammar | None = None, prompt_param: str | None = None) -> SamplingParams:
    """Validate lengths and token ids against the model and build the sampling parameters;
    ``max_tokens`` is capped to what the context leaves after the prompt and to
    ``max_tokens_limit``, and only a prompt that leaves no room is refused."""
    room = context - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {context}",
                       param=prompt_param or ("messages" if hasattr(body, "messages") else "prompt"),
                       code="context_length_exceeded")
    # A max_tokens past what fits is a ceiling, not an error: agent clients send their own
    # output limit (32,000) whatever the model; the reply ends with "length" if it gets there.
    requested = body.requested_max_tokens()
    if body.n > limits.max_batch_size:
        raise APIError(400, f"n must be at most {limits.max_batch_size} (the batch size)", param="n")
    bias = body.bias_pairs()
    if any(token >= vocab_size for token, _ in bias):
        raise APIError(400, f"logit_bias token ids must be below the vocabulary size {vocab_size}",
                       param="logit_bias")
    if body.ignore_eos and grammar is not None:  # a grammar ends by its end-of-sequence token
        raise APIError(400, "ignore_eos cannot be combined with response_format or tools", param="ignore_eos")
    logprobs, top = body.logprob_request()
    return SamplingParams(max_tokens=min(requested or limits.max_tokens, room, limits.max_tokens_limit),
                          temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          min_p=body.min_p, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, logit_bias=bias,
                          seed=None if body.seed is None else body.seed % SEED_SPAN,
                          stop=body.stop_list(), logprobs=logprobs, top_logprobs=top, grammar=grammar,
                          ignore_eos=body.ignore_eos)


# OpenAI seeds are signed 64-bit; MLX's PRNG takes unsigned 64-bit, so seeds wrap into it
# (-1 -> 2**64 - 1), as do the seeds of choices 2..n past the top.
SEED_SPAN = 2**64


def make_request(tokens: list[int], params: SamplingParams, n: int, boundaries: tuple[int, ...] = ()) -> Request:
    """One engine request; choices 2..n are its forks (seeded ones with seeds s+1, s+2, ...).

    >>> r = make_request([1, 2], SamplingParams(seed=7), 3)
    >>> [f.params.seed for f in r.forks], r.forks[0].fork_of == r.request_id
    ([8, 9], True)
    """
    leader = Request(prompt_tokens=tokens, params=params, boundaries=boundaries)
    for i in range(1, n):
        seed = None if params.seed is None else (params.seed + i) % SEED_SPAN
        fork_params = dataclasses.replace(params, seed=seed)
        leader.forks.append(Request(prompt_tokens=tokens, params=fork_params, fork_of=leader.request_id))
    return leader


@dataclass
class Submitted:
    """A request the engine has taken: its events arrive on ``stream``; ``abort`` stops it
    (all its choices); ``close`` ends its tracking by the drain gate, aborting it if it has
    not finished (a client that left)."""

    stream: EventStream
    abort: Callable[[], None]
    gate: Gate
    handle: int

    def close(self) -> None:
        self.gate.untrack(self.handle)
        if not self.stream.finished:  # disconnected or cancelled: free the engine's work
            self.abort()

    async def closing(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """``events``, then ``close`` (however the stream ends)."""
        try:
            async for event in events:
                yield event
        finally:
            self.gate.untrack(self.handle)


def submit(engine: Engine, body: SamplingFields, tokens: list[int], http_request: HTTPRequest,
           grammar: Grammar | None = None, prompt_param: str | None = None,
           boundaries: tuple[int, ...] = (), thinking: ThinkingBudget | None = None) -> Submitted:
    """Validate against the model, queue the request (429 when the queue is full) and track
    it for the drain; ``prompt_param`` names the prompt's field in a too-long error;
    ``boundaries``: where the prompt's messages end (``Request.boundaries``); ``thinking``:
    the reasoning budget the sampler enforces."""
    params = sampling_params(body, len(tokens), engine.model.info.context_length, engine.config,
                             engine.model.info.vocab_size, grammar, prompt_param)
    if thinking is not None:
        params = dataclasses.replace(params, thinking=thinking)
    request = make_request(tokens, params, body.n, boundaries)
    members = [request, *request.forks]
    stream = EventStream([r.request_id for r in members])
    try:
        engine.submit(request, stream.sink)
    except QueueFull:
        raise APIError(429, "the server is at capacity; retry shortly", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except EngineDown as exc:
        raise APIError(503, f"the engine is down: {exc}", code="engine_down") from None

    def abort() -> None:
        for member in members:
            engine.abort(member.request_id)

    gate: Gate = http_request.app.state.gate
    return Submitted(stream, abort, gate, gate.track(abort))  # a drain out of time aborts it


async def answer(job: Submitted, http_request: HTTPRequest, events: Callable[[], AsyncIterator[str]] | None,
                 collect: Callable[[], Awaitable[dict]],
                 error: Callable[[int, dict], dict] = lambda status, body: body) -> Response:
    """The reply of a submitted request, as every dialect gives it: server-sent ``events()``
    when streaming, else the JSON ``collect()`` builds; a client that left or an engine
    failure answered with ``error(status, openai_error_body)`` (a dialect's own shape)."""
    if events is not None:
        return StreamingResponse(job.closing(events()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        return JSONResponse(await collect())
    except ClientGone:
        return JSONResponse(error(400, error_body("client disconnected")), status_code=400)
    except EngineFailed as exc:  # the engine failed on this request, or it waited too long
        return JSONResponse(error(exc.status, exc.body), status_code=exc.status)
    finally:
        job.close()
