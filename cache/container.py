"""``PromptCache``: the one reference object that holds a request's per-layer caches.

Whoever holds the container (runner, scheduler, prefix cache, caller) sees the same layers,
including after a conversion: layers are swapped *inside* the container, never handed out
to be kept. A model step:

    cache = PromptCache.for_model(model, "affine4", quantize_after=512)
    logits = model(tokens[None], cache=cache)   # the container is list-like, mlx-lm accepts it
    cache.maybe_convert()                       # after every forward: fp16 -> affine4 at 512

Batching (one container per request, one batch container per step):

    batch = PromptCache.merge([cache_a, cache_b])     # left-padded batch layers
    logits = model(tokens, cache=batch)               # tokens (2, 1)
    batch.maybe_convert()
    cache_a = batch.extract(0)                        # or batch.filter([1]) / batch.extend(...)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx import nn

from kvserve.cache import fp16 as _fp16
from kvserve.cache.adapter import install_attention, layer_caches
from kvserve.cache.registry import (
    batch_class_for,
    batch_class_of,
    is_batch_cache,
    is_kvserve_cache,
    layer_scheme,
    make_layer_cache,
)
from kvserve.cache.scheme import KVScheme, parse_scheme

from kvserve.cache.sliding import BatchSlidingKVCache, SlidingKVCache
from kvserve.cache.parallel import BatchParallelCache, ParallelCache

_FP16_CLASSES = (_fp16.FP16KVCache, _fp16.BatchFP16KVCache)
SLIDING = (SlidingKVCache, BatchSlidingKVCache)
PARALLEL = (ParallelCache, BatchParallelCache)


def _store(layer: Any) -> Any:
    """The cache that holds a layer's K/V: the layer itself, a sliding window's store, or
    that of a parallel layer's K/V part."""
    if isinstance(layer, PARALLEL):
        return _store(next(p for p in layer.parts if p.stores_kv))
    return layer.inner if isinstance(layer, SLIDING) else layer


def _converted(layer: Any, target: KVScheme) -> Any:
    """``layer`` with its fp16 K/V store converted to ``target``; windows and parallel layers
    stay the same objects (their holders see the new store)."""
    if isinstance(layer, SLIDING):
        layer.inner = convert_layer(layer.inner, target)
        return layer
    if isinstance(layer, PARALLEL):
        layer.parts = [_converted(p, target) if p.stores_kv else p for p in layer.parts]
        return layer
    return convert_layer(layer, target)


def _kind(layer: Any) -> str:
    if isinstance(layer, PARALLEL):
        return "(" + "|".join(_kind(p) for p in layer.parts) + ")"
    if isinstance(layer, SLIDING):
        return f"window{layer.window}"
    if not layer.stores_kv:
        return f"state{len(layer.cache)}"
    return "kv"


def _can_trim(layer: Any, n: int) -> bool:
    can = getattr(layer, "can_trim", None)
    return can(n) if can is not None else layer.is_trimmable() and n <= layer.size()


