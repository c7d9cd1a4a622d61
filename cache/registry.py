"""Which cache classes store which scheme: families register themselves on import.

A family is a pair of classes (per-request, batch) registered under a kind:

    register("fp16", FP16KVCache, BatchFP16KVCache)           # kvserve.cache.fp16
    register("affine", QuantizedKVCache, BatchQuantizedKVCache)  # kvserve.cache.affine
    register("turbo", TurboKVCache, BatchTurboKVCache)        # kvserve.cache.turbo

A scheme belongs to "turbo" when its keys or values are turbo, to "fp16" when both are fp16,
and to "affine" otherwise (``mx.quantize`` formats: affine, mxfp4, mxfp8, nvfp4). Looking up
a kind that is not registered yet imports its module, so the registry never depends on
import order.

Contract for a family's classes:
  * ``Single(scheme)`` and ``Batch(scheme, left_padding)`` construct empty caches;
  * both implement ``kvserve.cache.protocol`` (``KVCacheLayer`` / ``BatchKVCacheLayer``),
    including ``state``, ``meta_state`` and ``from_state(scheme, state, meta)``;
  * ``Batch.merge([Single, ...])`` and ``Batch.extract(i) -> Single``; batch caches expose
    ``left_padding`` (list of ints, used when a container converts a batch layer);
  * ``capacity``/``growths`` (the growth laws) and ``dequantize() -> (keys, values)`` in f32
    (the float reference the attention laws compare ``attend`` with);
  * class names are unique across families (files store them).

    >>> family_of(parse_scheme("turbo0v4")), family_of(parse_scheme("mxfp4"))
    ('turbo', 'affine')
    >>> layer_scheme("turbo4", layer_index=1, num_layers=30).name   # boundary layers stay affine8
    'affine8'
"""

from __future__ import annotations

import importlib

from kvserve.cache.scheme import SCHEME_NAMES, KVScheme, parse_scheme

__all__ = [
    "SCHEME_NAMES",
    "SchemeUnavailable",
    "batch_class_for",
    "batch_class_of",
    "cache_class_by_name",
    "family_of",
    "is_batch_cache",
    "is_kvserve_cache",
    "layer_scheme",
    "make_layer_cache",
    "register",
    "register_kind",
    "registered_families",
    "single_class_for",
    "stores_scheme",
]

FAMILY_MODULES = {"fp16": "kvserve.cache.fp16", "affine": "kvserve.cache.affine",
                  "turbo": "kvserve.cache.turbo"}
# Layer kinds other than full attention: they wrap a family or store no K/V at all.
KIND_MODULES = {"sliding": "kvserve.cache.sliding", "recurrent": "kvserve.cache.recurrent",
                "parallel": "kvserve.cache.parallel"}
BOUNDARY_LAYERS = 2  # first and last two layers of protected schemes stay affine8

_FAMILIES: dict[str, tuple[type, type]] = {}
_BY_NAME: dict[str, type] = {}
_BATCH: set[type] = set()
_BATCH_OF: dict[type, type] = {}  # per-request class -> its batch class


class SchemeUnavailable(LookupError):
    """A valid scheme whose cache family cannot be imported in this build."""


def register(family_kind: str, single_cls: type, batch_cls: type) -> None:
    """Register a family's (per-request, batch) classes; re-registering the same pair is a no-op."""
    for cls in (single_cls, batch_cls):
        known = _BY_NAME.get(cls.__name__)
        if known is not None and known.__module__ != cls.__module__:  # a reload may replace
            raise ValueError(f"cache class name {cls.__name__} is already registered by {known.__module__}")
    _FAMILIES[family_kind] = (single_cls, batch_cls)
    _add_classes(single_cls, batch_cls)


