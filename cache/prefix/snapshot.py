"""Entries in memory: a ``PromptCache`` copied into compact arrays, and back.

A ``Snapshot`` keeps each layer's class name, scheme, ``state`` arrays (exactly ``offset``
tokens, in the layer's own quantized form; an affine layer's ``stored`` records, two arrays
where its state has six) and ``meta_state``. Taking one copies the arrays
out of the caller's growable buffers, so the caller's next append neither changes the entry
nor has to copy a buffer the entry still shares.

An entry's arrays under 1 MiB share one allocation (``pack``). One per layer and part they
are small (tens of KiB for a short prompt) and the same sizes as the short-lived buffers of
prefill chunks and hit copies, so in malloc's arenas they sat between them, and the gaps that
evicted entries left stayed resident. One allocation per entry is, from 1 MiB up (the mmap
threshold ``kvserve serve`` pins glibc at), a mapping of its own that an eviction hands
back to the OS whole. An array of 1 MiB or more is such a mapping by itself, so it is copied
on its own: one copy, where joining it into the shared buffer took two (a strided slice
flattened, then concatenated), 3-4x the time for a long prompt's entry.

Which prefixes a copy can serve exactly. A copy trimmed to m tokens is only handed out when
it equals what the original held at m tokens. Each layer records its ``reach``, how many of
its last tokens it can drop that way (``kv_floor`` and the kind's ``trim_reach``):

* fp16 and ``mx.quantize`` layers encode every token on its own: all of them;
* TurboQuant layers in their raw phase hold the tokens as computed: all of them (the first
  decode step compresses, calibrating keys on the m tokens, as the original would);
* TurboQuant layers already compressed hold codes calibrated on every token stored at the
  first decode step, and do not record at which length that was: none;
* a container whose layers were converted from fp16 at ``quantize_after`` = q held fp16
  below q, which the quantized copy cannot give back: down to q;
* a sliding window, what it holds beyond ``window - 1``; a recurrent state, none.

An entry also keeps ``checkpoints`` (checkpoints.py): copies of its window and state layers
at shorter lengths. ``spans`` are the lengths every layer can serve, from the entry's own
layers or a checkpoint's.

    >>> import mlx.core as mx
    >>> from kvserve.cache import PromptCache, make_layer_cache
    >>> layers = [make_layer_cache("affine8") for _ in range(2)]
    >>> for layer in layers:
    ...     _ = layer.update_and_fetch(mx.ones((1, 2, 5, 64)), mx.ones((1, 2, 5, 64)))
    >>> snap = take_snapshot(PromptCache(layers, "affine8"))
    >>> snap.num_tokens, snap.spans, snap.layers[0].cls_name, len(snap.layers[0].arrays)
    (5, ((1, 5),), 'QuantizedKVCache', 2)
    >>> snap.layers[0].arrays[0].shape        # K|V codes (B, H_kv, T, 2*D*8/32): offset tokens
    (1, 2, 5, 32)
    >>> [a.shape[-1] for a in snap.layers[0].state()]   # what a file holds: the six parts
    [16, 1, 1, 16, 1, 1]
    >>> copy = restore(snap, 3)
    >>> copy.offset, snap.num_tokens          # a trimmed copy; the snapshot is unchanged
    (3, 5)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from kvserve.cache.container import PromptCache, kv_stores
from kvserve.cache.prefix.checkpoints import Checkpoint, Span, source, spans
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
    """One layer as ``from_state`` takes it back, or, where ``stored``, as the layer stores
    it (``from_stored``: an affine layer's two records, not its six parts)."""

    cls_name: str
    scheme: KVScheme
    arrays: tuple[mx.array, ...]  # (1, H_kv, T, W_i) parts, then per-family extras
    meta: dict[str, str]
    reach: int = 0  # how many last tokens a copy can drop exactly
    stored: bool = False
    # What copies restored from it share of their encoding (``TurboKVCache.encoding_share``);
    # not in files.
    shared: Any = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def state(self) -> tuple[mx.array, ...]:
        """The layer's ``state`` (what a file holds)."""
        return cache_class_by_name(self.cls_name).state_of(self.scheme, self.arrays) if self.stored else self.arrays

    def layer(self) -> Any:
        """A new layer holding these arrays."""
        cls = cache_class_by_name(self.cls_name)
        return (cls.from_stored if self.stored else cls.from_state)(self.scheme, self.arrays, self.meta)


def _kept(layer: Any) -> tuple[tuple[mx.array, ...], bool]:
    """What a snapshot copies of a layer: ``stored`` where its class keeps another
    arrangement than ``state`` (fewer, larger arrays), else ``state``."""
    return (tuple(layer.stored), True) if hasattr(type(layer), "from_stored") else (tuple(layer.state), False)


@dataclass(frozen=True)
class Snapshot:
    """A B = 1 container's layers, its scheme and threshold, its checkpoints, and the
    lengths they serve exactly (closed intervals)."""

    layers: tuple[LayerState, ...]
    scheme: KVScheme
    quantize_after: int
    num_tokens: int
    spans: tuple[Span, ...]
    checkpoints: tuple[Checkpoint, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers) + sum(c.nbytes for c in self.checkpoints)


def unsupported(cache: PromptCache) -> str | None:
    """Why ``cache`` cannot be stored, or None: only per-request kvserve layers can."""
    if not isinstance(cache, PromptCache) or len(cache) == 0:
        return "not a PromptCache with layers"
    if cache.is_batch:
        return "a batch container (extract one sequence first)"
    foreign = [type(layer).__name__ for layer in cache if not is_kvserve_cache(layer)]
    return f"layers of other kinds ({', '.join(sorted(set(foreign)))})" if foreign else None


def kv_floor(cache: PromptCache) -> int:
    """The shortest prefix the K/V encodings of ``cache`` reproduce exactly (module doc);
    what windows and states can drop is their ``trim_reach``."""
    n = int(cache.offset)
    if any(isinstance(store, TurboKVCache) and store.phase == COMPRESSED for store in kv_stores(cache)):
        return n
    converted = cache.scheme.quantized and cache.quantize_after > 0 and not cache.pending_conversion
    return min(cache.quantize_after, n) if converted else 0


# Offset alignment of each array inside an entry's one allocation (any dtype, SIMD loads).
PACK_ALIGN = 64
# From this size up an array is copied on its own: glibc then serves it from a mapping of its
# own (server/engine/heap.py pins its threshold at this value).
OWN_BUFFER = 1 << 20


def pack(arrays: Sequence[mx.array]) -> tuple[mx.array, ...]:
    """Evaluated copies of ``arrays`` (contiguous or not): those under ``OWN_BUFFER`` bytes
    share one buffer, each larger one has a buffer of its own.

    The shared buffer is laid out as rows of ``PACK_ALIGN`` bytes: MLX's shape dimensions are
    32-bit, so a flat byte buffer would stop at 2 GiB; rows reach 128 GiB.

    >>> a, b = pack([mx.arange(6, dtype=mx.float16).reshape(2, 3)[:, :2], mx.ones((2,), mx.uint32)])
    >>> a.tolist(), b.tolist()
    ([[0.0, 1.0], [3.0, 4.0]], [1, 1])
    """
    out: list[mx.array | None] = [mx.array(a) if a.nbytes >= OWN_BUFFER else None for a in arrays]
    small = [i for i, a in enumerate(out) if a is None]
    parts, rows, at = [], [], 0
    for i in small:
        raw = arrays[i].reshape(-1).view(mx.uint8)  # row-major bytes (reshape copies a strided slice)
        pad = -raw.size % PACK_ALIGN
        raw = mx.concatenate([raw, mx.zeros((pad,), mx.uint8)]) if pad else raw
        parts.append(raw.reshape(-1, PACK_ALIGN))
        rows.append(at)
        at += parts[-1].shape[0]
    if parts:
        flat = mx.concatenate(parts)  # (rows, PACK_ALIGN)
        for i, r, part in zip(small, rows, parts):
            a = arrays[i]
            out[i] = flat[r : r + part.shape[0]].reshape(-1)[: a.nbytes].view(a.dtype).reshape(a.shape)
    mx.eval(out)  # slices, views and reshapes of a contiguous buffer share it
    return tuple(out)


def reaches(cache: PromptCache) -> list[int]:
    """Per layer, how many of its last tokens a copy can drop exactly (module doc)."""
    room = int(cache.offset) - kv_floor(cache)
    return [min(layer.trim_reach(), room) for layer in cache]


def layer_states(layers: Sequence[Any], reach: Sequence[int]) -> tuple[LayerState, ...]:
    """Every layer's state, packed into one allocation."""
    kept = [_kept(layer) for layer in layers]  # exactly offset tokens each
    packed = iter(pack([a for arrays, _ in kept for a in arrays]))
    return tuple(LayerState(type(layer).__name__, layer.scheme, tuple(next(packed) for _ in arrays),
                            dict(layer.meta_state), r, stored,
                            layer.encoding_share() if isinstance(layer, TurboKVCache) else None)
                 for layer, (arrays, stored), r in zip(layers, kept, reach))


def take_snapshot(cache: PromptCache, checkpoints: Sequence[Checkpoint] = ()) -> Snapshot:
    """Copy ``cache`` (B = 1, kvserve layers) into compact, evaluated arrays, with the
    ``checkpoints`` of it that add lengths (``with_checkpoints``)."""
    reason = unsupported(cache)
    if reason:
        raise ValueError(f"cannot snapshot {reason}")
    layers = layer_states(list(cache), reaches(cache))
    return with_checkpoints(layers, cache.scheme, cache.quantize_after, int(cache.offset), checkpoints)


def keep_checkpoints(reach: Sequence[int], num_tokens: int,
                     checkpoints: Sequence[Checkpoint]) -> tuple[tuple[Checkpoint, ...], tuple[Span, ...]]:
    """Of ``checkpoints``, the layer copies that layers of these ``reach`` holding
    ``num_tokens`` cannot trim back to (one per length and layer), at lengths the entry can
    serve; and the lengths it serves with them. Reads no array."""
    kept, seen = [], set()
    for cp in checkpoints:
        need = tuple((i, s) for i, s in cp.layers
                     if cp.num_tokens < num_tokens - reach[i] and (cp.num_tokens, i) not in seen)
        seen.update((cp.num_tokens, i) for i, _ in need)
        if need:
            kept.append(Checkpoint(cp.num_tokens, need))
    served = spans(num_tokens, reach, [(c.num_tokens, c.reaches()) for c in kept])
    kept = [c for c in kept if any(lo <= c.num_tokens <= hi for lo, hi in served)]
    served = spans(num_tokens, reach, [(c.num_tokens, c.reaches()) for c in kept])
    return tuple(sorted(kept, key=lambda c: c.num_tokens)), served


def with_checkpoints(layers: tuple[LayerState, ...], scheme: KVScheme, quantize_after: int, num_tokens: int,
                     checkpoints: Sequence[Checkpoint]) -> Snapshot:
    """A snapshot of ``layers`` holding ``num_tokens`` with what ``keep_checkpoints`` keeps."""
    kept, served = keep_checkpoints([s.reach for s in layers], num_tokens, checkpoints)
    return Snapshot(layers, scheme, quantize_after, num_tokens, served, kept)


def as_checkpoints(older: Snapshot) -> list[Checkpoint]:
    """What an entry whose tokens a newer one extends passes on: its checkpoints, and its own
    layers as one more at its length (arrays shared, not copied), so one entry serves what
    both served."""
    return [*older.checkpoints, Checkpoint(older.num_tokens, tuple(enumerate(older.layers)))]


def snapshot_of_loaded(layers: list[Any], reach: Sequence[int], checkpoints: Sequence[Checkpoint],
                       scheme: KVScheme, quantize_after: int) -> Snapshot:
    """A snapshot of freshly loaded layers (their arrays, one per tensor, are packed too)."""
    cache = PromptCache(layers, scheme, quantize_after)
    own = [min(r, limit) for r, limit in zip(reach, reaches(cache))]  # never more than the layer can
    return with_checkpoints(layer_states(layers, own), scheme, quantize_after, int(cache.offset), checkpoints)


def restore(snap: Snapshot, num_tokens: int) -> PromptCache:
    """A new container holding the first ``num_tokens`` tokens, a length in ``snap.spans``:
    each layer is its own copy trimmed, or a checkpoint's.

    Its layers own their handles: appending to them never changes the snapshot's arrays.
    """
    if not any(lo <= num_tokens <= hi for lo, hi in snap.spans):
        raise ValueError(f"{num_tokens} tokens cannot be restored exactly from an entry of "
                         f"{snap.num_tokens} (it serves {list(snap.spans)})")
    layers = []
    for i, state in enumerate(snap.layers):
        have = snap.num_tokens
        if num_tokens < have - state.reach:
            cp = source(snap.checkpoints, i, num_tokens)
            state, have = dict(cp.layers)[i], cp.num_tokens
        layer = state.layer()
        if num_tokens < have:
            layer.trim(have - num_tokens)
        if state.shared is not None:
            layer.adopt_encoding_share(state.shared)
        layers.append(layer)
    return PromptCache(layers, snap.scheme, snap.quantize_after)


# --- to and from the bytes a file holds ---

def _describe(prefix: str, i: int, s: LayerState, offset: int) -> tuple[str, str]:
    return f"{prefix}.{i}", json.dumps({"class": s.cls_name, "params": s.scheme.params(), "offset": offset,
                                        "meta": s.meta, "tensors": len(s.state()), "reach": s.reach})


def _parts(snap: Snapshot) -> Iterator[tuple[str, int, LayerState, int]]:
    """(name prefix, layer index, state, tokens) of every stored layer: the entry's own
    (``layer.<i>``), then each checkpoint's (``ckpt.<k>.layer.<i>``)."""
    for i, s in enumerate(snap.layers):
        yield "layer", i, s, snap.num_tokens
    for k, cp in enumerate(snap.checkpoints):
        for i, s in cp.layers:
            yield f"ckpt.{k}.layer", i, s, cp.num_tokens


def layer_descriptions(snap: Snapshot) -> dict[str, str]:
    """The per-layer metadata of ``kvserve.cache.serialize`` (so ``load_layers`` reads our
    files), the checkpoints' layers beside them, and ``checkpoints``: [[tokens, [layer
    indices]], ...]."""
    out = {"num_layers": str(len(snap.layers)),
           "checkpoints": json.dumps([[cp.num_tokens, [i for i, _ in cp.layers]] for cp in snap.checkpoints])}
    out.update(_describe(prefix, i, s, n) for prefix, i, s, n in _parts(snap))
    return out


def host_tensors(snap: Snapshot) -> list[tuple[str, str, np.ndarray]]:
    """(name, safetensors dtype, numpy view) per array, names ``layer.<i>.<j>`` and
    ``ckpt.<k>.layer.<i>.<j>``.

    Views, not copies: they keep the evaluated MLX arrays alive and are only read (by the
    writer thread). Call on the thread that owns the arrays."""
    out = []
    for prefix, i, s, _ in _parts(snap):
        arrays = s.state()  # views of stored records: numpy keeps their strides, the writer copies
        mx.eval(arrays)
        for j, a in enumerate(arrays):
            st_dtype = ST_DTYPES[a.dtype]
            if a.dtype == mx.bfloat16:
                a = a.view(mx.uint16)
                mx.eval(a)
            out.append((f"{prefix}.{i}.{j}", st_dtype, np.asarray(a)))
    return out


def rebuild(md: dict[str, str], load_layer: Callable[[int, str], Any], scheme: KVScheme,
            quantize_after: int) -> Snapshot:
    """The snapshot a file's metadata describes; ``load_layer(i, prefix)`` rebuilds one
    layer through ``kvserve.cache.serialize``'s checks. Reaches are taken as recorded but
    never beyond what the layer itself can drop; checkpoints must be shorter than the entry."""
    count = int(md["num_layers"])
    layers = [load_layer(i, "layer") for i in range(count)]
    reach = [int(json.loads(md[f"layer.{i}"])["reach"]) for i in range(count)]
    checkpoints = []
    for k, (tokens, indices) in enumerate(json.loads(md["checkpoints"])):
        states = []
        for i in indices:
            if not 0 <= i < count:
                raise ValueError(f"checkpoint {k} names layer {i} of {count}")
            layer = load_layer(i, f"ckpt.{k}.layer")
            if int(layer.offset) != tokens:
                raise ValueError(f"checkpoint {k} layer {i} holds {layer.offset} tokens, not {tokens}")
            recorded = int(json.loads(md[f"ckpt.{k}.layer.{i}"])["reach"])
            states.append((i, layer_states([layer], [min(recorded, layer.trim_reach())])[0]))
        checkpoints.append(Checkpoint(int(tokens), tuple(states)))
    return snapshot_of_loaded(layers, reach, checkpoints, scheme, quantize_after)


def stored_layer_count(md: dict[str, str]) -> int:
    """Layers a file's metadata describes, its checkpoints' included."""
    return int(md["num_layers"]) + sum(len(indices) for _, indices in json.loads(md["checkpoints"]))


def device_array(data: np.ndarray, st_dtype: str) -> mx.array:
    """An MLX array from file bytes viewed as numpy (``data`` already has the stored shape)."""
    a = mx.array(data)
    return a.view(mx.bfloat16) if st_dtype == "BF16" else a
