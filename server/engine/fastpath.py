"""Cheaper per-token work for mlx-lm models on the CPU, without forking them.

* :func:`install_table_rope` swaps every plain ``nn.RoPE`` for :class:`TableRoPE`,
  which reads cos/sin from a table shared by all layers.  On the CPU
  ``mx.fast.rope`` recomputes its frequencies and angles on every call: ~55 us
  per call, twice per layer per token (3.3 ms of a ~35 ms decode step for a
  30-layer model); the table version costs ~23 us.
* :func:`install_cpu_ops` makes each plain ``nn.RMSNorm`` one CPU operation instead of
  the eleven of ``mx.fast.rms_norm``'s fallback, each ``nn.Linear`` one instead of four,
  and a SwiGLU MLP's activation a vectorized one; with the table, a RoPE is one operation
  too (``kernels/cpu_ops``).
* :func:`last_logits` runs a prefill chunk but applies the output projection to
  the last position only: calling the model computes logits for every prompt
  token (a 512x49152x576 product for a 512-token chunk of SmolLM2) that are
  thrown away.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from kvserve.kernels import cpu_ops
from mlx_lm.models.activations import swiglu


class _Table:
    """cos/sin of position * frequency for rows 0..n-1, grown on demand and
    computed in float64 so the table is at least as exact as mx.fast.rope."""

    def __init__(self, dims: int, base: float, scale: float):
        self.dims, self.base, self.scale = dims, base, scale
        self.cos = self.sin = mx.zeros((0, dims))

    def rows(self, offset: int, n: int) -> tuple[mx.array, mx.array]:
        self.cover(offset + n)
        return self.cos[offset : offset + n], self.sin[offset : offset + n]

    def cover(self, n: int) -> None:
        """Grow the table to at least ``n`` rows."""
        if n > self.cos.shape[0]:
            self._grow(max(4096, 1 << math.ceil(math.log2(n))))

    def _grow(self, n: int) -> None:
        half = self.dims // 2
        inv = self.base ** (-np.arange(half, dtype=np.float64) / half)
        ang = (np.arange(n, dtype=np.float64) * self.scale)[:, None] * inv[None]
        cos, sin = np.cos(ang), np.sin(ang)
        # Laid out so that rope(x) = x * cos + rotate_half(x) * sin, with
        # rotate_half(x) = [x2, x1] and the sign folded into the sin table.
        self.cos = mx.array(np.concatenate([cos, cos], -1).astype(np.float32))
        self.sin = mx.array(np.concatenate([-sin, sin], -1).astype(np.float32))
        mx.eval(self.cos, self.sin)


_TABLES: dict[tuple[int, float, float], _Table] = {}


class TableRoPE(nn.Module):
    """Drop-in for a non-traditional ``nn.RoPE`` (same arguments, same result
    within float32 rounding), computed from a shared cos/sin table.

    Per-sequence offsets (a batch cache's ``offset`` array) gather each row's positions from
    the table when it covers ``positions`` (the model's context, which no request passes);
    on the CPU ``mx.fast.rope`` with an offset array is a chain of some 15 operations with
    sin and cos per call. Without ``positions`` such calls keep ``mx.fast.rope``."""

    def __init__(self, dims: int, base: float = 10000.0, scale: float = 1.0, positions: int = 0):
        super().__init__()
        self.dims, self.base, self.scale = dims, base, scale
        key = (dims, float(base), float(scale))
        self._table = _TABLES.setdefault(key, _Table(*key))
        self._positions = positions
        if positions:
            self._table.cover(positions)  # grown once, here, so every gather stays inside

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        fused = self._fused(x, offset)
        if fused is not None:
            return fused
        if not isinstance(offset, int):  # per-sequence offsets (batched caches)
            if not self._positions:
                return mx.fast.rope(x, self.dims, traditional=False, base=self.base,
                                    scale=self.scale, offset=offset)
            rows = offset.reshape(-1, 1) + mx.arange(x.shape[-2])  # (B, L) positions
            # Never read outside the table: a left-padded prefill row starts below 0.
            rows = mx.clip(rows, 0, self._positions - 1)
            cos = mx.take(self._table.cos, rows, axis=0)[:, None]  # (B, 1, L, dims)
            sin = mx.take(self._table.sin, rows, axis=0)[:, None]
        else:
            cos, sin = self._table.rows(offset, x.shape[-2])
        d, h = self.dims, self.dims // 2
        rot, rest = (x, None) if x.shape[-1] == d else (x[..., :d], x[..., d:])
        out = rot * cos + mx.concatenate([rot[..., h:], rot[..., :h]], -1) * sin
        if rest is not None:
            out = mx.concatenate([out, rest], -1)
        return out if out.dtype == x.dtype else out.astype(x.dtype)

    def _fused(self, x: mx.array, offset) -> mx.array | None:
        """The same rotation as one CPU operation (``kernels/cpu_ops``), where it serves."""
        if not cpu_ops.available():
            return None
        if isinstance(offset, int):
            self._table.cover(offset + x.shape[-2])  # no row is clamped
            offsets, limit = mx.array([offset], dtype=mx.int32), self._table.cos.shape[0]
        elif self._positions:
            offsets, limit = offset.reshape(-1), self._positions
        else:
            return None
        return cpu_ops.table_rope(x, self._table.cos, self._table.sin, offsets, self.dims, limit)


# Positions a table is grown to for batched calls, at most: 65536 x 128 dims is 64 MiB of
# cos/sin. Models with a longer context keep mx.fast.rope for those calls.
MAX_TABLE_POSITIONS = 1 << 16


def install_table_rope(model: nn.Module, context: int = 0) -> int:
    """Replace each plain non-traditional ``nn.RoPE`` in ``model`` by a
    :class:`TableRoPE`; returns how many were replaced.  Scaled variants
    (Llama 3, YaRN, ...) are other classes and are left alone. ``context``: the longest
    sequence served, for which batched calls gather their rows (0, or more than
    ``MAX_TABLE_POSITIONS``: batched calls keep ``mx.fast.rope``)."""
    positions = context if 0 < context <= MAX_TABLE_POSITIONS else 0
    count = 0
    for _, module in model.named_modules():
        for name, child in module.children().items():
            if type(child) is nn.RoPE and not child.traditional and child.dims % 2 == 0:
                setattr(module, name, TableRoPE(child.dims, child.base, child.scale, positions))
                count += 1
    return count


class CpuRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed as one CPU operation (``kernels/cpu_ops``) where that serves:
    the fallback of ``mx.fast.rms_norm`` on the CPU is a chain of eleven operations."""

    def __call__(self, x: mx.array) -> mx.array:
        fused = cpu_ops.rms_norm(x, self["weight"], self.eps)
        return super().__call__(x) if fused is None else fused


class CpuLinear(nn.Linear):
    """``nn.Linear`` as one CPU operation where that serves, instead of MLX's transpose,
    flatten, matmul and unflatten; the same ``cblas_sgemm`` call computes it."""

    def __call__(self, x: mx.array) -> mx.array:
        fused = cpu_ops.linear(x, self["weight"], self.get("bias"))
        return super().__call__(x) if fused is None else fused


def _swiglu_call(self, x: mx.array) -> mx.array:
    gate, up = self.gate_proj(x), self.up_proj(x)
    fused = cpu_ops.swiglu(gate, up)
    return self.down_proj(swiglu(gate, up) if fused is None else fused)


# mlx-lm MLP classes checked to compute exactly down_proj(swiglu(gate_proj(x), up_proj(x))).
_SWIGLU_MLPS = {f"mlx_lm.models.{name}" for name in ("llama", "qwen2", "qwen3", "olmo2", "granite")}
_CPU_CLASSES: dict[type, type] = {nn.RMSNorm: CpuRMSNorm, nn.Linear: CpuLinear}


def _cpu_class(cls: type) -> type | None:
    if cls in _CPU_CLASSES:
        return _CPU_CLASSES[cls]
    if cls.__name__ == "MLP" and cls.__module__ in _SWIGLU_MLPS:
        return _CPU_CLASSES.setdefault(cls, type(f"Cpu{cls.__name__}", (cls,), {"__call__": _swiglu_call}))
    return None


def install_cpu_ops(model: nn.Module) -> int:
    """Make each plain ``nn.RMSNorm`` and ``nn.Linear`` of ``model``, and each SwiGLU MLP of
    the mlx-lm classes checked, its one-operation CPU subclass (same parameters, same
    values) when the CPU primitives serve; returns how many. Other classes (Gemma's
    ``1 + weight`` norm, quantized and sharded linears, ...) keep their own code."""
    if not cpu_ops.available():
        return 0
    count = 0
    for _, module in model.named_modules():
        cls = _cpu_class(type(module))
        if cls is not None:
            module.__class__ = cls
            count += 1
    return count


def apply_rewrites(model: nn.Module, rewrites: tuple[str, ...], context: int = 0) -> dict[str, int]:
    """Apply the named rewrites (a device profile's ``rewrites``: "table_rope", "cpu_ops",
    "fused_projections", "few_rows_qmv"), in order, to ``model``; returns how many modules (or groups) each replaced.

        >>> apply_rewrites(nn.Sequential(nn.RoPE(8)), ())
        {}
    """
    from kvserve.server.engine.few_rows import install_few_rows
    from kvserve.server.engine.projections import fuse_projections

    installers = {"table_rope": lambda: install_table_rope(model, context), "cpu_ops": lambda: install_cpu_ops(model),
                  "fused_projections": lambda: fuse_projections(model),
                  "few_rows_qmv": lambda: install_few_rows(model)}
    unknown = set(rewrites) - set(installers)
    if unknown:
        raise ValueError(f"unknown rewrites {sorted(unknown)}; known: {sorted(installers)}")
    return {name: installers[name]() for name in rewrites}


def last_logits(model: nn.Module, tokens: mx.array, cache) -> mx.array:
    """Logits of the last position only, shape (B, vocab), for ``tokens`` of
    shape (B, L); extends ``cache`` exactly as ``model(tokens, cache=cache)``.

    Done for the mlx-lm model classes whose forward is exactly that; any
    other model falls back to the full call (same result, more work).
    """
    inner = getattr(model, "model", None)
    if inner is None or not _plain_head(model):
        return model(tokens, cache=cache)[:, -1, :]
    hidden = inner(tokens, cache=cache)[:, -1:, :]
    # The same choice as the model's own __call__.
    if model.args.tie_word_embeddings:
        return inner.embed_tokens.as_linear(hidden)[:, -1, :]
    return model.lm_head(hidden)[:, -1, :]


def _plain_head(model: nn.Module) -> bool:
    """True when the model's __call__ is the plain ``head(model.model(x))``
    (no logit soft-capping or scaling): the mlx-lm classes checked to be so."""
    return type(model).__module__ in {f"mlx_lm.models.{n}" for n in ("llama", "qwen2", "qwen3")}
