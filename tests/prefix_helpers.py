"""Real caches of tiny shapes for the prefix-cache tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvserve.cache import PromptCache, make_layer_cache, parse_scheme


def kv(n: int, seed: int, dtype=mx.float16, heads: int = 2, dim: int = 64) -> mx.array:
    return mx.random.normal((1, heads, n, dim), key=mx.random.key(seed)).astype(dtype)  # (B, H_kv, T, D)


def filled(scheme: str, n: int, seed: int = 0, layers: int = 2, dtype=mx.float16,
           quantize_after: int = 0) -> PromptCache:
    """A container of ``layers`` layers holding n random tokens, written in one prefill."""
    s = parse_scheme(scheme)
    caches = [make_layer_cache(s, layer_index=i, num_layers=layers) for i in range(layers)]
    for i, layer in enumerate(caches):
        layer.update_and_fetch(kv(n, seed * 100 + i, dtype), kv(n, seed * 100 + 50 + i, dtype))
    cache = PromptCache(caches, s, quantize_after)
    mx.eval(cache.state)
    return cache


def step(cache: PromptCache, seed: int) -> None:
    """One decode step (L = 1) into every layer."""
    for i, layer in enumerate(cache):
        layer.update_and_fetch(kv(1, 7000 + seed * 10 + i), kv(1, 8000 + seed * 10 + i))
    mx.eval(cache.state)


def state_bytes(cache: PromptCache) -> list[list[tuple[str, tuple, bytes]]]:
    """Every layer's state as (dtype, shape, raw bytes): equal means bit-identical."""
    out = []
    for layer in cache:
        row = []
        for a in layer.state:
            raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
            row.append((str(a.dtype), tuple(a.shape), np.asarray(raw).tobytes()))
        out.append(row)
    return out


def prefix_state(cache: PromptCache, m: int) -> list[list[tuple[str, tuple, bytes]]]:
    """The state a cache holding the first m of ``cache``'s tokens has (sliced on the T axis)."""
    out = []
    for layer in cache:
        row = []
        for a in layer.state:
            a = a[:, :, :m] if a.ndim == 4 and a.shape[2] == cache.offset else a
            raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
            row.append((str(a.dtype), tuple(a.shape), np.asarray(raw).tobytes()))
        out.append(row)
    return out
