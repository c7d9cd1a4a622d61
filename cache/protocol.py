"""The cache contract every KV cache family implements (modelled on mlx-lm's ``_BaseCache``).

A per-request cache holds one sequence (batch axis 1). A batch cache holds B sequences,
left-padded to a common length. Both declare their own attention path through ``attend``;
nothing detects a scheme with ``hasattr``.

Batch layout (left padding), for sequences of 3, 1 and 4 tokens:

    slot:   0  1  2  3          left_padding = [1, 3, 0]
    seq 0:  .  a  b  c          offset (per sequence, used by RoPE) = [3, 1, 4]
    seq 1:  .  .  .  d          size() = 4 slots written
    seq 2:  e  f  g  h          mask: slot j visible to seq i iff j >= left_padding[i]

Arrays are (B, H_kv, T, D) for keys/values before encoding; encoded storage is the family's
own business. ``state`` returns only the first ``size()`` slots (never the padded capacity).

Layer kinds: full attention (the scheme families), sliding windows (``kvserve.cache.sliding``,
a family's cache inside a window) and recurrent state (``kvserve.cache.recurrent``, no K/V,
no ``attend``). All answer this protocol; ``stores_kv`` tells the first two from the third.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from kvserve.cache.scheme import KVScheme


@runtime_checkable
class KVCacheLayer(Protocol):
    """One attention layer's cache for one sequence (B = 1)."""

    scheme: KVScheme

    @property
    def offset(self) -> int:
        """Tokens stored so far (the RoPE position of the next token)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Append (1, H_kv, L, D) keys/values; returns whatever ``attend`` expects back."""

    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any,
               sinks: mx.array | None = None) -> mx.array:
        """Attention of (1, H_q, L, D) queries over everything stored; f32 accumulation,
        grouped-query heads mapped without repeating K/V; ``sinks`` (H_q,) adds one valueless
        logit per head to each softmax (gpt-oss); returns the queries' dtype."""

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """The mask for N new queries, in mlx-lm's conventions (None, "causal" or an array)."""

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Arrays holding exactly ``offset`` tokens (for serialization)."""

    @property
    def meta_state(self) -> dict[str, str]:
        """Scalars needed with ``state`` to rebuild the cache (offset, phase, ...)."""

    @classmethod
    def from_state(cls, scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]) -> "KVCacheLayer":
        """Rebuild a cache from ``state`` and ``meta_state``."""

    def is_trimmable(self) -> bool:
        """Any shorter prefix can be restored exactly by ``trim`` (the prefix cache's question)."""

    def trim_reach(self) -> int:
        """How many last tokens ``trim`` can drop and leave exactly what the layer held at that
        length: its kind's prefix-cache rule (all of them for full attention, the tokens beyond
        a window's ``window - 1``, none for a recurrent state)."""

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; returns how many were dropped. Layers that cannot trim
        every n (sliding windows, recurrent state) answer ``can_trim(n)`` first."""

    def begin_decode(self) -> None:
        """Decoding (or a speculative verify chunk) follows: take the decode form now
        (TurboQuant compresses its raw prompt; other families do nothing)."""

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not just ``offset``)."""

    def empty(self) -> bool: ...


@runtime_checkable
class BatchKVCacheLayer(Protocol):
    """One attention layer's cache for B left-padded sequences."""

    scheme: KVScheme

    @classmethod
    def merge(cls, caches: list[KVCacheLayer]) -> "BatchKVCacheLayer":
        """Left-pad and stack per-request caches of one scheme."""

    def extract(self, i: int) -> KVCacheLayer:
        """The per-request cache of sequence ``i``, padding removed."""

    def filter(self, indices: list[int]) -> None:
        """Keep only these sequences (in place); drops padding columns no one needs."""

    def extend(self, other: "BatchKVCacheLayer") -> None:
        """Append the sequences of ``other`` (in place), re-aligning the padding."""

    def can_trim_rows(self, counts: list[int]) -> bool:
        """Whether ``trim_rows(counts)`` can run (recurrent state: only all zeros)."""

    def trim_rows(self, counts: list[int]) -> None:
        """Drop the last ``counts[b]`` tokens of row b; rows still end at the last slot."""

    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None: ...

    def finalize(self) -> None: ...

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]: ...

    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any,
               sinks: mx.array | None = None) -> mx.array: ...

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any: ...

    def size(self) -> int: ...

    @property
    def nbytes(self) -> int: ...
