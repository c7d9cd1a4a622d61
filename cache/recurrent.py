"""Recurrent-state layers: linear attention and SSM layers keep fixed-size arrays, not K/V.

Qwen3.5 / Qwen3-Next (GatedDeltaNet), LFM2 (short convolutions), Nemotron-H and the Granite
and Falcon hybrids (Mamba 2) keep per sequence a few arrays that each forward overwrites:
a convolution window (B, kernel - 1, channels) and a state such as (B, heads, D_v, D_k).
mlx-lm's model code reads and writes them as ``cache[0]``, ``cache[1]`` and calls
``cache.advance(N)`` after a forward of N tokens; ``StateCache`` speaks that interface
and kvserve's protocol (offset, state, trim, batch algebra). Arrays stay in the dtype the
model writes: no scheme changes them (quantizing a state that every token rewrites
compounds its error), and the request's scheme is recorded for the file only.

Batching stacks rows; a left-padded prefill hides its padding through ``make_mask`` (the
model zeroes those positions before they reach the state):

    rows [a b c] [d e]   left_padding [0, 1]   make_mask(3) = [[T, T, T], [F, T, T]]
    after advance(3)     left_padding None      offsets [3, 2]

A state is valid only at the exact position it was taken (``is_trimmable`` is False), but
the last forward can be undone: the first write of each array in a forward keeps the array
it replaces, and ``trim(n)`` with n = the tokens of that forward puts them back.

Speculative decoding verifies several tokens per row in one forward and keeps a different
number of them per row. A state has no per-token history, so the forward keeps one itself:
``record_positions`` before it makes the decoder layers over a state take the chunk one
position at a time (``install_position_steps``: the model's own layer code, called per
position, as decoding calls it), the state after each position is kept, and ``trim_rows``
gives each row the state after the last token it keeps.

    rows a, b verify [x y z]      states after x, after y, after z are kept
    trim_rows([0, 2])             row a: the state after z; row b: the state after x

    >>> c = StateCache(1)
    >>> c[0] = mx.zeros((1, 3)); c.advance(2)
    >>> c[0] = mx.ones((1, 3)); c.advance(1)
    >>> c.can_trim(1), c.can_trim(2), c.trim(1), c.offset, c[0].tolist()
    (True, False, 1, 2, [[0.0, 0.0, 0.0]])
"""

from __future__ import annotations

from functools import cache as _memo
from typing import Any

import mlx.core as mx

from kvserve.cache.registry import register_kind
from kvserve.cache.scheme import KVScheme, parse_scheme

FP16 = parse_scheme("fp16")


