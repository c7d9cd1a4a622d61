"""Per-layer caches to and from one safetensors file that says exactly what it holds.

Layout of a file with two layers (``state`` arrays hold only ``offset`` tokens, never capacity):

    tensors:   layer.0.0  layer.0.1  ...      layer i's state arrays, in order
               layer.1.0  layer.1.1  ...
    metadata:  format          "kvserve.kv-layers"
               format_version  "1"
               num_layers      "2"
               layer.0         JSON {"class": "QuantizedKVCache", "params": scheme.params(),
                                     "offset": 37, "meta": meta_state, "tensors": 6}
               user.<key>      caller metadata (model fingerprint, tokenizer hash, ...)

Loading refuses, with ``CacheFileError``, anything it cannot rebuild exactly: another format
or version, an unknown class, a class that does not store the recorded scheme, parameters
that differ from what the scheme name parses to, and missing or extra tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvserve.cache.registry import (
    SchemeUnavailable,
    cache_class_by_name,
    is_kvserve_cache,
    single_class_for,
    stores_scheme,
)
from kvserve.cache.scheme import UnknownScheme, parse_scheme

FORMAT = "kvserve.kv-layers"
FORMAT_VERSION = "1"
USER_PREFIX = "user."


class CacheFileError(ValueError):
    """A cache file that cannot be loaded as written (the message says why)."""


def _offset(cache: Any) -> Any:
    offset = cache.offset
    return offset.tolist() if isinstance(offset, mx.array) else int(offset)


def save_layers(path: str | Path, caches: Iterable[Any], metadata: dict[str, str] | None = None) -> Path:
    """Write caches (a list or a ``PromptCache``) and string metadata; returns the path.

    The path gets a ``.safetensors`` suffix if it has none (MLX would add one anyway).
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    caches = list(caches)
    tensors: dict[str, mx.array] = {}
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "num_layers": str(len(caches))}
    for i, cache in enumerate(caches):
        if not is_kvserve_cache(cache):
            raise TypeError(f"layer {i} is a {type(cache).__name__}, not a kvserve cache")
        state = cache.state
        tensors.update({f"layer.{i}.{j}": a for j, a in enumerate(state)})
        header[f"layer.{i}"] = json.dumps({"class": type(cache).__name__, "params": cache.scheme.params(),
                                           "offset": _offset(cache), "meta": cache.meta_state,
                                           "tensors": len(state)})
    for key, value in (metadata or {}).items():
        if not isinstance(value, str):
            raise TypeError(f"metadata values must be strings, got {type(value).__name__} for {key}")
        header[USER_PREFIX + key] = value
    mx.save_safetensors(str(path), tensors, header)
    return path


def load_layers(path: str | Path) -> tuple[list[Any], dict[str, str]]:
    """Read a file written by ``save_layers``: (caches, caller metadata)."""
    try:
        tensors, header = mx.load(str(path), return_metadata=True)
    except Exception as err:  # MLX raises RuntimeError/ValueError for unreadable files
        raise CacheFileError(f"{path}: not a readable safetensors file ({err})") from err
    _check_header(path, header)
    caches = [_load_layer(path, i, header, tensors) for i in range(int(header["num_layers"]))]
    expected = sum(json.loads(header[f"layer.{i}"])["tensors"] for i in range(len(caches)))
    if len(tensors) != expected:
        raise CacheFileError(f"{path}: {len(tensors)} tensors, the layers describe {expected}")
    user = {k[len(USER_PREFIX):]: v for k, v in header.items() if k.startswith(USER_PREFIX)}
    return caches, user


def _check_header(path: Any, header: dict[str, str]) -> None:
    if header.get("format") != FORMAT:
        raise CacheFileError(f"{path}: not a kvserve cache file (format {header.get('format')!r})")
    if header.get("format_version") != FORMAT_VERSION:
        raise CacheFileError(f"{path}: unsupported format version {header.get('format_version')!r} "
                             f"(this build reads {FORMAT_VERSION})")


def _load_layer(path: Any, i: int, header: dict[str, str], tensors: dict[str, mx.array],
                prefix: str = "layer") -> Any:
    """Layer ``i`` as ``<prefix>.<i>`` describes it, from tensors ``<prefix>.<i>.<j>``."""
    try:
        info = json.loads(header[f"{prefix}.{i}"])
        cls = cache_class_by_name(info["class"])
        scheme = parse_scheme(info["params"]["scheme"])
    except (KeyError, json.JSONDecodeError, UnknownScheme) as err:
        raise CacheFileError(f"{path}: layer {i} description is unusable ({err})") from err
    if scheme.params() != info["params"]:
        raise CacheFileError(f"{path}: layer {i} parameters {info['params']} differ from {scheme.name}'s")
    try:
        single_class_for(scheme)
    except SchemeUnavailable as err:
        raise CacheFileError(f"{path}: layer {i}: {err}") from err
    if not stores_scheme(cls, scheme):
        raise CacheFileError(f"{path}: layer {i} class {cls.__name__} does not store scheme {scheme.name}")
    names = [f"{prefix}.{i}.{j}" for j in range(info["tensors"])]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CacheFileError(f"{path}: layer {i} is missing tensors {missing}")
    try:
        cache = cls.from_state(scheme, tuple(tensors[n] for n in names), info["meta"])
    except (ValueError, KeyError, TypeError) as err:
        raise CacheFileError(f"{path}: layer {i} state does not match its description ({err})") from err
    if _offset(cache) != info["offset"]:
        raise CacheFileError(f"{path}: layer {i} holds offset {_offset(cache)}, recorded {info['offset']}")
    return cache
