"""Layers that hold several caches side by side (mlx-lm's ``CacheList``).

Falcon-H1 runs a Mamba-2 mixer and attention in parallel in every layer, so each layer
owns a recurrent state and a K/V cache; its model code reads them as ``cache[0]`` and
``cache[1]``. ``ParallelCache`` holds kvserve caches of any kind in that order and answers
the protocol for them together: every part takes the same tokens, trims together, merges
row by row with its own batch class. A file stores the parts' arrays one after another and
a description of each part:

    state     [conv, ssm, keys, values]        (StateCache's arrays, then FP16KVCache's)
    meta      {"parallel.parts": '[{"class": "StateCache", "meta": {...}, "tensors": 2},
                                   {"class": "FP16KVCache", "meta": {...}, "tensors": 2}]'}
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx

from kvserve.cache.registry import batch_class_of, cache_class_by_name, register_kind, stores_scheme
from kvserve.cache.scheme import KVScheme


def _can_trim(part: Any, n: int) -> bool:
    can = getattr(part, "can_trim", None)
    return can(n) if can is not None else part.is_trimmable() and n <= part.size()


class ParallelCache:
    """One request's layer of side-by-side caches (``parts``, in the model's order)."""

    any_scheme = True

    def __init__(self, parts: list[Any]):
        if not parts:
            raise ValueError("a parallel layer needs at least one cache")
        self.parts = list(parts)

    def __getitem__(self, idx: int) -> Any:
        return self.parts[idx]

    def __len__(self) -> int:
        return len(self.parts)

    @property
    def stores_kv(self) -> bool:
        return any(p.stores_kv for p in self.parts)

    @property
    def scheme(self) -> KVScheme:
        kv = [p for p in self.parts if p.stores_kv]
        return (kv or self.parts)[0].scheme

    @property
    def offset(self) -> Any:
        return self.parts[0].offset

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def size(self) -> int:
        return max(p.size() for p in self.parts)

    def empty(self) -> bool:
        return all(p.empty() for p in self.parts)

    def is_trimmable(self) -> bool:
        return all(p.is_trimmable() for p in self.parts)

    def trim_reach(self) -> int:
        return min(p.trim_reach() for p in self.parts)

    def can_trim(self, n: int) -> bool:
        return all(_can_trim(p, n) for p in self.parts)

    def trim(self, n: int) -> int:
        if not self.can_trim(n):
            raise ValueError(f"a part of this layer cannot drop {n} tokens")
        return [p.trim(n) for p in self.parts][0]

    def begin_decode(self) -> None:
        for p in self.parts:
            p.begin_decode()

    @property
    def state(self) -> tuple[mx.array, ...]:
        return tuple(a for p in self.parts for a in p.state)

    @property
    def meta_state(self) -> dict[str, str]:
        parts = [{"class": type(p).__name__, "meta": p.meta_state, "tensors": len(p.state)}
                 for p in self.parts]
        return {"parallel.parts": json.dumps(parts)}

    @classmethod
    def from_state(cls, scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]):
        described = json.loads(meta["parallel.parts"])
        if sum(int(d["tensors"]) for d in described) != len(state):
            raise ValueError(f"{len(state)} arrays for parts of {[d['tensors'] for d in described]}")
        parts, at = [], 0
        for d in described:
            part_cls = cache_class_by_name(d["class"])
            if part_cls in (ParallelCache, BatchParallelCache) or not stores_scheme(part_cls, scheme):
                raise ValueError(f"{part_cls.__name__} cannot be a part of a {scheme.name} layer")
            n = int(d["tensors"])
            parts.append(part_cls.from_state(scheme, state[at:at + n], d["meta"]))
            at += n
        return cls(parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.parts))})"


class BatchParallelCache(ParallelCache):
    """B rows of side-by-side caches: each part is its kind's batch cache."""

    single_cls = ParallelCache

    @classmethod
    def merge(cls, caches: list[ParallelCache]) -> BatchParallelCache:
        columns = zip(*(c.parts for c in caches))
        return cls([batch_class_of(col[0]).merge(list(col)) for col in columns])

    def extract(self, i: int) -> ParallelCache:
        return ParallelCache([p.extract(i) for p in self.parts])

    def filter(self, indices: list[int]) -> None:
        for p in self.parts:
            p.filter(indices)

    def extend(self, other: BatchParallelCache) -> None:
        for p, o in zip(self.parts, other.parts):
            p.extend(o)

    def can_trim_rows(self, counts: list[int]) -> bool:
        return all(p.can_trim_rows(counts) for p in self.parts)

    def trim_rows(self, counts: list[int]) -> None:
        for p in self.parts:
            p.trim_rows(counts)

    def prepare(self, **kwargs) -> None:
        for p in self.parts:
            p.prepare(**kwargs)

    def finalize(self) -> None:
        for p in self.parts:
            p.finalize()


register_kind("parallel", ParallelCache, BatchParallelCache)
