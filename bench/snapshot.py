"""What a prefix-cache entry costs to take and to hand back, per scheme.

A B = 1 cache of ``--layers`` layers (``--kv-heads`` heads of ``--head-dim``, float16 K/V,
``--tokens`` tokens, random values) is copied into an entry (``take_snapshot``: what the
engine does when it offers a prompt, and again a finished reply) and restored trimmed to
``--restore`` tokens (``restore``, evaluated: what a request that hits the entry starts
from). Medians of ``--repeats`` in milliseconds, on the default device. The defaults are
the default model's geometry with a 200-token prompt and its reply.

    python bench/snapshot.py --schemes fp16,affine4,turbo0v4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default="fp16,affine4")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=330)
    p.add_argument("--restore", type=int, default=30)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args(argv)
    from kvserve.server.models.blas import enable_fast_blas

    enable_fast_blas()
    import mlx.core as mx

    from kvserve.cache import PromptCache, make_layer_cache
    from kvserve.cache.prefix.snapshot import restore, take_snapshot

    shape = (1, args.kv_heads, args.tokens, args.head_dim)
    print(f"device: {mx.default_device()}; {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, "
          f"{args.tokens} tokens, restored to {args.restore}; median of {args.repeats}")
    print("| scheme | snapshot ms | restore ms |\n|---|---|---|")
    for scheme in args.schemes.split(","):
        layers = [make_layer_cache(scheme) for _ in range(args.layers)]
        for layer in layers:
            layer.update_and_fetch(mx.random.normal(shape).astype(mx.float16), mx.random.normal(shape).astype(mx.float16))
        cache = PromptCache(layers, scheme)
        mx.eval(cache.state)
        took, back = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            snap = take_snapshot(cache)
            took.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mx.eval(restore(snap, args.restore).state)
            back.append(time.perf_counter() - t0)
        print(f"| {scheme} | {1e3 * statistics.median(took):.2f} | {1e3 * statistics.median(back):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