class StateCache:
    """One request's recurrent state (B = 1 rows; the batch class reuses all of this)."""

    any_scheme = True
    stores_kv = False

    def __init__(self, size: int, scheme: KVScheme = FP16, offsets: list[int] | None = None):
        self.cache: list[mx.array | None] = [None] * size
        self.scheme = scheme
        self.offsets = [0] if offsets is None else list(offsets)
        self.left_padding: mx.array | None = None
        self.lengths = None  # mlx-lm's right-padding lengths: kvserve never right-pads
        self._before: dict[int, mx.array | None] = {}  # arrays this forward replaced
        self._undo: tuple[dict[int, mx.array | None], list[int]] | None = None
        # While recording (a verify forward): the arrays and offsets after each position.
        self._positions: list[tuple[list[mx.array | None], list[int]]] | None = None

    # --- what mlx-lm's model code calls ---

    def __getitem__(self, idx: int) -> mx.array | None:
        return self.cache[idx]

    def __setitem__(self, idx: int, value: mx.array) -> None:
        if idx not in self._before:
            self._before[idx] = self.cache[idx]
        self.cache[idx] = value

    def advance(self, N: int) -> None:
        """A forward of N slots ended: count real tokens, make it the one ``trim`` undoes."""
        pad = [0] * len(self.offsets) if self.left_padding is None else self.left_padding.tolist()
        self._undo = (self._before, list(self.offsets))
        self._before = {}
        self.offsets = [o + max(0, N - max(p, 0)) for o, p in zip(self.offsets, pad)]
        if self.left_padding is not None:
            self.left_padding = self.left_padding - N
            if int(mx.max(self.left_padding).item()) <= 0:
                self.left_padding = None
        if self._positions is not None:
            self._positions.append((list(self.cache), list(self.offsets)))

    def record_positions(self) -> None:
        """Keep the state after each position of the next forward (``trim_rows``)."""
        self._positions = []

    @property
    def recording(self) -> bool:
        return self._positions is not None

    def make_mask(self, N: int, **_: Any) -> mx.array | None:
        """(B, N) bool hiding left padding from the state, or None when there is none."""
        if self.left_padding is None:
            return None
        return mx.arange(N)[None] >= self.left_padding[:, None]

    @property
    def batch_size(self) -> int:
        return len(self.offsets)

    # --- kvserve's protocol ---

    @property
    def offset(self) -> Any:
        return self.offsets[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.cache if a is not None)

    def empty(self) -> bool:
        return self.cache[0] is None

    def size(self) -> int:
        return 0

    def is_trimmable(self) -> bool:
        return False

    def trim_reach(self) -> int:
        """None: a state is valid only where it was taken (the prefix cache keeps checkpoints)."""
        return 0

    def can_trim(self, n: int) -> bool:
        """Only the whole last forward can be undone, once."""
        if n == 0:
            return True
        if self._undo is None or self._before:
            return False
        return all(now - then == n for now, then in zip(self.offsets, self._undo[1]))

    def trim(self, n: int) -> int:
        if n == 0:
            return 0
        if not self.can_trim(n):
            raise ValueError(f"a recurrent state cannot drop {n} tokens (it can undo its last "
                             "forward only)")
        replaced, self.offsets = self._undo
        for idx, array in replaced.items():
            self.cache[idx] = array
        self._undo = None
        return n

    def begin_decode(self) -> None:
        pass

    def _forget_undo(self) -> None:
        self._before, self._undo = {}, None

    @property
    def state(self) -> tuple[mx.array, ...]:
        return tuple(a for a in self.cache if a is not None)

    @property
    def meta_state(self) -> dict[str, str]:
        present = "".join("1" if a is not None else "0" for a in self.cache)
        return {"offset": ",".join(map(str, self.offsets)), "arrays": present}

    @classmethod
    def from_state(cls, scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]):
        present = meta["arrays"]
        offsets = [int(o) for o in meta["offset"].split(",") if o]
        if set(present) - {"0", "1"} or present.count("1") != len(state):
            raise ValueError(f"{len(state)} arrays for the layout {present!r}")
        if any(a.shape[0] != len(offsets) for a in state):
            raise ValueError(f"state arrays of {[a.shape[0] for a in state]} rows for {len(offsets)} offsets")
        cache = cls(len(present), scheme, offsets)
        arrays = iter(state)
        cache.cache = [next(arrays) if p == "1" else None for p in present]
        return cache

    def __repr__(self) -> str:
        shapes = [None if a is None else tuple(a.shape) for a in self.cache]
        return f"{type(self).__name__}(offsets={self.offsets}, arrays={shapes})"


