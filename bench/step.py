"""The model step alone: one batched decode forward of the served model, without a server.

Loads the model the way ``kvserve serve`` does (same BLAS, weight format, RoPE table and
KV scheme), prefills ``batch`` prompts of ``context`` tokens into per-request caches, merges
them into one batch cache and times greedy decode steps, each evaluated before the next
as the engine does. ``kvserve bench`` compares this with the inter-token latency its
clients see, which is the model step plus everything the server adds.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def model_step_seconds(model_dir: Path, kv_scheme: str, batch: int = 8, context: int = 160,
                       steps: int = 48) -> float:
    """Median seconds of one decode step over ``batch`` rows at ``context`` tokens."""
    import mlx.core as mx

    from kvserve.cache import PromptCache, parse_scheme
    from kvserve.configs import ModelConfig
    from kvserve.server.engine.model_loader import load_model

    scheme = parse_scheme(kv_scheme)
    loaded = load_model(ModelConfig(model=str(model_dir)), scheme, blas="as enabled")
    model = loaded.runner.model
    caches = []
    for row in range(batch):
        cache = PromptCache.for_model(model, scheme)
        prompt = mx.array([[(17 * row + 31 * i) % 1000 + 10 for i in range(context)]])
        model(prompt, cache=cache)
        cache.maybe_convert()
        mx.eval(cache.state)
        caches.append(cache)
    cache = PromptCache.merge(caches)
    tokens = mx.zeros((batch, 1), dtype=mx.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(tokens, cache=cache)[:, -1, :]
        cache.maybe_convert()
        tokens = mx.argmax(logits, axis=-1)[:, None]
        mx.eval(tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times[steps // 4:])  # the first steps warm caches up
