"""A reasoning budget: a request may think for at most ``budget`` tokens, then its thinking
block is closed for it.

Anthropic's ``thinking: {"type": "enabled", "budget_tokens": N}`` asks for this. The budget
counts the tokens generated inside a thinking block (between the template's start and end
markers, or from the first token when the prompt already opened the block). When the count
reaches the budget and the model has not closed the block itself, the sampler emits the end
marker's tokens in place of sampling, one per step, and the model answers after them. Only
the tokens' ids are involved: this sits beside grammars and penalties in the sampler, and
works for any model whose tokenizer names its markers.

Example (a budget of 2, the prompt ended inside ``<think>``; the end marker is token 9):
    >>> state = BudgetState(ThinkingBudget(budget=2, start=(8,), end=(9,), open=True))
    >>> forced = []
    >>> for sampled in (5, 6, 7, 7):
    ...     token = state.forced()
    ...     token = sampled if token is None else token
    ...     forced.append(token)
    ...     state.observe(token)
    >>> forced  # two thinking tokens, then the end marker, then the answer
    [5, 6, 9, 7]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingBudget:
    """What a request's budget needs: how many thinking tokens, the token ids of the start
    and end markers, and whether the prompt ends inside an open block (templates that end
    the generation prompt with ``<think>\\n``)."""

    budget: int
    start: tuple[int, ...]
    end: tuple[int, ...]
    open: bool = False


class BudgetState:
    """One request's count of thinking tokens, fed every generated token (``observe``);
    ``forced()`` is the token the next step must emit (None: sample as usual)."""

    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.inside = budget.open
        self.spent = 0  # thinking tokens over every block, as Anthropic counts the budget
        self._forcing: int | None = None  # index into budget.end while closing the block
        self._recent: list[int] = []  # the last tokens, to match multi-token markers

    def forced(self) -> int | None:
        if self._forcing is not None:
            return self.budget.end[self._forcing]
        if self.inside and self.spent >= self.budget.budget:
            return self.budget.end[0]
        return None

    def may_force_soon(self) -> bool:
        """Whether the step after the next could be forced, whatever the next token is: a
        step queued before the previous token is read must then wait for it."""
        return self._forcing is not None or (self.inside and self.spent + 1 >= self.budget.budget) \
            or (not self.inside and self.budget.budget <= 1)

    def observe(self, token: int) -> None:
        end, start = self.budget.end, self.budget.start
        if self.forced() is not None:  # a forced step: the token emitted is the marker's
            self._forcing = (self._forcing or 0) + 1
            if self._forcing == len(end):
                self._forcing, self.inside = None, False
            return
        self._recent = (self._recent + [token])[-max(len(end), len(start), 1):]
        if self.inside:
            if _ends_with(self._recent, end):
                self.inside = False
            else:
                self.spent += 1
        elif start and _ends_with(self._recent, start):
            self.inside = True


def _ends_with(seq: list[int], tail: tuple[int, ...]) -> bool:
    return bool(tail) and len(seq) >= len(tail) and tuple(seq[-len(tail):]) == tail
