"""The one adapter between mlx-lm and kvserve caches.

mlx-lm model files call the module-level ``scaled_dot_product_attention`` they imported from
``mlx_lm.models.base``, which only knows mlx-lm's caches (it checks ``hasattr(cache, "bits")``).
``install_attention(model)`` rebinds that name, in the model's module and in every
``mlx_lm.models.*`` module its sub-modules come from, to a dispatcher:

    kvserve cache (registered class)  ->  cache.attend(queries, keys, values, scale, mask)
    anything else (mlx-lm caches, None) ->  mlx-lm's original function, unchanged

so model files are used as they are. Other protocol differences live here too: which kvserve
cache stands for each cache mlx-lm's ``make_cache`` returns (``layer_caches``):

    KVCache                              ->  factory(k, n): the scheme's full-attention cache
    RotatingKVCache(max_size=W, keep=0)  ->  SlidingKVCache(factory(k, n), W)
    ArraysCache(size=s)                  ->  StateCache(s): recurrent state in the model's dtype
    CacheList(a, b)                      ->  ParallelCache([ours(a), ours(b)]): side by side
    anything else                        ->  UnsupportedLayers, naming the layer and the class

and converting mlx-lm's ``KVCache`` (``from_mlx_lm``; mlx-lm 0.32.2 caches have no
``meta_state``, ours do).

Attention sinks (gpt-oss) reach ``cache.attend(..., sinks=...)``. Layers that reuse another
layer's K/V (Gemma 4's KV-shared layers) call attention with ``cache=None`` and the K/V that
the source layer's ``update_and_fetch`` returned, which for a quantized scheme are stored
parts only their cache can read: the dispatcher remembers, for the K/V objects a kvserve cache
attended over last, which cache that was, and routes such calls to it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models import cache as mlx_cache

from kvserve.cache.registry import is_kvserve_cache

ATTENTION_NAME = "scaled_dot_product_attention"
ORIGINAL_ATTR = "__kvserve_original__"


class UnsupportedLayers(TypeError):
    """A model makes caches kvserve does not serve (the message names the layer and why)."""


# The K/V a kvserve cache attended over most recently, by id, with the cache: a shared-KV
# layer's call presents the same objects. Strong references keep the ids from being reused.
# One table per thread: a forward runs on its engine's thread, and two engines in one process
# (tests serve several at once) would otherwise evict each other's entries.
_LOCAL = threading.local()
_RECENT_MAX = 4


def _recent_kv() -> dict[int, tuple[Any, Any]]:
    table = getattr(_LOCAL, "kv", None)
    if table is None:
        table = _LOCAL.kv = {}
    return table


def _remember(keys: Any, cache: Any) -> None:
    if not isinstance(keys, mx.array):  # raw arrays need no routing: mlx-lm reads them
        recent = _recent_kv()
        recent[id(keys)] = (keys, cache)
        while len(recent) > _RECENT_MAX:
            recent.pop(next(iter(recent)))


def _owner(keys: Any) -> Any:
    found = _recent_kv().get(id(keys))
    return found[1] if found is not None and found[0] is keys else None


def dispatching_attention(original: Callable) -> Callable:
    """Wrap mlx-lm's attention function so kvserve caches run their own ``attend``."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
        if cache is None:
            cache = _owner(keys)
        elif is_kvserve_cache(cache):
            _remember(keys, cache)
        if is_kvserve_cache(cache):
            return cache.attend(queries, keys, values, scale, mask, sinks=sinks)
        if sinks is not None:
            kwargs["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    setattr(scaled_dot_product_attention, ORIGINAL_ATTR, original)
    return scaled_dot_product_attention


def attention_modules(model: nn.Module) -> list[ModuleType]:
    """The model's own module and every ``mlx_lm.models.*`` module its layers come from."""
    own = type(model).__module__
    names = {own} | {type(m).__module__ for m in model.modules()}
    return [sys.modules[n] for n in sorted(names) if n == own or n.startswith("mlx_lm.models.")]


def install_attention(model: nn.Module) -> int:
    """Route attention through kvserve caches (idempotent); returns modules newly patched."""
    patched = 0
    for module in attention_modules(model):
        fn = module.__dict__.get(ATTENTION_NAME)
        if fn is None or getattr(fn, ORIGINAL_ATTR, None) is not None:
            continue
        setattr(module, ATTENTION_NAME, dispatching_attention(fn))
        patched += 1
    return patched


def uninstall_attention(model: nn.Module) -> None:
    """Restore mlx-lm's functions in the modules ``install_attention`` patched."""
    for module in attention_modules(model):
        original = getattr(module.__dict__.get(ATTENTION_NAME), ORIGINAL_ATTR, None)
        if original is not None:
            setattr(module, ATTENTION_NAME, original)


def layer_caches(model: nn.Module, factory: Callable[[int, int], Any], scheme: Any = None) -> list[Any]:
    """One kvserve cache per cache mlx-lm's ``make_cache`` returns (table above); ``factory(k,
    n)`` makes the K/V store of the k-th of n K/V-bearing layers. ``UnsupportedLayers`` for
    a cache class without a kvserve counterpart."""
    if not hasattr(model, "make_cache"):  # mlx-lm's own rule (make_prompt_cache)
        n = len(model.layers)
        return [factory(k, n) for k in range(n)]
    theirs = model.make_cache()
    for i, c in enumerate(theirs):
        reason = unsupported_reason(c)
        if reason:
            raise UnsupportedLayers(f"layer {i}: {reason}")
    kv = [i for i, c in enumerate(theirs) if _holds_kv(c)]
    rank = {i: k for k, i in enumerate(kv)}
    return [_ours(c, lambda i=i: factory(rank[i], len(kv)), scheme) for i, c in enumerate(theirs)]


def _holds_kv(cache: Any) -> bool:
    if isinstance(cache, mlx_cache.CacheList):
        return any(_holds_kv(c) for c in cache.caches)
    return not isinstance(cache, mlx_cache.ArraysCache)


def _ours(cache: Any, store: Callable[[], Any], scheme: Any) -> Any:
    """The kvserve cache for one of mlx-lm's; ``store()`` makes the layer's K/V store."""
    from kvserve.cache.parallel import ParallelCache
    from kvserve.cache.recurrent import StateCache
    from kvserve.cache.sliding import SlidingKVCache

    if isinstance(cache, mlx_cache.CacheList):
        return ParallelCache([_ours(c, store, scheme) for c in cache.caches])
    if isinstance(cache, mlx_cache.ArraysCache):
        return StateCache(len(cache.cache), **({"scheme": scheme} if scheme is not None else {}))
    if isinstance(cache, mlx_cache.RotatingKVCache):
        return SlidingKVCache(store(), cache.max_size)
    return store()


def unsupported_reason(cache: Any) -> str | None:
    """Why kvserve cannot stand in for one of mlx-lm's caches, or None when it can."""
    kind = type(cache)
    if kind is mlx_cache.KVCache or kind is mlx_cache.ArraysCache:
        return None
    if kind is mlx_cache.CacheList:
        reasons = [r for r in map(unsupported_reason, cache.caches) if r]
        return f"a cache list holding {reasons[0]}" if reasons else None
    if kind is mlx_cache.RotatingKVCache:
        return None if cache.keep == 0 else f"a rotating cache that keeps {cache.keep} first tokens"
    return f"mlx-lm's {kind.__name__} (no kvserve cache for this layer kind)"


def from_mlx_lm(cache: mlx_cache.KVCache):
    """An fp16 kvserve cache holding the same tokens as an mlx-lm ``KVCache``."""
    from kvserve.cache.fp16 import FP16_SCHEME, FP16KVCache

    if cache.keys is None:
        return FP16KVCache()
    n = cache.offset
    state = (cache.keys[..., :n, :], cache.values[..., :n, :])  # (1, H_kv, n, D)
    return FP16KVCache.from_state(FP16_SCHEME, tuple(mx.contiguous(a) for a in state), {"offset": str(n)})
