"""Decode products that read the model's packed 4- or 8-bit codes instead of its dense weights.

A quantized model served as dense float32 (``weights.py``: the fastest format for prefill on
a CPU) streams 8x the bytes it stores on every decode step, and a decode step of a small
model on a CPU is bound by that stream: SmolLM2-135M's 540 MB of float32 weights take
~33 ms per step on a 2-core VM, where its 4-bit codes are ~100 MB. So each dense weight keeps
the codes it was dequantized from, registered with the BLAS shim (``blas_shim.c``): a product
of at most 16 activation rows against a registered weight reads the codes and dequantizes
them in registers (the same ``scale * q + bias`` values); prefill chunks keep the dense
float32 gemm.

Registration lives as long as the module that owns the weight: the module holds a
:class:`PackedCodes`, whose finalizer unregisters the weight before its codes are freed,
and which holds the dense weight itself, so its address is never reused while registered.

Example (a 4-bit layer; the packed product equals the dense one within float rounding):
    >>> import mlx.core as mx, mlx.nn as nn
    >>> q = nn.QuantizedLinear(64, 48, bits=4, group_size=32)
    >>> dense = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=4)
    >>> layout = codes_layout(q)
    >>> layout.codes.shape, layout.scales.shape  # 32 weights in 16 bytes; a scale per group
    ((48, 32), (48, 2))
    >>> bool(np.allclose(layout.dense(), np.array(dense), atol=1e-6))
    True
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

ROWS = 16  # the shim's SMALL_M: products of more rows keep the dense gemm


@dataclass(frozen=True)
class CodesLayout:
    """One weight's codes as the shim reads them, with its float32 scales and biases."""

    codes: np.ndarray  # uint8 (N, K // 2) for 4 bits, (N, K) for 8
    scales: np.ndarray  # float32 (N, K // group)
    biases: np.ndarray
    bits: int
    group: int

    def dense(self) -> np.ndarray:
        """The weight the codes stand for, (N, K) float32 (tests and checks)."""
        n = self.codes.shape[0]
        if self.bits == 4:
            c = self.codes.reshape(n, -1, 16)
            q = np.concatenate([c & 15, c >> 4], axis=-1).reshape(n, -1)
        else:
            q = self.codes
        q = q.reshape(n, self.scales.shape[1], self.group).astype(np.float32)
        return (q * self.scales[..., None] + self.biases[..., None]).reshape(n, -1)


def codes_layout(m: nn.Module) -> CodesLayout | None:
    """The shim's layout of a QuantizedLinear/QuantizedEmbedding's codes, or None where the
    kernel does not take it (not affine, other bits, groups not a multiple of 32)."""
    bits, group = getattr(m, "bits", 0), getattr(m, "group_size", 0)
    if getattr(m, "mode", "affine") != "affine" or bits not in (4, 8) or group % 32 or "biases" not in m:
        return None
    words = np.array(m.weight)  # uint32, little-endian: element i of a word at bits i * bits
    q = words.view(np.uint8)
    n = q.shape[0]
    if bits == 4:
        q = np.stack([q & 15, q >> 4], axis=-1).reshape(n, -1)  # elements in order
        halves = q.reshape(n, -1, 2, 16)
        codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, -1)
    else:
        codes = q.reshape(n, -1)
    scales = np.array(m.scales.astype(mx.float32))
    biases = np.array(m["biases"].astype(mx.float32))
    return CodesLayout(np.ascontiguousarray(codes), scales, biases, bits, group)


class PackedCodes:
    """A dense weight registered with the shim (``blas.codes_library()``, whose signatures
    are declared there) together with its codes; unregistered when this object is collected
    (it lives on the module that owns the weight)."""

    def __init__(self, lib: ctypes.CDLL, dense: mx.array, layout: CodesLayout):
        self.dense, self.layout = dense, layout
        n, k = dense.shape
        self.address = np.frombuffer(memoryview(dense), dtype=np.float32).ctypes.data
        self.registered = bool(lib.kvserve_packed_add(
            self.address, n, k, layout.group, layout.bits, layout.codes.ctypes.data,
            layout.scales.ctypes.data, layout.biases.ctypes.data))
        if self.registered:
            # Removal before the arrays go: the finalizer holds them, not this object.
            weakref.finalize(self, _remove, lib, self.address, (dense, layout))


def _remove(lib: ctypes.CDLL, address: int, keep: tuple) -> None:
    """Unregister ``address``; ``keep`` (its weight and codes) is freed after this returns."""
    lib.kvserve_packed_remove(address)


def attach_codes(module: nn.Module, quantized: nn.Module, lib: ctypes.CDLL) -> bool:
    """Register ``module``'s dense float32 weight with the codes of ``quantized`` it was
    dequantized from; True when the shim took it."""
    layout = codes_layout(quantized)
    if layout is None:
        return False
    mx.eval(module.weight)
    module._packed_codes = PackedCodes(lib, module.weight, layout)
    return module._packed_codes.registered


def packed_calls(lib: ctypes.CDLL) -> int:
    """Products the shim computed from codes so far (tests)."""
    return int(lib.kvserve_packed_calls())
