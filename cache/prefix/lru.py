"""Least-recently-used bookkeeping by bytes, for the RAM tier and the disk tier.

Only keys and sizes live here; the tiers keep the payloads. ``add`` makes room by evicting
the least recently used keys and returns them, oldest first:

    >>> lru = LRUBytes(100)
    >>> lru.add("a", 40), lru.add("b", 40)
    ([], [])
    >>> lru.touch("a")                # now b is the oldest
    >>> lru.add("c", 40)
    ['b']
    >>> lru.order(), lru.total
    (['a', 'c'], 80)
    >>> lru.add("huge", 101)          # larger than the whole budget: refused, nothing evicted
    ['huge']
    >>> lru.order()
    ['a', 'c']
"""

from __future__ import annotations

from collections import OrderedDict


class LRUBytes:
    """Keys with sizes under a byte budget; iteration order is least recently used first."""

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError("budget must be >= 0")
        self.budget = budget
        self.total = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size(self, key: str) -> int:
        return self._sizes[key]

    def order(self) -> list[str]:
        return list(self._sizes)

    def touch(self, key: str) -> None:
        self._sizes.move_to_end(key)

    def add(self, key: str, nbytes: int) -> list[str]:
        """Add (or re-add) ``key`` as the most recent; returns the keys evicted to fit it.
        A key larger than the budget is not added and comes back as the only eviction."""
        self.remove(key)
        if nbytes > self.budget:
            return [key]
        evicted = []
        while self.total + nbytes > self.budget:
            evicted.append(self.pop_oldest())
        self._sizes[key] = nbytes
        self.total += nbytes
        return evicted

    def pop_oldest(self) -> str:
        key, nbytes = self._sizes.popitem(last=False)
        self.total -= nbytes
        return key

    def remove(self, key: str) -> bool:
        nbytes = self._sizes.pop(key, None)
        if nbytes is None:
            return False
        self.total -= nbytes
        return True
