"""Quantized linears that multiply a decode step's few rows with kvserve's CUDA kernel.

A decode step runs every projection on one row of activations per running request. On
NVIDIA GPUs MLX serves more than one row with a tiled GEMM that reads the weights at a few
percent of the card's bandwidth (``kvserve.kernels.cuda_qmv`` has the figures); this
rewrite (``few_rows_qmv``, in the CUDA device profile) sends the products of a decode
step's rows and short prompt chunks (``cuda_qmv.serves_rows``: 2 to ``MAX_ROWS``, one row
too for a large matrix) to ``cuda_qmv``'s tensor-core kernel, prompt chunks of
``DENSE_ROWS`` rows or more to a dense product of the weights dequantized for the call,
and everything else (chunks in between, unsupported formats) to MLX's quantized GEMM.
Only each module's class changes: its weights and parameters stay (a long chunk's
dequantized matrix lives for its product only), so the rewrite composes with
``fused_projections`` (run after it, it takes the stacked linears too).

    >>> import mlx.nn as nn
    >>> m = nn.Sequential(nn.QuantizedLinear(64, 32, bits=4, group_size=64), nn.Linear(4, 4))
    >>> m.set_dtype(mx.float16)  # a loaded model's scales are in its activation dtype
    >>> takes(m.layers[0]), takes(m.layers[1])
    (True, False)
    >>> install_few_rows(m) == (1 if cuda_qmv.on_cuda() else 0)  # a CUDA GPU's kernel only
    True
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kvserve.kernels import cuda_qmv


# From this many rows a prompt chunk's product is faster with the weights dequantized to the
# activations' dtype and multiplied densely than through MLX's quantized GEMM. Device time
# on an H100, Llama-3-8B's 4-bit shapes (docs/benchmarks/gpu-serve.md, thirteenth round):
# at 128 rows the dense product lost on the two widest matrices (gate/up 389 against 329 us,
# head 672 against 484), at 192 it tied or won on all five, at 256 it won 1.3-2.3x, at
# 2048 3.2-3.8x (gate/up 952 against 3507 us).
DENSE_ROWS = 192


class FewRowsQuantizedLinear(nn.QuantizedLinear):
    """An ``nn.QuantizedLinear`` whose products of few rows run on ``cuda_qmv`` and whose
    long prompt chunks (``DENSE_ROWS`` rows or more) on the weights dequantized for the
    call: a transient copy of one matrix in the activations' dtype."""

    def __call__(self, x: mx.array) -> mx.array:
        w, scales = self["weight"], self["scales"]
        rows = x.size // max(x.shape[-1], 1)
        # The default device is one for the whole process, and ``with mx.stream(mx.cpu)``
        # in another thread (a kernel's self-check against the CPU reference) moves it for
        # a moment: a forward then running here must not launch a GPU-only kernel.
        if mx.default_device() == mx.gpu and cuda_qmv.serves_rows(x, scales, w.size * 32 // self.bits):
            y = cuda_qmv.quantized_matmul(x, w, scales, self["biases"], self.group_size, self.bits)
        elif rows >= DENSE_ROWS and x.dtype == scales.dtype:
            y = x @ mx.dequantize(w, scales, self["biases"], group_size=self.group_size, bits=self.bits).T
        else:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


# MLX's CUDA quantized matmul compiles one kernel per row tile of each weight format: 16, 32
# or 64 rows (the rows' next power of two, clamped), and which kernel family serves a weight
# depends on its shape too (its tensor-core GEMM wants N a multiple of 128). Products of up
# to ``MAX_ROWS`` rows are served here, so MLX's only tile left is the 64-row one (chunks
# below ``DENSE_ROWS``); kvserve's kernel compiles once per count of column tiles, and the
# dense path compiles MLX's dequantization. All are compiled at install, so that no prompt
# chunk of a length the warm-up's prompts did not have compiles one while its request waits.
MLX_TILE_ROWS = 64
TILE_ROWS = tuple(8 * t for t in (1, 2, 4, 8))  # one product per kvserve kernel (tiles_for)


def install_few_rows(model: nn.Module) -> int:
    """Give every ``nn.QuantizedLinear`` of ``model`` whose weights ``cuda_qmv`` takes the
    few-rows path, and compile both kernels for their formats and shapes; returns how many."""
    if not cuda_qmv.on_cuda():
        return 0
    taken = [module for _, module in model.named_modules() if takes(module)]
    for module in taken:
        module.__class__ = FewRowsQuantizedLinear
    compile_products(taken)
    return len(taken)


def compile_products(modules: list[nn.QuantizedLinear]) -> None:
    """One product per weight format and shape (a model has a handful: one per kind of
    projection) at MLX's 64-row tile, at each of kvserve's column-tile counts and on the
    dense path."""
    formats = {}
    for m in modules:
        formats.setdefault((m.bits, m.group_size, m.mode, m["scales"].dtype, m["weight"].shape), m)
    out = []
    for m in formats.values():
        x = mx.zeros((DENSE_ROWS, m["weight"].shape[1] * 32 // m.bits), m["scales"].dtype)
        out.append(nn.QuantizedLinear.__call__(m, x[:MLX_TILE_ROWS]))
        out.extend(m(x[:rows]) for rows in (*TILE_ROWS, DENSE_ROWS))
    mx.eval(out)


def takes(module: nn.Module) -> bool:
    """A plain ``nn.QuantizedLinear`` with weights ``cuda_qmv`` multiplies."""
    return (type(module) is nn.QuantizedLinear and "biases" in module and cuda_qmv.serves_weights(
        module["weight"], module["scales"], module.group_size, module.bits, module.mode))
