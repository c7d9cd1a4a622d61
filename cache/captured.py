"""A batch cache's face inside a captured decode step (``kvserve.server.engine.captured``).

A captured step is traced once by ``mx.compile`` and replayed for every later step of the
same shapes, so whatever the model asks its caches must be an array the step takes as an
input, never a Python number baked into the trace. ``view(cls, scheme, parts, slot, starts)``
makes a stand-in for a batch layer of class ``cls`` that answers mlx-lm's questions that way:

    update_and_fetch(k, v)  encodes as the layer does, writes at slot ``slot`` (an array)
                            of parts allocated to the layer's capacity, returns all of it
    offset                  each row's position, ``slot - starts`` (B,)
    make_mask(1)            slot j visible to row b iff starts[b] <= j <= slot: the row's
                            tokens and the one written now, never padding or spare capacity
    attend                  the layer's own (its family's kernels, under that mask)

    >>> from kvserve.cache.fp16 import BatchFP16KVCache
    >>> from kvserve.cache.scheme import parse_scheme
    >>> parts = [mx.zeros((2, 1, 4, 2), mx.float16)] * 2
    >>> v = view(BatchFP16KVCache, parse_scheme("fp16"), parts, mx.array(2), mx.array([1, 0]))
    >>> v.offset.tolist(), v.make_mask(1)[:, 0, 0].tolist()
    ([1, 2], [[False, True, True, False], [True, True, True, False]])
    >>> k, _ = v.update_and_fetch(mx.ones((2, 1, 1, 2)), mx.ones((2, 1, 1, 2)))
    >>> k[0, 0, :, 0].tolist(), k.shape
    ([0.0, 0.0, 1.0, 0.0], (2, 1, 4, 2))

The view exists only while the step is traced; the runner keeps the arrays it returns.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from kvserve.cache.base import BatchStoredKVCache
from kvserve.cache.scheme import KVScheme


class _SlotBuffer:
    """``GrowableBuffer``'s face: parts at full capacity, appends at an array slot."""

    def __init__(self, parts: list[mx.array], slot: mx.array):
        self.parts, self.slot = list(parts), slot

    def append(self, parts: list[mx.array]) -> None:
        self.parts = [write_slot(dst, src.astype(dst.dtype), self.slot) for dst, src in zip(self.parts, parts)]

    def views(self) -> list[mx.array]:
        return list(self.parts)


def write_slot(dst: mx.array, src: mx.array, slot: mx.array) -> mx.array:
    """``dst`` (B, H, capacity, W) with slot ``slot`` (an array) replaced by ``src`` (B, H, 1, W),
    as a scatter: MLX's CUDA ``slice_update`` at an array offset launched a thread per slot of
    the whole destination (0.77 ms per call for 268 MB of fp16 K, 49 of a 57 ms step at 16K,
    H200), a scatter one per element written.

        >>> write_slot(mx.zeros((1, 1, 4, 2)), mx.ones((1, 1, 1, 2)), mx.array(2))[0, 0, :, 0].tolist()
        [0.0, 0.0, 1.0, 0.0]
    """
    at = mx.broadcast_to(slot.astype(mx.int32).reshape(1, 1, 1, 1), src.shape)
    return mx.put_along_axis(dst, at, src, axis=2)


class CapturedView:
    """Overrides of a batch layer's position questions (mixed in before its class)."""

    _starts: mx.array
    _slot: mx.array
    _mask: mx.array

    @property
    def offset(self) -> mx.array:
        return self._slot - self._starts

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if N != 1 or window_size is not None:
            raise ValueError("a captured step decodes one token per row, under full attention")
        return self._mask


@functools.cache
def view_class(cls: type) -> type:
    """``cls`` with the captured answers; attention dispatch takes it for ``cls`` itself."""
    return type(f"Captured{cls.__name__}", (CapturedView, cls), {"view_of": cls})


def captured_state(layer: Any) -> dict[str, Any] | None:
    """What a view of ``layer`` copies (its ``captured_state``), or None where a captured step
    cannot stand in for it: layers that are not stored full-attention batch layers (windows,
    recurrent states, parallel parts) or that are not in their decode form."""
    if not isinstance(layer, BatchStoredKVCache) or layer._buf.parts is None:
        return None
    return layer.captured_state()


def structure(layers: list[Any]) -> tuple | None:
    """What a trace of ``layers`` assumes beyond array shapes (each layer's class, scheme and
    storage parts), or None where a captured step cannot stand in for all of them at one size."""
    if not layers or any(captured_state(layer) is None for layer in layers):
        return None
    if len({layer.size() for layer in layers}) != 1:
        return None
    return tuple((type(layer), layer.scheme.name, len(layer._buf.parts)) for layer in layers)


def templates(layers: list[Any]) -> list[tuple[type, KVScheme, int, dict[str, Any]]]:
    """What ``view`` needs of each layer: classes, schemes and static state only, since a
    trace outlives the batch it was made for."""
    return [(type(layer), layer.scheme, len(layer._buf.parts), captured_state(layer)) for layer in layers]


def step_inputs(layers: list[Any]) -> tuple[int, list[mx.array]]:
    """The layers' size and their storage parts in order, each with room for one more slot
    (made here, outside the trace: a copy on growth)."""
    size = layers[0].size()
    for layer in layers:
        layer._buf.reserve(layer._buf.parts, size + 1)
    return size, [p for layer in layers for p in layer._buf.parts]


def adopt_outputs(layers: list[Any], parts: list[mx.array]) -> None:
    """The step's storage parts become the layers' own, one slot longer."""
    i = 0
    for layer in layers:
        n = len(layer._buf.parts)
        layer._buf.parts, i = parts[i:i + n], i + n
        layer._buf.size += 1


def view(cls: type, scheme: KVScheme, parts: list[mx.array], slot: mx.array, starts: mx.array,
         mask: mx.array | None = None, state: dict[str, Any] | None = None) -> Any:
    """A stand-in for a batch layer of ``cls`` over ``parts`` (its storage at full capacity),
    one row per entry of ``starts``, with the layer's ``state`` (``captured_state``)."""
    v = object.__new__(view_class(cls))
    v.__dict__.update(state or {})
    v.scheme, v.left_padding, v._right_padding = scheme, [0] * starts.shape[0], None
    v._buf, v._slot, v._starts = _SlotBuffer(parts, slot), slot, starts
    v._mask = step_mask(starts, slot, parts[0].shape[2]) if mask is None else mask
    return v


def step_mask(starts: mx.array, slot: mx.array, capacity: int) -> mx.array:
    """(B, 1, 1, capacity) bool: slot j visible to row b iff starts[b] <= j <= slot. The GPU
    kernels read it as a mask over the whole capacity. Known by its rows' spans instead (the
    tensor-core pass reading each row's first slot and the end, as it does for a padded
    eager step), captured steps of the default model on an H200 parted from the eager ones
    by up to 0.98 nats a token (mean 0.22, against 0.01 with the mask read): not yet
    explained, so not used (docs/benchmarks/gpu-serve.md, twenty-second round)."""
    j = mx.arange(capacity, dtype=mx.int32)
    return ((j[None] >= starts[:, None]) & (j[None] <= slot))[:, None, None, :]
