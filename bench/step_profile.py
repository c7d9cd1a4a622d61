"""Where a decode step's time goes, per phase, for each KV scheme and batch size.

    python bench/step_profile.py [--schemes fp16,affine4,turbo0v4] [--batches 1,8] [--context 160]
                                 [--weight-format auto] [--mlx-attention] [--mlx-layer-ops]
                                 [--out docs/benchmarks/cpu-step.md]

Loads the served model the way ``kvserve serve`` does (BLAS shim, weight format, RoPE table,
KV scheme), prefills ``batch`` rows of ``context`` tokens, merges them, and times greedy
decode steps, each evaluated before the next. Phases of a step:

* **graph**: Python building the step's lazy graph (mlx-lm's modules, the caches' code);
* **products**: time inside the BLAS shim's ``cblas_sgemm`` (the weight products, and the
  per-head products of MLX's own attention where it runs), from the shim's own clock;
* **other ops**: the rest of the evaluation: attention kernels, norms, RoPE, cache writes,
  the argmax, and MLX's per-operation overhead;
* **operations**: the nodes of one step's graph (``mx.export_to_dot``), views included.

``--weight-format dense-f32`` and ``--mlx-attention`` (the CPU attention kernel unregistered)
give the step as it was before decode products read the packed codes and attention had its
CPU kernel; ``--mlx-layer-ops`` keeps RMSNorm, RoPE, linear layers, SwiGLU and turbo encoding in MLX
operations (``kernels/cpu_ops`` off), as before they were one operation each.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--schemes", default="fp16,affine4,turbo0v4")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--weight-format", default="auto")
    p.add_argument("--mlx-attention", action="store_true", help="without the CPU attention kernel")
    p.add_argument("--mlx-layer-ops", action="store_true", help="without the CPU layer primitives")
    p.add_argument("--out", help="also write the table to this markdown file")
    args = p.parse_args(argv)

    from kvserve.server.models.blas import enable_fast_blas

    blas = enable_fast_blas()
    from kvserve.bench.report import publish
    from kvserve.bench.step import profile
    from kvserve.cache import parse_scheme
    from kvserve.configs import ModelConfig
    from kvserve.server.engine.model_loader import load_model

    if args.mlx_attention:
        from kvserve.kernels import dispatch

        dispatch.unregister_kernel("cpu-stored")
    if args.mlx_layer_ops:
        from kvserve.kernels import cpu_ops

        cpu_ops.available = lambda: False
    config = ModelConfig(model=args.model, weight_format=args.weight_format)
    loaded = load_model(config, parse_scheme("fp16"), blas.describe())
    model = loaded.runner.model
    rows = []
    for scheme in args.schemes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            ms = profile(model, scheme, batch, args.context, args.steps)
            rows.append(f"| {scheme} | {batch} | {ms['step']:.1f} | {ms['graph']:.1f} | {ms['products']:.1f} "
                        f"| {ms['other ops']:.1f} | {ms['ops']:,} | {batch / ms['step'] * 1e3:.0f} |")
            print(rows[-1], file=sys.stderr, flush=True)
    command = "python bench/step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        f"Model: `{Path(loaded.info.source).name}`, weights {loaded.info.weight_format.split(' (')[0]}, "
        f"attention {'MLX ops' if args.mlx_attention else 'CPU kernel where it serves'}, "
        f"norms/RoPE/linears/SwiGLU/turbo encoding {'MLX ops' if args.mlx_layer_ops else 'one CPU operation each'}; "
        f"{args.context}-token rows; {platform.processor() or platform.machine()}; `{command.strip()}`",
        "",
        "| scheme | rows | step ms | graph ms | products ms | other ops ms | operations | tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows, ""])
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
