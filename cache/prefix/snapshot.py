"""Entries in memory: a ``PromptCache`` copied into compact arrays, and back.

A ``Snapshot`` keeps each layer's class name, scheme, ``state`` arrays (exactly ``offset``
tokens, in the layer's own quantized form) and ``meta_state``. Taking one copies the arrays
out of the caller's growable buffers, so the caller's next append neither changes the entry
nor has to copy a buffer the entry still shares.

All arrays of an entry share one allocation (``pack``). One per layer and part they are
small (tens of KiB for a short prompt) and the same sizes as the short-lived buffers of prefill
chunks and hit copies, so in malloc's arenas they sat between them, and the gaps that
evicted entries left stayed resident. One allocation per entry is, from 1 MiB up (the mmap
threshold ``kvserve serve`` pins glibc at), a mapping of its own that an eviction hands
back to the OS whole.

Which prefixes a copy can serve exactly (``exact_floor``). A trimmed copy holding m tokens is
only handed out when it equals what the original held at m tokens:

* fp16 and ``mx.quantize`` layers encode every token on its own: any m is exact;
* TurboQuant layers in their raw phase hold the tokens as computed: any m is exact (the
  first decode step compresses, calibrating keys on the m tokens, as the original would);
* TurboQuant layers already compressed hold codes calibrated on every token stored at the
  first decode step, and do not record at which length that was: only the full length;
* a container whose layers were converted from fp16 at ``quantize_after`` = q held fp16
  below q, which the quantized copy cannot give back: only m >= q;
* layers that cannot trim (``is_trimmable()`` false): only the full length.

    >>> import mlx.core as mx
    >>> from kvserve.cache import PromptCache, make_layer_cache
    >>> layers = [make_layer_cache("affine8") for _ in range(2)]
    >>> for layer in layers:
    ...     _ = layer.update_and_fetch(mx.ones((1, 2, 5, 64)), mx.ones((1, 2, 5, 64)))
    >>> snap = take_snapshot(PromptCache(layers, "affine8"))
    >>> snap.num_tokens, snap.floor, snap.layers[0].cls_name, len(snap.layers[0].arrays)
    (5, 0, 'QuantizedKVCache', 6)
    >>> snap.layers[0].arrays[0].shape        # (B, H_kv, T, D*8/32): offset tokens, not capacity
    (1, 2, 5, 16)
    >>> copy = restore(snap, 3)
    >>> copy.offset, snap.num_tokens          # a trimmed copy; the snapshot is unchanged
    (3, 5)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvserve.cache.container import PromptCache
from kvserve.cache.registry import cache_class_by_name, is_kvserve_cache
from kvserve.cache.scheme import KVScheme
from kvserve.cache.turbo import COMPRESSED, TurboKVCache

# mx dtype <-> safetensors dtype name; bfloat16 travels as its uint16 bits (numpy has none).
ST_DTYPES = {mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32", mx.uint8: "U8",
             mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.int8: "I8",
             mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.bool_: "BOOL"}
MX_DTYPES = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True)
class LayerState:
    """One layer as ``from_state`` takes it back."""

    cls_name: str
    scheme: KVScheme
    arrays: tuple[mx.array, ...]  # (1, H_kv, T, W_i) parts, then per-family extras
    meta: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@dataclass(frozen=True)
class Snapshot:
    """A B = 1 container's layers, its scheme and threshold, and the shortest exact prefix."""

    layers: tuple[LayerState, ...]
    scheme: KVScheme
    quantize_after: int
    num_tokens: int
    floor: int

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


def unsupported(cache: PromptCache) -> str | None:
    """Why ``cache`` cannot be stored, or None: only per-request kvserve layers can."""
    if not isinstance(cache, PromptCache) or len(cache) == 0:
        return "not a PromptCache with layers"
    if cache.is_batch:
        return "a batch container (extract one sequence first)"
    foreign = [type(layer).__name__ for layer in cache if not is_kvserve_cache(layer)]
    return f"layers of other kinds ({', '.join(sorted(set(foreign)))})" if foreign else None


def exact_floor(cache: PromptCache) -> int:
    """The shortest prefix a trimmed copy of ``cache`` reproduces exactly (module doc)."""
    n = int(cache.offset)
    if not cache.is_trimmable():
        return n
    if any(isinstance(layer, TurboKVCache) and layer.phase == COMPRESSED for layer in cache):
        return n
    converted = cache.scheme.quantized and cache.quantize_after > 0 and not cache.pending_conversion
    return min(cache.quantize_after, n) if converted else 0


# Offset alignment of each array inside an entry's one allocation (any dtype, SIMD loads).
PACK_ALIGN = 64


