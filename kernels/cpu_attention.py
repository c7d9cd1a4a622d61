"""Fused decode attention over stored K/V on the CPU (``cpu_attention.cpp``).

On the CPU, attention over an affine4 cache ran through MLX's ``quantized_matmul``, which
decodes one element at a time, and over a turbo cache through a (B, H, T, D) float32 decode
of the whole context: with 8 rows at 160 tokens either cost more than the whole rest of the
decode step over an fp16 cache (docs/benchmarks/cpu-step.md). The kernel here is an MLX
primitive written in C++ (the extension API MLX ships: its headers and nanobind), built once
per machine with the system compiler into the cache directory (``cpu_build``). It serves
raw, affine 4/8-bit (groups a multiple of 32) and turbo (up to 4 bits) keys and values, for
decode, verify and prefill alike (``kvserve bench-attention --device cpu`` measures it beside
the MLX paths); MX formats keep the pure-MLX paths, and so do calls whose scores would pass
``MAX_SCORES`` with one query row (the blockwise reference; a prompt chunk past it runs in
pieces of query rows). Where it cannot be built (no compiler, no
nanobind, an MLX whose nanobind ABI differs), ``available()`` is False and nothing changes.

Example (8 rows of affine4 K/V; the kernel equals the reference within float rounding):
    >>> from kvserve.cache.affine import QuantizedFormat
    >>> from kvserve.cache.scheme import parse_scheme
    >>> from kvserve.kernels.reference import attend_full
    >>> fmt = QuantizedFormat(parse_scheme("affine4").keys)
    >>> q, k, v = (mx.random.normal(s) for s in ((8, 9, 1, 64), (8, 3, 160, 64), (8, 3, 160, 64)))
    >>> kp, vp = tuple(mx.quantize(k, 64, 4)), tuple(mx.quantize(v, 64, 4))
    >>> got = attend_cpu(q, fmt, kp, fmt, vp, 0.125, None) if available() else attend_full(q, fmt, kp, fmt, vp, 0.125, None)
    >>> bool(mx.allclose(got, attend_full(q, fmt, kp, fmt, vp, 0.125, None), atol=1e-5))
    True
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import mlx.core as mx
from kvserve.cache.base import MASKED, causal_mask
from kvserve.kernels import cpu_build
from kvserve.kernels.reference import attend_blockwise, format_key, group_queries, ungroup


# Scores one (row, KV head) pair holds at once: n_rep * L * T floats, 64 MiB. Larger calls
# (long prompt chunks over long contexts) run in pieces of query rows (``_in_pieces``); one
# row past it takes the blockwise reference, whose memory is bounded.
MAX_SCORES = 1 << 24
_NAME = "kvserve_cpu_attention"
_SOURCE = Path(__file__).with_name("cpu_attention.cpp")


RAW, AFFINE, TURBO = 0, 1, 2


def supports(key_fmt, value_fmt, L: int) -> bool:
    """Raw, affine 4/8-bit or turbo keys and values, any number of queries per row."""
    return reads(key_fmt, value_fmt) and available()


def reads(key_fmt, value_fmt) -> bool:
    """Whether the kernel reads these formats (built here or not)."""
    return _spec(key_fmt) is not None and _spec(value_fmt) is not None


_SPECS: dict[tuple, tuple | None] = {}  # by format_key: attention asks for every layer, every step


def _spec(fmt) -> tuple[int, int, int, list[float]] | None:
    """(kind, bits, group, centroids) of a format of the attention protocol; None: not served.

        >>> from kvserve.cache.scheme import parse_scheme
        >>> from kvserve.cache.turbo_codec import make_format
        >>> s = parse_scheme("turbo8v3")
        >>> [_spec(make_format(f, 64))[:3] for f in (s.keys, s.values)]
        [(1, 8, 64), (2, 3, 0)]
    """
    key = format_key(fmt)
    if key not in _SPECS:
        _SPECS[key] = _spec_of(fmt)
    return _SPECS[key]


def _spec_of(fmt) -> tuple[int, int, int, list[float]] | None:
    kind = getattr(fmt, "kind", None)
    inner = getattr(fmt, "fmt", None)  # cache.affine.QuantizedFormat wraps a ComponentFormat
    if inner is not None:
        kind = "affine" if inner.kind == "affine" and inner.mode == "affine" else None
        bits, group = inner.bits, inner.group_size
    else:
        bits, group = getattr(fmt, "bits", 0), getattr(fmt, "group_size", 0)
    if kind == "fp16":
        return RAW, 16, 0, []
    if kind == "affine" and bits in (4, 8) and group % 32 == 0:
        return AFFINE, bits, group, []
    if kind == "turbo" and fmt.codec.bits <= 4:
        return TURBO, fmt.codec.bits, 0, fmt.codec.centroids.tolist()
    return None


def _value_dim(spec, fmt, parts: tuple[mx.array, ...]) -> int:
    if spec[0] == RAW:
        return parts[0].shape[3]
    if spec[0] == AFFINE:
        return parts[0].shape[3] * 32 // spec[1]
    return fmt.dim


def attend_cpu(queries: mx.array, key_fmt, keys: tuple[mx.array, ...], value_fmt,
               values: tuple[mx.array, ...], scale: float, mask: Any,
               key_scale: mx.array | None = None, sinks: mx.array | None = None) -> mx.array:
    """``dispatch.attend``'s signature: (B, H_q, L, D) queries over the stored parts. Turbo
    keys score against queries rotated here (``group_queries``, as in the reference); raw and
    affine keys take the queries as they are, any layout, scaled in the kernel. Turbo values
    are rotated back in the kernel; other formats' ``finish`` runs here."""
    B, Hq, L, D = queries.shape
    Hkv, T = keys[0].shape[1], keys[0].shape[2]
    ks, vs = _spec(key_fmt), _spec(value_fmt)
    dv = _value_dim(vs, value_fmt, values)
    step = 32 if AFFINE in (ks[0], vs[0]) or 4 in (ks[1], vs[1]) else 16
    per = MAX_SCORES // ((Hq // Hkv) * max(T, 1))  # query rows per call within the bound
    if D % step or dv % step or per < 1:
        return attend_blockwise(queries, key_fmt, keys, value_fmt, values, scale, mask, key_scale, sinks=sinks)
    if L > per:
        return _in_pieces(per, queries, key_fmt, keys, value_fmt, values, scale, mask, key_scale, sinks)
    if ks[0] == TURBO:  # rotated (and calibrated) queries
        q, q_scale = group_queries(queries, key_fmt, Hkv, scale, key_scale).reshape(B, Hq, L, D), 1.0
    else:  # raw and affine keys take the queries as they are, scaled in the kernel
        q, q_scale = queries, scale
    unrotate = value_fmt.codec.pi if vs[0] == TURBO else None
    out = _module().stored_attention(q, *ks, list(keys), *vs, list(values), dv, _additive(mask, B, Hq, L, T), sinks,
                                     unrotate, q_scale)
    if unrotate is None:
        out = value_fmt.finish(out.reshape(B, Hkv, Hq // Hkv, L, dv))
    return ungroup(out, queries)


def _in_pieces(per: int, queries: mx.array, key_fmt, keys: tuple[mx.array, ...], value_fmt,
               values: tuple[mx.array, ...], scale: float, mask: Any, key_scale: mx.array | None,
               sinks: mx.array | None) -> mx.array:
    """A prompt chunk whose scores would pass ``MAX_SCORES``, ``per`` query rows a call. The
    kernel treats each row alone (its sums in token order), so the pieces give the same
    bits as one call. A causal piece ending at row l1 attends over the first T - L + l1
    keys only: the ones after are hidden from all its rows, and a hidden key adds an exact
    zero at the end of each row's sum. The blockwise reference served these calls before:
    an fp16 chunk of 1024 queries over 4,097 keys in Llama-3-8B's shape took 27.0 s on the
    2-core CPU, and 3.1 s in pieces (docs/benchmarks/attention-cpu.md)."""
    L, T = queries.shape[2], keys[0].shape[2]
    outs = []
    for l0 in range(0, L, per):
        l1 = min(L, l0 + per)
        k, v, m = keys, values, mask
        if isinstance(mask, str):
            k, v = (tuple(p[:, :, : T - L + l1] for p in parts) for parts in (keys, values))
        elif mask is not None and mask.ndim >= 2 and mask.shape[-2] == L:
            m = mask[..., l0:l1, :]
        outs.append(attend_cpu(queries[:, :, l0:l1], key_fmt, k, value_fmt, v, scale, m, key_scale, sinks))
    return mx.concatenate(outs, axis=2)


def _additive(mask: Any, B: int, Hq: int, L: int, T: int) -> mx.array | None:
    """Any mlx-lm mask as (B, 1 or H_q, L, T) float32 to add to the scores; None: no mask."""
    if mask is None or (isinstance(mask, str) and mask == "causal" and L == 1):
        return None
    if isinstance(mask, str):
        mask = causal_mask(L, T - L)
    if mask.dtype == mx.bool_:
        mask = mx.where(mask, 0.0, MASKED)
    while mask.ndim < 4:
        mask = mask[None]
    heads = Hq if mask.shape[1] > 1 else 1
    return mx.broadcast_to(mask.astype(mx.float32), (B, heads, L, T))


@functools.cache
def available() -> bool:
    """True when the extension is built (or was before) and loads into this MLX."""
    return cpu_build.loads(_NAME, _SOURCE, "CPU attention kernel")


def _module():
    return cpu_build.load(_NAME, _SOURCE)