class PromptCache(Sequence):
    """A request's (or a batch's) per-layer caches, converted in place at a threshold.

    ``scheme`` is the scheme the request asked for; K/V layers (full attention, and the
    store inside a sliding window) hold fp16 until ``offset`` reaches ``quantize_after``
    (0: they start in ``scheme``). Recurrent-state layers keep the model's dtype.
    """

    def __init__(self, layers: list[Any], scheme: KVScheme | str, quantize_after: int = 0):
        self._layers = list(layers)
        self.scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
        self.quantize_after = quantize_after

    @classmethod
    def for_model(cls, model: nn.Module, scheme: KVScheme | str, quantize_after: int = 0) -> PromptCache:
        """Empty caches for every layer of an mlx-lm model; installs the attention dispatcher."""
        scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
        install_attention(model)
        start_fp16 = scheme.quantized and quantize_after > 0

        def factory(i: int, n: int):
            if start_fp16:
                return _fp16.FP16KVCache(_fp16.RAW_PHASE)
            return make_layer_cache(scheme, layer_index=i, num_layers=n)

        return cls(layer_caches(model, factory, scheme), scheme, quantize_after)

    # --- list-like, so mlx-lm models take it as ``cache=`` ---

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i):
        return self._layers[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._layers)

    def __add__(self, other: list) -> list:
        # Gemma 4 pads the cache list for its KV-shared layers: ``cache + [None] * k``.
        return list(self._layers) + list(other)

    @property
    def layers(self) -> tuple[Any, ...]:
        """A snapshot; do not keep it across steps (conversion replaces layers)."""
        return tuple(self._layers)

    # --- what every holder asks ---

    @property
    def offset(self) -> Any:
        """Tokens stored: an int, or (B,) per sequence for a batch."""
        return self._layers[0].offset

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers)

    def layout(self) -> str:
        """The layer kinds in order, runs collapsed: ``kv`` full attention, ``window<W>`` a
        sliding window, ``state<n>`` recurrent state of n arrays (what a file must match).

            >>> PromptCache([make_layer_cache("fp16") for _ in range(3)], "fp16").layout()
            'kv*3'
        """
        kinds = [_kind(layer) for layer in self._layers]
        runs: list[list] = []
        for kind in kinds:
            if runs and runs[-1][0] == kind:
                runs[-1][1] += 1
            else:
                runs.append([kind, 1])
        return ",".join(k if n == 1 else f"{k}*{n}" for k, n in runs)

    @property
    def is_batch(self) -> bool:
        return any(is_batch_cache(layer) for layer in self._layers)

    @property
    def state(self) -> list[Any]:
        """Every layer's arrays, e.g. for ``mx.eval(cache.state)``."""
        return [layer.state for layer in self._layers]

    def is_trimmable(self) -> bool:
        """Every layer can be cut to any shorter prefix (what the prefix cache asks)."""
        return all(layer.is_trimmable() for layer in self._layers)

    def can_trim(self, n: int) -> bool:
        """The last ``n`` tokens can go from every layer (a sliding window keeps a reserve,
        a recurrent state can undo its last forward)."""
        return all(_can_trim(layer, n) for layer in self._layers)

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens from every layer, or from none (returns 0)."""
        if not self._layers or not self.can_trim(n):
            return 0
        trimmed = [layer.trim(n) for layer in self._layers]  # every layer, not just the first
        return trimmed[0]

    def can_trim_rows(self, counts: list[int]) -> bool:
        """Row b of a batch can drop its last ``counts[b]`` tokens in every layer."""
        return all(layer.can_trim_rows(counts) for layer in self._layers)

    def trim_rows(self, counts: list[int]) -> None:
        """Drop the last ``counts[b]`` tokens of row b from every layer (rejected
        speculative tokens); each layer keeps its class and scheme."""
        if not self.can_trim_rows(counts):
            raise ValueError(f"cannot drop {counts} tokens row by row from {self!r}")
        for layer in self._layers:
            layer.trim_rows(counts)

    def begin_decode(self) -> None:
        """Every layer takes its decode form (TurboQuant compresses its raw prompt)."""
        for layer in self._layers:
            layer.begin_decode()

    def record_positions(self) -> None:
        """The next forward is a verify step: recurrent layers keep their state after each
        of its positions, so ``trim_rows`` can roll every row back to the tokens it keeps."""
        for layer in self._layers:
            for part in layer.parts if isinstance(layer, PARALLEL) else (layer,):
                if hasattr(part, "record_positions"):
                    part.record_positions()

    # --- conversion, inside the container ---

    def _targets(self) -> list[tuple[int, KVScheme]]:
        """(layer index, scheme) for every fp16 K/V store that the requested scheme would change.

        Boundary protection counts K/V-bearing layers only, as ``layer_caches`` numbers them.
        """
        kv = [i for i, layer in enumerate(self._layers) if layer.stores_kv]
        out = []
        for k, i in enumerate(kv):
            store = _store(self._layers[i])
            if type(store) in _FP16_CLASSES:
                target = layer_scheme(self.scheme, k, len(kv))
                if target != store.scheme:
                    out.append((i, target))
        return out

    @property
    def pending_conversion(self) -> bool:
        return bool(self._targets())

    def maybe_convert(self) -> bool:
        """Convert fp16 layers once ``offset >= quantize_after`` (a batch: its longest
        sequence); call after every forward. Returns True when layers were converted."""
        targets = self._targets()
        if not targets:
            return False
        offset = self._layers[targets[0][0]].offset
        longest = int(mx.max(offset).item()) if isinstance(offset, mx.array) else offset
        if longest < self.quantize_after:
            return False
        self.convert()
        return True

    def convert(self) -> None:
        """Convert every pending fp16 layer now, whatever the offset."""
        for i, target in self._targets():
            self._layers[i] = _converted(self._layers[i], target)

    # --- batch algebra, layer by layer ---

    @classmethod
    def merge(cls, caches: Sequence[PromptCache]) -> PromptCache:
        """Left-pad and stack per-request containers of one scheme into a batch container.

        Layers must share a class to stack: when some containers are still fp16 and others
        converted, the fp16 ones are converted first (in place, so their holders see it)."""
        first = caches[0]
        if any(c.scheme != first.scheme for c in caches):
            raise ValueError("cannot merge containers of different schemes")
        if any(c.pending_conversion for c in caches) and not all(c.pending_conversion for c in caches):
            for c in caches:  # layers must share a class to merge
                c.convert()
        layers = []
        for column in zip(*(c._layers for c in caches)):
            if not is_kvserve_cache(column[0]):
                raise TypeError(f"cannot merge {type(column[0]).__name__} layers")
            layers.append(batch_class_of(column[0]).merge(list(column)))
        return cls(layers, first.scheme, first.quantize_after)

    def extract(self, i: int) -> PromptCache:
        return PromptCache([layer.extract(i) for layer in self._layers], self.scheme, self.quantize_after)

    def filter(self, indices: list[int]) -> None:
        for layer in self._layers:
            layer.filter(indices)

    def extend(self, other: PromptCache) -> None:
        if other.pending_conversion != self.pending_conversion:
            self.convert()
            other.convert()
        for layer, theirs in zip(self._layers, other._layers):
            layer.extend(theirs)

    def prepare(self, **kwargs) -> None:
        for layer in self._layers:
            layer.prepare(**kwargs)

    def finalize(self) -> None:
        for layer in self._layers:
            layer.finalize()

    def __repr__(self) -> str:
        return (f"PromptCache({self.scheme.name}, layers={len(self)}, offset={self.offset}, "
                f"nbytes={self.nbytes})")


def kv_stores(cache: PromptCache) -> list[Any]:
    """The caches that hold each K/V layer's tokens (a window's or a parallel layer's store)."""
    return [_store(layer) for layer in cache if layer.stores_kv]


