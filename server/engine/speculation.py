"""Speculative decoding: what each decoding row proposes, and when it stops proposing.

A row's proposals are verified by the target model inside the continuous batch (the
runner feeds ``[last token, *proposals]`` in one forward, ``sampler.accept`` keeps the
longest prefix the model agrees with, each cache family drops the rest in its own scheme).
This module is pure Python: it never touches arrays.

Prompt lookup (``--speculative ngram``): the continuation of the latest earlier occurrence
of the row's last n tokens (n = 4, then 3, then 2) in its own prompt and output. Agents,
code edits and documents quoted back repeat long stretches of their context; there it
guesses right most of the time, for no second model.

    >>> index = NgramIndex()
    >>> index.propose([5, 6, 7, 8, 9, 5, 6, 7], k=3)     # "5 6 7" was followed by "8 9 5"
    [8, 9, 5]
    >>> index.propose([1, 2, 3], k=3)                     # no earlier match: nothing
    []

A draft model (``--speculative draft``, ``draft.py``) proposes instead: its own greedy
continuation of the row's tokens. Either way a ``Speculator`` decides which rows propose at
each step and how many of their proposals are verified.

Adaptive, twice. Verifying costs: every row of the batch computes as many positions as the
longest proposal (a rectangular forward), and no step is queued ahead while any row
proposes. So ``verify_width`` verifies only as many positions as the rows' expected accepted
tokens pay for (each row's acceptance rate, ``RowSpeculation.rate``, against the cost of a
position, ``position_cost``); and a row whose guesses keep failing pauses
(``RowSpeculation.record``) for a number of steps that doubles at each pause.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import fsum
from typing import Callable, Protocol

NGRAM_SIZES = (4, 3, 2)  # longest first: a longer match is a better guess
MIN_GAIN = 0.3  # accepted tokens per step below which a row pauses
GAIN_WEIGHT = 0.2  # weight of the latest step in the running mean
FIRST_PAUSE, LONGEST_PAUSE = 16, 256  # steps
RATE_DECAY = 0.8  # weight of the history in a row's acceptance rate


def position_cost(rows: int) -> float:
    """What one more verified position costs, as a share of a one-token decode step of
    ``rows`` rows, fitted on a 2-core x86-64 VM with the default model (135M, decode
    products from the packed codes, the CPU attention kernel and layer primitives) at
    ~1,100 cached tokens (``python bench/speculative.py --costs``). One row: 2 positions
    take 1.24x one, 5 positions 1.95x (~0.2 a position). Eight rows: 5 take 2.6x (0.4 a
    position), and rows that keep different counts are realigned (a copy of each row that
    moves, ~0.2 of a step per row), and the step queued ahead is lost; a position costs
    ~0.9 of a step there. Between the two, linear. Fitted lower (0.41 at eight rows), the
    eight copying streams of ``python bench/speculative.py --engine-steps --fit 0.2,0.03``
    verified 2-3 positions a step, 186.5 ms a step against 61-65 ms for a plain one, and
    their all-eight-rows steps decoded 91.6 tok/s against 130.5 without speculation: at
    eight rows a verify forward of 24 or more rows leaves the packed codes for the dense
    products, and the step is bound by arithmetic, not per-step overhead.

        >>> round(position_cost(1), 3), round(position_cost(8), 3)
        (0.2, 0.9)
    """
    return 0.2 + 0.1 * (rows - 1)


def verify_width(guesses: list[tuple[int, float]], rows: int, cost=position_cost) -> int:
    """Positions to verify (1: none) for ``rows`` rows of which some propose ``(k, rate)``:
    the width that maximizes expected tokens per unit of step cost, a row emitting
    1 + rate + rate^2 + ... (up to its k) tokens; ``cost(rows)`` is a position's share of a
    step (a device where positions are free verifies every guess).

        >>> verify_width([(4, 0.9)], rows=1), verify_width([(4, 0.3)], rows=1)
        (5, 2)
        >>> verify_width([(4, 0.9)] * 2, rows=2), verify_width([(4, 0.85)] * 8, rows=8)
        (5, 1)
    """
    best, best_score = 1, 1.0 - 1e-9  # a free position is taken
    for width in range(2, max((k for k, _ in guesses), default=0) + 2):
        gained = fsum(rate ** i for k, rate in guesses for i in range(1, min(k, width - 1) + 1))
        score = (1 + gained / rows) / (1 + cost(rows) * (width - 1))
        if score > best_score:
            best, best_score = width, score
    return best


class NgramIndex:
    """The latest position of every n-gram of one request's tokens, grown as they come.

    ``propose`` indexes every n-gram that ends before the last token, then looks up the
    n-gram the tokens end with: its latest earlier occurrence is followed by the proposal.
    Indexing is incremental (a token list only grows while a request lives)."""

    def __init__(self, sizes: tuple[int, ...] = NGRAM_SIZES):
        self.sizes = sizes
        self._seen: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self._indexed = 0  # n-grams ending before this index are in _seen

    def propose(self, tokens: list[int], k: int) -> list[int]:
        last = len(tokens) - 1
        for end in range(self._indexed, last):
            for n in self.sizes:
                if end + 1 >= n:
                    self._seen[tuple(tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, last)
        for n in self.sizes:
            if len(tokens) > n:
                at = self._seen.get(tuple(tokens[-n:]))
                if at is not None:
                    return tokens[at + 1 : at + 1 + k]
        return []


@dataclass
class RowSpeculation:
    """One request's acceptance history and the rule that pauses its proposals.

        >>> row = RowSpeculation()
        >>> for _ in range(6): row.record(proposed=4, accepted=0)
        >>> row.active, row.paused_for
        (False, 16)
    """

    gain: float = 1.0  # running mean of accepted tokens per step
    kept: float = 0.0  # decayed counts of guesses kept and of first rejections
    missed: float = 0.0
    paused_for: int = 0  # steps left before it proposes again
    next_pause: int = FIRST_PAUSE

    @property
    def active(self) -> bool:
        return self.paused_for == 0

    @property
    def rate(self) -> float:
        """Chance that the next guess is kept (Laplace's rule on the decayed counts).

            >>> row = RowSpeculation(); row.record(proposed=4, accepted=4); round(row.rate, 3)
            0.833
        """
        return (self.kept + 1) / (self.kept + self.missed + 2)

    def record(self, proposed: int, accepted: int) -> None:
        """A step this row was active in: ``proposed`` tokens verified (0: no guess)."""
        if proposed:
            self.kept = RATE_DECAY * self.kept + accepted
            self.missed = RATE_DECAY * self.missed + (accepted < proposed)
        self.gain += GAIN_WEIGHT * (accepted - self.gain)
        if self.gain < MIN_GAIN:
            self.paused_for, self.gain = self.next_pause, 1.0
            self.next_pause = min(2 * self.next_pause, LONGEST_PAUSE)
        elif accepted >= proposed > 0:
            self.next_pause = FIRST_PAUSE  # it guesses well again: short pauses

    def tick(self) -> None:
        """A step this row decoded while paused; a pause that ends forgets the acceptance
        history, so the row tries again from the prior (a rate that stayed too low to pay
        for a position would otherwise never be measured again).

            >>> row = RowSpeculation(missed=3.0, paused_for=1); row.tick(); row.active, row.rate
            (True, 0.5)
        """
        self.paused_for = max(0, self.paused_for - 1)
        if self.paused_for == 0:
            self.kept = self.missed = 0.0


class Proposer(Protocol):
    """Where proposals come from: ``ready`` says whether a row would propose after
    ``tokens``, ``propose`` gives up to k tokens per row (``{id: (tokens, k)}``), ``release``
    forgets a request. ``cost``: one proposed position's forward, as a share of a one-row
    decode step of the target (0: no model runs)."""

    cost: float

    def ready(self, request_id: str, tokens: list[int]) -> bool: ...

    def propose(self, wants: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]: ...

    def release(self, request_id: str) -> None: ...


class NgramProposer:
    """Prompt lookup: each request's ``NgramIndex`` over its own prompt and output.

        >>> p = NgramProposer()
        >>> p.ready("a", [5, 6, 7, 5, 6]), p.propose({"a": ([5, 6, 7, 5, 6], 2)})
        (True, {'a': [7, 5]})
    """

    cost = 0.0

    def __init__(self):
        self._index: dict[str, NgramIndex] = {}

    def ready(self, request_id: str, tokens: list[int]) -> bool:
        return bool(self._index.setdefault(request_id, NgramIndex()).propose(tokens, 1))

    def propose(self, wants: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
        return {r: self._index.setdefault(r, NgramIndex()).propose(tokens, k) for r, (tokens, k) in wants.items()}

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)


class Speculator:
    """Which decoding rows propose at each step and how many of their proposals are
    verified; the runner feeds it the rows' tokens and what the model kept.

    Once per step (``arm``), for the next one: paused rows count the step, then the rows
    that will propose are those whose proposer is ready, provided one guess each would pay
    for its position in a batch of this size. Text that does not repeat itself rarely arms
    an n-gram row, and a wide batch where positions cost more than the rows' guesses bring
    arms none: either way the runner keeps queueing steps ahead. (Proposals never change
    the tokens, only the steps.)

        >>> s = Speculator(NgramProposer())
        >>> tokens = {"a": [5, 6, 7, 5, 6], "b": [1, 2, 3]}
        >>> sorted(s.arm(["a"], tokens, takes=lambda r: True)), sorted(s.arm(["b"], tokens, takes=lambda r: True))
        (['a'], [])
        >>> s.arm(["a"], tokens, takes=lambda r: True) and s.propose(["a"], {"a": 4}, tokens)
        [[7]]

    ("b" has no earlier match; "a" proposes "7 5 6", and at a first guess's rate of 1/2 one
    verified position pays for itself in a one-row batch, a second does not.)
    """

    def __init__(self, proposer: Proposer):
        self.proposer = proposer
        self.position_cost = position_cost  # a verified position's share of a step
        self._rows: dict[str, RowSpeculation] = {}
        self._consulted: dict[str, int] = {}  # rows asked for proposals this step: how many
        self.armed: frozenset[str] = frozenset()  # rows that propose at the next step

    def cost(self, rows: int) -> float:
        """A verified position's share of a step of ``rows`` rows, with the forward a draft
        model takes for it in each row (counted at a one-row step: an upper bound).

            >>> Speculator(NgramProposer()).cost(1)
            0.2
        """
        return self.position_cost(rows) + self.proposer.cost * rows

    def arm(self, rows: list[str], tokens: dict[str, list[int]], takes: Callable[[str], bool]) -> frozenset[str]:
        """The rows that propose at the next step; ``takes(r)``: row r's sampling can take
        verified proposals (no grammar, no logprobs)."""
        for r in rows:
            if r in self._rows and not self._rows[r].active:
                self._rows[r].tick()
        armed = {r for r in rows if takes(r) and self._rows.setdefault(r, RowSpeculation()).active
                 and self.proposer.ready(r, tokens[r])}
        # A position's gain falls with its depth while its cost does not: if a first guess
        # does not pay, no longer proposal does (verify_width would verify nothing). Rows
        # declined count a step without gain: they pause, and try again after it.
        if armed and verify_width([(1, self._rows[r].rate) for r in armed], len(rows), self.cost) == 1:
            for r in armed:
                self._rows[r].record(proposed=0, accepted=0)
            armed = set()
        self.armed = frozenset(armed)
        return self.armed

    def propose(self, rows: list[str], drafts: dict[str, int], tokens: dict[str, list[int]]) -> list[list[int]]:
        """Each batch row's proposals (maybe none): armed rows with ``drafts`` ask the
        proposer; ``verify_width`` cuts them to what the rows' acceptance rates pay for in a
        batch of this size."""
        wants = {r: (tokens[r], drafts[r]) for r in rows if drafts.get(r, 0) > 0 and r in self.armed}
        if wants and self.proposer.cost:
            # A draft model's tokens cost forwards: ask only for as many as full-length
            # guesses would have verified (the same width as cutting them afterwards).
            most = verify_width([(k, self._rows[r].rate) for r, (_, k) in wants.items()], len(rows), self.cost) - 1
            wants = {r: (t, min(k, most)) for r, (t, k) in wants.items()}
        guesses = self.proposer.propose(wants) if wants else {}
        width = verify_width([(len(g), self._rows[r].rate) for r, g in guesses.items() if g], len(rows), self.cost)
        self._consulted = {r: min(len(g), width - 1) for r, g in guesses.items()}
        return [guesses.get(r, [])[: width - 1] for r in rows]

    def record(self, accepted: dict[str, tuple[int, ...]]) -> None:
        """Every row consulted this step (whether or not it guessed, whatever the step's
        form) counts its outcome once: the adaptive rule sees one history per request."""
        for r, n in self._consulted.items():
            if r in self._rows:
                self._rows[r].record(n, len(accepted.get(r, ())))
        self._consulted = {}

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self.proposer.release(request_id)
