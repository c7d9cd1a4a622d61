"""Fused decode attention over stored K/V on the CPU (``cpu_attention.cpp``).

On the CPU, attention over an affine4 cache ran through MLX's ``quantized_matmul``, which
decodes one element at a time, and over a turbo cache through a (B, H, T, D) float32 decode
of the whole context: with 8 rows at 160 tokens either cost more than the whole rest of the
decode step over an fp16 cache (docs/benchmarks/cpu-step.md). The kernel here is an MLX
primitive written in C++ (the extension API MLX ships: its headers and nanobind), built once
per machine with the system compiler into the cache directory, like the BLAS shim. It serves
raw, affine 4/8-bit (groups a multiple of 32) and turbo (up to 4 bits) keys and values, for
decode, verify and prefill alike (``kvserve bench-attention --device cpu`` measures it beside
the MLX paths); MX formats keep the pure-MLX paths, and so do calls whose scores would pass
``MAX_SCORES`` (the blockwise reference). Where it cannot be built (no compiler, no
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
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from kvserve.cache.base import MASKED, causal_mask
from kvserve.kernels.reference import attend_blockwise, format_key, group_queries, ungroup

log = logging.getLogger(__name__)

# Scores one (row, KV head) pair holds at once: n_rep * L * T floats, 64 MiB. Larger calls
# (long prompt chunks over long contexts) take the blockwise reference, whose memory is bounded.
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
    """``dispatch.attend``'s signature: (B, H_q, L, D) queries over the stored parts. Queries
    are prepared for the key format and the output finished for the value format here, as
    in the reference (``group_queries`` / ``finish``)."""
    B, Hq, L, D = queries.shape
    Hkv, T = keys[0].shape[1], keys[0].shape[2]
    ks, vs = _spec(key_fmt), _spec(value_fmt)
    dv = _value_dim(vs, value_fmt, values)
    step = 32 if AFFINE in (ks[0], vs[0]) or 4 in (ks[1], vs[1]) else 16
    if D % step or dv % step or (Hq // Hkv) * L * T > MAX_SCORES:
        return attend_blockwise(queries, key_fmt, keys, value_fmt, values, scale, mask, key_scale, sinks=sinks)
    q = group_queries(queries, key_fmt, Hkv, scale, key_scale).reshape(B, Hq, L, D)
    out = _module().stored_attention(q, *ks, list(keys), *vs, list(values), dv, _additive(mask, B, Hq, L, T), sinks)
    return ungroup(value_fmt.finish(out.reshape(B, Hkv, Hq // Hkv, L, dv)), queries)


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
    try:
        _module()
    except Exception as exc:  # noqa: BLE001 (any build or load failure: keep the MLX path)
        log.info("CPU attention kernel unavailable (%s); quantized attention uses MLX ops", exc)
        return False
    return True


@functools.cache
def _module():
    path = _build(_cache_dir())
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cache_dir() -> Path:
    from kvserve.configs import default_cache_dir

    return default_cache_dir() / "cpu-kernels"


def _build(cache: Path) -> Path:
    """Compile the extension once per (source, MLX, nanobind, Python, machine)."""
    import mlx
    import nanobind

    mlx_dir = Path(mlx.__path__[0])
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    source = _SOURCE.read_text()
    key = "|".join([source, mx.__version__, nanobind.__version__, sys.version, platform.machine(), _cpu_flags()])
    out = cache / hashlib.sha256(key.encode()).hexdigest()[:16] / f"{_NAME}{suffix}"
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    nb = Path(nanobind.source_dir()).parent
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / out.name
        # MLX's bindings live in nanobind domain "mlx": the extension must join it to take
        # and return mx.array objects.
        cmd = [cxx, "-O3", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-DNDEBUG",
               "-DNB_DOMAIN=mlx", f"-I{mlx_dir / 'include'}", f"-I{nanobind.include_dir()}",
               f"-I{nb / 'ext' / 'robin_map' / 'include'}", f"-I{sysconfig.get_paths()['include']}",
               str(_SOURCE), str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
               f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(lib)]
        res = subprocess.run(cmd[:2] + ["-march=native"] + cmd[2:], capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"{Path(cxx).name} failed: {res.stderr.strip()[-400:]}")
        os.replace(lib, out)
    return out


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()
