"""Where the engine's decode step goes on a GPU: building the graph, queueing it, reading back.

The engine loop of ``bench/gpu_decode.py`` (the server's scheduler and ``ModelRunner``, 8B
shape, ``--batch`` rows at ``--context`` tokens), with three clocks inside each decode-only
step: the Python time to build the queued step's graph (the model and the sampler), the
time ``mx.async_eval`` takes to hand it to the device (it returns only once MLX lets that
much work be in flight), and the time to read the previous step's tokens back. Medians
over the last 3/4 of ``--steps``, per scheme.

    python bench/gpu_engine_split.py --schemes fp16,affine4 --context 16384 --batch 8
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def timed(clocks: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clocks[name].append(time.perf_counter() - t0)
    return wrapper


def main(argv=None) -> int:
    from gpu_decode import build_model, engine_steps, parser

    args = parser(__doc__, "fp16,affine4", 24).parse_args(argv)
    import mlx.core as mx
    from kvserve.server.engine.runner import ModelRunner

    clocks: dict[str, list[float]] = defaultdict(list)
    ModelRunner._forward = timed(clocks, "forward", ModelRunner._forward)
    ModelRunner._read = timed(clocks, "read", ModelRunner._read)
    mx.async_eval = timed(clocks, "async_eval", mx.async_eval)
    mx.set_default_device(mx.gpu)
    model = build_model(args.layers)
    print(f"device: {mx.device_info().get('device_name', mx.default_device())}, mlx {mx.__version__}; "
          f"llama 8B shape, {args.layers} layers, f16, batch {args.batch}, context {args.context}")
    print("| scheme | step ms | build ms | async_eval ms | read ms |\n|---|---|---|---|---|")
    for scheme in args.schemes.split(","):
        clocks.clear()
        times, _ = engine_steps(model, scheme, args.batch, args.context, args.steps)
        tail = args.steps * 3 // 4
        med = {k: 1e3 * statistics.median(v[-tail:]) for k, v in clocks.items()}
        print(f"| {scheme} | {1e3 * statistics.median(times[-tail:]):.2f} | "
              f"{med['forward'] - med['async_eval']:.2f} | {med['async_eval']:.2f} | {med['read']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
