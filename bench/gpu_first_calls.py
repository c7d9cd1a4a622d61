"""Whether a new shape of a decode step compiles the CUDA attention kernels again: the first
and second call of the dispatch's affine4 attention for each query dtype, batch size and
length (each a new shape family), on MLX's default device.

    python bench/gpu_first_calls.py            # docs/benchmarks/gpu-serve.md quotes it

Shapes as the default model's layers have them: 9 query heads over 3 KV heads, D = 64.
"""

from __future__ import annotations

import time

import mlx.core as mx

from kvserve.cache import parse_scheme
from kvserve.cache.affine import QuantizedFormat, quantize_parts
from kvserve.kernels import dispatch


def call_ms(q: mx.array, parts: tuple[mx.array, ...], fmt: QuantizedFormat) -> float:
    start = time.perf_counter()
    mx.eval(dispatch.attend(q, fmt, parts, fmt, parts, 0.125, None))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
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
