"""Per-layer chains of MLX operations as one CPU operation each (``cpu_ops.cpp``).

On the CPU ``mx.fast.rms_norm`` and ``mx.fast.rope`` run their fallbacks, chains of eleven
and (gathering per-row positions from a cos/sin table) nineteen operations; ``nn.Linear`` is
a transpose, flatten, matmul and unflatten; TurboQuant's value encoding some 25 operations.
A decode step of one row pays MLX's cost per operation, which hardly depends on its size
(``bench/step_profile.py --mlx-layer-ops`` shows it), and these chains were most of the ~120
operations of a layer of the default model (``bench/step_profile.py`` counts them). The
primitives here compute the same values, row by row, so a row's result does not depend on
its batch:

* ``rms_norm`` and ``table_rope`` (used by ``server/engine/fastpath.py``);
* ``linear``: the same ``cblas_sgemm`` call MLX's matmul makes, through the BLAS shim, so
  decode products still read the packed codes;
* ``turbo_encode``: ``TurboCodec.encode`` on the Walsh-Hadamard path (``cache/turbo_codec.py``).

They take float32 only; every other call returns None, and the caller keeps the MLX path,
as it does where the extension cannot be built (``available()``).

Example (the primitive equals the fallback within float rounding):
    >>> x, w = mx.random.normal((2, 3, 64)), mx.random.normal((64,))
    >>> got = rms_norm(x, w, 1e-5) if available() else mx.fast.rms_norm(x, w, 1e-5)
    >>> bool(mx.allclose(got, mx.fast.rms_norm(x, w, 1e-5), atol=1e-5))
    True
"""

from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
from kvserve.kernels import cpu_build

_NAME = "kvserve_cpu_ops"
_SOURCE = Path(__file__).with_name("cpu_ops.cpp")


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
    """``mx.fast.rms_norm(x, weight, eps)`` as one operation; None where it does not serve
    (not float32, a weight that is not one vector over the last axis: checked in C++, as
    this runs twice per layer and token)."""
    return _module().rms_norm(x, weight, eps)


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array | None:
    """``x @ weight.T (+ bias)`` as one operation through the BLAS shim's ``cblas_sgemm``
    (the call MLX's matmul makes, so decode products still read the packed codes); None
    where it does not serve (not float32, shapes that do not match, the shim not in use, a
    weight that is a view or not evaluated: checked in C++)."""
    return _module().linear(x, weight, bias)


def swiglu(gate: mx.array, up: mx.array) -> mx.array | None:
    """``silu(gate) * up`` (mlx-lm's ``swiglu``) with a vectorized exp; None where it does not
    serve (not float32, shapes that differ: checked in C++, as this runs once per layer and
    token)."""
    return _module().swiglu(gate, up)


def turbo_encode(x: mx.array, pi: mx.array, boundaries: mx.array, bits: int,
                 eps: float) -> tuple[mx.array, mx.array] | None:
    """TurboQuant's uncalibrated encoding of (..., D) vectors rotated by ``pi`` (D, D):
    (packed indices (..., ceil(D * bits / 32)) uint32, norms (..., 1) float32), as
    ``TurboCodec.encode`` computes them on the Walsh-Hadamard path; None where it does not
    serve. Half-precision vectors (K/V in a model's activation dtype) are widened first,
    as the codec's own operations widen them."""
    if x.dtype not in (mx.float32, mx.float16, mx.bfloat16) or pi.dtype != mx.float32 \
            or pi.shape != (x.shape[-1],) * 2 or not 1 <= bits <= 8:
        return None
    x = x.astype(mx.float32)
    packed, norms = _module().turbo_encode(x, pi, boundaries.astype(mx.float32), bits, eps)
    return packed, norms


def table_rope(x: mx.array, cos: mx.array, sin: mx.array, offsets: mx.array, dims: int,
               limit: int) -> mx.array | None:
    """RoPE of (B, H, L, D) ``x`` from (P, dims) tables (``fastpath._Table``'s layout), row b
    at positions ``offsets[b] + l`` clamped to ``[0, limit - 1]`` (a left-padded prefill row
    starts below 0); None where it does not serve (checked in C++, as this runs twice per
    layer and token)."""
    return _module().table_rope(x, cos, sin, offsets, dims, limit)


@functools.cache
def available() -> bool:
    """True when the extension is built (or was before) and loads into this MLX, and the
    default device is the CPU (on a GPU the fast operations are kernels already)."""
    return mx.default_device() == mx.cpu and cpu_build.loads(_NAME, _SOURCE, "CPU layer primitives")


_MODULE = None


def _module():
    global _MODULE  # looked up several times per layer and token
    if _MODULE is None:
        _MODULE = cpu_build.load(_NAME, _SOURCE)
    return _MODULE
