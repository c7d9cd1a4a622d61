"""KV caches: schemes, per-layer cache families, the request container, files.

    from kvserve.cache import PromptCache, parse_scheme
    cache = PromptCache.for_model(model, parse_scheme("affine4"), quantize_after=256)

Families register themselves on import (``kvserve.cache.registry``).
"""

from kvserve.cache.adapter import install_attention, uninstall_attention
from kvserve.cache.affine import BatchQuantizedKVCache, QuantizedKVCache
from kvserve.cache.base import BatchStoredKVCache, StoredKVCache
from kvserve.cache.buffer import GrowableBuffer
from kvserve.cache.container import PromptCache
from kvserve.cache.fp16 import BatchFP16KVCache, FP16KVCache
from kvserve.cache.protocol import BatchKVCacheLayer, KVCacheLayer
from kvserve.cache.registry import (
    SCHEME_NAMES,
    SchemeUnavailable,
    batch_class_for,
    cache_class_by_name,
    family_of,
    layer_scheme,
    make_layer_cache,
    register,
    single_class_for,
)
from kvserve.cache.scheme import ComponentFormat, KVScheme, UnknownScheme, parse_scheme
from kvserve.cache.serialize import CacheFileError, load_layers, save_layers

from kvserve.cache.turbo import BatchTurboKVCache, TurboKVCache
from kvserve.cache.sliding import BatchSlidingKVCache, SlidingKVCache
from kvserve.cache.recurrent import BatchStateCache, StateCache
from kvserve.cache.parallel import BatchParallelCache, ParallelCache
from kvserve.cache.adapter import UnsupportedLayers

__all__ = [
    "SCHEME_NAMES", "BatchFP16KVCache", "BatchSlidingKVCache", "BatchStateCache", "SlidingKVCache",
    "StateCache", "UnsupportedLayers", "ParallelCache", "BatchParallelCache", "BatchKVCacheLayer", "BatchQuantizedKVCache",
    "BatchStoredKVCache", "CacheFileError", "ComponentFormat", "FP16KVCache", "GrowableBuffer",
    "KVCacheLayer", "KVScheme", "PromptCache", "QuantizedKVCache", "SchemeUnavailable",
    "StoredKVCache", "TurboKVCache", "BatchTurboKVCache", "UnknownScheme", "batch_class_for", "cache_class_by_name", "family_of",
    "install_attention", "layer_scheme", "load_layers", "make_layer_cache", "parse_scheme", "register",
    "save_layers", "single_class_for", "uninstall_attention",
]
