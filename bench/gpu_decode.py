"""Batched decoding over long contexts on a GPU: kvserve's caches and attention in a model step.

A random-weight llama of Llama-3-8B shape (hidden 4096, 32 query heads over 8 KV heads,
head_dim 128, MLP 14336, vocabulary 128256; ``--layers`` layers, default 32) in float16.
For each scheme, ``--batch`` rows are prefilled with ``--context`` tokens each (chunks of
2048, at fp16, then converted to the scheme once, as the server does), merged into one
batch cache, and ``--steps`` greedy decode steps are timed, each evaluated before the next
as the engine does. Reported per scheme: median step ms, output tokens/s, K/V GiB held.

    python bench/gpu_decode.py --schemes fp16,affine4,turbo0v4 --context 16384 --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

CHUNK = 2048


def build_model(layers: int):
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=4096, num_hidden_layers=layers,
                           intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                           rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def batch_cache(model, scheme: str, batch: int, context: int):
    """``batch`` per-row caches of ``context`` random tokens, merged."""
    import mlx.core as mx
    from kvserve.cache import PromptCache

    rows = []
    for row in range(batch):
        cache = PromptCache.for_model(model, scheme, quantize_after=context)
        tokens = mx.random.randint(0, 128256, (1, context), key=mx.random.key(row))
        for start in range(0, context, CHUNK):
            model(tokens[:, start:start + CHUNK], cache=cache)
            mx.eval(cache.state)
        cache.maybe_convert()
        mx.eval(cache.state)
        rows.append(cache)
    merged = PromptCache.merge(rows)
    mx.eval(merged.state)
    return merged


def time_steps(model, cache, batch: int, steps: int) -> list[float]:
    import mlx.core as mx

    tokens = mx.zeros((batch, 1), dtype=mx.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(tokens, cache=cache)[:, -1, :]
        tokens = mx.argmax(logits, axis=-1)[:, None]
        mx.eval(tokens)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default="fp16,affine4,turbo0v4")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    args = p.parse_args(argv)
    import mlx.core as mx

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    model = build_model(args.layers)
    print(f"device: {mx.device_info().get('device_name', mx.default_device())}, mlx {mx.__version__}; "
          f"llama 8B shape, {args.layers} layers, f16, batch {args.batch}, context {args.context}")
    print("| scheme | step ms (median) | output tok/s | K/V GiB |\n|---|---|---|---|")
    for scheme in args.schemes.split(","):
        cache = batch_cache(model, scheme, args.batch, args.context)
        times = time_steps(model, cache, args.batch, args.steps)[args.steps // 4:]
        # After decoding: turbo caches hold the raw prefill until their first decode step.
        kv = sum(getattr(layer, "nbytes", 0) for layer in cache.layers) / 2**30
        ms = 1e3 * statistics.median(times)
        print(f"| {scheme} | {ms:.2f} | {args.batch * 1e3 / ms:.1f} | {kv:.2f} |", flush=True)
        del cache
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
