"""Quantized linears that multiply a decode step's few rows with kvserve's CUDA kernel.

A decode step runs every projection on one row of activations per running request. On
NVIDIA GPUs MLX serves more than one row with a tiled GEMM that reads the weights at a few
percent of the card's bandwidth (``kvserve.kernels.cuda_qmv`` has the figures); this
rewrite (``few_rows_qmv``, in the CUDA device profile) sends the products of a decode
step's rows (``cuda_qmv.serves_rows``: 2 to ``MAX_ROWS``, one row too for a large matrix)
to ``cuda_qmv``'s tensor-core kernel and everything else (prompt chunks, unsupported
formats) to MLX as before. Only each module's class changes: its weights and parameters
stay, so the rewrite adds no memory and composes with ``fused_projections`` (run after it,
it takes the stacked linears too).

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


class FewRowsQuantizedLinear(nn.QuantizedLinear):
    """An ``nn.QuantizedLinear`` whose products of few rows run on ``cuda_qmv``."""

    def __call__(self, x: mx.array) -> mx.array:
        if not cuda_qmv.serves_rows(x, self["scales"], self["weight"].size * 32 // self.bits):
            return super().__call__(x)
        y = cuda_qmv.quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                                      self.group_size, self.bits)
        return y + self["bias"] if "bias" in self else y


# MLX's CUDA quantized matmul compiles one kernel per row tile of each weight format: 16, 32
# or 64 rows (the rows' next power of two, clamped), and which kernel family serves a weight
# depends on its shape too (its tensor-core GEMM wants N a multiple of 128). Products of 2-8
# rows used to compile the 16-row tiles; served here, they no longer do, and a prompt chunk of
# 9-32 tokens then compiled a tile while its request waited (the warm-up's prompts need not
# have that length).
MLX_TILE_ROWS = (16, 32, 64)


def install_few_rows(model: nn.Module) -> int:
    """Give every ``nn.QuantizedLinear`` of ``model`` whose weights ``cuda_qmv`` takes the
    few-rows path, and compile MLX's kernel at each row tile for their formats (what the rest
    of their products run on); returns how many."""
    if not cuda_qmv.on_cuda():
        return 0
    taken = [module for _, module in model.named_modules() if takes(module)]
    for module in taken:
        module.__class__ = FewRowsQuantizedLinear
    compile_mlx_tiles(taken)
    return len(taken)


def compile_mlx_tiles(modules: list[nn.QuantizedLinear]) -> None:
    """One MLX product at each of ``MLX_TILE_ROWS`` per weight format and shape (a model has a
    handful: one per kind of projection)."""
    formats = {}
    for m in modules:
        formats.setdefault((m.bits, m.group_size, m.mode, m["scales"].dtype, m["weight"].shape), m)
    for m in formats.values():
        x = mx.zeros((max(MLX_TILE_ROWS), m["weight"].shape[1] * 32 // m.bits), m["scales"].dtype)
        mx.eval([nn.QuantizedLinear.__call__(m, x[:rows]) for rows in MLX_TILE_ROWS])


def takes(module: nn.Module) -> bool:
    """A plain ``nn.QuantizedLinear`` with weights ``cuda_qmv`` multiplies."""
    return (type(module) is nn.QuantizedLinear and "biases" in module and cuda_qmv.serves_weights(
        module["weight"], module["scales"], module.group_size, module.bits, module.mode))
