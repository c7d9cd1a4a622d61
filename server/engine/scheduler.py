"""Pure scheduling policy: which requests run this step and how many prompt tokens each gets.

The scheduler never imports ``mlx`` and never touches arrays; it moves ``Request`` objects
between a waiting queue and a running set and emits a ``StepPlan`` for the runner. A test
imports it with ``mlx`` made unimportable to keep it that way.

Policy (continuous batching with chunked prefill):
  * admission is FIFO, up to ``max_running`` requests (prefilling or decoding); the choices
    of an ``n > 1`` request (its ``forks``) are admitted together and share its prefill;
  * a step computes at most ``max_step_tokens`` tokens: every decoding request costs 1 and
    always runs, the rest of the budget goes to prompt chunks (each at most
    ``prefill_step_size``) of the running requests that still prefill, in admission order;
  * a new request's first chunk is planned at full size even where the prefix cache will
    give most of the prompt (the runner finds the hit as the chunk runs): the budget left
    unused paces questions after a cached document to one a step. Planning only their own
    tokens started all of them in one step, and every first token then waited for all the
    questions' prefills (docs/benchmarks/long-context-4k.md, fourth run);
  * with ``max_draft_tokens`` (speculative decoding), a decoding request that the runner
    said will propose (``StepResult.armed``) may also verify up to that many proposed tokens
    in its row; they come out of the same budgets, before the prompt chunks, and never past
    the request's ``max_tokens`` (``StepPlan.drafts``);
  * with ``max_kv_tokens``, KV memory is a budget too: a request is admitted only when its
    whole prompt fits beside what the running requests hold, and when decoding outgrows the
    budget the most recently admitted decoding request is *preempted*: its cache is swapped
    out (``StepPlan.swap_out``), it waits at the head of the queue and is swapped back in
    (``StepPlan.swap_in``) when room returns, to continue exactly where it stopped.

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

from kvserve.server.engine.request import FinishReason, Request, RequestStatus, TokenLogprob


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
    """What the runner does in one step, in this order: swap caches out, swap caches in,
    decode the decoding requests, prefill prompt chunks."""

    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[Request, ...] = ()
    swap_out: tuple[Request, ...] = ()
    swap_in: tuple[Request, ...] = ()
    # Proposed tokens a decoding request may verify this step (absent: none).
    drafts: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode and not self.swap_out

    @property
    def num_tokens(self) -> int:
        """Tokens this step may compute: one per decoding request, its proposals, the
        prompt chunks."""
        return len(self.decode) + sum(self.drafts.values()) + sum(c.num_tokens for c in self.prefill)

    def describe(self) -> dict[str, list]:
        """Request ids and chunk sizes, for logs and exact tests (swaps only when present)."""
        out: dict[str, list] = {"prefill": [(c.request.request_id, c.num_tokens) for c in self.prefill],
                                "decode": [r.request_id for r in self.decode]}
        for name in ("swap_out", "swap_in"):
            if getattr(self, name):
                out[name] = [r.request_id for r in getattr(self, name)]
        return out


@dataclass(frozen=True)
class StepResult:
    """What the runner did: prompt tokens consumed and one sampled token per request, after
    the proposed tokens it accepted (speculative decoding): a request's new tokens are
    ``accepted[r] + (sampled[r],)``."""

    prefilled: dict[str, int] = field(default_factory=dict)
    sampled: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    proposed: dict[str, int] = field(default_factory=dict)  # tokens each row verified
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # rows that asked
    cached: dict[str, int] = field(default_factory=dict)  # prompt tokens a prefix cache gave (in prefilled too)
    armed: frozenset[str] = frozenset()  # rows that will propose at the next step: only they get drafts


class Scheduler:
    """FIFO admission into at most ``max_running`` requests; every step decodes all decoding
    requests and fills the rest of a ``max_step_tokens`` budget with prompt chunks."""

    def __init__(self, max_running: int, prefill_step_size: int, max_waiting: int,
                 max_step_tokens: int | None = None, max_kv_tokens: int | None = None,
                 max_draft_tokens: int = 0):
        self.max_running = max_running
        self.prefill_step_size = prefill_step_size
        self.max_waiting = max_waiting
        self.max_step_tokens = prefill_step_size if max_step_tokens is None else max_step_tokens
        if self.max_step_tokens < max_running:  # a decoding request would miss steps
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) < max_running ({max_running})")
        self.max_kv_tokens = max_kv_tokens
        self.max_draft_tokens = max_draft_tokens
        self.armed: frozenset[str] = frozenset()  # the last step's StepResult.armed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        """Queue a request (with its forks, if any) at the back."""
        if len(request.forks) + 1 > self.max_running:
            raise ValueError(f"{len(request.forks) + 1} choices exceed max_running ({self.max_running})")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        swap_in = self._admit()
        swap_out = self._preempt()
        decode = tuple(r for r in self.running if r.status is RequestStatus.DECODE)
        budget = self.max_step_tokens - len(decode)
        kv_room = self._kv_room() - len(decode)
        drafts = self._drafts(decode, min(budget, kv_room))
        budget -= sum(drafts.values())
        kv_room -= sum(drafts.values())
        prefill = []
        for r in self.running:
            if budget <= 0 or kv_room <= 0:
                break  # budget spent: later requests wait, FIFO order is kept
            n = min(self.prefill_step_size, r.prefill_remaining, budget, kv_room)
            if r.status in (RequestStatus.WAITING, RequestStatus.PREFILL) and r.fork_of is None and n > 0:
                prefill.append(PrefillChunk(r, n))
                budget -= n
                kv_room -= n
        return StepPlan(prefill=tuple(prefill), decode=decode, swap_out=swap_out,
                        swap_in=tuple(r for r in swap_in if r not in swap_out), drafts=drafts)

    def _drafts(self, decode: tuple[Request, ...], room: int) -> dict[str, int]:
        """Proposed tokens each armed decoding request may verify: ``max_draft_tokens``,
        less where its ``max_tokens`` is near (the step's own token comes after them) or the
        step's token and KV budgets run out (earliest admitted first). A row that will not
        propose reserves nothing, so prompt chunks keep the budget.

            >>> from kvserve.server.engine.request import Request, SamplingParams
            >>> s = Scheduler(2, 16, 4, max_step_tokens=8, max_draft_tokens=4)
            >>> a, b, c = (Request([1], SamplingParams(max_tokens=n), request_id=i)
            ...            for n, i in ((9, "a"), (3, "b"), (9, "c")))
            >>> b.num_generated = 1
            >>> s.armed = frozenset({"a", "b"})
            >>> s._drafts((a, b, c), room=6)
            {'a': 4, 'b': 1}
        """
        out = {}
        for r in (r for r in decode if r.request_id in self.armed):
            n = min(self.max_draft_tokens, r.params.max_tokens - r.num_generated - 1, room)
            if n > 0:
                out[r.request_id] = n
                room -= n
        return out

    def commit(self, result: StepResult) -> None:
        """Advance counters and states after the runner executed a plan."""
        self.armed = result.armed
        for request in self.running:
            done = result.prefilled.get(request.request_id, 0)
            if request.request_id in result.cached:
                request.num_prefix_cached = result.cached[request.request_id]
            if done:
                request.num_computed += done
                request.status = RequestStatus.PREFILL
            if request.request_id in result.sampled:
                if request.fork_of is not None and request.status is RequestStatus.WAITING:
                    request.num_computed = request.num_prompt_tokens  # its leader's prefill
                request.num_generated += 1 + len(result.accepted.get(request.request_id, ()))
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
            for fork in request.forks:
                if fork.request_id == request_id and not fork.finished:
                    return fork
        return None

    # ---- admission and KV memory -----------------------------------------------------
    def _admit(self) -> list[Request]:
        """Admit from the head of the queue while requests and KV memory allow (FIFO: the
        head blocks the rest). Returns the swapped-out requests admitted back."""
        swap_in = []
        while self.waiting:
            head = self.waiting[0]
            size = 1 if head.swapped else 1 + len(head.forks)
            if len(self.running) + size > self.max_running or not self._fits(head, size):
                break
            self.waiting.popleft()
            if head.swapped:
                head.swapped = False
                swap_in.append(head)
                self.running.append(head)
            else:
                self.running.extend([head, *head.forks])
        return swap_in

    def _fits(self, head: Request, size: int) -> bool:
        """Room for ``head`` and one decode step of everything running with it."""
        if self.max_kv_tokens is None or not self.running:
            return True  # an empty engine admits anything: a lone request is never stuck
        step = len(self.running) + size
        return self._held() + self._need(head) + step <= self.max_kv_tokens

    def _preempt(self) -> tuple[Request, ...]:
        """Swap out the latest-admitted decoding requests until this step's decode fits."""
        if self.max_kv_tokens is None:
            return ()
        victims = []
        while True:
            decoding = [r for r in self.running if r.status is RequestStatus.DECODE]
            if self._held() + len(decoding) <= self.max_kv_tokens or len(self.running) <= 1 \
                    or not decoding:
                break
            victim = decoding[-1]
            self.running.remove(victim)
            victim.swapped = True
            victims.append(victim)
        for victim in reversed(victims):  # the earliest admitted resumes first
            self.waiting.appendleft(victim)
        return tuple(victims)

    def _kv_room(self) -> int:
        if self.max_kv_tokens is None:
            return 1 << 62
        reserved = sum(r.prefill_remaining * len(r.forks) for r in self.running)
        return self.max_kv_tokens - sum(r.num_cached for r in self.running) - reserved

    def _held(self) -> int:
        """KV tokens the running requests hold or have reserved (whole prompts of forks)."""
        return sum(self._need(r) for r in self.running if r.fork_of is None) \
            + sum(r.num_cached for r in self.running if r.fork_of is not None)

    @staticmethod
    def _need(r: Request) -> int:
        """KV tokens ``r`` holds once its prompt is in (its forks copy the prompt)."""
        if r.swapped:
            return r.num_cached
        return r.num_cached + r.prefill_remaining * (1 + len(r.forks))


# Whole prompts prefill together while the padding this adds stays below this share of
# their tokens (padding is computed and thrown away).
MAX_PADDING_SHARE = 0.25


def group_whole_prompts(chunks: tuple[PrefillChunk, ...]) -> tuple[list[PrefillChunk], list[PrefillChunk]]:
    """Split a step's chunks into prompts prefilled together and the rest.

    Together: whole prompts from their first token, without forks, longest first, as long
    as the left padding stays under ``MAX_PADDING_SHARE`` of their tokens; at least two.

        >>> from kvserve.server.engine.request import Request, SamplingParams
        >>> cs = [PrefillChunk(Request(list(range(n)), SamplingParams()), n) for n in (10, 9, 2)]
        >>> [[c.num_tokens for c in g] for g in group_whole_prompts(tuple(cs))]
        [[10, 9], [2]]
    """
    whole = sorted((c for c in chunks if c.request.num_computed == 0 and c.completes_prompt
                    and not c.request.forks), key=lambda c: -c.num_tokens)
    together: list[PrefillChunk] = []
    for c in whole:
        tokens = sum(x.num_tokens for x in together) + c.num_tokens
        padding = (len(together) + 1) * (whole[0].num_tokens) - tokens
        if padding <= MAX_PADDING_SHARE * tokens:
            together.append(c)
    if len(together) < 2:
        return [], list(chunks)
    return together, [c for c in chunks if c not in together]
