"""Fused decode attention over affine-quantized K/V on the CPU (``cpu_attention.cpp``).

On the CPU, attention over an affine4 cache ran through MLX's ``quantized_matmul``, which
decodes one element at a time: with 8 rows at 160 tokens it cost more than the whole rest of
the decode step over an fp16 cache (docs/benchmarks/cpu-step.md). The kernel here is an MLX
primitive written in C++ (the extension API MLX ships: its headers and nanobind), built once
per machine with the system compiler into the cache directory, like the BLAS shim. It serves
affine 4- and 8-bit keys and values with groups of 32, 64 or 128 at head dims that are a
multiple of 32, for up to ``MAX_L`` queries per row (decode and verify steps); anything else
keeps the pure-MLX path. Where it cannot be built (no compiler, no nanobind, an MLX whose
nanobind ABI differs), ``available()`` is False and nothing changes.

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

log = logging.getLogger(__name__)

MAX_L = 16  # queries per row: decode and verify steps (a prefill chunk keeps MLX's matmuls)
_NAME = "kvserve_cpu_attention"
_SOURCE = Path(__file__).with_name("cpu_attention.cpp")


def supports(key_fmt, value_fmt, L: int) -> bool:
    """Affine 4/8-bit keys and values (groups a multiple of 32), at most ``MAX_L`` queries."""
    return L <= MAX_L and _affine(key_fmt) and _affine(value_fmt) and available()


def _affine(fmt) -> bool:
    f = getattr(fmt, "fmt", None)
    return (type(fmt).__name__ == "QuantizedFormat" and f is not None and f.mode == "affine"
            and f.bits in (4, 8) and f.group_size % 32 == 0)


def attend_cpu(queries: mx.array, key_fmt, keys: tuple[mx.array, ...], value_fmt,
               values: tuple[mx.array, ...], scale: float, mask: Any,
               key_scale: mx.array | None = None, sinks: mx.array | None = None) -> mx.array:
    """``dispatch.attend``'s signature: (B, H_q, L, D) queries over stored affine parts."""
    B, Hq, L, D = queries.shape
    T = keys[0].shape[2]
    if D % 32 or (keys[0].shape[3] * 32 // key_fmt.fmt.bits) != D:
        from kvserve.kernels.reference import attend_full

        return attend_full(queries, key_fmt, keys, value_fmt, values, scale, mask, key_scale, sinks)
    q = queries.astype(mx.float32) * scale
    out = _module().affine_attention(q, *keys, key_fmt.fmt.bits, key_fmt.fmt.group_size, *values,
                                     value_fmt.fmt.bits, value_fmt.fmt.group_size,
                                     _additive(mask, B, Hq, L, T), sinks)
    return out.astype(queries.dtype)


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
