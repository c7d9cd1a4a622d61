"""Checkpoints: what a prefix cache entry keeps of the layers that cannot trim back.

A full-attention layer trimmed to m tokens is what it held at m, so one entry serves every
shorter prefix. A sliding window has dropped its oldest tokens and a recurrent state
(GatedDeltaNet, Mamba) holds one position only: each layer can drop only its ``reach`` last
tokens (``trim_reach``: a window, what it holds beyond ``window - 1``; a state, none). So
while a prompt is prefilled, the runner takes ``capture`` of those layers at the points
later prompts are likely to part (message ends, a grid, the last prompt token minus one);
the entry keeps them beside its full layers, and a lookup resumes at the longest length
every layer can serve: its own full layers trimmed, the window and state layers from the
checkpoint at or after that length.

Which lengths an entry serves (``spans``), a worked example: 3 layers, 100 tokens, one
full-attention layer, one window layer that can drop 20, one state layer (reach 0);
checkpoints at 40 (the window's copy there can drop 10, the state none) and at 99 (the
state only: the window's own end reaches back to 80):

    >>> spans(100, [100, 20, 0], [(40, {1: 10, 2: 0}), (99, {2: 0})])
    ((40, 40), (99, 100))
    >>> best_length(((40, 40), (99, 100)), 98), best_length(((40, 40), (99, 100)), 30)
    (40, None)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvserve.cache.container import PromptCache, checkpointed_kinds, converted_copy

Span = tuple[int, int]


@dataclass(frozen=True)
class Checkpoint:
    """Copies of some layers (index -> ``LayerState``) as they were at ``num_tokens``."""

    num_tokens: int
    layers: tuple[tuple[int, "LayerState"], ...]  # noqa: F821 (snapshot.py)

    @property
    def nbytes(self) -> int:
        return sum(state.nbytes for _, state in self.layers)

    def reaches(self) -> dict[int, int]:
        return {i: state.reach for i, state in self.layers}


def capture(cache: PromptCache) -> Checkpoint:
    """Copies of ``cache``'s window and state layers (B = 1) at its offset, in the scheme the
    container will convert them to, packed into one allocation."""
    from kvserve.cache.prefix.snapshot import kv_floor, layer_states

    n = int(cache.offset)
    indices = checkpointed_kinds(cache)
    floor = kv_floor(cache)
    copies = [converted_copy(cache, i) for i in indices]
    states = layer_states(copies, [min(c.trim_reach(), n - floor) for c in copies])
    return Checkpoint(n, tuple(zip(indices, states)))


def _intervals(n: int, reach: int, layer: int, checkpoints: Sequence[tuple[int, dict[int, int]]]) -> list[Span]:
    out = [(n - reach, n)]
    out += [(c - r[layer], c) for c, r in checkpoints if layer in r]
    return _union(out)


def _union(spans: Iterable[Span]) -> list[Span]:
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _intersect(a: list[Span], b: list[Span]) -> list[Span]:
    out = []
    for lo_a, hi_a in a:
        for lo_b, hi_b in b:
            lo, hi = max(lo_a, lo_b), min(hi_a, hi_b)
            if lo <= hi:
                out.append((lo, hi))
    return _union(out)


def spans(num_tokens: int, reaches: Sequence[int],
          checkpoints: Sequence[tuple[int, dict[int, int]]]) -> tuple[Span, ...]:
    """The lengths (closed intervals, at least 1) every layer can serve exactly: from the
    entry's own layers (``reaches``) or from a checkpoint's copies."""
    out = [(1, num_tokens)]
    for i, reach in enumerate(reaches):
        out = _intersect(out, _intervals(num_tokens, reach, i, checkpoints))
    return tuple(out)


def best_length(servable: Sequence[Span], m: int) -> int | None:
    """The longest servable length at most ``m``, or None."""
    best = None
    for lo, hi in servable:
        if lo <= m:
            best = min(hi, m)
    return best


def covers(outer: Sequence[Span], inner: Sequence[Span]) -> bool:
    """Every length of ``inner`` is in ``outer``.

    >>> covers(((1, 10),), ((3, 4), (9, 10))), covers(((1, 5),), ((3, 6),))
    (True, False)
    """
    return all(any(lo <= a and b <= hi for lo, hi in outer) for a, b in inner)


def source(checkpoints: Sequence[Checkpoint], layer: int, length: int) -> Checkpoint | None:
    """The first checkpoint at or after ``length`` whose copy of ``layer`` can trim to it
    (``checkpoints`` in ascending lengths, as a snapshot keeps them)."""
    for cp in checkpoints:
        r = cp.reaches()
        if layer in r and cp.num_tokens - r[layer] <= length <= cp.num_tokens:
            return cp
    return None
