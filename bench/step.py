"""The model step alone: one batched decode forward of the served model, without a server.

Loads the model the way ``kvserve serve`` does (same BLAS, weight format, RoPE table and
KV scheme), prefills ``batch`` prompts of ``context`` tokens into per-request caches, merges
them into one batch cache and times greedy decode steps, each evaluated before the next
as the engine does. ``kvserve bench`` compares this with the inter-token latency its
clients see, which is the model step plus everything the server adds;
``bench/step_profile.py`` splits the same step into phases.
"""

from __future__ import annotations

import io
import re
import statistics
import time
from pathlib import Path


def model_step_seconds(model_dir: Path, kv_scheme: str, batch: int = 8, context: int = 160,
                       steps: int = 48) -> float:
    """Median seconds of one decode step over ``batch`` rows at ``context`` tokens."""
    from kvserve.cache import parse_scheme
    from kvserve.configs import ModelConfig
    from kvserve.server.engine.model_loader import load_model

    loaded = load_model(ModelConfig(model=str(model_dir)), parse_scheme(kv_scheme), blas="as enabled")
    return profile(loaded.runner.model, kv_scheme, batch, context, steps)["step"] / 1e3


def profile(model, scheme_name: str, batch: int, context: int, steps: int) -> dict[str, float]:
    """Median milliseconds of each phase over ``steps`` decode steps (after 8 warm-up steps),
    and ``ops``: the operations in one step's graph (``mx.export_to_dot``)."""
    import mlx.core as mx

    from kvserve.cache import PromptCache, parse_scheme
    from kvserve.server.models.blas import codes_library

    lib = codes_library()
    clock = (lambda: 0) if lib is None else lib.kvserve_blas_product_ns
    scheme = parse_scheme(scheme_name)
    caches = []
    for row in range(batch):
        cache = PromptCache.for_model(model, scheme)
        model(mx.array([[(17 * row + 31 * i) % 1000 + 10 for i in range(context)]]), cache=cache)
        cache.begin_decode()
        mx.eval(cache.state)
        caches.append(cache)
    cache = PromptCache.merge(caches)
    tokens = mx.zeros((batch, 1), dtype=mx.int32)
    phases: dict[str, list[float]] = {"graph": [], "products": [], "other ops": [], "step": []}
    for i in range(steps + 8):
        start, ns = time.perf_counter(), clock()
        tokens = mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)[:, None]
        built = time.perf_counter()
        if i == 0:
            graph = io.StringIO()
            mx.export_to_dot(graph, tokens)
            ops = len(re.findall(r'label ="[A-Za-z]', graph.getvalue()))  # operations, not inputs
        mx.eval(tokens)
        end = time.perf_counter()
        if i >= 8:
            products = (clock() - ns) / 1e9
            phases["graph"].append(built - start)
            phases["products"].append(products)
            phases["other ops"].append(end - built - products)
            phases["step"].append(end - start)
    return {"ops": ops, **{name: statistics.median(v) * 1e3 for name, v in phases.items()}}
