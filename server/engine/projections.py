"""Projections of one input as one matmul: a layer's q, k and v (and an MLP's gate and up)
computed by a single linear over their weights stacked, each projection a slice of it.

On a GPU a small model's decode step is bound by the host launching kernels (~13 us each
on an H100 through MLX's CUDA backend, docs/benchmarks/gpu-serve.md), not by the device:
three projections are three kernels where one does the same arithmetic. This rewrite
takes a llama-style layer from five projection kernels (q, k, v, gate, up) to two,
without forking the model's code: the modules named ``q_proj``, ``k_proj`` and ``v_proj``
stay, each now a ``ProjectionPart`` that slices the shared product of the input it is
called with (computed by whichever part is called first).

    >>> import mlx.core as mx, mlx.nn as nn
    >>> attn = nn.Module()
    >>> attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
    >>> x = mx.ones((1, 2, 8))
    >>> before = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    >>> fuse_projections(attn)
    1
    >>> after = [attn.v_proj(x), attn.q_proj(x), attn.k_proj(x)]          # any order
    >>> [a.shape for a in after], all(mx.allclose(b, a).item() for b, a in zip(before, after[1:] + after[:1]))
    ([(1, 2, 4), (1, 2, 8), (1, 2, 4)], True)

Only plain ``nn.Linear`` and ``nn.QuantizedLinear`` siblings with one input width (and one
quantization) are stacked; sharded and CPU-specific linears keep their own code. The
stacked weights replace the separate ones (no memory is added). A layer that calls only
some parts computes the others' columns for nothing: the KV-shared layers of Gemma 3n and
Gemma 4 call ``q_proj`` alone (correct, a little slower there).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# Sibling projections of one input, in the order they are stacked.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedProduct:
    """The product of the stacked linear with the latest input, kept until every part has
    taken its slice (then dropped, so no activation outlives its step)."""

    def __init__(self, linear: nn.Module, widths: list[int]):
        self.linear = linear
        self.bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
        self._input: mx.array | None = None
        self._product: mx.array | None = None
        self._taken: set[int] = set()

    def slice(self, x: mx.array, index: int) -> mx.array:
        if x is not self._input or index in self._taken:
            self._input, self._product, self._taken = x, self.linear(x), set()
        out = self._product[..., self.bounds[index] : self.bounds[index + 1]]
        self._taken.add(index)
        if len(self._taken) == len(self.bounds) - 1:
            self._input = self._product = None
        return out


class ProjectionPart(nn.Module):
    """One projection's columns of a ``SharedProduct``. The first part of a group holds the
    stacked linear as its child (``fused``), so the model's parameters count it once."""

    def __init__(self, shared: SharedProduct, index: int):
        super().__init__()
        if index == 0:
            self.fused = shared.linear
        self._shared, self._index = shared, index

    def __call__(self, x: mx.array) -> mx.array:
        return self._shared.slice(x, self._index)


def _stackable(linears: list[nn.Module]) -> bool:
    kinds = {type(m) for m in linears}
    if len(kinds) != 1 or kinds.pop() not in (nn.Linear, nn.QuantizedLinear):
        return False
    if len({m.weight.shape[1] for m in linears}) != 1 or len({"bias" in m for m in linears}) != 1:
        return False
    if isinstance(linears[0], nn.QuantizedLinear):
        return len({(m.group_size, m.bits, m.mode) for m in linears}) == 1
    return len({m.weight.dtype for m in linears}) == 1


def _stack(linears: list[nn.Module]) -> nn.Module:
    first = linears[0]
    stacked = type(first).__new__(type(first))
    nn.Module.__init__(stacked)
    for key in ("weight", "scales", "biases", "bias"):
        if key in first:
            stacked[key] = mx.concatenate([m[key] for m in linears], axis=0)
    for attr in ("group_size", "bits", "mode"):
        if hasattr(first, attr):
            setattr(stacked, attr, getattr(first, attr))
    if isinstance(first, nn.QuantizedLinear):
        stacked.freeze()
    return stacked


def _widths(linears: list[nn.Module]) -> list[int]:
    return [m.weight.shape[0] for m in linears]


def fuse_projections(model: nn.Module) -> int:
    """Stack each group of sibling projections (``GROUPS``) of ``model`` into one linear;
    returns how many groups were stacked."""
    count = 0
    for _, module in model.named_modules():
        for names in GROUPS:
            linears = [module.get(n) if isinstance(module, dict) else None for n in names]
            if any(m is None for m in linears) or not _stackable(linears):
                continue
            shared = SharedProduct(_stack(linears), _widths(linears))
            for i, name in enumerate(names):
                setattr(module, name, ProjectionPart(shared, i))
            count += 1
    return count
