"""Turning sampled token ids into text: incremental detokenization and stop strings.

Stop strings are matched on text, across token boundaries: text that could still be the
start of a stop string is held back until the next token decides it.

Example (stop "END" split over two tokens " E" and "ND!"):
    >>> m = StopMatcher(("END",))
    >>> m.feed("ok E")      # "E" might begin "END": hold it back
    ('ok ', False)
    >>> m.feed("ND!")       # the stop string completed: drop it and what follows
    ('', True)
"""

from __future__ import annotations

from dataclasses import dataclass, field


class StopMatcher:
    """Emits text up to the first stop string; holds back a possible partial match."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns ``(text safe to emit, stopped)``."""
        window = self._held + text
        hit = self._first_stop(window)
        if hit is not None:
            self._held = ""
            return window[:hit], True
        keep = self._partial_suffix(window)
        self._held = window[len(window) - keep :] if keep else ""
        return window[: len(window) - keep], False

    def flush(self) -> str:
        """Text held back when generation ends without completing a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, window: str) -> int | None:
        hits = [(i, s) for i, s in ((window.find(s), s) for s in self.stops) if i >= 0]
        if not hits:
            return None
        at, self.matched = min(hits, key=lambda h: h[0])
        return at

    def _partial_suffix(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(window)), best, -1):
                if window.endswith(stop[:n]):
                    best = n
                    break
        return best


@dataclass
class OutputState:
    """Per-request text state: a streaming detokenizer from mlx-lm plus the stop matcher."""

    detokenizer: object
    matcher: StopMatcher
    eos_token_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)

    def add_token(self, token: int) -> tuple[str, bool]:
        """Returns ``(new text, stopped)``; an end-of-sequence token stops without text."""
        if token in self.eos_token_ids:
            return self.finish(), True
        self.token_ids.append(token)
        self.detokenizer.add_token(token)
        return self.matcher.feed(self.detokenizer.last_segment)

    def finish(self) -> str:
        """Flush the detokenizer and the held-back text at the end of generation."""
        self.detokenizer.finalize()
        text, stopped = self.matcher.feed(self.detokenizer.last_segment)
        return text if stopped else text + self.matcher.flush()
