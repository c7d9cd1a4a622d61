"""Launch shapes of the tensor-core attention pass on a GPU: chained ms per blocks x warps.

For each ``--shapes`` entry (target blocks x warps per block x 16-token tiles per step) it
sets ``kvserve.kernels.cuda_attention``'s ``MMA_*`` constants and times one decode step of
attention (B=8, 32 query heads over 8 KV heads, D=128, L=1, T=``--context``) as
``kvserve bench-attention`` does (``bench_cases.measure``: a chain of 10 dependent calls).
``--once`` runs each shape's call twice without timing, for a profiler:

    python bench/gpu_attention_shapes.py --schemes affine4 --shapes 256x2x1,768x2x1,384x4x1
    ncu --clock-control none -k regex:kvs_attn_mma -c 1 --section SpeedOfLight \\
        --section Occupancy --section SchedulerStats \\
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \\
        python bench/gpu_attention_shapes.py --shapes 384x4x1 --once
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default="affine4")
    p.add_argument("--shapes", default="768x2x1")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--once", action="store_true")
    args = p.parse_args(argv)
    import mlx.core as mx
    from kvserve.kernels import bench_cases as bc
    from kvserve.kernels import cuda_attention as ca

    mx.set_default_device(mx.gpu)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    for scheme in args.schemes.split(","):
        case = bc.build_case(scheme, "cuda", bc.Shape(8, 32, 8, 128, args.context))
        mx.eval(case.inputs)
        for blocks, warps, tiles in shapes:
            ca.MMA_TARGET_BLOCKS, ca.MMA_WARPS, ca.MMA_STEP_TILES = blocks, warps, tiles
            ca._families.clear()  # the warps are compiled into the kernel
            if args.once:
                mx.eval(case.run(case.queries))
                mx.eval(case.run(case.queries))
                continue
            r = bc.measure(case, repeats=7, calls=10, profile=True)
            print(f"{scheme} {blocks}x{warps}x{tiles}: {r['ms']:.3f} ms, {r['GB_s']:.0f} GB/s; "
                  f"kernels {r.get('kernel_ms', '-')} ms, {r.get('kernel_GB_s', '-')} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
