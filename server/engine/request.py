"""Typed objects that cross the engine's boundaries: what a request asks, and what comes back.

Nothing here imports ``mlx``: the HTTP layer builds ``Request`` objects and reads
``TokenEvent`` objects, and the scheduler reasons about them without touching arrays.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from kvserve.server.engine.grammar import Grammar
from kvserve.server.engine.thinking import ThinkingBudget

_ids = itertools.count()


class RequestStatus(enum.Enum):
    """Life cycle of a request. Only the scheduler moves a request between states."""

    WAITING = "waiting"  # queued, nothing computed
    PREFILL = "prefill"  # some prompt tokens are in its cache
    DECODE = "decode"  # prompt done, generating
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the client went away or the server is stopping
    ERROR = "error"  # the engine failed on this request
    TIMEOUT = "timeout"  # waited in the queue longer than engine.queue_timeout_s


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy.

    ``top_k == 0`` and ``min_p == 0`` switch those filters off. The penalties follow
    OpenAI: a token's logit loses ``presence_penalty`` once it has been generated and
    ``frequency_penalty`` per time it was generated; ``logit_bias`` adds to chosen logits.
    ``logprobs`` asks for the log-probability of each sampled token and ``top_logprobs``
    for that many alternatives, both from the model's own distribution (before penalties,
    filters and temperature). ``grammar`` constrains the output (``grammar.py``);
    ``thinking`` closes a reasoning block once it has used its budget (``thinking.py``);
    ``ignore_eos`` keeps generating past end-of-sequence tokens, up to ``max_tokens``.

    Example:
        >>> p = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((5, -100.0),))
        >>> p.greedy, p.adjusts_logits, p.plain_greedy
        (True, True, False)
    """

    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Grammar | None = None
    thinking: ThinkingBudget | None = None
    ignore_eos: bool = False  # end-of-sequence tokens are output like any other

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a bias change the logits before sampling."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def penalized(self) -> bool:
        """The logits depend on the tokens generated so far (presence or frequency penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits: such rows of a batch are sampled together."""
        return self.greedy and not self.adjusts_logits and self.grammar is None and self.thinking is None


@dataclass
class Request:
    """One generation request as the engine sees it.

    The counters are named rather than derived from list lengths so the scheduler can
    plan without reading token lists: ``num_computed`` prompt tokens are in the cache,
    ``num_generated`` tokens were sampled.
    """

    prompt_tokens: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    num_generated: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    # Choices 2..n of an ``n > 1`` request: they share this request's prefill and start
    # decoding, each with its own sampler, from the step its prompt completes.
    forks: list[Request] = field(default_factory=list)
    fork_of: str | None = None
    swapped: bool = False  # preempted: its cache is on disk, its sampler kept
    num_prefix_cached: int = 0  # prompt tokens that came from the prefix cache
    # Prompt lengths where a later prompt is likely to part from this one (the end of each
    # rendered message): the prefix cache keeps checkpoints there for window and state layers.
    boundaries: tuple[int, ...] = ()

    @property
    def num_cached(self) -> int:
        """Tokens in this request's KV cache (the last sampled token is not in it yet)."""
        return self.num_computed + max(self.num_generated - 1, 0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_tokens)

    @property
    def prefill_remaining(self) -> int:
        return self.num_prompt_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those reused from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the ``top_logprobs`` most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """What the engine sends to a request's outbox after each step.

    ``text`` is the new printable text (stop strings already removed); the last event of a
    request carries ``finish_reason`` and ``usage``.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    usage: Usage | None = None
    error: str | None = None
    stop: str | None = None  # the stop string that ended the request, if one did
