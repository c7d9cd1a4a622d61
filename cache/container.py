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
    is_batch_cache,
    is_kvserve_cache,
    layer_scheme,
    make_layer_cache,
)
from kvserve.cache.scheme import KVScheme, parse_scheme

_FP16_CLASSES = (_fp16.FP16KVCache, _fp16.BatchFP16KVCache)


class PromptCache(Sequence):
    """A request's (or a batch's) per-layer caches, converted in place at a threshold.

    ``scheme`` is the scheme the request asked for; layers hold fp16 until ``offset`` reaches
    ``quantize_after`` (0: they start in ``scheme``). Layers that mlx-lm makes for other
    attention types (rotating windows, SSM state) are kept as they are and never converted.
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
                return _fp16.FP16KVCache()
            return make_layer_cache(scheme, layer_index=i, num_layers=n)

        return cls(layer_caches(model, factory), scheme, quantize_after)

    # --- list-like, so mlx-lm models take it as ``cache=`` ---

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i):
        return self._layers[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._layers)

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

    @property
    def is_batch(self) -> bool:
        return any(is_batch_cache(layer) for layer in self._layers)

    @property
    def state(self) -> list[Any]:
        """Every layer's arrays, e.g. for ``mx.eval(cache.state)``."""
        return [layer.state for layer in self._layers]

    def is_trimmable(self) -> bool:
        return all(layer.is_trimmable() for layer in self._layers)

    def trim(self, n: int) -> int:
        if not self._layers or not self.is_trimmable():
            return 0
        trimmed = [layer.trim(n) for layer in self._layers]  # every layer, not just the first
        return trimmed[0]

    # --- conversion, inside the container ---

    def _targets(self) -> list[tuple[int, KVScheme]]:
        """(layer index, scheme) for every fp16 layer that the requested scheme would change.

        Boundary protection counts kvserve layers only, as ``layer_caches`` numbers them.
        """
        kv = [i for i, layer in enumerate(self._layers) if is_kvserve_cache(layer)]
        out = []
        for k, i in enumerate(kv):
            layer = self._layers[i]
            if type(layer) in _FP16_CLASSES:
                target = layer_scheme(self.scheme, k, len(kv))
                if target != layer.scheme:
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
            self._layers[i] = convert_layer(self._layers[i], target)

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
            layers.append(batch_class_for(column[0].scheme).merge(list(column)))
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
