"""Pure scheduling policy: which requests run this step and how many prompt tokens each gets.

The scheduler never imports ``mlx`` and never touches arrays; it moves ``Request`` objects
between a waiting queue and a running set and emits a ``StepPlan`` for the runner. A test
imports it with ``mlx`` made unimportable to keep it that way.

Example (one running request, prefill in chunks of 4, then one token per step):
    >>> from kvserve.server.engine.request import Request, SamplingParams
    >>> s = Scheduler(max_running=1, prefill_step_size=4, max_waiting=8)
    >>> r = Request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2))
    >>> s.add(r)
    >>> [(c.request is r, c.num_tokens) for c in s.schedule().prefill]
    [(True, 4)]
    >>> s.commit(StepResult(prefilled={r.request_id: 4}, sampled={}))
    >>> [(c.num_tokens) for c in s.schedule().prefill]
    [2]
    >>> s.commit(StepResult(prefilled={r.request_id: 2}, sampled={r.request_id: 42}))
    >>> [q is r for q in s.schedule().decode]
    [True]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.server.engine.request import FinishReason, Request, RequestStatus


class QueueFull(Exception):
    """The waiting queue is at its bound; the HTTP layer answers 429."""


@dataclass(frozen=True)
class PrefillChunk:
    """Feed ``num_tokens`` prompt tokens of ``request`` starting at ``request.num_computed``."""

    request: Request
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        return self.num_tokens == self.request.prefill_remaining


@dataclass(frozen=True)
class StepPlan:
    """What the runner does in one step: prompt chunks to prefill and requests to decode."""

    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[Request, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass(frozen=True)
class StepResult:
    """What the runner did: prompt tokens consumed and one sampled token per request."""

    prefilled: dict[str, int] = field(default_factory=dict)
    sampled: dict[str, int] = field(default_factory=dict)


class Scheduler:
    """FIFO admission into at most ``max_running`` requests, chunked prefill, then decode."""

    def __init__(self, max_running: int, prefill_step_size: int, max_waiting: int):
        self.max_running = max_running
        self.prefill_step_size = prefill_step_size
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        self._admit()
        prefill = tuple(
            PrefillChunk(r, min(self.prefill_step_size, r.prefill_remaining))
            for r in self.running
            if r.status in (RequestStatus.WAITING, RequestStatus.PREFILL)
        )
        decode = tuple(r for r in self.running if r.status is RequestStatus.DECODE)
        return StepPlan(prefill=prefill, decode=decode)

    def commit(self, result: StepResult) -> None:
        """Advance counters and states after the runner executed a plan."""
        for request in self.running:
            done = result.prefilled.get(request.request_id, 0)
            if done:
                request.num_computed += done
                request.status = RequestStatus.PREFILL
            if request.request_id in result.sampled:
                request.num_generated += 1
                request.status = RequestStatus.DECODE

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request from whichever queue holds it."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def find(self, request_id: str) -> Request | None:
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        return None

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