def register_kind(kind: str, single_cls: type, batch_cls: type) -> None:
    """Register the classes of a layer kind that is not a scheme family (sliding windows,
    recurrent state): they are kvserve caches, files name them, but no scheme maps to them."""
    if kind not in KIND_MODULES:
        raise ValueError(f"unknown layer kind {kind!r}")
    _add_classes(single_cls, batch_cls)


def _add_classes(single_cls: type, batch_cls: type) -> None:
    _BY_NAME[single_cls.__name__] = single_cls
    _BY_NAME[batch_cls.__name__] = batch_cls
    _BATCH.add(batch_cls)
    _BATCH_OF[single_cls] = batch_cls


def batch_class_of(layer: object) -> type:
    """The batch class that merges per-request layers like ``layer``."""
    return _BATCH_OF[type(layer)]


def stores_scheme(cls: type, scheme: KVScheme) -> bool:
    """Whether instances of ``cls`` may hold ``scheme`` (wrappers and state caches: any)."""
    if getattr(cls, "any_scheme", False):
        return True
    try:
        return cls in (single_class_for(scheme), batch_class_for(scheme))
    except SchemeUnavailable:
        return False


def family_of(scheme: KVScheme | str) -> str:
    scheme = _as_scheme(scheme)
    kinds = {scheme.keys.kind, scheme.values.kind}
    if "turbo" in kinds:
        return "turbo"
    return "fp16" if kinds == {"fp16"} else "affine"


def _as_scheme(scheme: KVScheme | str) -> KVScheme:
    return parse_scheme(scheme) if isinstance(scheme, str) else scheme


def _family(kind: str) -> tuple[type, type]:
    if kind not in _FAMILIES:
        module = FAMILY_MODULES[kind]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:  # a missing dependency inside the family is a real bug
                raise
            raise SchemeUnavailable(f"cache family '{kind}' ({module}) is not available") from err
        if kind not in _FAMILIES:
            raise SchemeUnavailable(f"{module} did not register the '{kind}' family")
    return _FAMILIES[kind]


def layer_scheme(scheme: KVScheme | str, layer_index: int | None = None,
                 num_layers: int | None = None) -> KVScheme:
    """The scheme one layer actually uses: protected schemes keep boundary layers at affine8."""
    scheme = _as_scheme(scheme)
    if not scheme.protect_boundary_layers or layer_index is None or num_layers is None:
        return scheme
    if layer_index < BOUNDARY_LAYERS or layer_index >= num_layers - BOUNDARY_LAYERS:
        return parse_scheme("affine8")
    return scheme


def make_layer_cache(scheme: KVScheme | str, *, layer_index: int | None = None,
                     num_layers: int | None = None):
    """An empty per-request cache for one layer (boundary protection applied when given)."""
    scheme = layer_scheme(scheme, layer_index, num_layers)
    return _family(family_of(scheme))[0](scheme)


def single_class_for(scheme: KVScheme | str) -> type:
    return _family(family_of(scheme))[0]


def batch_class_for(scheme: KVScheme | str) -> type:
    return _family(family_of(scheme))[1]


def cache_class_by_name(name: str) -> type:
    """The registered class called ``name`` (as stored in cache files); KeyError if none."""
    if name not in _BY_NAME:
        for kind in FAMILY_MODULES:
            try:
                _family(kind)
            except SchemeUnavailable:
                continue
        for module in KIND_MODULES.values():
            importlib.import_module(module)
    if name not in _BY_NAME:
        raise KeyError(f"unknown cache class '{name}'; known: {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[name]


def is_kvserve_cache(obj: object) -> bool:
    """True for instances of registered classes (exact type: the registry is the protocol),
    and for a captured step's view of one (``kvserve.cache.captured``)."""
    cls = getattr(type(obj), "view_of", type(obj))
    return _BY_NAME.get(cls.__name__) is cls


def is_batch_cache(obj: object) -> bool:
    return type(obj) in _BATCH


def registered_families() -> dict[str, tuple[type, type]]:
    return dict(_FAMILIES)
