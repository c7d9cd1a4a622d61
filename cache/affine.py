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
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvserve.cache.base import BatchStoredKVCache, StoredKVCache, apply_mask, grouped_mask
from kvserve.cache.buffer import DEFAULT_GRANULE
from kvserve.cache.registry import register
from kvserve.cache.scheme import ComponentFormat, KVScheme

QUANTIZE_KINDS = ("affine", "mx")


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
        return quantize_parts(keys, self.scheme.keys) + quantize_parts(values, self.scheme.values)

    def present(self, parts: list[mx.array]) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
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
    def __init__(self, scheme: KVScheme, granule: int = DEFAULT_GRANULE):
        super().__init__(scheme, granule)


class BatchQuantizedKVCache(AffineCodec, BatchStoredKVCache):
    single_cls = QuantizedKVCache


register("affine", QuantizedKVCache, BatchQuantizedKVCache)
