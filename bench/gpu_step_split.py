"""Where a batched decode step's time goes on a GPU: graph building against evaluation.

The same model and caches as ``bench/gpu_decode.py`` (a random-weight llama of Llama-3-8B
shape in f16, ``--batch`` rows at ``--context`` tokens, merged into one batch cache). Per
scheme it reports:

  * graph nodes of one step, by primitive (``mx.export_to_dot``);
  * the caches alone: each layer's cache appends one token per row and attends, chained
    through the layers, graph building (Python) and evaluation timed apart;
  * whole steps as the engine runs them (build the graph, then evaluate it), the median
    build and evaluation time apart, and the same steps pipelined as mlx-lm's ``generate``
    does (step n + 1 built while the device runs step n, ``mx.async_eval``).

    python bench/gpu_step_split.py --schemes fp16,affine4 --context 16384 --batch 8
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def steps(model, cache, batch: int, n: int) -> tuple[float, float]:
    """Median ms of graph building and of evaluation over the last 3/4 of n steps."""
    import mlx.core as mx

    tokens = mx.zeros((batch, 1), dtype=mx.int32)
    builds, evals = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        tokens = mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)[:, None]
        t1 = time.perf_counter()
        mx.eval(tokens)
        builds.append(t1 - t0)
        evals.append(time.perf_counter() - t1)
    k = n // 4
    return 1e3 * statistics.median(builds[k:]), 1e3 * statistics.median(evals[k:])


def pipelined(model, cache, batch: int, n: int) -> float:
    """Mean ms per step when step n + 1 is built while the device runs step n."""
    import mlx.core as mx

    y = mx.argmax(model(mx.zeros((batch, 1), dtype=mx.int32), cache=cache)[:, -1, :], axis=-1)[:, None]
    mx.async_eval(y)
    y.tolist()
    t0 = time.perf_counter()
    for _ in range(n):
        nxt = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1)[:, None]
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
    y.tolist()
    return 1e3 * (time.perf_counter() - t0) / n


def caches_alone(cache, batch: int) -> tuple[float, float]:
    """Median ms of building and evaluating one token's append + attention in every layer."""
    import mlx.core as mx

    q = mx.random.normal((batch, 32, 1, 128)).astype(mx.float16)
    k = mx.random.normal((batch, 8, 1, 128)).astype(mx.float16)
    mx.eval(q, k)
    builds, evals = [], []
    for _ in range(6):
        t0 = time.perf_counter()
        x = q
        for layer in cache.layers:
            keys, values = layer.update_and_fetch(k, k)
            x = layer.attend(x, keys, values, 128 ** -0.5, None)
        t1 = time.perf_counter()
        mx.eval(x)
        builds.append(t1 - t0)
        evals.append(time.perf_counter() - t1)
    return 1e3 * statistics.median(builds[2:]), 1e3 * statistics.median(evals[2:])


def graph_nodes(model, cache, batch: int, path: str) -> Counter:
    import mlx.core as mx

    logits = model(mx.zeros((batch, 1), dtype=mx.int32), cache=cache)
    mx.export_to_dot(path, logits)
    mx.eval(logits)
    lines = Path(path).read_text().splitlines()
    return Counter(line.split('label ="')[1].split('"')[0] for line in lines if "shape=rectangle" in line)


def main(argv=None) -> int:
    from gpu_decode import parser

    args = parser(__doc__, "fp16,affine4", 12).parse_args(argv)
    import tempfile

    import mlx.core as mx
    from gpu_decode import batch_cache, build_model

    mx.set_default_device(mx.gpu)
    model = build_model(args.layers)
    print(f"device: {mx.device_info().get('device_name', '')}, mlx {mx.__version__}; llama 8B shape, "
          f"{args.layers} layers, f16, batch {args.batch}, context {args.context}")
    for scheme in args.schemes.split(","):
        cache = batch_cache(model, scheme, args.batch, args.context)
        with tempfile.NamedTemporaryFile(suffix=".dot") as f:
            nodes = graph_nodes(model, cache, args.batch, f.name)
        print(f"{scheme}: {sum(nodes.values())} graph nodes per step; {nodes.most_common(10)}")
        b, e = caches_alone(cache, args.batch)
        print(f"{scheme}: caches alone, {len(cache.layers)} layers: build {b:.2f} ms, evaluate {e:.2f} ms")
        b, e = steps(model, cache, args.batch, args.steps)
        pipe = pipelined(model, cache, args.batch, args.steps)
        print(f"{scheme}: step build {b:.2f} ms + evaluate {e:.2f} ms = {b + e:.2f} ms; pipelined {pipe:.2f} ms",
              flush=True)
        del cache
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
