"""ggml tensor data -> MLX arrays: affine-quantized triples where that is exact, dense otherwise.

A ggml quantized type stores blocks; every type below except Q6_K is, group of 32 by group
of 32, an affine code ``value = scale * q + bias`` with unsigned ``q`` of ``bits`` bits,
which is exactly MLX's affine layout (``nn.QuantizedLinear`` with group size 32)::

    type   block  bits  per group of 32: scale, bias
    Q4_0     32     4   d,        -8 d
    Q4_1     32     4   d,         m
    Q5_0     32     5   d,       -16 d
    Q5_1     32     5   d,         m
    Q8_0     32     8   d,      -128 d
    Q4_K    256     4   d * sc_j, -dmin * m_j     (8 groups; sc_j, m_j are 6-bit)
    Q5_K    256     5   d * sc_j, -dmin * m_j

So nothing is re-quantized: the codes are recovered from the values the ``gguf`` package
dequantizes, ``q = (value - bias) / scale``, and the converted model computes what the
GGUF file describes. K-quant scales are products of two numbers (``d * sc_j``) that
float16 cannot always hold, so they are kept in float32. Q6_K has 16-element groups, which
MLX's affine format does not take, and becomes a dense float32 matrix, as do F16, BF16,
F32 and the other K-quants.
"""

from __future__ import annotations

import numpy as np

# Types kept as MLX affine (bits), and the code offset of the symmetric ones.
AFFINE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
_SYMMETRIC_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}
_K_QUANTS = ("Q4_K", "Q5_K")
DENSE_TYPES = ("F32", "F16", "BF16", "Q6_K", "Q2_K", "Q3_K")
SUPPORTED_TYPES = (*AFFINE_BITS, *DENSE_TYPES)
GROUP = 32
_ROWS_PER_CHUNK = 4096  # bounds the float32 temporaries of a large tensor (an embedding)


def mlx_layout(type_name: str) -> tuple[int, int] | None:
    """(bits, group_size) of the MLX affine layout of a ggml type; None: stored dense.

    >>> mlx_layout("Q4_K"), mlx_layout("Q6_K")
    ((4, 32), None)
    """
    bits = AFFINE_BITS.get(type_name)
    return (bits, GROUP) if bits else None


def affine_params(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-group float32 (scale, bias) of ``blocks`` (n_blocks, bytes per block, uint8),
    each (n_blocks, groups per block)."""
    f16 = lambda a: a.copy().view(np.float16).astype(np.float32)  # noqa: E731
    d = f16(blocks[:, 0:2])
    if type_name in _SYMMETRIC_OFFSET:
        return d, -_SYMMETRIC_OFFSET[type_name] * d
    if type_name in ("Q4_1", "Q5_1"):
        return d, f16(blocks[:, 2:4])
    if type_name in _K_QUANTS:
        from gguf.quants import Q4_K  # the 12-byte packing of 6-bit scales and mins

        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        return d * sc.astype(np.float32), -(f16(blocks[:, 2:4]) * mins.astype(np.float32))
    raise ValueError(f"{type_name} is not an affine type")


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``codes`` (rows, cols) into MLX's layout: each row one little-endian
    bit stream of ``bits``-bit fields, read as uint32 words.

    >>> pack_codes(np.array([[1, 2, 3, 4, 5, 6, 7, 8]]), 4).tolist()  # 0x87654321
    [[2271560481]]
    >>> pack_codes(np.array([[1, 2, 3, 4]]), 8).tolist(), pack_codes(np.arange(32)[None] % 32, 5).shape
    ([[67305985]], (1, 5))
    """
    rows = codes.shape[0]
    if bits in (4, 8):  # whole nibbles or bytes: no bit stream to build (10x faster)
        packed = codes.astype(np.uint8)
        if bits == 4:
            packed = packed[:, 0::2] | (packed[:, 1::2] << 4)
        return np.ascontiguousarray(packed).view(np.uint32)
    spread = np.unpackbits(codes.astype(np.uint8)[..., None], axis=-1, bitorder="little")
    stream = spread[..., :bits].reshape(rows, -1)
    return np.packbits(stream, axis=-1, bitorder="little").view(np.uint32)


def _ggml_type(type_name: str):
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType[type_name]


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """float32 values of ``raw`` (rows, bytes per row), by the ``gguf`` package."""
    from gguf.quants import dequantize as gguf_dequantize

    if type_name == "BF16":  # the top half of a float32
        return (raw.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(gguf_dequantize(raw, _ggml_type(type_name)), dtype=np.float32)


def _affine_chunk(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed codes, scales, biases) of ``raw`` (rows, bytes per row)."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[_ggml_type(type_name)]
    rows = raw.shape[0]
    scale, bias = affine_params(raw.reshape(-1, size), type_name)
    scale, bias = scale.reshape(rows, -1), bias.reshape(rows, -1)  # (rows, cols / 32)
    values = dequantize(raw, type_name).reshape(rows, -1, GROUP)
    safe = np.where(scale == 0, 1, scale)[..., None]  # an all-equal group: every code is 0
    codes = np.rint((values - bias[..., None]) / safe)
    codes = np.clip(codes, 0, 2 ** AFFINE_BITS[type_name] - 1).reshape(rows, -1)
    return pack_codes(codes, AFFINE_BITS[type_name]), scale, bias


def to_affine(raw: np.ndarray, type_name: str, half_scales: bool = False) -> dict[str, np.ndarray]:
    """``{"weight": packed uint32, "scales": ..., "biases": ...}`` for a quantized 2-D
    tensor, ``raw`` being its bytes as (rows, bytes per row). Scales and biases are
    float32, or float16 when ``half_scales`` and that is exact (the block types, whose
    d and m are float16; not the K-quants)."""
    parts = [_affine_chunk(raw[i:i + _ROWS_PER_CHUNK], type_name)
             for i in range(0, raw.shape[0], _ROWS_PER_CHUNK)]
    weight, scales, biases = (np.concatenate(p) for p in zip(*parts))
    dtype = np.float16 if half_scales and type_name not in _K_QUANTS else np.float32
    return {"weight": weight, "scales": scales.astype(dtype), "biases": biases.astype(dtype)}


def to_dense(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A dense array of ``shape``: F16 stays float16 and F32 float32 (as stored), BF16
    and the block types become float32."""
    if type_name == "F16":
        return raw.copy().view(np.float16).reshape(shape)
    chunks = [dequantize(raw[i:i + _ROWS_PER_CHUNK], type_name)
              for i in range(0, raw.shape[0], _ROWS_PER_CHUNK)]
    return np.concatenate(chunks).reshape(shape)
