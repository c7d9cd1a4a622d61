"""KV bytes of a Gemma-3-shaped model at a long context: sliding windows against full caches.

    python bench/window_bytes.py [--context 8192] [--schemes fp16,affine4,turbo0v4] [--out F]

The model has Gemma 3 270M's attention (head_dim 256, 1 KV head, 4 query heads, window 512,
five sliding layers to one full one) in 6 layers with random weights; the MLP is narrowed,
since it holds no cache. The prompt is prefilled in chunks of 256 (as the engine's step
budget does), then 16 tokens are decoded. Three containers hold the same tokens:

* kvserve: ``PromptCache.for_model`` (sliding layers keep at most the window plus slack);
* kvserve, every layer a full cache of the scheme (what the engine held before it knew windows);
* mlx-lm's own ``make_prompt_cache`` (fp16 only: its rotating cache cannot be quantized).

It prints, per scheme, allocated bytes (``nbytes``) and the stored tokens of each layer kind,
and what one prefix-cache checkpoint of the sliding layers takes (``checkpoints.capture``:
the copies of what the windows hold, in the scheme), and so per 1,000 shared tokens at the
default grid of one checkpoint every 1,024 prompt tokens (message ends add one each).
"""

from __future__ import annotations

import argparse
import platform

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import gemma3_text

from kvserve.cache import PromptCache, SlidingKVCache, make_layer_cache, parse_scheme
from kvserve.cache.prefix.checkpoints import capture

GRID = 1024  # cache.prompt_cache_checkpoint_tokens' default

CHUNK = 256
DECODE = 16


def gemma_shaped() -> gemma3_text.Model:
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=640, num_hidden_layers=6, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=1024,
        sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
        max_position_embeddings=32768, rope_local_base_freq=10000.0)
    mx.random.seed(0)
    model = gemma3_text.Model(args)
    model.set_dtype(mx.bfloat16)  # as Gemma checkpoints ship: K/V of 2 bytes per value
    mx.eval(model.parameters())
    return model


def fill(model, cache, context: int) -> None:
    """Prefill ``context`` tokens in chunks, then decode ``DECODE``."""
    tokens = mx.random.randint(0, 1024, (1, context), key=mx.random.key(1))
    for a in range(0, context, CHUNK):
        model(tokens[:, a:a + CHUNK], cache=cache)
        if isinstance(cache, PromptCache):
            cache.maybe_convert()
        mx.eval([c.state for c in cache])
    for _ in range(DECODE):
        model(mx.array([[7]]), cache=cache)
        mx.eval([c.state for c in cache])


def stored_bytes(cache: PromptCache) -> int:
    """Bytes of the stored tokens (``state``), without the spare capacity of the buffers."""
    return sum(a.nbytes for layer in cache for a in layer.state)


def stored_tokens(cache) -> str:
    """Tokens each layer stores (first sliding layer, then the full one)."""
    sizes = [c.size() for c in cache]
    return f"{sizes[0]} / {sizes[5]}"


def measure(model, scheme: str, context: int) -> list[dict]:
    rows = []
    windowed = PromptCache.for_model(model, scheme)
    fill(model, windowed, context)
    rows.append({"scheme": scheme, "caches": "kvserve (sliding windows)", "bytes": windowed.nbytes,
                 "stored": stored_bytes(windowed), "tokens": stored_tokens(windowed),
                 "checkpoint": capture(windowed).nbytes})
    assert isinstance(windowed[0], SlidingKVCache)
    full = PromptCache([make_layer_cache(parse_scheme(scheme)) for _ in model.layers], scheme)
    fill(model, full, context)
    rows.append({"scheme": scheme, "caches": "kvserve, full caches in every layer", "bytes": full.nbytes,
                 "stored": stored_bytes(full), "tokens": stored_tokens(full)})
    if scheme == "fp16":
        theirs = mlx_cache.make_prompt_cache(model)
        fill(model, theirs, context)
        rows.append({"scheme": scheme, "caches": "mlx-lm make_prompt_cache",
                     "bytes": sum(c.nbytes for c in theirs), "tokens": stored_tokens(theirs),
                     "stored": sum(k.nbytes + v.nbytes for k, v in
                                   (c.keys_and_values() for c in theirs))})
    return rows


def report(rows: list[dict], context: int) -> str:
    lines = [f"Gemma-3-270M-shaped attention, 6 layers (5 sliding, window 512, 1 full), "
             f"{context} + {DECODE} tokens, {platform.machine()} CPU, MLX {mx.__version__}.", "",
             "| scheme | caches | KV MiB allocated | KV MiB stored | tokens stored (sliding / full layer) "
             "| allocated vs full caches | checkpoint KiB | checkpoint KiB per 1,000 tokens |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    full = {r["scheme"]: r["bytes"] for r in rows if r["caches"].startswith("kvserve, full")}
    for r in rows:
        cp = (f"{r['checkpoint'] / 2**10:.0f} | {r['checkpoint'] / 2**10 * 1000 / GRID:.0f}"
              if "checkpoint" in r else "- | -")
        lines.append(f"| {r['scheme']} | {r['caches']} | {r['bytes'] / 2**20:.2f} | "
                     f"{r['stored'] / 2**20:.2f} | {r['tokens']} | "
                     f"{r['bytes'] / full[r['scheme']]:.2f}x | {cp} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--schemes", default="fp16,affine4,turbo0v4")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    model = gemma_shaped()
    rows = [r for s in args.schemes.split(",") for r in measure(model, s, args.context)]
    text = report(rows, args.context)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# KV bytes with sliding windows\n\n`python bench/window_bytes.py --context "
                    f"{args.context} --schemes {args.schemes}`\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
