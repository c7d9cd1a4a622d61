"""The fp16 family: keys and values stored as given, in the model's activation dtype.

Parts per token: ``[keys (B, H_kv, T, D), values (B, H_kv, T, D_v)]``, so K+V cost
2 * H_kv * D * itemsize bytes per token (512 B per KV head at D = 128 in fp16).
Attention is ``mx.fast.scaled_dot_product_attention``, which maps grouped query heads to
KV heads itself and accepts mlx-lm's masks unchanged.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvserve.cache.base import BatchStoredKVCache, StoredKVCache
from kvserve.cache.buffer import DEFAULT_GRANULE
from kvserve.cache.registry import register
from kvserve.cache.scheme import KVScheme, parse_scheme

FP16_SCHEME = parse_scheme("fp16")


class FP16Codec:
    """Identity encoding; shared by the per-request and batch classes."""

    def check_scheme(self, scheme: KVScheme) -> None:
        if scheme.keys.kind != "fp16" or scheme.values.kind != "fp16":
            raise ValueError(f"{type(self).__name__} stores fp16 keys and values, not {scheme.name}")

    def n_parts(self) -> int:
        return 2

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        return [keys, values]

    def present(self, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
        return parts[0], parts[1]  # (B, H_kv, S, D), (B, H_kv, S, D_v)

    def decode(self, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
        return parts[0].astype(mx.float32), parts[1].astype(mx.float32)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               mask: Any) -> mx.array:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


class FP16KVCache(FP16Codec, StoredKVCache):
    def __init__(self, scheme: KVScheme = FP16_SCHEME, granule: int = DEFAULT_GRANULE):
        super().__init__(scheme, granule)


class BatchFP16KVCache(FP16Codec, BatchStoredKVCache):
    single_cls = FP16KVCache


register("fp16", FP16KVCache, BatchFP16KVCache)
