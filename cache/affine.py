"""The ``mx.quantize`` family: affine 4/8-bit (groups 32/64/128) and the MX block formats.

Parts per component (keys, then values), each (B, H_kv, T, W):

    affine b-bit, group g:  packed uint32 (D*b/32) + scales (D/g) + biases (D/g), activation dtype
    mxfp4 / mxfp8 / nvfp4:  packed uint32 (D*b/32) + scales uint8 (D/32, D/32, D/16), no biases

Bytes per token per KV head for one component, D = 128, fp16 activations:
affine8 g64 = 128 + 2*2*2 = 136; affine4 g64 = 72; mxfp4 = 64 + 4 = 68 (4.25 bits/value);
mxfp8 = 132 (8.25); nvfp4 = 72 (4.5).

``attend`` works on the stored parts directly: queries are grouped to (B, H_kv, n_rep, L, D)
so K/V are never repeated, and scores, mask and softmax are computed in f32. The caches
call ``kvserve.kernels.dispatch.attend`` through ``QuantizedFormat``; ``attend_quantized``
is the full-context reference it is tested against.

**Storage: two records, not six parts.** Where keys and values share a head size, the cache
stores the parts of both in two arrays (``pack_record``): the codes of K then V, and the
side parts (scales, biases) of K then V, in the scales' dtype. A decode step then writes
two slices per layer, as an fp16 cache does, instead of six; on a GPU, where a small
model's step is bound by the host launching kernels, that and the one-kernel encoder
(``kvserve.kernels.cuda_quantize``) are what bring the step near fp16's. Attention, files
and ``state`` see the six parts as views of the records (``unpack_record``):

    codes (B, H, T, 2W)  uint32   [ K codes (W) | V codes (W) ]        W = D * bits / 32
    side  (B, H, T, 2sG) T        [ K scales (G) | K biases (G) | V scales | V biases ]

with G = D / group and s side parts per component (2 affine, 1 MX). For affine4, D = 64,
fp16 activations: codes 16 words, side 4 halves, 72 bytes per token per head, as before.

    >>> from kvserve.cache.scheme import parse_scheme
    >>> k, v, fmt = mx.zeros((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)), parse_scheme("affine4").keys
    >>> codes, side = pack_record(quantize_parts(k, fmt), quantize_parts(v, fmt))
    >>> codes.shape, side.shape
    ((1, 2, 3, 16), (1, 2, 3, 4))
    >>> [a.shape[-1] for a in unpack_record([codes, side], 3)]
    [8, 1, 1, 8, 1, 1]
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from kvserve.cache.base import BatchStoredKVCache, StoredKVCache, apply_mask, grouped_mask
from kvserve.cache.buffer import DEFAULT_GRANULE, GrowableBuffer
from kvserve.cache.registry import register
from kvserve.cache.scheme import ComponentFormat, KVScheme

QUANTIZE_KINDS = ("affine", "mx")
log = logging.getLogger(__name__)


def parts_per_component(fmt: ComponentFormat) -> int:
    """Parts ``mx.quantize`` returns: affine has biases, the MX modes do not."""
    return 3 if fmt.mode == "affine" else 2


def quantize_parts(x: mx.array, fmt: ComponentFormat) -> list[mx.array]:
    """(..., D) -> [packed (..., D*b/32), scales (..., D/g)(, biases (..., D/g))]."""
    if x.shape[-1] % fmt.group_size:
        raise ValueError(f"head_dim {x.shape[-1]} is not a multiple of the group size "
                         f"{fmt.group_size} of {fmt.mode} {fmt.bits}-bit")
    return list(mx.quantize(x, group_size=fmt.group_size, bits=fmt.bits, mode=fmt.mode))


def dequantize_parts(parts: tuple[mx.array, ...] | list[mx.array], fmt: ComponentFormat,
                     dtype: mx.Dtype = mx.float32) -> mx.array:
    """Float values of stored parts; scales and biases are widened first, because
    ``mx.dequantize`` computes in the scales' dtype (f16 scales would round the result)."""
    w, scales, *biases = parts
    if fmt.mode == "affine":
        scales, biases = scales.astype(dtype), [biases[0].astype(dtype)]
    return mx.dequantize(w, scales, *biases, group_size=fmt.group_size, bits=fmt.bits,
                         mode=fmt.mode, dtype=dtype)


