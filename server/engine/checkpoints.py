"""Where a prompt's prefill stops for the prefix cache to keep a checkpoint, and what it kept.

A model with sliding-window or recurrent-state layers can only resume from the lengths the
prefix cache holds those layers at (``kvserve.cache.prefix.checkpoints``). The runner asks
``cuts`` where to split a prompt chunk: the end of each rendered message (where the next
conversation with the same system prompt, or a retry with an edited last turn, parts), a
grid of every ``every`` tokens (a long document that parts mid-message), where the prompt
parts from the longest cached one (``part``: a second prompt with a known start marks where
that start ends, for the third), and, when a layer cannot trim at all, the last prompt token
minus one (an identical re-send recomputes one token). After each piece it calls ``take``; when the prompt completes, ``pop`` hands the
checkpoints to the prefix cache with the prompt's entry.

    >>> from kvserve.server.engine.request import Request, SamplingParams
    >>> r = Request(list(range(3000)), SamplingParams(), boundaries=(512, 2990))
    >>> plan = Checkpoints(every=1024)
    >>> plan.cuts(r, start=0, end=2048, windows=True, states=True)
    [512, 1024, 2048]
    >>> plan.cuts(r, start=2048, end=3000, windows=True, states=True)
    [2990, 2999]
    >>> plan.cuts(r, start=0, end=3000, windows=True, states=False)   # a window reaches back
    [512, 1024, 2048, 2990]
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.cache import PromptCache
from kvserve.cache.container import cannot_trim_at_all, checkpointed_kinds
from kvserve.cache.prefix.checkpoints import Checkpoint, capture
from kvserve.server.engine.request import Request


# A cut where a prompt parts from the cached ones is made only when it would serve at least
# this many tokens more than the prompt's own hit: every chat shares its template's first
# few tokens with every other, and a cut there would only split the prefill (and make its
# rounding depend on which requests happened to be cached first).
MIN_PARTING_GAIN = 256


class Checkpoints:
    """The cut points of prompts being prefilled and the checkpoints taken so far."""

    def __init__(self, every: int):
        self.every = every
        self._taken: dict[str, list[Checkpoint]] = {}
        self._parting: dict[str, int] = {}  # where a prompt parts from the cached ones
        self._kinds: tuple[bool, bool] | None = None  # (window or state layers, a state layer)

    def kinds(self, fresh: Callable[[], PromptCache]) -> tuple[bool, bool]:
        """Whether the model has layers to checkpoint, and layers that cannot trim at all
        (read once from an empty cache of the model, ``fresh()``)."""
        if self._kinds is None:
            cache = fresh()
            self._kinds = (bool(checkpointed_kinds(cache)), cannot_trim_at_all(cache))
        return self._kinds

    def part(self, request_id: str, at: int, hit: int) -> None:
        """The request's prompt parts from the cached ones after ``at`` tokens
        (``PrefixCache.parting``) and resumes at ``hit``: one more cut at ``at`` when that
        serves ``MIN_PARTING_GAIN`` tokens more."""
        if at - hit >= MIN_PARTING_GAIN:
            self._parting[request_id] = at

    def cuts(self, request: Request, start: int, end: int, windows: bool, states: bool) -> list[int]:
        """Prompt lengths in (start, end] to stop at, ascending (module doc); never the
        prompt's own length, which its entry holds."""
        if not windows:
            return []
        n = request.num_prompt_tokens
        points = {*request.boundaries, self._parting.get(request.request_id, 0)}
        if self.every:
            points.update(range(self.every, n, self.every))
        if states:
            points.add(n - 1)
        return sorted(p for p in points if start < p <= end and p < n)

    def take(self, request_id: str, cache: PromptCache) -> None:
        self._taken.setdefault(request_id, []).append(capture(cache))

    def pop(self, request_id: str) -> list[Checkpoint]:
        self._parting.pop(request_id, None)
        return self._taken.pop(request_id, [])
