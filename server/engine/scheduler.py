"""Pure scheduling policy: which requests run this step and how many prompt tokens each gets.

The scheduler never imports ``mlx`` and never touches arrays; it moves ``Request`` objects
between a waiting queue and a running set and emits a ``StepPlan`` for the runner. A test
imports it with ``mlx`` made unimportable to keep it that way.

Policy (continuous batching with chunked prefill):
  * admission is FIFO, up to ``max_running`` requests (prefilling or decoding);
  * a step computes at most ``max_step_tokens`` tokens: every decoding request costs 1 and
    always runs, the rest of the budget goes to prompt chunks (each at most
    ``prefill_step_size``) of the running requests that still prefill, in admission order.

Example (two requests, chunks of at most 4, a budget of 5 tokens per step):
    >>> from kvserve.server.engine.request import Request, SamplingParams
    >>> s = Scheduler(max_running=2, prefill_step_size=4, max_waiting=8, max_step_tokens=5)
    >>> a = Request([1, 2, 3], SamplingParams(), request_id="a")
    >>> b = Request([4, 5, 6, 7, 8, 9], SamplingParams(), request_id="b")
    >>> s.add(a); s.add(b)
    >>> s.schedule().describe()          # a's whole prompt, b gets the 2 tokens left
    {'prefill': [('a', 3), ('b', 2)], 'decode': []}
    >>> s.commit(StepResult(prefilled={"a": 3, "b": 2}, sampled={"a": 42}))
    >>> s.schedule().describe()          # a decodes (1 token), b's last 4 prompt tokens
    {'prefill': [('b', 4)], 'decode': ['a']}
    >>> s.commit(StepResult(prefilled={"b": 4}, sampled={"a": 7, "b": 9}))
    >>> s.schedule().describe()
    {'prefill': [], 'decode': ['a', 'b']}
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

    @property
    def num_tokens(self) -> int:
        """Tokens this step computes: one per decoding request plus the prompt chunks."""
        return len(self.decode) + sum(c.num_tokens for c in self.prefill)

    def describe(self) -> dict[str, list]:
        """Request ids and chunk sizes, for logs and exact tests."""
        return {"prefill": [(c.request.request_id, c.num_tokens) for c in self.prefill],
                "decode": [r.request_id for r in self.decode]}


@dataclass(frozen=True)
class StepResult:
    """What the runner did: prompt tokens consumed and one sampled token per request."""

    prefilled: dict[str, int] = field(default_factory=dict)
    sampled: dict[str, int] = field(default_factory=dict)


class Scheduler:
    """FIFO admission into at most ``max_running`` requests; every step decodes all decoding
    requests and fills the rest of a ``max_step_tokens`` budget with prompt chunks."""

    def __init__(self, max_running: int, prefill_step_size: int, max_waiting: int,
                 max_step_tokens: int | None = None):
        self.max_running = max_running
        self.prefill_step_size = prefill_step_size
        self.max_waiting = max_waiting
        self.max_step_tokens = prefill_step_size if max_step_tokens is None else max_step_tokens
        if self.max_step_tokens < max_running:  # a decoding request would miss steps
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) < max_running ({max_running})")
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
        decode = tuple(r for r in self.running if r.status is RequestStatus.DECODE)
        budget = self.max_step_tokens - len(decode)
        prefill = []
        for r in self.running:
            if budget <= 0:
                break  # budget spent: later requests wait, FIFO order is kept
            n = min(self.prefill_step_size, r.prefill_remaining, budget)
            if r.status in (RequestStatus.WAITING, RequestStatus.PREFILL) and n > 0:
                prefill.append(PrefillChunk(r, n))
                budget -= n
        return StepPlan(prefill=tuple(prefill), decode=decode)

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
