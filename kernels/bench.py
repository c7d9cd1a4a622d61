"""``kvserve bench-attention``: decode attention over fp16 and compressed K/V, one run.

    kvserve bench-attention [--device cpu|gpu] [--json] [--contexts 1024,2048,4096] [--profile]
                            [--heads 32:8] [--head-dim 128]

For each context T: fp16 ``mx.fast.scaled_dot_product_attention``, mlx-lm's unfused
quantized path on 4-bit K/V, and ours for affine4, mxfp4, turbo0v4 and turbo8v3 (on a
GPU also affine8); B=8, 32 query heads over 8 KV heads, D=128, L=1 (``--heads 9:3
--head-dim 64``: the default model's attention). Ours is, on the CPU,
the full path, the blockwise reference and the CPU kernel (``kvserve.kernels.cpu_attention``,
for the formats it reads; "dispatch" marks the one ``kvserve.kernels.dispatch`` picks at
that T); on an NVIDIA GPU, the CUDA kernels of
``kvserve.kernels.cuda_attention`` (default contexts 1K to 64K there). Columns: median ms,
K/V MiB read, effective GB/s (K/V bytes / time), peak MiB of all live arrays (K/V
included) and the MiB the call added on top, max |ours - family's full-context
reference| (computed on the CPU stream, up to T=8192). The machine's copy bandwidth
(``x + 1`` over 256 MiB) is the ceiling for GB/s. On a GPU with PyTorch installed, PyTorch's
fp16 SDPA is measured first as the reference; ``--profile`` adds the kernels' own device time
per call (``kernel_ms``, ``kernel_GB_s``, ``span_ms``, ``kernels``: ``bench_cases.device_times``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

SCHEMES = ("affine4", "mxfp4", "turbo0v4", "turbo8v3")
GPU_SCHEMES = ("affine4", "affine8", "mxfp4", "turbo0v4", "turbo8v3")
GPU_CONTEXTS = "1024,4096,16384,32768,65536"
GPU_CALLS = 10  # calls evaluated together per timing on a GPU (see bench_cases.measure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvserve bench-attention", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    p.add_argument("--contexts", default="",
                   help=f"comma-separated T values (default 1024,2048,4096; GPU {GPU_CONTEXTS})")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", default="32:8", help="query heads:KV heads (the default model: 9:3)")
    p.add_argument("--head-dim", type=int, default=128, help="D (the default model: 64)")
    p.add_argument("--queries", type=int, default=1,
                   help="queries per row: 1 a decode step, more a prompt chunk over the context")
    p.add_argument("--profile", action="store_true",
                   help="on a GPU, add the kernels' own device time (CUPTI through torch.profiler)")
    return p.parse_args(argv)


def plan(schemes=SCHEMES, device: str = "cpu") -> list[tuple[str, str]]:
    """(scheme, impl) pairs measured at every context, baselines first; on the CPU, the CPU
    kernel too for the formats it reads.

        >>> plan(("affine4", "mxfp4"))[2:]
        [('affine4', 'full'), ('affine4', 'blockwise'), ('affine4', 'cpu'), ('mxfp4', 'full'), ('mxfp4', 'blockwise'), ('fp16', 'cpu')]
        >>> plan(("affine4",), "gpu")
        [('fp16', 'fp16'), ('affine4', 'mlx-lm'), ('affine4', 'cuda')]
    """
    from kvserve.kernels.cpu_attention import reads

    rows = [("fp16", "fp16"), ("affine4", "mlx-lm")]
    for name in schemes:
        if device == "gpu":
            rows.append((name, "cuda"))
            continue
        rows += [(name, "full"), (name, "blockwise")] + ([(name, "cpu")] if reads(*_formats(name)) else [])
    return rows + ([("fp16", "cpu")] if device == "cpu" else [])  # fp16 K/V through the kernel


def run_all(contexts: list[int], batch: int, repeats: int, device: str = "cpu",
            profile: bool = False, heads: tuple[int, int] = (32, 8), head_dim: int = 128,
            queries: int = 1) -> dict:
    import mlx.core as mx
    from kvserve.kernels import bench_cases as bc

    calls = GPU_CALLS if device == "gpu" else 1
    results = {"machine": machine(), "copy_GB_s": bc.copy_bandwidth(calls=calls), "runs": []}
    schemes = GPU_SCHEMES if device == "gpu" else SCHEMES
    from kvserve.kernels.cpu_attention import available

    for T in contexts:
        shape = bc.Shape(batch, *heads, head_dim, T, queries)
        if device == "gpu" and (row := bc.torch_sdpa(shape, repeats, calls)):
            results["runs"].append({"T": T, **row, "dispatch": ""})
        for scheme, impl in plan(schemes, device):
            if impl == "cpu" and not available():
                continue
            case = bc.build_case(scheme, impl, shape)
            row = bc.measure(case, repeats, calls=calls, profile=profile)
            picked = "yes" if _picked(scheme, impl, T, queries) else ""
            results["runs"].append({"T": T, **row, "dispatch": picked})
            mx.clear_cache()  # the next case's peak starts from what it allocates itself
    return results


def _picked(scheme: str, impl: str, T: int, L: int = 1) -> bool:
    """Whether ``kvserve.kernels.dispatch.attend`` runs ``impl`` for this scheme at T."""
    from kvserve.kernels.dispatch import choose
    if impl in ("fp16", "mlx-lm") or scheme == "fp16":  # the fp16 cache picks its path itself
        return False
    picked = choose(*_formats(scheme), L, T)
    return picked.startswith(impl + "-") if impl in ("cuda", "cpu") else picked == impl


def _formats(scheme: str):
    from kvserve.cache.affine import QuantizedFormat
    from kvserve.cache.scheme import parse_scheme
    from kvserve.cache.turbo_codec import make_format
    s = parse_scheme(scheme)
    if s.values.kind in ("turbo", "fp16"):
        return make_format(s.keys, 128), make_format(s.values, 128)
    return QuantizedFormat(s.keys), QuantizedFormat(s.values)


def machine() -> dict:
    import mlx.core as mx
    from kvserve.kernels.dispatch import CPU_FULL_MAX_T
    info = {"cpu": platform.processor() or platform.machine(), "system": platform.system(),
            "python": platform.python_version(), "mlx": mx.__version__,
            "device": str(mx.default_device()), "cpu_full_max_T": CPU_FULL_MAX_T}
    if mx.default_device().type == mx.gpu:
        try:
            info["gpu"] = mx.device_info().get("device_name", "")
        except Exception:  # noqa: BLE001, S110 (the name is a label, not a requirement)
            pass
    return info


def table(results: dict) -> str:
    """Markdown table of ``run_all``'s result."""
    cols = ("T", "name", "dispatch", "ms", "build_ms", "kv_MiB", "GB_s", "peak_MiB", "extra_MiB",
            "max_abs_diff")
    cols += tuple(c for c in ("kernel_ms", "kernel_GB_s", "span_ms", "kernels")
                  if any(c in r for r in results["runs"]))
    lines = [f"machine: {results['machine']}", f"copy bandwidth: {results['copy_GB_s']} GB/s", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results["runs"]:
        lines.append("| " + " | ".join(_fmt(r.get(c, "-")) for c in cols) + " |")
    return "\n".join(lines)


def _fmt(x) -> str:
    return f"{x:.2e}" if isinstance(x, float) and 0 < abs(x) < 1e-2 else str(x)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Before anything imports mlx: its bundled reference BLAS is ~50x slower than OpenBLAS.
    from kvserve.server.models.blas import enable_fast_blas
    enable_fast_blas()
    import mlx.core as mx

    if args.device == "gpu" and not mx.is_available(mx.gpu):
        print("no GPU backend in this MLX build", file=sys.stderr)
        return 2
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    default = GPU_CONTEXTS if args.device == "gpu" else "1024,2048,4096"
    contexts = [int(t) for t in (args.contexts or default).split(",") if t]
    heads = tuple(int(h) for h in args.heads.split(":"))
    results = run_all(contexts, args.batch, args.repeats, args.device, args.profile, heads, args.head_dim,
                      args.queries)
    print(json.dumps(results, indent=1) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
