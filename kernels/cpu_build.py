"""Build and load the C++ extensions that add CPU primitives to MLX.

Each extension is one source file next to this one (with the headers beside it), written
against the extension API MLX ships (its headers and nanobind), compiled once per (source,
flags, MLX, nanobind, Python, machine) with the system compiler into ``<cache>/cpu-kernels``,
like the BLAS shim. ``load`` raises where that cannot happen (no compiler, no nanobind, a
failing build); ``loads`` says whether it can, and callers keep their MLX path where not.

Example (the first call on a machine compiles, later ones load the cached library):
    >>> source = Path(__file__).with_name("cpu_ops.cpp")
    >>> built = loads("kvserve_cpu_ops", source, "CPU layer primitives")
    >>> type(load("kvserve_cpu_ops", source).rms_norm).__name__ if built else "nb_func"
    'nb_func'
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

import mlx.core as mx

log = logging.getLogger(__name__)

_FLAGS = ("-O3", "-std=c++20")  # part of the build key: a change rebuilds


def loads(name: str, source: Path, what: str) -> bool:
    """Whether the extension builds (or was built before) and loads into this MLX; a failure
    is logged once as ``what`` unavailable."""
    try:
        load(name, source)
    except Exception as exc:  # noqa: BLE001 (any build or load failure: the caller keeps MLX's path)
        log.info("%s unavailable (%s); MLX operations serve", what, exc)
        return False
    return True


@functools.cache
def load(name: str, source: Path):
    """The extension module ``name`` built from ``source`` (``NB_MODULE(name, m)``)."""
    path = _build(name, source, _cache_dir())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cache_dir() -> Path:
    from kvserve.configs import default_cache_dir

    return default_cache_dir() / "cpu-kernels"


def _build(name: str, source: Path, cache: Path) -> Path:
    import mlx
    import nanobind

    mlx_dir = Path(mlx.__path__[0])
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    text = source.read_text() + "".join(h.read_text() for h in sorted(source.parent.glob("*.h")))
    key = "|".join([text, " ".join(_FLAGS), mx.__version__, nanobind.__version__, sys.version, platform.machine(), _cpu_flags()])
    out = cache / hashlib.sha256(key.encode()).hexdigest()[:16] / f"{name}{suffix}"
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
        cmd = [cxx, *_FLAGS, "-shared", "-fPIC", "-fvisibility=hidden", "-DNDEBUG",
               "-DNB_DOMAIN=mlx", f"-I{source.parent}", f"-I{mlx_dir / 'include'}", f"-I{nanobind.include_dir()}",
               f"-I{nb / 'ext' / 'robin_map' / 'include'}", f"-I{sysconfig.get_paths()['include']}",
               str(source), str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
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
