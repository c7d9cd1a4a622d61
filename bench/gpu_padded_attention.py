"""Decode attention of a left-padded batch against the same batch without padding.

A server's decode batch is left-padded whenever its rows hold different numbers of tokens
(almost always), and then every layer's attention takes a mask array. For each scheme, one
KV layer of ``--batch`` rows (32 query heads over 8 KV heads, D=128, f16) is filled through
kvserve's caches: rows of T - b tokens (row b, so the batch is padded) or of T tokens each
(no padding), merged into a batch cache, plus one decoded token. Timed: the cache's own
attention call (``attend``, with the mask the cache makes), chained as ``kvserve
bench-attention`` times it (``bench_cases.measure``; "kernel ms": the kernels' own device time,
where PyTorch can read it); for the padded fp16 batch also
``mx.fast.scaled_dot_product_attention`` given the same mask, which is what MLX runs for
such a call by itself (unpadded, the fp16 cache's ``attend`` is that call).

    python bench/gpu_padded_attention.py --schemes fp16,affine4,turbo0v4 --context 16384
"""

from __future__ import annotations

import argparse
import sys

CHUNK = 4096


def batch_layer(scheme: str, lengths: list[int], hkv: int = 8, dim: int = 128):
    """A batch cache of one layer whose row b holds ``lengths[b]`` random tokens, after one
    decode append; returns the layer, what its ``update_and_fetch`` returned and the mask
    it made for that token (before the append, as a model does)."""
    import mlx.core as mx
    from kvserve.cache import PromptCache, make_layer_cache

    rows = []
    for b, n in enumerate(lengths):
        layer = make_layer_cache(scheme)
        for start in range(0, n, CHUNK):
            m = min(CHUNK, n - start)
            k, v = mx.random.normal((2, 1, hkv, m, dim), key=mx.random.key(1000 * b + start)).astype(mx.float16)
            layer.update_and_fetch(k, v)
            mx.eval(layer.state)
        rows.append(PromptCache([layer], scheme))
    batch = PromptCache.merge(rows)[0]
    mask = batch.make_mask(1)
    k, v = mx.random.normal((2, len(lengths), hkv, 1, dim), key=mx.random.key(7)).astype(mx.float16)
    keys, values = batch.update_and_fetch(k, v)
    mx.eval(keys, values)
    return batch, keys, values, mask


def cases(scheme: str, batch: int, context: int) -> list:
    import mlx.core as mx
    from kvserve.kernels.bench_cases import Case

    out = []
    for padded in (False, True):
        lengths = [context - b if padded else context for b in range(batch)]
        layer, keys, values, mask = batch_layer(scheme, lengths)
        q = mx.random.normal((batch, 32, 1, 128), key=mx.random.key(3)).astype(mx.float16)
        scale = 128 ** -0.5
        parts = [a for a in (*_tuple(keys), *_tuple(values)) if isinstance(a, mx.array)]
        kv = sum(a.nbytes for a in parts)
        label = f"{scheme}, {'padded' if padded else 'not padded'}"
        if scheme == "fp16" and padded:  # unpadded, the cache's attend is this very call
            sdpa = lambda x, k=keys, v=values, mask=mask: mx.fast.scaled_dot_product_attention(
                x, k, v, scale=scale, mask=mask)
            out.append(Case(f"{label}: mx.fast.sdpa", sdpa, kv, lambda: "-", [q, *parts]))
        run = lambda x, layer=layer, keys=keys, values=values, mask=mask: layer.attend(x, keys, values, scale, mask)
        out.append(Case(f"{label}: cache attend", run, kv, lambda: "-", [q, *parts]))
    return out


def _tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default="fp16,affine4,turbo0v4")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    import mlx.core as mx
    from kvserve.kernels.bench_cases import measure

    print(f"device: {mx.device_info().get('device_name', mx.default_device())}, mlx {mx.__version__}; "
          f"B={args.batch}, 32 query heads over 8 KV heads, D=128, L=1, T={args.context}, f16")
    print("| scheme, batch: path | ms per call (median) | K/V GB/s | kernel ms |\n|---|---|---|---|")
    for scheme in args.schemes.split(","):
        for case in cases(scheme, args.batch, args.context):
            r = measure(case, calls=10, profile=True)
            print(f"| {case.name} | {r['ms']:.3f} | {r['GB_s']:.0f} | {r.get('kernel_ms', '-')} |", flush=True)
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