class BatchStateCache(StateCache):
    """Rows of recurrent state stacked on axis 0, one per sequence."""

    single_cls = StateCache

    @property
    def offset(self) -> mx.array:
        return mx.array(self.offsets)  # (B,)

    @classmethod
    def merge(cls, caches: list[StateCache]) -> BatchStateCache:
        out = cls(len(caches[0].cache), caches[0].scheme, [c.offset for c in caches])
        out.cache = [_stack([c.cache[i] for c in caches]) for i in range(len(out.cache))]
        return out

    def extract(self, i: int) -> StateCache:
        single = StateCache(len(self.cache), self.scheme, [self.offsets[i]])
        single.cache = [None if a is None else a[i : i + 1] for a in self.cache]
        return single

    def filter(self, indices: list[int]) -> None:
        idx = mx.array(indices, dtype=mx.int32)
        self.cache = [None if a is None else a[idx] for a in self.cache]
        self.offsets = [self.offsets[i] for i in indices]
        self._positions = None  # rows left: a verify forward's positions no longer line up
        if self.left_padding is not None:
            self.left_padding = self.left_padding[idx]
        if self._undo is not None:  # a queued forward over these rows may still be undone
            replaced, before = self._undo
            self._undo = ({k: None if a is None else a[idx] for k, a in replaced.items()},
                          [before[i] for i in indices])

    def extend(self, other: StateCache) -> None:
        rows = [self.batch_size, other.batch_size]
        self.cache = [_stack([a, b], rows) for a, b in zip(self.cache, other.cache)]
        self.offsets = self.offsets + other.offsets
        pads = [self.left_padding, other.left_padding]
        if any(p is not None for p in pads):
            self.left_padding = mx.concatenate([p if p is not None else mx.zeros((n,), mx.int32)
                                                for p, n in zip(pads, rows)])
        self._forget_undo()

    def can_trim_rows(self, counts: list[int]) -> bool:
        """Rows can drop their last tokens only back into a recorded forward (the arrays
        hold no per-token history of their own); rows added after it drop none."""
        if not any(counts):
            return True
        positions = self._positions or []
        rows = len(positions[0][1]) if positions else 0
        return all(c < len(positions) if b < rows else c == 0 for b, c in enumerate(counts))

    def trim_rows(self, counts: list[int]) -> None:
        """Row b takes the state it had ``counts[b]`` positions before the end of the
        recorded forward (rows added since keep theirs); recording stops.

            >>> c = BatchStateCache(1, offsets=[4, 4]); c.record_positions()
            >>> for v in (1.0, 2.0, 3.0):
            ...     c[0] = mx.full((2, 1), v); c.advance(1)
            >>> c.trim_rows([0, 2]); c[0].tolist(), c.offsets
            ([[3.0], [1.0]], [7, 5])
        """
        if not self.can_trim_rows(counts):
            raise ValueError("a recurrent state can drop tokens row by row only back into a "
                             "forward that recorded its positions")
        positions, self._positions = self._positions, None
        if not any(counts):
            return
        last, rows = len(positions) - 1, len(positions[0][1])
        kept = [positions[last - c] if b < rows else (self.cache, self.offsets) for b, c in enumerate(counts)]
        self.cache = [None if a is None else mx.concatenate([k[0][i][b : b + 1] for b, k in enumerate(kept)])
                      for i, a in enumerate(self.cache)]
        self.offsets = [k[1][b] for b, k in enumerate(kept)]
        self._forget_undo()

    def prepare(self, *, left_padding: list[int] | None = None, **_: Any) -> None:
        if left_padding is not None and any(left_padding):
            self.left_padding = mx.array(left_padding)

    def finalize(self) -> None:
        pass


def install_position_steps(model) -> None:
    """Let the decoder layers of ``model`` that run over a recurrent state take a recording
    forward (``StateCache.record_positions``) one position at a time: their class becomes a
    subclass whose ``__call__`` splits such a chunk and calls the layer's own code per
    position. Any other call, and every other layer, runs as before; the parameters and the
    module tree are unchanged. Idempotent."""
    for layer in getattr(model, "layers", []):
        if not getattr(type(layer), "steps_positions", False):
            layer.__class__ = _position_stepped(type(layer))


@_memo
def _position_stepped(cls: type) -> type:
    def __call__(self, *args, **kwargs):
        # Layers of state models are called as layer(x, mask=..., cache=...); other layers
        # (whatever their signature) never see a recording state and pass straight through.
        x, mask, cache = (*args, None, None)[:3]
        mask, cache = kwargs.get("mask", mask), kwargs.get("cache", cache)
        if not (isinstance(cache, StateCache) and cache.recording and x.shape[1] > 1):
            return cls.__call__(self, *args, **kwargs)
        # The mask of a state layer is (B, L): which positions are real (left padding).
        outs = [cls.__call__(self, x[:, j : j + 1], mask=None if mask is None else mask[:, j : j + 1], cache=cache)
                for j in range(x.shape[1])]
        return mx.concatenate(outs, axis=1)

    return type(cls.__name__, (cls,), {"__call__": __call__, "steps_positions": True})


def _stack(arrays: list[mx.array | None], rows: list[int] | None = None) -> mx.array | None:
    """Concatenate along rows; a missing array stands for zeros (a fresh state)."""
    rows = rows or [1] * len(arrays)
    template = next((a for a in arrays if a is not None), None)
    if template is None:
        return None
    return mx.concatenate([a if a is not None else mx.zeros((n, *template.shape[1:]), template.dtype)
                           for a, n in zip(arrays, rows)])


register_kind("recurrent", StateCache, BatchStateCache)
