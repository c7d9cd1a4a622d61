"""``kvserve bench-attention``: decode attention over fp16 and compressed K/V, one run.

    kvserve bench-attention --device cpu [--json] [--contexts 1024,2048,4096]

For each context T: fp16 ``mx.fast.scaled_dot_product_attention``, mlx-lm's unfused
quantized path on 4-bit K/V, and ours (full path and blockwise reference; "dispatch"
marks the one ``kvserve.kernels.dispatch`` picks at that T) for affine4, mxfp4, turbo0v4
and turbo8v3; B=8, 32 query heads over 8 KV heads, D=128, L=1. Columns: median ms, K/V
MiB read, effective GB/s (K/V bytes / time), peak MiB of all live arrays (K/V included)
and the MiB the call added on top, max |ours - family's full-context reference|.
The machine's copy bandwidth (``x + 0`` over 256 MiB) is the ceiling for GB/s.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

SCHEMES = ("affine4", "mxfp4", "turbo0v4", "turbo8v3")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvserve bench-attention", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    p.add_argument("--contexts", default="1024,2048,4096", help="comma-separated T values")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    return p.parse_args(argv)


def plan(schemes=SCHEMES) -> list[tuple[str, str]]:
    """(scheme, impl) pairs measured at every context, baselines first.

        >>> plan(("affine4",))
        [('fp16', 'fp16'), ('affine4', 'mlx-lm'), ('affine4', 'full'), ('affine4', 'blockwise')]
    """
    rows = [("fp16", "fp16"), ("affine4", "mlx-lm")]
    for name in schemes:
        rows += [(name, "full"), (name, "blockwise")]
    return rows


def run_all(contexts: list[int], batch: int, repeats: int) -> dict:
    import mlx.core as mx
    from kvserve.kernels import bench_cases as bc
    from kvserve.kernels.dispatch import choose

    results = {"machine": machine(), "copy_GB_s": bc.copy_bandwidth(), "runs": []}
    for T in contexts:
        shape = bc.Shape(batch, 32, 8, 128, T)
        for scheme, impl in plan():
            row = bc.measure(bc.build_case(scheme, impl, shape), repeats)
            picked = "yes" if choose(None, None, 1, T) == impl else ""
            results["runs"].append({"T": T, **row, "dispatch": picked})
            mx.clear_cache()  # the next case's peak starts from what it allocates itself
    return results


def machine() -> dict:
    import mlx.core as mx
    from kvserve.kernels.dispatch import CPU_FULL_MAX_T
    return {"cpu": platform.processor() or platform.machine(), "system": platform.system(),
            "python": platform.python_version(), "mlx": mx.__version__,
            "device": str(mx.default_device()), "cpu_full_max_T": CPU_FULL_MAX_T}


def table(results: dict) -> str:
    """Markdown table of ``run_all``'s result."""
    cols = ("T", "name", "dispatch", "ms", "kv_MiB", "GB_s", "peak_MiB", "extra_MiB",
            "max_abs_diff")
    lines = [f"machine: {results['machine']}", f"copy bandwidth: {results['copy_GB_s']} GB/s", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results["runs"]:
        lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def _fmt(x) -> str:
    return f"{x:.2e}" if isinstance(x, float) and 0 < abs(x) < 1e-2 else str(x)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Before anything imports mlx: its bundled reference BLAS is ~50x slower than OpenBLAS.
    from kvserve.server.engine.blas import enable_fast_blas
    enable_fast_blas()
    import mlx.core as mx

    if args.device == "gpu" and not mx.is_available(mx.gpu):
        print("no GPU backend in this MLX build", file=sys.stderr)
        return 2
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    contexts = [int(t) for t in args.contexts.split(",") if t]
    results = run_all(contexts, args.batch, args.repeats)
    print(json.dumps(results, indent=1) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
