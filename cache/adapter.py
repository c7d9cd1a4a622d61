"""The one adapter between mlx-lm and kvserve caches.

mlx-lm model files call the module-level ``scaled_dot_product_attention`` they imported from
``mlx_lm.models.base``, which only knows mlx-lm's caches (it checks ``hasattr(cache, "bits")``).
``install_attention(model)`` rebinds that name, in the model's module and in every
``mlx_lm.models.*`` module its sub-modules come from, to a dispatcher:

    kvserve cache (registered class)  ->  cache.attend(queries, keys, values, scale, mask)
    anything else (mlx-lm caches, None) ->  mlx-lm's original function, unchanged

so model files are used as they are. Other protocol differences live here too: which layers of
a model get a kvserve cache (``layer_caches``), and converting mlx-lm's ``KVCache``
(``from_mlx_lm``; mlx-lm 0.32.2 caches have no ``meta_state``, ours do).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models import cache as mlx_cache

from kvserve.cache.registry import is_kvserve_cache

ATTENTION_NAME = "scaled_dot_product_attention"
ORIGINAL_ATTR = "__kvserve_original__"


def dispatching_attention(original: Callable) -> Callable:
    """Wrap mlx-lm's attention function so kvserve caches run their own ``attend``."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
        if is_kvserve_cache(cache):
            if sinks is not None:
                raise NotImplementedError(f"{type(cache).__name__} does not support attention sinks")
            return cache.attend(queries, keys, values, scale, mask)
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


def layer_caches(model: nn.Module, factory: Callable[[int, int], Any]) -> list[Any]:
    """One cache per layer: ``factory(k, n)`` where mlx-lm would use a plain ``KVCache``
    (k-th of n such layers); mlx-lm's other caches (rotating, SSM, ...) are kept as the
    model makes them."""
    if not hasattr(model, "make_cache"):  # mlx-lm's own rule (make_prompt_cache)
        n = len(model.layers)
        return [factory(k, n) for k in range(n)]
    theirs = model.make_cache()
    full = [i for i, c in enumerate(theirs) if type(c) is mlx_cache.KVCache]
    ours = {i: factory(k, len(full)) for k, i in enumerate(full)}
    return [ours.get(i, c) for i, c in enumerate(theirs)]


def from_mlx_lm(cache: mlx_cache.KVCache):
    """An fp16 kvserve cache holding the same tokens as an mlx-lm ``KVCache``."""
    from kvserve.cache.fp16 import FP16_SCHEME, FP16KVCache

    if cache.keys is None:
        return FP16KVCache()
    n = cache.offset
    state = (cache.keys[..., :n, :], cache.values[..., :n, :])  # (1, H_kv, n, D)
    return FP16KVCache.from_state(FP16_SCHEME, tuple(mx.contiguous(a) for a in state), {"offset": str(n)})
