"""Sliding-window layers: at most ``window`` tokens visible, storage bounded, any scheme.

A sliding layer (Gemma 3/4, gpt-oss, Mistral) attends to the last ``window`` tokens only.
``SlidingKVCache`` wraps a stored cache of any family (fp16, affine/MX, TurboQuant): the
inner cache encodes, stores and attends exactly as it does for full attention (the window
is just a shorter context under a mask), and the wrapper drops the oldest slots once they can
no longer be seen. Slots stay in temporal order (no ring), so the batch algebra, the masks
and every attention kernel are those of the full-attention families.

Storage, window W = 4 with a reserve of 1 and a slack of 2 (the real ones are larger):

    after 6 tokens   [a b c d e f]   size 6 <= W - 1 + reserve + slack = 6: kept
    after 7 tokens   [c d e f g]     size 7 > 6: the first 2 slots go (one copy), offset 7

The next query (token 8) sees slots e f g and itself: W tokens. ``RESERVE`` slots more than
the window needs stay so that the last few tokens can be trimmed (an undone decode step,
rejected speculative tokens). The slack (``slack_for``) sets how often the copy happens:
every slack decoded tokens, a copy of W - 1 + ``RESERVE`` slots. At rest a layer holds at
most W - 1 + ``RESERVE`` + slack tokens; while a chunk of L tokens is in flight, L more.

Offsets are true positions (what RoPE needs): ``offset`` = slots stored + slots dropped.
In a left-padded batch every row ends at the same slot, so the window covers the same slots
for every row and dropping the front drops padding first:

    left_padding [2, 0], drop 3 slots   ->   left_padding [0, 0], dropped [1, 3]

A layer is ``is_trimmable`` (to any shorter prefix, as the prefix cache needs) only while it
has dropped nothing; ``can_trim(n)`` tells whether the last n tokens can go.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvserve.cache.base import causal_mask, row_offsets
from kvserve.cache.registry import cache_class_by_name, register_kind, stores_scheme
from kvserve.cache.scheme import KVScheme

RESERVE = 16  # slots kept beyond the window: that many last tokens can always be trimmed


def slack_for(window: int) -> int:
    """Slots written between two drops: a quarter of the window, 16 to 256. The copy of a
    window every window/4 tokens costs ~4 slot copies per token, against the window that
    attention reads for every token; memory stays within 1.25 windows.

        >>> slack_for(16), slack_for(512), slack_for(4096)
        (16, 128, 256)
    """
    return max(16, min(window // 4, 256))
META = ("sliding.window", "sliding.dropped", "sliding.inner")


def effective_window(window: int, asked: int | None) -> int:
    """The window a mask applies: the model's ``window_size`` when it passes one, never more
    than the cache keeps (mlx-lm's rotating cache never shows more than its ``max_size``)."""
    return window if asked is None else min(window, asked)


def sliding_mask(N: int, size: int, window: int, left_padding: list[int] | None) -> Any:
    """mlx-lm's mask conventions for N queries after ``size`` stored slots of a window.

        >>> sliding_mask(1, 3, 4, None) is None      # 4 slots in all: the window sees them
        True
        >>> sliding_mask(1, 4, 4, None).tolist()     # slot 0 left the window
        [[False, True, True, True, True]]
    """
    padded = left_padding is not None and any(left_padding)
    if not padded and size + N <= window:
        return None if N == 1 else "causal"
    pad = mx.array(left_padding) if padded else None
    return causal_mask(N, size, pad, window)


class _Sliding:
    """What both classes share: the inner cache and the window."""

    inner: Any
    window: int
    stores_kv = True

    @property
    def scheme(self) -> KVScheme:
        return self.inner.scheme

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def size(self) -> int:
        return self.inner.size()

    def empty(self) -> bool:
        return self.inner.empty()

    @property
    def keys(self) -> mx.array | None:  # a pipelined model's hand-off (``_Buffered.keys``)
        return self.inner.keys

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self.inner.keys = value

    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any,
               sinks: mx.array | None = None) -> mx.array:
        return self.inner.attend(queries, keys, values, scale, mask, sinks=sinks)

    def dequantize(self) -> tuple[mx.array, mx.array]:
        return self.inner.dequantize()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        # What is returned covers every stored slot, as the mask built before this call
        # expects; only then are the slots that no later query sees dropped.
        out = self.inner.update_and_fetch(keys, values)
        if self.size() > self._limit():
            self._drop(self.size() - (self.window - 1 + RESERVE))
        return out

    def _limit(self) -> int:
        """Slots held at rest at most (the new arrays' capacity after a drop)."""
        return self.window - 1 + RESERVE + slack_for(self.window)

    def is_trimmable(self) -> bool:
        return not self._dropped_any()

    def trim_reach(self) -> int:
        """Tokens that can go while the next query's window stays stored: all of them until
        the first drop, then what the layer holds beyond ``window - 1`` (the reserve, and
        up to the slack and a chunk more)."""
        return self.size() if not self._dropped_any() else max(0, self.size() - (self.window - 1))

    def can_trim(self, n: int) -> bool:
        """The last ``n`` tokens can go while the window of the next query stays stored."""
        if not self._dropped_any():
            return n <= self.size()
        return self.size() - n >= self.window - 1

    def trim(self, n: int) -> int:
        if not self.can_trim(n):
            raise ValueError(f"cannot trim {n} tokens from a sliding window of {self.window} "
                             f"holding {self.size()} slots")
        return self.inner.trim(n)

    def begin_decode(self) -> None:
        self.inner.begin_decode()

    def _meta(self, dropped: str) -> dict[str, str]:
        return {**self.inner.meta_state, "sliding.window": str(self.window),
                "sliding.dropped": dropped, "sliding.inner": type(self.inner).__name__}

    @staticmethod
    def _inner_from_state(scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]):
        inner_cls = cache_class_by_name(meta["sliding.inner"])
        if not stores_scheme(inner_cls, scheme) or getattr(inner_cls, "any_scheme", False):
            raise ValueError(f"{inner_cls.__name__} cannot hold a sliding window of {scheme.name}")
        inner_meta = {k: v for k, v in meta.items() if k not in META}
        return inner_cls.from_state(scheme, state, inner_meta)