def pack(arrays: Sequence[mx.array]) -> tuple[mx.array, ...]:
    """Evaluated copies of ``arrays`` (contiguous or not) that share one buffer.

    The buffer is laid out as rows of ``PACK_ALIGN`` bytes: MLX's shape dimensions are
    32-bit, so a flat byte buffer would stop at 2 GiB (one fp16 layer stack of an 8B model
    at 16K tokens is exactly that); rows reach 128 GiB. One array must stay under 2 GiB.

    >>> a, b = pack([mx.arange(6, dtype=mx.float16).reshape(2, 3)[:, :2], mx.ones((2,), mx.uint32)])
    >>> a.tolist(), b.tolist()
    ([[0.0, 1.0], [3.0, 4.0]], [1, 1])
    """
    parts, rows, at = [], [], 0
    for a in arrays:
        if a.nbytes >= 1 << 31:
            raise ValueError(f"an array of {a.nbytes} bytes is too large to snapshot (limit 2 GiB)")
        raw = a.reshape(-1).view(mx.uint8)  # row-major bytes (reshape copies a strided slice)
        pad = -raw.size % PACK_ALIGN
        raw = mx.concatenate([raw, mx.zeros((pad,), mx.uint8)]) if pad else raw
        parts.append(raw.reshape(-1, PACK_ALIGN))
        rows.append(at)
        at += parts[-1].shape[0]
    if not parts:
        return ()
    flat = mx.concatenate(parts)  # (rows, PACK_ALIGN)
    out = tuple(flat[r : r + part.shape[0]].reshape(-1)[: a.nbytes].view(a.dtype).reshape(a.shape)
                for r, part, a in zip(rows, parts, arrays))
    mx.eval(out)  # slices, views and reshapes of a contiguous buffer share it
    return out


def _layer_states(layers: Sequence[Any]) -> tuple[LayerState, ...]:
    """Every layer's state, packed into one allocation."""
    states = [tuple(layer.state) for layer in layers]  # exactly offset tokens each
    packed = iter(pack([a for state in states for a in state]))
    return tuple(LayerState(type(layer).__name__, layer.scheme, tuple(next(packed) for _ in state),
                            dict(layer.meta_state)) for layer, state in zip(layers, states))


def take_snapshot(cache: PromptCache) -> Snapshot:
    """Copy ``cache`` (B = 1, kvserve layers) into compact, evaluated arrays."""
    reason = unsupported(cache)
    if reason:
        raise ValueError(f"cannot snapshot {reason}")
    return Snapshot(_layer_states(list(cache)), cache.scheme, cache.quantize_after, int(cache.offset),
                    exact_floor(cache))


def snapshot_of_loaded(layers: list[Any], scheme: KVScheme, quantize_after: int) -> Snapshot:
    """A snapshot of freshly loaded layers (their arrays, one per tensor, are packed too)."""
    cache = PromptCache(layers, scheme, quantize_after)
    return Snapshot(_layer_states(layers), scheme, quantize_after, int(cache.offset), exact_floor(cache))


def restore(snap: Snapshot, num_tokens: int) -> PromptCache:
    """A new container holding the first ``num_tokens`` tokens; ``floor <= num_tokens`` required.

    Its layers own their handles: appending to them never changes the snapshot's arrays.
    """
    if not snap.floor <= num_tokens <= snap.num_tokens:
        raise ValueError(f"{num_tokens} tokens cannot be restored exactly from an entry of "
                         f"{snap.num_tokens} (shortest exact prefix {snap.floor})")
    layers = []
    for state in snap.layers:
        layer = cache_class_by_name(state.cls_name).from_state(state.scheme, state.arrays, state.meta)
        if num_tokens < snap.num_tokens:
            layer.trim(snap.num_tokens - num_tokens)
        layers.append(layer)
    return PromptCache(layers, snap.scheme, snap.quantize_after)


# --- to and from the bytes a file holds ---

def layer_descriptions(snap: Snapshot) -> dict[str, str]:
    """The per-layer metadata of ``kvserve.cache.serialize`` (so ``load_layers`` reads our files)."""
    out = {"num_layers": str(len(snap.layers))}
    for i, s in enumerate(snap.layers):
        out[f"layer.{i}"] = json.dumps({"class": s.cls_name, "params": s.scheme.params(),
                                        "offset": snap.num_tokens, "meta": s.meta,
                                        "tensors": len(s.arrays)})
    return out


def host_tensors(snap: Snapshot) -> list[tuple[str, str, np.ndarray]]:
    """(name, safetensors dtype, numpy view) per array, names ``layer.<i>.<j>``.

    Views, not copies: they keep the evaluated MLX arrays alive and are only read (by the
    writer thread). Call on the thread that owns the arrays."""
    out = []
    for i, s in enumerate(snap.layers):
        for j, a in enumerate(s.arrays):
            if a.dtype == mx.bfloat16:
                a = a.view(mx.uint16)
                mx.eval(a)
            out.append((f"layer.{i}.{j}", ST_DTYPES[s.arrays[j].dtype], np.asarray(a)))
    return out


def device_array(data: np.ndarray, st_dtype: str) -> mx.array:
    """An MLX array from file bytes viewed as numpy (``data`` already has the stored shape)."""
    a = mx.array(data)
    return a.view(mx.bfloat16) if st_dtype == "BF16" else a
