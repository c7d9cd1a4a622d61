"""Shared machinery for cache families whose state is a set of (B, H, T, W) parts.

A family provides a *codec* mixin with five methods and inherits everything else:

    encode(keys, values) -> list[mx.array]     # (B, H_kv, L, W_i) parts, key parts first
    present(parts) -> (keys, values)           # what update_and_fetch returns / attend takes
    decode(parts) -> (keys, values)            # f32 (B, H_kv, T, D): the float reference
    n_parts() -> int                           # how many parts ``state`` holds
    attend(queries, keys, values, scale, mask) -> mx.array   # (B, H_q, L, D_v)

    class QuantizedKVCache(AffineCodec, StoredKVCache): ...
    class BatchQuantizedKVCache(AffineCodec, BatchStoredKVCache):
        single_cls = QuantizedKVCache

Masks follow mlx-lm: ``None``, ``"causal"`` or a boolean / additive array that broadcasts
against (B, H_q, L, S). ``grouped_mask`` brings any of them to the grouped-query score layout
(B, H_kv, n_rep, L, S) used by attention that never repeats K/V.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import mlx.core as mx

from kvserve.cache.buffer import DEFAULT_GRANULE, GrowableBuffer
from kvserve.cache.scheme import KVScheme

# Finite, so a fully masked row (a padding query) gives a uniform softmax instead of NaN.
MASKED = float(mx.finfo(mx.float32).min)


def causal_mask(N: int, offset: int, left_padding: mx.array | None = None,
                window_size: int | None = None) -> mx.array:
    """Boolean mask for N queries at positions [offset, offset + N) over offset + N slots.

    (N, S) without padding; (B, 1, N, S) with ``left_padding`` (B,): slot j is hidden from
    sequence b when j < left_padding[b].

        >>> causal_mask(2, 1).tolist()
        [[True, True, False], [True, True, True]]
    """
    q = mx.arange(offset, offset + N)[:, None]  # (N, 1)
    k = mx.arange(offset + N)[None]  # (1, S)
    mask = q >= k
    if window_size is not None:
        mask = mask & (q < k + window_size)
    if left_padding is not None:
        mask = mask & (k >= left_padding[:, None, None, None])  # (B, 1, N, S)
    return mask


def mask_for_queries(N: int, offset: int, return_array: bool = False,
                     window_size: int | None = None) -> Any:
    """mlx-lm's conventions for one unpadded sequence: None, "causal" or an array."""
    if window_size is not None or (return_array and N > 1):
        return causal_mask(N, offset, window_size=window_size)
    return None if N == 1 else "causal"


def grouped_mask(mask: Any, n_kv: int, n_rep: int, L: int, S: int) -> mx.array | None:
    """Any mlx-lm mask as an array broadcasting against (B, H_kv, n_rep, L, S) scores.

    A batch mask (B, 1, L, S) must become (B, 1, 1, L, S): left as is, broadcasting would
    align B with n_rep, e.g. (2, 1, 1, 66) against (2, 8, 2, 1, 66) fails or, worse, mixes
    sequences. Per-head masks (B, H_q, L, S) split H_q into (H_kv, n_rep).
    """
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask '{mask}'")
        return causal_mask(L, S - L) if L > 1 else None  # (L, S)
    if mask.ndim <= 2:
        return mask
    while mask.ndim < 4:
        mask = mask[None]
    b, h = mask.shape[:2]
    if h == 1:
        return mx.expand_dims(mask, 2)  # (B, 1, 1, L, S)
    return mask.reshape(b, n_kv, n_rep, *mask.shape[2:])  # (B, H_kv, n_rep, L, S)


def apply_mask(scores: mx.array, mask: mx.array | None) -> mx.array:
    """Boolean masks hide slots; additive masks are added (in the scores' f32)."""
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, MASKED)
    return scores + mask.astype(scores.dtype)