class SlidingKVCache(_Sliding):
    """One request's sliding-window layer (B = 1) around a stored cache of any scheme."""

    any_scheme = True  # the inner cache holds the scheme; files record its class

    def __init__(self, inner: Any, window: int, dropped: int = 0):
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.inner, self.window, self.dropped = inner, int(window), int(dropped)

    @property
    def offset(self) -> int:
        return self.inner.offset + self.dropped

    def _dropped_any(self) -> bool:
        return self.dropped > 0

    def _drop(self, n: int) -> None:
        self.inner._buf.drop_front(n, self._limit())
        self.dropped += n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        mask = sliding_mask(N, self.size(), effective_window(self.window, window_size), None)
        if return_array and not isinstance(mask, mx.array) and N > 1:
            return causal_mask(N, self.size())  # the window hides nothing yet
        return mask

    @property
    def state(self) -> tuple[mx.array, ...]:
        return self.inner.state

    @property
    def meta_state(self) -> dict[str, str]:
        return self._meta(str(self.dropped))

    @classmethod
    def from_state(cls, scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]):
        inner = cls._inner_from_state(scheme, state, meta)
        return cls(inner, int(meta["sliding.window"]), int(meta["sliding.dropped"]))

    def __repr__(self) -> str:
        return f"SlidingKVCache(window={self.window}, offset={self.offset}, {self.inner!r})"


