"""Typed objects that cross the engine's boundaries: what a request asks, and what comes back.

Nothing here imports ``mlx``: the HTTP layer builds ``Request`` objects and reads
``TokenEvent`` objects, and the scheduler reasons about them without touching arrays.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy.

    Example:
        >>> SamplingParams(max_tokens=8, temperature=0.0).greedy
        True
    """

    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


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
    usage: Usage | None = None
    error: str | None = None
