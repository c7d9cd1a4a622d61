"""TurboQuant codec: Lloyd-Max codebooks, rotations, bit packing, per-vector encode/decode,
and the pure-MLX attention reference over the encoded formats.

A turbo vector x of length d is stored as its norm and the b-bit indices of its rotated unit
direction: n = |x|, y = (x / n) @ Pi.T, idx_j = #{k : y_j > boundary_k}. Decoding in the
rotated basis is n * c[idx]; in the original basis (n * c[idx]) @ Pi. Pi is orthogonal, so
attention can run entirely in the rotated basis: scores <Pi q, n c[idx]> and one inverse
rotation of the value accumulator per step.

Worked example (d=4, 2 bits, illustrative centroids c = [-0.75, -0.25, 0.25, 0.75]):
    y = [0.7, -0.1, -0.9, 0.2]  ->  idx = [3, 1, 0, 2]  ->  packed word 0b10_00_01_11 = 135
(index j sits at bit 2*j of the little-endian uint32 stream).

Everything here runs in float32 whatever the activation dtype: rounding the rotation or the
unit vectors to bf16/fp16 moves values across quantization boundaries.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kvserve.cache.base import apply_mask, grouped_mask
from kvserve.cache.fp16 import as_16_bit
from kvserve.kernels import cpu_ops, cuda_encode

log = logging.getLogger("kvserve.cache")
# (dim, bits) -> whether the GPU encoder matched the MLX encoder on its first call.
_GPU_ENCODER_CHECKED: dict[tuple[int, int], bool] = {}

F32 = mx.float32
_NORM_EPS = 1e-8  # unit vectors of all-zero rows (padding) stay zero instead of NaN
CALIB_MIN_SAMPLES = 32
CALIB_MIN_SPREAD = 0.1
CALIB_CLAMP = (0.25, 4.0)


# ----------------------------------------------------------------------------- codebooks

def lloyd_max_beta(d: int, bits: int, grid: int = 1 << 16, tol: float = 1e-12,
                   max_iter: int = 20000) -> np.ndarray:
    """Lloyd-Max centroids (ascending, float64) for one coordinate of a random unit vector
    in R^d, whose density is f(t) ~ (1 - t^2)^((d - 3) / 2) on [-1, 1].

    Lloyd iteration with exact cell integrals: the cumulative mass and first moment are
    tabulated on a fine grid (trapezoid rule) and interpolated at the boundaries, so the
    iteration converges smoothly instead of stalling on grid cells.

        >>> np.round(lloyd_max_beta(128, 2)[2:], 5)     # ~ [0.4528, 1.5104] / sqrt(128)
        array([0.03999, 0.13304])
    """
    t = np.linspace(-1.0, 1.0, grid + 1)
    f = np.exp(0.5 * (d - 3) * np.log(np.clip(1.0 - t * t, 1e-300, None)))
    mass = np.concatenate([[0.0], np.cumsum(0.5 * (f[1:] + f[:-1]))])
    g = f * t
    moment = np.concatenate([[0.0], np.cumsum(0.5 * (g[1:] + g[:-1]))])
    moment, mass = moment / mass[-1], mass / mass[-1]
    k = 1 << bits
    c = np.interp((np.arange(k) + 0.5) / k, mass, t)  # start from the quantiles
    for _ in range(max_iter):
        edges = np.concatenate([[-1.0], 0.5 * (c[1:] + c[:-1]), [1.0]])
        new = np.diff(np.interp(edges, t, moment)) / np.diff(np.interp(edges, t, mass))
        done = np.max(np.abs(new - c)) < tol
        c = new
        if done:
            break
    c = 0.5 * (c - c[::-1])  # exact symmetry (the density is even)
    return c


@functools.cache
def codebook(d: int, bits: int) -> tuple[mx.array, mx.array]:
    """(centroids (2^bits,), boundaries (2^bits - 1,)) as float32; boundaries are midpoints."""
    c = lloyd_max_beta(d, bits)
    return mx.array(c.astype(np.float32)), mx.array((0.5 * (c[1:] + c[:-1])).astype(np.float32))


# ----------------------------------------------------------------------------- rotations

def is_power_of_two(d: int) -> bool:
    return d > 0 and d & (d - 1) == 0


def wht_signs(d: int, seed: int) -> mx.array:
    """Random signs s_i = +1 if uniform(key(seed))_i > 0.5 else -1, shape (d,) float32."""
    u = mx.random.uniform(key=mx.random.key(seed), shape=(d,))
    return mx.where(u > 0.5, 1.0, -1.0).astype(F32)


def _hadamard(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.cache
def rotation(d: int, seed: int) -> mx.array:
    """Orthogonal Pi (d, d) float32. Power-of-two d: Pi = H diag(s) / sqrt(d) (randomised
    Walsh-Hadamard); otherwise Q of a seeded Gaussian matrix's QR with column signs fixed by
    sign(diag R). Row-vector convention: y = x @ Pi.T rotates, x = y @ Pi inverts."""
    if is_power_of_two(d):
        s = np.array(wht_signs(d, seed))
        return mx.array((_hadamard(d) * s[None, :] / math.sqrt(d)).astype(np.float32))
    g = mx.random.normal(shape=(d, d), key=mx.random.key(seed), dtype=F32)
    q, r = mx.linalg.qr(g, stream=mx.cpu)  # QR runs on the CPU stream only
    q = q * mx.where(mx.diagonal(r) < 0, -1.0, 1.0)[None, :]
    return mx.contiguous(q.T)  # rows of Pi are the orthonormal basis


# ----------------------------------------------------------------------------- bit packing

@dataclass(frozen=True)
class _PackPlan:
    """Tables for one period of P indices that fill exactly Wp words (P * bits = 32 * Wp)."""

    period: int
    words: int
    shift: mx.array  # (P,) bit offset of index j inside its first word
    rshift: mx.array  # (P,) 32 - shift where index j spills into the next word, else 0
    spill: mx.array  # (P,) 1 where index j spills
    lo_word: mx.array  # (P,) word holding the low bits of index j
    hi_word: mx.array  # (P,) word holding the spilled high bits (= lo_word if none)
    lo_hot: mx.array  # (P, Wp) one-hot of lo_word
    hi_hot: mx.array  # (P, Wp) one-hot of hi_word, zero rows where nothing spills


@functools.cache
def _pack_plan(bits: int) -> _PackPlan:
    period = 32 // math.gcd(32, bits)
    words = period * bits // 32
    start = np.arange(period) * bits
    lo_word, shift = start // 32, start % 32
    spill = shift + bits > 32
    hi_word = np.where(spill, lo_word + 1, lo_word)
    cols = np.arange(words)[None, :]
    def u32(a):
        return mx.array(a.astype(np.uint32))
    return _PackPlan(period, words, u32(shift), u32(np.where(spill, 32 - shift, 0)), u32(spill),
                     mx.array(lo_word.astype(np.int32)), mx.array(hi_word.astype(np.int32)),
                     u32(cols == lo_word[:, None]), u32((cols == hi_word[:, None]) & spill[:, None]))


def packed_words(d: int, bits: int) -> int:
    return -(-d * bits // 32)


def pack_indices(idx: mx.array, bits: int) -> mx.array:
    """Pack b-bit indices (..., d) into uint32 words (..., ceil(d*b/32)), little-endian:
    index j occupies bits [j*b, j*b + b) of the word stream and may spill into the next word.

    Example, 3 bits: index 10 starts at bit 30, so its low 2 bits are bits 30-31 of word 0
    and its high bit is bit 0 of word 1; index 11 then starts at bit 1 of word 1.
    Example, 4 bits: indices [1, 2, 3, 4, 5, 6, 7, 8] -> one word 0x87654321.
    """
    d, plan = idx.shape[-1], _pack_plan(bits)
    n_periods = -(-d // plan.period)
    x = idx.astype(mx.uint32)
    if n_periods * plan.period != d:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n_periods * plan.period - d)])
    x = x.reshape(*idx.shape[:-1], n_periods, plan.period)  # (..., nP, P)
    lo = mx.left_shift(x, plan.shift)  # bits beyond 32 fall off: they belong to the next word
    hi = mx.right_shift(x, plan.rshift) * plan.spill
    # Bit fields are disjoint, so a sum is the bitwise OR.
    w = (lo[..., None] * plan.lo_hot).sum(axis=-2) + (hi[..., None] * plan.hi_hot).sum(axis=-2)
    return w.reshape(*idx.shape[:-1], n_periods * plan.words)[..., :packed_words(d, bits)]


def unpack_indices(words: mx.array, bits: int, d: int) -> mx.array:
    """Inverse of ``pack_indices``: (..., ceil(d*b/32)) uint32 -> (..., d) uint32."""
    plan = _pack_plan(bits)
    n_periods = -(-d // plan.period)
    lead = words.shape[:-1]
    pad = n_periods * plan.words - words.shape[-1]
    if pad:
        words = mx.pad(words, [(0, 0)] * len(lead) + [(0, pad)])
    w = words.reshape(*lead, n_periods, plan.words)  # (..., nP, Wp)
    lo = mx.right_shift(mx.take(w, plan.lo_word, axis=-1), plan.shift)  # (..., nP, P)
    hi = mx.left_shift(mx.take(w, plan.hi_word, axis=-1), plan.rshift) * plan.spill
    x = mx.bitwise_and(lo | hi, mx.array((1 << bits) - 1, dtype=mx.uint32))
    return x.reshape(*lead, n_periods * plan.period)[..., :d]


# ----------------------------------------------------------------------------- codec

@dataclass(frozen=True)
class TurboCodec:
    """Per-vector TurboQuant codec for vectors of length ``dim`` at ``bits`` bits.

    Stored per vector: ``packed`` (W,) uint32 with W = ceil(dim*bits/32) and ``norm`` (1,)
    float32. The norm is raw |x| on the Walsh-Hadamard path; on the dense (QR) path and for
    calibrated keys it is corrected, |x| / |c[idx] * s|, so decoded vectors keep |x|.
    """

    dim: int
    bits: int
    seed: int
    centroids: mx.array = field(init=False, repr=False, compare=False)
    boundaries: mx.array = field(init=False, repr=False, compare=False)
    pi: mx.array = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        c, b = codebook(self.dim, self.bits)
        object.__setattr__(self, "centroids", c)
        object.__setattr__(self, "boundaries", b)
        object.__setattr__(self, "pi", rotation(self.dim, self.seed))

    @property
    def words(self) -> int:
        return packed_words(self.dim, self.bits)

    def lookup(self, packed: mx.array) -> mx.array:
        """Centroid values of packed indices: (..., W) uint32 -> (..., dim) float32.

        Where whole indices fit a 16-bit half-word (1, 2, 4 and 8 bits, dim * bits a
        multiple of 16), each half-word is looked up at once in a table of its
        16 // bits centroid values: 4x fewer gathers than one per index, and no unpacking
        (MLX's CPU gather costs about as much per element as the unpacking ops together).
        Other widths unpack and gather per index.

            >>> c = get_codec(64, 4, 43)
            >>> idx = mx.arange(64, dtype=mx.uint32)[None] % 16
            >>> bool(mx.array_equal(c.lookup(pack_indices(idx, 4)), mx.take(c.centroids, idx)))
            True
        """
        table = self._half_word_table()
        if table is None:
            return mx.take(self.centroids, unpack_indices(packed, self.bits, self.dim))
        halves = packed.view(mx.uint16)  # little-endian: index j sits in half-word j // per
        return mx.take(table, halves, axis=0).reshape(*packed.shape[:-1], -1)[..., : self.dim]

    def _half_word_table(self) -> mx.array | None:
        if 16 % self.bits or (self.dim * self.bits) % 16:
            return None
        cached = self.__dict__.get("_table")
        if cached is None:
            per, codes = 16 // self.bits, np.arange(1 << 16, dtype=np.uint32)
            idx = np.stack([(codes >> (self.bits * i)) & ((1 << self.bits) - 1) for i in range(per)], axis=-1)
            cached = mx.take(self.centroids, mx.array(idx.astype(np.int32)))  # (65536, per)
            object.__setattr__(self, "_table", cached)
        return cached

    @property
    def norm_corrected(self) -> bool:
        return not is_power_of_two(self.dim)

    def rotate(self, x: mx.array) -> mx.array:
        return x.astype(F32) @ self.pi.T

    def unrotate(self, y: mx.array) -> mx.array:
        return y.astype(F32) @ self.pi

    def quantize(self, y: mx.array) -> mx.array:
        """Index of the nearest centroid = number of boundaries below y: (..., d) -> uint32.
        One broadcast comparison (..., d, 2^b - 1) beats a gather-based binary search on
        CPU by ~2x; callers bound its size by encoding long prefills in chunks."""
        return (y[..., None] > self.boundaries).sum(axis=-1).astype(mx.uint32)

    def unit_rotated(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(rotated unit directions (..., d), norms (..., 1)) in float32."""
        x = x.astype(F32)
        n = mx.sqrt((x * x).sum(axis=-1, keepdims=True))
        return self.rotate(x / mx.maximum(n, _NORM_EPS)), n

    def encode(self, x: mx.array, scale: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """x (..., d) -> (packed (..., W) uint32, norms (..., 1) float32).

        ``scale`` (broadcastable to (..., d)) is the per-dimension key calibration: the
        direction is quantized as y / s and decodes as c[idx] * s; rows whose scale is all
        ones are uncalibrated and keep the plain encoding."""
        if scale is None and not self.norm_corrected and cpu_ops.available():
            fused = cpu_ops.turbo_encode(x, self.pi, self.boundaries, self.bits, _NORM_EPS)
            if fused is not None:  # the same encoding as one CPU operation (kernels/cpu_ops)
                return fused
        if scale is None and not self.norm_corrected and cuda_encode.serves(x, self.pi, self.bits) \
                and self._gpu_encoder_trusted(x):  # one kernel on an NVIDIA GPU (kernels/cuda_encode)
            return cuda_encode.turbo_encode(x, self.pi, self.boundaries, self.bits, _NORM_EPS)
        return self.encode_unit(*self.unit_rotated(x), scale)

    def _gpu_encoder_trusted(self, x: mx.array) -> bool:
        """The GPU encoder's first call for this width and bit count in the process is
        checked against the MLX operations: equal norms, and indices equal but for a few
        coordinates within a rounding error of a boundary (one level apart). A kernel
        that fails serves no later call; the MLX operations do."""
        key = (self.dim, self.bits)
        if key not in _GPU_ENCODER_CHECKED:
            _GPU_ENCODER_CHECKED[key] = self._gpu_encoder_agrees(x)
        return _GPU_ENCODER_CHECKED[key]

    def _gpu_encoder_agrees(self, x: mx.array) -> bool:
        try:
            packed, norms = cuda_encode.turbo_encode(x, self.pi, self.boundaries, self.bits, _NORM_EPS)
            ref_packed, ref_norms = self.encode_unit(*self.unit_rotated(x))
            idx, ref = (unpack_indices(p, self.bits, self.dim).astype(mx.int32) for p in (packed, ref_packed))
            apart = mx.abs(idx - ref)
            ok = (mx.allclose(norms, ref_norms, rtol=1e-5, atol=1e-6).item() and mx.max(apart).item() <= 1
                  and mx.sum(apart).item() <= max(1, idx.size // 1000))
        except Exception as exc:  # noqa: BLE001 (a kernel that does not build serves nothing)
            log.warning("TurboQuant GPU encoder (D=%d, %d bits) raised on its first call: %s", self.dim, self.bits, exc)
            return False
        if not ok:
            log.warning("TurboQuant GPU encoder (D=%d, %d bits) disagreed with the MLX encoder on its first "
                        "call; the MLX operations encode instead", self.dim, self.bits)
        return bool(ok)

    def encode_unit(self, y: mx.array, n: mx.array, scale: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """``encode`` from rotated unit directions y (..., d) and norms n (..., 1)."""
        idx = self.quantize(y if scale is None else y / scale)
        if scale is None and not self.norm_corrected:
            return pack_indices(idx, self.bits), n  # WHT path: the raw norm is stored
        c = mx.take(self.centroids, idx)
        c = c if scale is None else c * scale
        fixed = n / mx.maximum(mx.sqrt((c * c).sum(axis=-1, keepdims=True)), _NORM_EPS)
        if not self.norm_corrected:  # only calibrated rows (scale not all ones) are corrected
            fixed = mx.where(mx.any(scale != 1.0, axis=-1, keepdims=True), fixed, n)
        return pack_indices(idx, self.bits), fixed

    def decode_rotated(self, packed: mx.array, norms: mx.array,
                       scale: mx.array | None = None) -> mx.array:
        """(..., W), (..., 1) -> (..., d) float32 in the rotated basis: n * c[idx] (* s)."""
        c = self.lookup(packed)
        return (c * scale if scale is not None else c) * norms

    def decode(self, packed: mx.array, norms: mx.array, scale: mx.array | None = None) -> mx.array:
        return self.unrotate(self.decode_rotated(packed, norms, scale))

    def calibration(self, x: mx.array, valid: mx.array | None = None) -> mx.array | None:
        """Per-dimension key scale s (d,) from raw keys x (..., d): the std of each rotated
        unit coordinate divided by the mean std, clamped to [0.25, 4]. None (no calibration)
        with fewer than 32 samples or when every |s - 1| < 0.1. ``valid`` (...) drops padding."""
        return self.calibration_rotated(self.unit_rotated(x)[0], valid)

    def calibration_rotated(self, y: mx.array, valid: mx.array | None = None) -> mx.array | None:
        """``calibration`` from rotated unit directions y (..., d)."""
        y = y.reshape(-1, self.dim)  # (N, d)
        w = mx.ones((y.shape[0], 1), F32) if valid is None else valid.reshape(-1, 1).astype(F32)
        count = w.sum().item()
        if count < CALIB_MIN_SAMPLES:
            return None
        mean = (y * w).sum(axis=0) / count
        std = mx.sqrt(((y - mean) ** 2 * w).sum(axis=0) / count)  # (d,)
        s = mx.clip(std / mx.maximum(std.mean(), _NORM_EPS), *CALIB_CLAMP)
        if mx.max(mx.abs(s - 1.0)).item() < CALIB_MIN_SPREAD:
            return None
        return s


@functools.cache
def get_codec(dim: int, bits: int, seed: int) -> TurboCodec:
    """Codecs are shared per (dim, bits, seed): rotation and tables are built once."""
    return TurboCodec(dim, bits, seed)


# ----------------------------------------------------------------------------- formats
# One class per stored component kind. Arrays are (B, H, T, W); ``scores`` takes grouped
# queries (B, H_kv, n_rep, L, D) already multiplied by the softmax scale. The attention
# protocol of ``kvserve.kernels`` (what a format needs to serve as keys or values):
#   prepare_queries(q, key_scale) -> q     once per step, before any block of keys
#   scores(q, arrays) -> (B, H, R, L, T)   f32, over any slice of T
#   accumulate(p, arrays) -> (B, H, R, L, D_v)   f32 sum_t p_t v_t in the format's basis
#   finish(o) -> o                         once per step, back to the original basis
#   decode(arrays, key_scale) -> (B, H, T, D) f32   the stored rows in the original basis

def folded(x: mx.array, product) -> mx.array:
    """Apply ``product`` (a matmul with (B, H, T, .) stored arrays) to grouped x
    (B, H, R, L, .) as (B, H, R*L, .): the R query heads of a KV head become rows of one
    product, so the stored arrays are never broadcast (copied) R times.

        >>> folded(mx.ones((1, 2, 3, 1, 4)), lambda x: x @ mx.ones((1, 2, 4, 5))).shape
        (1, 2, 3, 1, 5)
    """
    B, H, R, L, _ = x.shape
    return product(x.reshape(B, H, R * L, -1)).reshape(B, H, R, L, -1)


class RawFormat:
    """Keys kept as 16-bit floats, as the fp16 scheme keeps them: one array (B, H, T, D), in
    the activation dtype where that is float16 or bfloat16 (a GPU), as float16 where the
    model computes in float32 (a CPU, where float32 keys would cost more than fp16's)."""

    kind = "fp16"

    def __init__(self, dim: int):
        self.dim = dim

    def encode(self, x: mx.array, scale: mx.array | None = None) -> tuple[mx.array, ...]:
        return (as_16_bit(x),)

    def prepare_queries(self, q: mx.array, scale: mx.array | None = None) -> mx.array:
        return q

    def scores(self, q: mx.array, arrays: tuple[mx.array, ...]) -> mx.array:
        # f32: fp16 dot products overflow on outlier-heavy keys (|k| in the hundreds).
        return folded(q, lambda x: x @ arrays[0].astype(F32).swapaxes(-1, -2))  # (B, H, R, L, T)

    def accumulate(self, p: mx.array, arrays: tuple[mx.array, ...]) -> mx.array:
        return folded(p, lambda x: x @ arrays[0].astype(F32))  # (B, H, R, L, D)

    def finish(self, o: mx.array) -> mx.array:
        return o

    def decode(self, arrays: tuple[mx.array, ...], scale: mx.array | None = None) -> mx.array:
        return arrays[0].astype(F32)


def affine_group(dim: int, preferred: int = 64) -> int:
    """Group size for mx.quantize along a head of ``dim``: preferred if it divides, else
    64, 128 or 32 (the sizes mx.quantize supports)."""
    for g in (preferred, 64, 128, 32):
        if dim % g == 0:
            return g
    raise ValueError(f"head_dim {dim} is not a multiple of 32: no affine group size fits")


class AffineFormat:
    """mx.quantize keys: (wq (B,H,T,D*bits/32) uint32, scales, biases (B,H,T,D/g) act dtype)."""

    kind = "affine"

    def __init__(self, dim: int, bits: int = 8, group_size: int = 64):
        self.dim, self.bits, self.group_size = dim, bits, affine_group(dim, group_size)

    def encode(self, x: mx.array, scale: mx.array | None = None) -> tuple[mx.array, ...]:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def prepare_queries(self, q: mx.array, scale: mx.array | None = None) -> mx.array:
        return q

    def scores(self, q: mx.array, arrays: tuple[mx.array, ...]) -> mx.array:
        w, s, b = arrays
        return folded(q, lambda x: mx.quantized_matmul(x, w, s.astype(F32), b.astype(F32),
                                                       transpose=True, group_size=self.group_size,
                                                       bits=self.bits))

    def accumulate(self, p: mx.array, arrays: tuple[mx.array, ...]) -> mx.array:
        w, s, b = arrays
        return folded(p, lambda x: mx.quantized_matmul(x, w, s.astype(F32), b.astype(F32),
                                                       transpose=False, group_size=self.group_size,
                                                       bits=self.bits))

    def finish(self, o: mx.array) -> mx.array:
        return o

    def decode(self, arrays: tuple[mx.array, ...], scale: mx.array | None = None) -> mx.array:
        w, s, b = arrays
        return mx.dequantize(w, s.astype(F32), b.astype(F32), group_size=self.group_size,
                             bits=self.bits)


class TurboFormat:
    """Turbo component: (packed (B,H,T,W) uint32, norms (B,H,T,1) float32)."""

    kind = "turbo"

    def __init__(self, dim: int, bits: int, seed: int):
        self.dim, self.codec = dim, get_codec(dim, bits, seed)

    def encode(self, x: mx.array, scale: mx.array | None = None) -> tuple[mx.array, ...]:
        return self.codec.encode(x, scale)

    def prepare_queries(self, q: mx.array, scale: mx.array | None = None) -> mx.array:
        """Rotate once per step (and fold in the key calibration) instead of per key."""
        q = self.codec.rotate(q)
        return q * scale[:, :, None] if scale is not None else q  # scale (B,1,1,D)

    def centroids(self, packed: mx.array) -> mx.array:
        return self.codec.lookup(packed)

    def scores(self, q: mx.array, arrays: tuple[mx.array, ...]) -> mx.array:
        packed, norms = arrays
        c = self.centroids(packed)  # (B, H, T, D) f32, transient
        return folded(q, lambda x: x @ c.swapaxes(-1, -2)) * norms.swapaxes(-1, -2)[:, :, None]

    def accumulate(self, p: mx.array, arrays: tuple[mx.array, ...]) -> mx.array:
        """sum_t p_t n_t c[idx_t], left in the rotated basis (any slice of T)."""
        packed, norms = arrays
        pn = p * norms.swapaxes(-1, -2)[:, :, None]  # (B, H, R, L, T)
        c = self.centroids(packed)  # (B, H, T, D) f32, transient
        return folded(pn, lambda x: x @ c)  # (B, H, R, L, D)

    def finish(self, o: mx.array) -> mx.array:
        """ONE inverse rotation of the whole accumulator, not one per token."""
        return self.codec.unrotate(o)

    def weighted_sum(self, p: mx.array, arrays: tuple[mx.array, ...]) -> mx.array:
        """sum_t p_t n_t c[idx_t] in the rotated basis, then ONE inverse rotation."""
        return self.finish(self.accumulate(p, arrays))  # (B, H, R, L, D)

    def decode(self, arrays: tuple[mx.array, ...], scale: mx.array | None = None) -> mx.array:
        return self.codec.decode(*arrays, scale)


def make_format(fmt, dim: int):
    """The storage format for one ``ComponentFormat`` of a scheme at head dimension ``dim``."""
    if fmt.kind == "fp16":
        return RawFormat(dim)
    if fmt.kind == "affine":
        return AffineFormat(dim, fmt.bits, fmt.group_size or 64)
    if fmt.kind == "turbo":
        return TurboFormat(dim, fmt.bits, fmt.seed)
    raise ValueError(f"component kind {fmt.kind!r} is not part of the turbo family")


# ----------------------------------------------------------------------------- attention

def attend_encoded(queries: mx.array, key_fmt, keys: tuple[mx.array, ...], value_fmt,
                   values: tuple[mx.array, ...], scale: float, mask,
                   key_scale: mx.array | None = None) -> mx.array:
    """Attention of queries (B, H_q, L, D) over encoded keys/values (B, H_kv, T, .).

    Query heads are grouped contiguously per KV head (h_kv = h_q // n_rep) by a reshape, so
    K/V are never repeated. Scores, softmax and the value accumulator are float32; the
    result is (B, H_q, L, D_v) in the queries' dtype.
    """
    B, Hq, L, D = queries.shape
    Hkv, T = keys[0].shape[1], keys[0].shape[2]
    R = Hq // Hkv
    q = queries.astype(F32).reshape(B, Hkv, R, L, D) * scale
    q = key_fmt.prepare_queries(q, key_scale)
    s = key_fmt.scores(q, keys)  # (B, H_kv, R, L, T)
    s = apply_mask(s, grouped_mask(mask, Hkv, R, L, T))
    p = mx.softmax(s, axis=-1, precise=True)
    out = value_fmt.weighted_sum(p, values)  # (B, H_kv, R, L, D_v)
    return out.reshape(B, Hq, L, out.shape[-1]).astype(queries.dtype)
