"""Bytes per token per KV head for every scheme: the formula next to what the caches allocate.

    python bench/kv_bytes.py [--head-dim 64] [--tokens 1000] [--out docs/benchmarks/kv-bytes.md]

Each cache gets ``--tokens`` tokens of float16 keys/values (a prefill, then one decode step so
TurboQuant compresses), 3 KV heads. "stored" counts the arrays of ``state`` (exactly the
stored tokens), "allocated" is ``nbytes`` over the capacity the buffer grew to.
"""

from __future__ import annotations

import argparse
import math

import mlx.core as mx

from kvserve.cache import SCHEME_NAMES, make_layer_cache, parse_scheme
from kvserve.cache.scheme import ComponentFormat

HEADS = 3


def formula_bytes(fmt: ComponentFormat, d: int) -> float:
    """Bytes one token of one head costs in this format (turboquant.md section 7).

    >>> formula_bytes(parse_scheme("affine4").keys, 64)   # 32 B of nibbles + fp16 scale, bias
    36.0
    >>> formula_bytes(parse_scheme("turbo0v4").values, 64)  # 8 words + an f32 norm
    36.0
    """
    if fmt.kind == "fp16":
        return 2.0 * d
    if fmt.kind == "affine":
        return d * fmt.bits / 8 + 2 * 2 * d / fmt.group_size
    if fmt.kind == "mx":  # one 8-bit shared scale per block
        return d * fmt.bits / 8 + d / fmt.group_size
    return float(4 * math.ceil(d * fmt.bits / 32) + 4)  # turbo: packed words + f32 norm


def measure(name: str, d: int, tokens: int) -> dict:
    scheme = parse_scheme(name)
    cache = make_layer_cache(scheme)
    mx.random.seed(0)
    k = mx.random.normal((1, HEADS, tokens - 1, d)).astype(mx.float16)  # (B, H, T, D)
    cache.update_and_fetch(k, k)
    one = mx.random.normal((1, HEADS, 1, d)).astype(mx.float16)
    cache.update_and_fetch(one, one)  # first decode step: TurboQuant compresses here
    if hasattr(cache, "compress") and getattr(cache, "phase", "") == "raw":
        cache.compress()
    mx.eval(*cache.state)
    stored = sum(a.nbytes for a in cache.state) / (tokens * HEADS)
    allocated = cache.nbytes / (cache.capacity * HEADS)
    formula = formula_bytes(scheme.keys, d) + formula_bytes(scheme.values, d)
    return {"scheme": name, "formula": formula, "stored": stored, "allocated": allocated,
            "capacity": cache.capacity, "vs_fp16": 4 * d / formula}


def table(rows: list[dict], d: int, tokens: int) -> str:
    lines = [f"Bytes per token per KV head, head_dim {d}, K+V, 16-bit activations, {tokens} tokens.",
             "", "| scheme | formula | stored | allocated | capacity | vs fp16 (formula) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['formula']:.2f} | {r['stored']:.2f} | {r['allocated']:.2f} "
                     f"| {r['capacity']} | {r['vs_fp16']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = [measure(name, args.head_dim, args.tokens) for name in SCHEME_NAMES]
    text = table(rows, args.head_dim, args.tokens)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
