"""Where the engine's decode step goes on a GPU: building the graph, queueing it, reading back.

The engine loop of ``bench/gpu_decode.py`` (the server's scheduler and ``ModelRunner``, 8B
shape, ``--batch`` rows at ``--context`` tokens), with three clocks inside each decode-only
step: the Python time to build the queued step's graph (the model and the sampler), the
time ``mx.async_eval`` takes to hand it to the device (it returns only once MLX lets that
much work be in flight), and the time to read the previous step's tokens back. Medians
over the last 3/4 of ``--steps``, per scheme. ``--model default`` runs the served default
model instead; ``--functions N`` also lists the N functions with the most Python time
(cProfile, own time) inside every forward call of the run, prefill included: where the
host's time goes.

    python bench/gpu_engine_split.py --schemes fp16,affine4 --context 16384 --batch 8
    python bench/gpu_engine_split.py --model default --context 200 --functions 25
    python bench/gpu_engine_split.py --model default --context 200 --batch 8 --steps 30 \
        --device cpu --rewrites fused_projections --functions 35   # the GPU profile's Python, on a CPU
"""

from __future__ import annotations

import cProfile
import io
import pstats
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


def profiled(profile: cProfile.Profile, fn):
    def wrapper(*args, **kwargs):
        profile.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            profile.disable()
    return wrapper


def main(argv=None) -> int:
    from gpu_decode import build_model, captured_modes, chosen_rewrites, engine_steps, parser, served_model

    p = parser(__doc__, "fp16,affine4", 24)
    p.add_argument("--model", choices=("8b-shape", "default"), default="8b-shape")
    p.add_argument("--functions", type=int, default=0, metavar="N")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: the host's Python profile of the same graph without a GPU")
    p.add_argument("--rewrites", default="profile",
                   help="model rewrites: 'profile' (the device profile's), 'none', or names with commas")
    args = p.parse_args(argv)
    import mlx.core as mx
    from kvserve.server.engine.fastpath import apply_rewrites
    from kvserve.server.engine.runner import ModelRunner

    clocks: dict[str, list[float]] = defaultdict(list)
    forward = ModelRunner._forward
    ModelRunner._read = timed(clocks, "read", ModelRunner._read)
    mx.async_eval = timed(clocks, "async_eval", mx.async_eval)
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    rewrites = chosen_rewrites(args.rewrites)
    if args.model == "default":
        model, shape = served_model(rewrites), "the default model"
    else:
        model, shape = build_model(args.layers), f"llama 8B shape, {args.layers} layers, f16"
        apply_rewrites(model, rewrites)
    print(f"device: {mx.device_info().get('device_name', mx.default_device())}, mlx {mx.__version__}; "
          f"{shape}, batch {args.batch}, context {args.context}")
    print("| scheme | step ms | build ms | async_eval ms | read ms |\n|---|---|---|---|---|")
    stats = {}
    for scheme, captured in [(s, c) for s in args.schemes.split(",") for c in captured_modes(args.captured)]:
        clocks.clear()
        profile = cProfile.Profile()  # the whole run's building; engine_steps times decode steps only
        ModelRunner._forward = timed(clocks, "forward", profiled(profile, forward) if args.functions else forward)
        times, _ = engine_steps(model, scheme, args.batch, args.context, args.steps, captured=captured)
        tail = args.steps * 3 // 4
        med = {k: 1e3 * statistics.median(v[-tail:]) for k, v in clocks.items()}
        print(f"| {scheme}{', captured' if captured else ''} | {1e3 * statistics.median(times[-tail:]):.2f} | "
              f"{med['forward'] - med['async_eval']:.2f} | {med['async_eval']:.2f} | {med['read']:.2f} |", flush=True)
        stats[scheme] = (profile, len(clocks["forward"]))
    for scheme, (prof, calls) in stats.items() if args.functions else ():
        print(f"\n{scheme}: Python time inside {calls} forward calls (own time, profiled: slower than above)")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.functions)
        print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
