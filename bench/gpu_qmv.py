"""The decode step's weight products on an NVIDIA GPU: kvserve's few-rows kernel at each
count of warps per block against MLX's ``quantized_matmul``, per weight shape and row count.

    python bench/gpu_qmv.py --shapes 8b --rows 2,4,8          # docs/benchmarks/gpu-serve.md quotes it
    python bench/gpu_qmv.py --shapes default --splits 2,4

The shapes are a model's projections as the CUDA profile serves them (``fused_projections``
stacks q/k/v and gate/up): ``8b`` is Llama-3-8B's (4-bit, groups of 64, the 49152-row head of
``bench/shaped_model.py``), ``default`` the served default model's (4-bit, groups of 32; its
head is the tied embedding, which MLX multiplies). Columns: the device's own time per product
(CUPTI's kernel records through PyTorch, the mean over ``--calls`` products), the weights'
bytes over that time, and the largest difference from a float32 product of the same
quantized weights. Without PyTorch the times are wall clock per product of ``--calls``
products evaluated together.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from kvserve.kernels import cuda_qmv
from kvserve.kernels.bench_cases import kernel_records

SHAPES = {  # name -> (group, [(projection, K, N)])
    "8b": (64, [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
                ("down", 14336, 4096), ("head", 4096, 49152)]),
    "default": (32, [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]),
}


def device_us(run, calls: int) -> float:
    """Mean device time of one of ``calls`` products (wall clock without CUPTI)."""
    mx.eval(run())
    records = kernel_records(lambda: mx.eval([run() for _ in range(calls)]))
    if records:  # every kernel of the products: MLX may launch more than one per product
        return sum(end - start for _, start, end in records) / calls
    t0 = time.perf_counter()
    mx.eval([run() for _ in range(calls)])
    return (time.perf_counter() - t0) / calls * 1e6


def rows_of(shape: tuple[str, int, int], group: int, rows: list[int], splits: list[int],
            bits: int, calls: int, dequantized: bool = False) -> list[dict]:
    name, K, N = shape
    key = mx.random.key(sum(shape[1:]))
    w = (mx.random.normal((N, K), key=key) * 0.05).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    weight_bytes = wq.nbytes + s.nbytes + b.nbytes
    mx.eval(wq, s, b)
    out = []
    for M in rows:
        x = (mx.random.normal((M, K), key=mx.random.key(M)) * 0.5).astype(mx.float16)
        ref = x.astype(mx.float32) @ mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32).T
        impls = {"mlx": lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)}
        if dequantized:  # the weights decoded to x's dtype, then MLX's dense matmul (a prompt's path?)
            impls["mlx dequantize + matmul"] = lambda: x @ mx.dequantize(wq, s, b, group_size=group, bits=bits).T
        kernel_takes = cuda_qmv.serves_weights(wq, s, group, bits, "affine") and M <= cuda_qmv.MAX_ROWS
        if cuda_qmv.on_cuda() and kernel_takes:
            tiles = cuda_qmv.tiles_for(M)
            default = cuda_qmv.split_for(K, N, bits, tiles)
            for split in [n for n in splits if n * tiles <= cuda_qmv.MAX_SPLIT_TILES]:
                impls[f"kvserve {split} warps" + (" (default)" if split == default else "")] = (
                    lambda n=split: cuda_qmv.quantized_matmul(x, wq, s, b, group, bits, split=n))
        for impl, run in impls.items():
            us = device_us(run, calls)
            diff = mx.abs(run().astype(mx.float32) - ref).max().item()
            out.append({"shape": f"{name} {K}x{N}", "rows": M, "impl": impl, "us": round(us, 1),
                        "GB_s": round(weight_bytes / (us * 1e3), 1), "max_diff": round(diff, 4)})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="8b")
    p.add_argument("--rows", default="2,4,8",
                   help="comma-separated activation rows (at 1 the server keeps MLX's kernel for "
                        "matrices under cuda_qmv.ONE_ROW_WEIGHTS values)")
    p.add_argument("--splits", default=",".join(map(str, cuda_qmv.SPLITS)),
                   help="warps per block of kvserve's kernel, comma-separated")
    p.add_argument("--bits", type=int, default=4, choices=cuda_qmv.BITS)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--dequantized", action="store_true",
                   help="also time the weights dequantized then MLX's dense matmul")
    a = p.parse_args(argv)
    group, shapes = SHAPES[a.shapes]
    splits = [int(v) for v in a.splits.split(",")]
    rows = [int(v) for v in a.rows.split(",")]
    print(f"device: {mx.default_device()}; {a.shapes} shapes, {a.bits}-bit weights in groups of {group}, "
          f"mean of {a.calls} products")
    print("| shape | rows | impl | device us | weights GB/s | max diff |\n|---|---|---|---|---|---|")
    for shape in shapes:
        for r in rows_of(shape, group, rows, splits, a.bits, a.calls, a.dequantized):
            print(f"| {r['shape']} | {r['rows']} | {r['impl']} | {r['us']} | {r['GB_s']} | {r['max_diff']} |")


if __name__ == "__main__":
    main()
