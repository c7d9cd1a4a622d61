"""Whether a new shape costs a first call more than a repeated one, on MLX's default device.

Decode steps (the default): the first and second call of the dispatch's affine4 attention
for each query dtype, batch size and length (each a new shape family, which compiles the
CUDA attention kernels again if anything does). Shapes as the default model's layers have
them: 9 query heads over 3 KV heads, D = 64.

``--chunks``: a prompt chunk after a cached prefix, as the fp16 cache attends to it
(``cache.fp16.attend_raw``, K/V slices of a buffer with spare room, a causal mask), in
Llama-3-8B's attention shape (32 query heads over 8 KV heads, D = 128, float16): each
(L, T) once, again, and at T + 1 (a new shape, as every admitted request's chunk is). MLX's
CUDA attention builds a cuDNN graph per shape; ``MLX_CUDA_USE_CUDNN_SDPA=0`` in the
environment turns that off for comparison.

    python bench/gpu_first_calls.py            # docs/benchmarks/gpu-serve.md quotes it
    python bench/gpu_first_calls.py --chunks [--queries 20,27,256,1024] [--contexts 4096,14180]
    MLX_CUDA_USE_CUDNN_SDPA=0 python bench/gpu_first_calls.py --chunks
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from kvserve.cache import parse_scheme
from kvserve.cache.affine import QuantizedFormat, quantize_parts
from kvserve.kernels import dispatch


def call_ms(q: mx.array, parts: tuple[mx.array, ...], fmt: QuantizedFormat) -> float:
    mx.eval(q, parts)  # the inputs' own making is not the call's
    start = time.perf_counter()
    mx.eval(dispatch.attend(q, fmt, parts, fmt, parts, 0.125, None))
    return (time.perf_counter() - start) * 1e3


def chunk_ms(L: int, T: int, capacity: int) -> float:
    """One fp16 prompt chunk of ``L`` queries over ``T`` stored tokens, evaluated."""
    from kvserve.cache.fp16 import attend_raw

    q = mx.random.normal((1, 32, L, 128)).astype(mx.float16)
    k, v = (mx.random.normal((1, 8, capacity, 128)).astype(mx.float16)[:, :, :T] for _ in range(2))
    mx.eval(q, k, v)
    start = time.perf_counter()
    mx.eval(attend_raw(q, k, v, 128 ** -0.5, "causal"))
    return (time.perf_counter() - start) * 1e3


def chunks(queries: list[int], contexts: list[int]) -> None:
    print(f"device: {mx.default_device()}; fp16 prompt chunks, 32 query heads over 8 KV heads, D = 128")
    for L in queries:
        for T in contexts:
            capacity = -(-(T + 2) // 256) * 256  # the cache's buffer: room in whole granules
            times = [chunk_ms(L, T, capacity), chunk_ms(L, T, capacity), chunk_ms(L, T + 1, capacity)]
            print(f"L={L} T={T}: first {times[0]:.1f} ms, again {times[1]:.1f} ms, "
                  f"at T + 1 (a new shape) {times[2]:.1f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", action="store_true", help="fp16 prompt chunks instead of decode steps")
    p.add_argument("--queries", default="", help="--chunks: query rows per chunk (default 20,27,256,1024; "
                                                 "on a CPU 20,27,256)")
    p.add_argument("--contexts", default="4096,14180", help="--chunks: stored tokens T")
    a = p.parse_args()
    if a.chunks:
        default = "20,27,256,1024" if mx.default_device() == mx.gpu else "20,27,256"
        return chunks([int(v) for v in (a.queries or default).split(",")], [int(v) for v in a.contexts.split(",")])
    scheme = parse_scheme("affine4")
    fmt = QuantizedFormat(scheme.keys)
    print(f"device: {mx.default_device()}")
    for dtype in (mx.bfloat16, mx.float16):
        for B in (1, 2, 3, 5, 8):
            for T in (300, 301):
                q = mx.random.normal((B, 9, 1, 64)).astype(dtype)
                parts = tuple(quantize_parts(mx.random.normal((B, 3, T, 64)).astype(dtype), scheme.keys))
                first, second = call_ms(q, parts, fmt), call_ms(q, parts, fmt)
                print(f"{dtype} B={B} T={T}: first {first:.1f} ms, second {second:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