class _Buffered:
    """What every cache backed by one ``GrowableBuffer`` (``self._buf``) answers the same way."""

    _buf: GrowableBuffer
    stores_kv = True  # a K/V layer (recurrent-state layers say False)

    @property
    def capacity(self) -> int:
        return self._buf.capacity

    @property
    def growths(self) -> int:
        return self._buf.growths

    def is_trimmable(self) -> bool:
        return True

    def trim_reach(self) -> int:
        """How many of its last tokens the layer can drop and hold exactly what it held
        then (the prefix cache's rule for this kind): full attention, all of them."""
        return self.size()

    def trim(self, n: int) -> int:
        return self._buf.trim(n)

    def unpack(self, parts: list[mx.array]) -> list[mx.array]:
        """Storage parts -> the scheme's parts (``state``, files); a codec that stores its
        parts in another arrangement (``cache.affine``'s records) overrides both."""
        return list(parts)

    def pack(self, parts: list[mx.array]) -> list[mx.array]:
        """The scheme's parts -> storage parts (``from_state``)."""
        return list(parts)

    def begin_decode(self) -> None:
        """Decoding starts (or a verify chunk follows): a family that keeps prompts in a
        prefill form takes its decode form here. Stored families have one form."""

    @property
    def nbytes(self) -> int:
        return self._buf.nbytes

    def empty(self) -> bool:
        return self._buf.parts is None

    # mlx-lm's pipelined models tie the hand-off of their hidden state to the last layer's
    # cache (``cache[-1].keys = mx.depends(cache[-1].keys, h)``), so that evaluating the
    # cache runs the send: the first stored part stands in for "keys".
    @property
    def keys(self) -> mx.array | None:
        return self._buf.parts[0] if self._buf.parts is not None else None

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._buf.parts[0] = value


class StoredKVCache(_Buffered):
    """One sequence's cache (B = 1); its encoded K/V parts live in one ``GrowableBuffer``.

    ``offset`` is the number of tokens stored; ``state`` is exactly those tokens' parts.
    """

    scheme: KVScheme

    def __init__(self, scheme: KVScheme, granule: int = DEFAULT_GRANULE):
        self.check_scheme(scheme)
        self.scheme = scheme
        self._buf = GrowableBuffer(granule)

    def check_scheme(self, scheme: KVScheme) -> None:
        """Families refuse schemes they cannot store (overridden by codecs)."""

    @property
    def offset(self) -> int:
        return self._buf.size

    def size(self) -> int:
        return self._buf.size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._buf.append(self.encode(keys, values))  # keys (1, H_kv, L, D)
        return self.present(self._buf.views())

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return mask_for_queries(N, self.offset, return_array, window_size)

    def dequantize(self) -> tuple[mx.array, mx.array]:
        """Stored keys and values as f32 (1, H_kv, T, D): a reference for tests, never kept."""
        return self.decode(self._buf.views())

    @property
    def state(self) -> tuple[mx.array, ...]:
        return tuple(self.unpack(self._buf.views()))

    @property
    def meta_state(self) -> dict[str, str]:
        return {"offset": str(self.offset)}

    @classmethod
    def from_state(cls, scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]):
        cache = cls(scheme)
        offset = int(meta.get("offset", 0))
        if state:
            if len(state) != cache.n_parts() or state[0].shape[0] != 1:
                raise ValueError(f"{cls.__name__} of {scheme.name} takes {cache.n_parts()} arrays "
                                 f"of one row, got {len(state)} of {state[0].shape[0]}")
            if any(a.shape[2] != offset for a in state):
                raise ValueError(f"state holds {state[0].shape[2]} tokens, meta says {offset}")
            cache._buf = GrowableBuffer.adopt(cache.pack(list(state)), offset)
        elif offset:
            raise ValueError(f"empty state with offset {offset}")
        return cache

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scheme.name}, offset={self.offset}, capacity={self.capacity})"