def checkpointed_kinds(cache: PromptCache) -> list[int]:
    """Indices of the layers the prefix cache keeps checkpoints of: windows, recurrent
    states and layers with a state part (full-attention layers trim to any prefix)."""
    return [i for i, layer in enumerate(cache) if isinstance(layer, SLIDING + PARALLEL) or not layer.stores_kv]


def cannot_trim_at_all(cache: PromptCache) -> bool:
    """A layer holds a recurrent state: an entry serves only the lengths it has checkpoints at."""
    return any(isinstance(layer, PARALLEL) or not layer.stores_kv for layer in cache)


def converted_copy(cache: PromptCache, i: int) -> Any:
    """A new layer holding what layer ``i`` holds (B = 1), its fp16 K/V store converted as
    ``cache.convert()`` would convert it; the caller's layer is unchanged."""
    layer = cache[i]
    copy = type(layer).from_state(layer.scheme, tuple(layer.state), dict(layer.meta_state))
    target = dict(cache._targets()).get(i)
    return _converted(copy, target) if target is not None else copy


def convert_layer(layer: Any, target: KVScheme) -> Any:
    """A cache of ``target`` holding the same tokens (and padding) as an fp16 layer.

    Only the protocol is used: the new cache takes the stored keys and values as one prefill.
    """
    if is_batch_cache(layer):
        new = batch_class_for(target)(target, list(layer.left_padding))
    else:
        new = make_layer_cache(target)
    if not layer.empty() and layer.size() > 0:
        new.update_and_fetch(*layer.state)  # (B, H_kv, T, D) keys, values
    return new
