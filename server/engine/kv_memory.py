"""The KV memory budget: bytes all live requests' caches may hold (``--kv-memory``).

The scheduler stays pure policy over token counts; this module turns a byte budget into
those counts for the served model and scheme. What one token costs is measured once at
start-up (``token_bytes``): a request's cache is filled with 16 and then 32 tokens and the
bytes its stored arrays grew by are divided by 16, so per-layer constants (a recurrent
state, TurboQuant's key calibration) do not count and every layer kind counts at what it
stores. A scheme that stores fewer bytes per token gets proportionally more tokens, so more
rows are admitted before requests wait or are preempted.

Example (a 2 GiB budget at 7,200 bytes per token, the default model in affine4):
    >>> b = KVBudget(2 << 30, 7200, "--kv-memory")
    >>> b.tokens, b.describe()
    (298261, '2.0 GiB (--kv-memory) = 298,261 tokens at 7,200 B per token')
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_SHARE = 0.25  # of the machine's memory, without --kv-memory
_PROBE = (16, 32)  # tokens of the two fills whose difference is measured


@dataclass(frozen=True)
class KVBudget:
    """Bytes the KV caches may hold, what a token costs, and where the bytes came from."""

    bytes: int
    token_bytes: int
    source: str  # "--kv-memory", or how the default was worked out

    @property
    def tokens(self) -> int:
        return max(1, self.bytes // max(1, self.token_bytes))

    def describe(self) -> str:
        return f"{_size(self.bytes)} ({self.source}) = {self.tokens:,} tokens at {self.token_bytes:,} B per token"


def _size(n: int) -> str:
    """``n`` bytes in GiB, or MiB below 1 GiB: ``_size(6 << 20)`` is '6.0 MiB'."""
    return f"{n / 2**30:.1f} GiB" if n >= 1 << 30 else f"{n / 2**20:.1f} MiB"


def kv_budget(configured: int | None, token_bytes: int) -> KVBudget:
    """The configured budget, else ``DEFAULT_SHARE`` of the machine's memory."""
    if configured is not None:
        return KVBudget(configured, token_bytes, "--kv-memory")
    total = machine_memory()
    return KVBudget(int(total * DEFAULT_SHARE), token_bytes,
                    f"{DEFAULT_SHARE:.0%} of {_size(total)} of memory")


def machine_memory() -> int:
    """Physical memory of this machine in bytes (1/4 of it is the default budget)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30  # a platform that does not say: budget as for a 16 GiB machine


def token_bytes(model, scheme) -> int:
    """Bytes one more token adds to a request's cache of ``model`` in ``scheme``, all layers
    (this process's shard of a split model). Runs two short prefills."""
    import mlx.core as mx

    from kvserve.cache import PromptCache

    stored = []
    for n in _PROBE:
        cache = PromptCache.for_model(model, scheme)
        model(mx.array([[(7 * i + 1) % 100 for i in range(n)]]), cache=cache)
        cache.begin_decode()  # TurboQuant compresses its prompt, as decoding does
        stored.append(sum(a.nbytes for a in _arrays(cache.state)))
    return max(1, (stored[1] - stored[0]) // (_PROBE[1] - _PROBE[0]))


def _arrays(tree) -> list:
    """The arrays of a cache's ``state`` (nested lists and tuples of arrays)."""
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in _arrays(item)]
    return [] if tree is None else [tree]