@functools.lru_cache(maxsize=4)
def row_offsets(lengths: tuple[int, ...]) -> mx.array:
    """Each row's token count as one (B,) array, made once per step and shared by every layer:
    a model asks each layer's cache for its RoPE offsets, twice a layer in mlx-lm's llama
    (queries and keys), and a new array each time was 64 host arrays a step for a 32-layer
    model, 6.5% of the host's step time in a served 8B-shape run on a GPU.

        >>> row_offsets((3, 1)) is row_offsets((3, 1)), row_offsets((3, 1)).tolist()
        (True, [3, 1])
    """
    return mx.array(lengths)


class BatchStoredKVCache(_Buffered):
    """B left-padded sequences in one ``GrowableBuffer`` (rows = sequences).

    Merging per-request caches of 3, 1 and 4 tokens:

        slot:   0  1  2  3          left_padding = [1, 3, 0]
        seq 0:  .  a  b  c          offset = size() - left_padding = [3, 1, 4]  (RoPE positions)
        seq 1:  .  .  .  d          size() = 4 slots written
        seq 2:  e  f  g  h          mask: slot j visible to seq b iff j >= left_padding[b]

    ``filter([2, 0])`` keeps rows 2 and 0 and drops slot 0, which no kept row needs
    (left_padding becomes [0, 0]). ``extend`` left-pads the shorter batch so both end at the
    same slot. A right-padded prefill (``prepare(right_padding=...)``) is turned into left
    padding by ``finalize``, which rotates each row's slots.
    """

    scheme: KVScheme
    single_cls: ClassVar[type[StoredKVCache]]

    def __init__(self, scheme: KVScheme, left_padding: list[int], granule: int = DEFAULT_GRANULE):
        self.check_scheme(scheme)
        self.scheme = scheme
        self.left_padding = [int(p) for p in left_padding]
        self._buf = GrowableBuffer(granule)
        self._right_padding: list[int] | None = None

    def check_scheme(self, scheme: KVScheme) -> None:
        """Families refuse schemes they cannot store (overridden by codecs)."""

    @property
    def batch_size(self) -> int:
        return len(self.left_padding)

    @property
    def lengths(self) -> list[int]:
        """Tokens per sequence."""
        return [self._buf.size - p for p in self.left_padding]

    @property
    def offset(self) -> mx.array:
        return row_offsets(tuple(self.lengths))  # (B,)

    def size(self) -> int:
        return self._buf.size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if keys.shape[0] != self.batch_size:
            raise ValueError(f"batch of {keys.shape[0]} rows for a cache of {self.batch_size}")
        self._buf.append(self.encode(keys, values))  # keys (B, H_kv, L, D)
        return self.present(self._buf.views())

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if not any(self.left_padding):
            return mask_for_queries(N, self.size(), return_array, window_size)
        mask = causal_mask(N, self.size(), mx.array(self.left_padding), window_size)  # (B, 1, N, S)
        if N == 1 and window_size is None:  # hides exactly each row's padding: the GPU kernels
            from kvserve.kernels.cuda_layout import note_left_padding  # read from each row's start

            note_left_padding(mask, self.left_padding)
        return mask

    def captured_state(self) -> dict[str, Any] | None:
        """What a captured decode step's view of this layer copies besides scheme and storage
        (``kvserve.cache.captured``), or None while the layer cannot be captured. Families with
        one form throughout copy nothing; one whose decode form is reached later says so."""
        return {}

    def dequantize(self) -> tuple[mx.array, mx.array]:
        """Stored keys and values as f32 (B, H_kv, T, D), padding included; for tests."""
        return self.decode(self._buf.views())

    @classmethod
    def merge(cls, caches: list[StoredKVCache]) -> BatchStoredKVCache:
        schemes = {c.scheme for c in caches}
        if len(schemes) != 1:
            raise ValueError(f"cannot merge caches of schemes {sorted(s.name for s in schemes)}")
        size = max(c.offset for c in caches)
        batch = cls(caches[0].scheme, [size - c.offset for c in caches], caches[0]._buf.granule)
        stored = [c._buf for c in caches if c._buf.parts is not None]
        if size and stored:
            bufs = [c._buf if c._buf.parts is not None else stored[0].empty_rows(1) for c in caches]
            batch._buf = GrowableBuffer.concat_batch(bufs, batch.left_padding, size, stored[0].granule)
        return batch

    def extract(self, i: int) -> StoredKVCache:
        single = self.single_cls(self.scheme, self._buf.granule)
        if self._buf.parts is not None and self.lengths[i] > 0:
            single._buf = self._buf.row(i, self.left_padding[i])
        return single

    def filter(self, indices: list[int]) -> None:
        padding = [self.left_padding[i] for i in indices]
        drop = min(min(padding, default=0), self._buf.size)  # slots no kept row needs
        self._buf.take(indices, drop)
        self.left_padding = [p - drop for p in padding]

    def extend(self, other: BatchStoredKVCache) -> None:
        if other.scheme != self.scheme:
            raise ValueError(f"cannot extend a {self.scheme.name} batch with {other.scheme.name}")
        size = max(self.size(), other.size())
        fronts = [size - self.size(), size - other.size()]
        padding = [p + fronts[0] for p in self.left_padding] + [p + fronts[1] for p in other.left_padding]
        stored = [b._buf for b in (self, other) if b._buf.parts is not None]
        if stored:
            bufs = [b._buf if b._buf.parts is not None else stored[0].empty_rows(b.batch_size)
                    for b in (self, other)]
            self._buf = GrowableBuffer.concat_batch(bufs, fronts, size, self._buf.granule)
        self.left_padding = padding

    def can_trim_rows(self, counts: list[int]) -> bool:
        return max(counts, default=0) <= self.size()

    def trim_rows(self, counts: list[int]) -> None:
        """Drop the last ``counts[b]`` tokens of row b (rejected speculative tokens). Every
        row still ends at the last slot: the common part is trimmed, the rest of each row's
        junk is rotated to its front and becomes left padding.

            rows  [. a b X]  counts [1, 0]  ->  [. . a b]  left_padding [2, 0]
                  [c d e f]                     [c d e f]
        """
        least = min(counts)
        self._buf.trim(least)
        rest = [c - least for c in counts]
        if any(rest):
            self._buf.roll_rows(rest)
            self.left_padding = [p + r for p, r in zip(self.left_padding, rest)]

    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        """Add left padding to an empty cache, or announce right padding for ``finalize``."""
        if left_padding is not None:
            if self._buf.size:
                raise ValueError("left padding can only be added to an empty batch cache")
            self.left_padding = [a + int(b) for a, b in zip(self.left_padding, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = [int(p) for p in right_padding]

    def finalize(self) -> None:
        """Move right padding (written after each prompt) to the left, where masks expect it."""
        if self._right_padding is not None:
            self._buf.roll_rows(self._right_padding)
            self.left_padding = [a + b for a, b in zip(self.left_padding, self._right_padding)]
            self._right_padding = None

    @property
    def state(self) -> tuple[mx.array, ...]:
        return tuple(self.unpack(self._buf.views()))

    @property
    def meta_state(self) -> dict[str, str]:
        return {"size": str(self.size()), "left_padding": ",".join(map(str, self.left_padding))}

    @classmethod
    def from_state(cls, scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]):
        padding = [int(p) for p in meta["left_padding"].split(",") if p]
        batch = cls(scheme, padding)
        size = int(meta.get("size", 0))
        if state:
            if len(state) != batch.n_parts() or any(a.shape[2] != size or a.shape[0] != len(padding)
                                                     for a in state):
                raise ValueError(f"state of shape {state[0].shape} does not match meta {meta}")
            batch._buf = GrowableBuffer.adopt(batch.pack(list(state)), size)
        return batch

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.scheme.name}, lengths={self.lengths}, "
                f"size={self.size()}, capacity={self.capacity})")
