"""Whether the engine can serve a model, decided at start-up by running it the engine's way.

A model whose layers kvserve has no cache for, whose layers do not report the tokens they
took, or whose head size a scheme cannot store, would fail on every request. ``check_servable``
finds that once, before the server listens, and says what is missing in one line:

    prefill 3 tokens into a fresh container          every layer kind is known, every offset is 3
    decode one token                                 the scheme's first decode (TurboQuant compresses)
    merge with a 2-token container, decode, undo     batch algebra, left padding, the undo of a step

Each step raises ``NotServable`` with the layer and the reason.
"""

from __future__ import annotations

import mlx.core as mx

from kvserve.cache import PromptCache, UnsupportedLayers
from kvserve.cache.scheme import KVScheme


class NotServable(Exception):
    """The engine cannot serve this model with this scheme (one line: what is missing)."""


def check_servable(model, scheme: KVScheme, name: str = "this model") -> None:
    """Run the probe above; ``NotServable`` names the first thing that fails."""
    try:
        a = _prefilled(model, scheme, [0, 1, 2])
        _decode(model, a, 1)
        b = _prefilled(model, scheme, [3, 4])
        batch = PromptCache.merge([a, b])
        _decode(model, batch, 2)
        _check_offsets(batch, [5, 3])
        if batch.trim(1) != 1:
            raise NotServable(f"{name}: a decode step of its layers cannot be undone")
        _check_offsets(batch, [4, 2])
    except UnsupportedLayers as exc:
        raise NotServable(f"{name} cannot be served: {exc}") from None
    except ValueError as exc:
        raise NotServable(f"KV scheme {scheme.name} does not fit {name}: {exc}") from None


def _prefilled(model, scheme: KVScheme, tokens: list[int]) -> PromptCache:
    cache = PromptCache.for_model(model, scheme)
    model(mx.array([tokens]), cache=cache)
    mx.eval(cache.state)
    _check_offsets(cache, [len(tokens)])
    return cache


def _decode(model, cache: PromptCache, rows: int) -> None:
    model(mx.array([[5]] * rows), cache=cache)
    cache.maybe_convert()
    mx.eval(cache.state)


def _check_offsets(cache: PromptCache, expected: list[int]) -> None:
    """Every layer must count the tokens it took: positions, masks and the prefix cache
    rely on it (an SSM layer that never calls ``advance`` would stay at 0)."""
    for i, layer in enumerate(cache):
        offset = layer.offset
        got = offset.tolist() if isinstance(offset, mx.array) else [int(offset)]
        if got != expected:
            raise NotServable(f"layer {i} ({type(layer).__name__}) reports {got} tokens after "
                              f"{expected}: its model code does not count the tokens it takes")