def _qmm(x: mx.array, parts: tuple[mx.array, ...], fmt: ComponentFormat, transpose: bool) -> mx.array:
    grouped = [mx.expand_dims(p, 2) for p in parts]  # (B, H_kv, 1, S, W): broadcast over n_rep
    return mx.quantized_matmul(x, *grouped, transpose=transpose, group_size=fmt.group_size,
                               bits=fmt.bits, mode=fmt.mode)


def quantized_scores(q: mx.array, k_parts: tuple[mx.array, ...], fmt: ComponentFormat) -> mx.array:
    """(B, H_kv, n_rep, L, D) f32 queries x stored keys -> (B, H_kv, n_rep, L, S) f32."""
    return _qmm(q, k_parts, fmt, transpose=True)


def quantized_weighted_sum(w: mx.array, v_parts: tuple[mx.array, ...], fmt: ComponentFormat) -> mx.array:
    """(B, H_kv, n_rep, L, S) f32 weights x stored values -> (B, H_kv, n_rep, L, D_v) f32."""
    return _qmm(w, v_parts, fmt, transpose=False)


def pack_record(keys: list[mx.array], values: list[mx.array]) -> list[mx.array]:
    """The two storage records (module doc) of K and V parts of one head size."""
    return [mx.concatenate([keys[0], values[0]], axis=-1),
            mx.concatenate([*keys[1:], *values[1:]], axis=-1)]


def unpack_record(record: list[mx.array], n: int) -> list[mx.array]:
    """K parts then V parts (``n`` per component) as views of the two records."""
    codes, side = record
    # ``mx.split`` makes all the views in one call: a decode step unpacks every layer, and
    # six Python slices cost 17 us against 3 (the host sets a GPU step's pace).
    kc, vc = mx.split(codes, 2, axis=-1)
    sides = mx.split(side, 2 * (n - 1), axis=-1)
    return [kc, *sides[:n - 1], vc, *sides[n - 1:]]


_GPU_ENCODER_CHECKED: dict[tuple, bool] = {}  # (D, bits, group, dtype) -> the first call's verdict


def _encode_on_gpu(keys: mx.array, values: mx.array, fmt: ComponentFormat) -> list[mx.array] | None:
    """The records from one kernel on an NVIDIA GPU (``kvserve.kernels.cuda_quantize``), or
    None where it does not serve. Its first call per shape family in a process is checked
    against ``mx.quantize``: equal scales and biases, and codes equal but for a few values
    within a rounding error of .5 (one level apart). A kernel that fails encodes nothing."""
    from kvserve.kernels import cuda_quantize  # here: kvserve.kernels imports this package

    if fmt.mode != "affine" or not cuda_quantize.serves(keys, values, fmt.bits, fmt.group_size):
        return None
    family = (keys.shape[-1], fmt.bits, fmt.group_size, keys.dtype)
    if family not in _GPU_ENCODER_CHECKED:
        _GPU_ENCODER_CHECKED[family] = _gpu_encoder_agrees(keys, values, fmt)
    return cuda_quantize.encode_record(keys, values, fmt.bits, fmt.group_size) if _GPU_ENCODER_CHECKED[family] else None


def code_levels(codes: mx.array, bits: int) -> mx.array:
    """(..., W) packed words -> (..., W, 32 / bits) int32 levels, lowest bits first."""
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    return ((codes[..., None] >> shifts) & ((1 << bits) - 1)).astype(mx.int32)