class BatchSlidingKVCache(_Sliding):
    """B left-padded rows of sliding-window layers; the inner batch cache does the algebra,
    this class keeps each row's dropped-token count (``offset`` = stored + dropped)."""

    any_scheme = True
    single_cls = SlidingKVCache

    def __init__(self, inner: Any, window: int, dropped: list[int]):
        self.inner, self.window, self.dropped = inner, int(window), [int(d) for d in dropped]

    @property
    def left_padding(self) -> list[int]:
        return self.inner.left_padding

    @property
    def batch_size(self) -> int:
        return len(self.dropped)

    @property
    def lengths(self) -> list[int]:
        return [n + d for n, d in zip(self.inner.lengths, self.dropped)]

    @property
    def offset(self) -> mx.array:
        return row_offsets(tuple(self.lengths))  # (B,), shared by the step's layers

    def _dropped_any(self) -> bool:
        return any(self.dropped)

    def _drop(self, n: int) -> None:
        """Drop the first n slots of every row: padding first, then the oldest tokens."""
        padding = self.inner.left_padding
        self.dropped = [d + max(0, n - p) for d, p in zip(self.dropped, padding)]
        self.inner._buf.drop_front(n, self._limit())
        self.inner.left_padding = [max(0, p - n) for p in padding]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        window = effective_window(self.window, window_size)
        mask = sliding_mask(N, self.size(), window, self.inner.left_padding)
        if return_array and not isinstance(mask, mx.array) and N > 1:
            return causal_mask(N, self.size())
        return mask

    @classmethod
    def merge(cls, caches: list[SlidingKVCache]) -> BatchSlidingKVCache:
        from kvserve.cache.registry import batch_class_of

        windows = {c.window for c in caches}
        if len(windows) != 1:
            raise ValueError(f"cannot merge sliding windows of sizes {sorted(windows)}")
        inner = batch_class_of(caches[0].inner).merge([c.inner for c in caches])
        return cls(inner, caches[0].window, [c.dropped for c in caches])

    def extract(self, i: int) -> SlidingKVCache:
        return SlidingKVCache(self.inner.extract(i), self.window, self.dropped[i])

    def filter(self, indices: list[int]) -> None:
        self.inner.filter(indices)
        self.dropped = [self.dropped[i] for i in indices]

    def extend(self, other: BatchSlidingKVCache) -> None:
        if other.window != self.window:
            raise ValueError(f"cannot extend a window of {self.window} with one of {other.window}")
        self.inner.extend(other.inner)
        self.dropped += other.dropped

    def can_trim_rows(self, counts: list[int]) -> bool:
        return self.can_trim(max(counts, default=0))

    def trim_rows(self, counts: list[int]) -> None:
        """Row b drops its last ``counts[b]`` tokens (``BatchStoredKVCache.trim_rows``)."""
        if not self.can_trim_rows(counts):
            raise ValueError(f"cannot trim {max(counts)} tokens from a sliding window of "
                             f"{self.window} holding {self.size()} slots")
        self.inner.trim_rows(counts)

    def prepare(self, **kwargs) -> None:
        self.inner.prepare(**kwargs)

    def finalize(self) -> None:
        self.inner.finalize()

    @property
    def state(self) -> tuple[mx.array, ...]:
        return self.inner.state

    @property
    def meta_state(self) -> dict[str, str]:
        return self._meta(",".join(map(str, self.dropped)))

    @classmethod
    def from_state(cls, scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]):
        inner = cls._inner_from_state(scheme, state, meta)
        dropped = [int(d) for d in meta["sliding.dropped"].split(",") if d]
        if len(dropped) != len(inner.left_padding):
            raise ValueError(f"{len(dropped)} dropped counts for {len(inner.left_padding)} rows")
        return cls(inner, int(meta["sliding.window"]), dropped)

    def __repr__(self) -> str:
        return f"BatchSlidingKVCache(window={self.window}, lengths={self.lengths}, {self.inner!r})"


register_kind("sliding", SlidingKVCache, BatchSlidingKVCache)