def _gpu_encoder_agrees(keys: mx.array, values: mx.array, fmt: ComponentFormat) -> bool:
    from kvserve.kernels import cuda_quantize

    try:
        codes, side = cuda_quantize.encode_record(keys, values, fmt.bits, fmt.group_size)
        ref_codes, ref_side = pack_record(quantize_parts(keys, fmt), quantize_parts(values, fmt))
        apart = mx.abs(code_levels(codes, fmt.bits) - code_levels(ref_codes, fmt.bits))
        ok = (mx.allclose(side.astype(mx.float32), ref_side.astype(mx.float32), rtol=1e-3, atol=1e-6).item()
              and mx.max(apart).item() <= 1 and mx.sum(apart).item() <= max(1, apart.size // 1000))
    except Exception as exc:  # noqa: BLE001 (a kernel that does not build serves nothing)
        log.warning("affine GPU encoder (%s) raised on its first call: %s", fmt, exc)
        return False
    if not ok:
        log.warning("affine GPU encoder (%s) disagreed with mx.quantize on its first call; "
                    "mx.quantize encodes instead", fmt)
    return bool(ok)


class QuantizedFormat:
    """One ``mx.quantize`` component seen through the attention protocol of
    ``kvserve.kernels`` (see ``kvserve.cache.turbo_codec``): stored basis, no rotation."""

    def __init__(self, fmt: ComponentFormat):
        self.fmt = fmt

    def prepare_queries(self, q: mx.array, scale: mx.array | None = None) -> mx.array:
        return q

    def scores(self, q: mx.array, parts: tuple[mx.array, ...]) -> mx.array:
        return self._folded(q, parts, transpose=True)  # (B, H_kv, R, L, T)

    def accumulate(self, p: mx.array, parts: tuple[mx.array, ...]) -> mx.array:
        return self._folded(p, parts, transpose=False)  # (B, H_kv, R, L, D_v)

    def _folded(self, x: mx.array, parts: tuple[mx.array, ...], transpose: bool) -> mx.array:
        # (B, H_kv, R, L, .) -> (B, H_kv, R*L, .): the n_rep heads become rows of one product
        # with the stored (B, H_kv, T, W) parts, which are then never broadcast (copied) R times.
        B, H, R, L, _ = x.shape
        out = mx.quantized_matmul(x.reshape(B, H, R * L, -1), *parts, transpose=transpose,
                                  group_size=self.fmt.group_size, bits=self.fmt.bits,
                                  mode=self.fmt.mode)
        return out.reshape(B, H, R, L, -1)

    def finish(self, o: mx.array) -> mx.array:
        return o

    def decode(self, parts: tuple[mx.array, ...], scale: mx.array | None = None) -> mx.array:
        return dequantize_parts(parts, self.fmt)


def attend_quantized(queries: mx.array, k_parts: tuple[mx.array, ...], v_parts: tuple[mx.array, ...],
                     scale: float, mask: Any, kfmt: ComponentFormat, vfmt: ComponentFormat) -> mx.array:
    """Attention of (B, H_q, L, D) queries over quantized K/V; returns the queries' dtype.

    f32 queries make ``quantized_matmul`` accumulate in f32 whatever the scales' dtype.
    """
    B, Hq, L, D = queries.shape
    Hkv, S = k_parts[0].shape[1], k_parts[0].shape[2]
    n_rep = Hq // Hkv
    q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, n_rep, L, D)
    scores = quantized_scores(q, k_parts, kfmt)  # (B, H_kv, n_rep, L, S)
    scores = apply_mask(scores, grouped_mask(mask, Hkv, n_rep, L, S))
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = quantized_weighted_sum(weights, v_parts, vfmt)  # (B, H_kv, n_rep, L, D_v)
    return out.reshape(B, Hq, L, -1).astype(queries.dtype)


class AffineCodec:
    """``mx.quantize`` encoding and quantized attention; shared by both classes."""

    scheme: KVScheme

    def check_scheme(self, scheme: KVScheme) -> None:
        if scheme.keys.kind not in QUANTIZE_KINDS or scheme.values.kind not in QUANTIZE_KINDS:
            raise ValueError(f"{type(self).__name__} stores mx.quantize formats, not {scheme.name}")

    def n_parts(self) -> int:
        return parts_per_component(self.scheme.keys) + parts_per_component(self.scheme.values)

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        """Storage parts: the two records where K and V share a head size, else six parts."""
        if keys.shape[-1] != values.shape[-1]:
            return quantize_parts(keys, self.scheme.keys) + quantize_parts(values, self.scheme.values)
        fused = _encode_on_gpu(keys, values, self.scheme.keys)
        if fused is not None:
            return fused
        return pack_record(quantize_parts(keys, self.scheme.keys), quantize_parts(values, self.scheme.values))

    def unpack(self, parts: list[mx.array]) -> list[mx.array]:
        """Storage parts -> the scheme's parts (what ``state`` and attention see)."""
        n = parts_per_component(self.scheme.keys)
        return unpack_record(parts, n) if len(parts) == 2 else list(parts)

    def pack(self, parts: list[mx.array]) -> list[mx.array]:
        """The scheme's parts (a file, a snapshot) -> storage parts, as ``encode`` makes them."""
        n = parts_per_component(self.scheme.keys)
        keys, values = list(parts[:n]), list(parts[n:])
        return pack_record(keys, values) if keys[0].shape[-1] == values[0].shape[-1] else list(parts)

    def present(self, parts: list[mx.array]) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        parts = self.unpack(parts)
        n = parts_per_component(self.scheme.keys)
        return tuple(parts[:n]), tuple(parts[n:])

    def decode(self, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
        keys, values = self.present(parts)
        return dequantize_parts(keys, self.scheme.keys), dequantize_parts(values, self.scheme.values)

    def attend(self, queries: mx.array, keys: tuple[mx.array, ...], values: tuple[mx.array, ...],
               scale: float, mask: Any, sinks: mx.array | None = None) -> mx.array:
        from kvserve.kernels import dispatch  # here: kvserve.kernels imports this package

        # The dispatch picks the full path, the blockwise reference or a verified kernel.
        return dispatch.attend(queries, QuantizedFormat(self.scheme.keys), keys,
                               QuantizedFormat(self.scheme.values), values, scale, mask, sinks=sinks)


class QuantizedKVCache(AffineCodec, StoredKVCache):
    """One sequence's affine cache. Besides ``state`` (six parts), a prefix-cache snapshot
    in memory keeps the layer as ``stored`` (its two records, exactly ``offset`` tokens):
    two copies to take instead of six, and ``from_stored`` adopts them with no copy at all,
    where ``from_state`` concatenates the six parts back into records. ``state_of`` gives a
    file the six parts of stored records (views).

        >>> from kvserve.cache.scheme import parse_scheme
        >>> layer = QuantizedKVCache(parse_scheme("affine4"))
        >>> _ = layer.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
        >>> [a.shape for a in layer.stored], len(layer.state)
        ([(1, 2, 3, 16), (1, 2, 3, 4)], 6)
        >>> copy = QuantizedKVCache.from_stored(layer.scheme, layer.stored, layer.meta_state)
        >>> copy.offset, [a.shape[-1] for a in QuantizedKVCache.state_of(layer.scheme, copy.stored)]
        (3, [8, 1, 1, 8, 1, 1])
    """

    def __init__(self, scheme: KVScheme, granule: int = DEFAULT_GRANULE):
        super().__init__(scheme, granule)

    @property
    def stored(self) -> tuple[mx.array, ...]:
        return tuple(self._buf.views())

    @classmethod
    def from_stored(cls, scheme: KVScheme, stored: tuple[mx.array, ...], meta: dict[str, str]) -> QuantizedKVCache:
        cache = cls(scheme)
        offset = int(meta.get("offset", 0))
        if any(a.shape[0] != 1 or a.shape[2] != offset for a in stored):
            raise ValueError(f"stored arrays of shapes {[a.shape for a in stored]} do not hold one row of {offset} tokens")
        if stored:
            cache._buf = GrowableBuffer.adopt(list(stored), offset)
        return cache

    @classmethod
    def state_of(cls, scheme: KVScheme, stored: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        return tuple(cls(scheme).unpack(list(stored)))


class BatchQuantizedKVCache(AffineCodec, BatchStoredKVCache):
    single_cls = QuantizedKVCache


register("affine", QuantizedKVCache, BatchQuantizedKVCache)
