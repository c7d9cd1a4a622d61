"""Build and load the C++ extensions that add CPU primitives to MLX.

Each extension is one source file next to this one (with the headers beside it), written
against the extension API MLX ships (its headers and nanobind), compiled once per (source,
flags, MLX, nanobind, Python, machine) with the system compiler into ``<cache>/cpu-kernels``,
like the BLAS shim: one process at a time, and nanobind's own source once for all of them
(on the 2-core VM the two extensions took 32.6 s built the old way, one after the other,
and 17.4 s so). ``load`` raises where that cannot happen (no compiler, no nanobind, a
failing build); ``loads`` says whether it can, and callers keep their MLX path where not.

Example (the first call on a machine compiles, later ones load the cached library):
    >>> source = Path(__file__).with_name("cpu_ops.cpp")
    >>> built = loads("kvserve_cpu_ops", source, "CPU layer primitives")
    >>> type(load("kvserve_cpu_ops", source).rms_norm).__name__ if built else "nb_func"
    'nb_func'
"""

from __future__ import annotations

import fcntl
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
    """The extension's library in ``cache``, compiled first where it is not there yet.

    One process builds at a time (a lock in ``cache``): servers or test workers starting
    together on a fresh machine wait for the first one's library instead of compiling it
    again beside it. nanobind's own source, the larger half of every build, is compiled
    once into an object that every extension links (``_nanobind_object``), at the same time
    as the extension's source."""
    import nanobind

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    text = source.read_text() + "".join(h.read_text() for h in sorted(source.parent.glob("*.h")))
    key = "|".join([text, " ".join(_FLAGS), mx.__version__, nanobind.__version__, sys.version, platform.machine(), _cpu_flags()])
    out = cache / hashlib.sha256(key.encode()).hexdigest()[:16] / f"{name}{suffix}"
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():  # else built by the process that held the lock before
            _build_locked(cxx, source, out, cache)
    return out


def _build_locked(cxx: str, source: Path, out: Path, cache: Path) -> None:
    import mlx
    import nanobind

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        nb_object = _nanobind_object(cxx, cache)
        jobs = [(source, Path(tmp) / f"{source.stem}.o")]
        if not nb_object.exists():
            jobs.append((Path(nanobind.source_dir()) / "nb_combined.cpp", Path(tmp) / "nb_combined.o"))
        mlx_dir = Path(mlx.__path__[0])
        _compile(cxx, _compile_flags(source.parent, mlx_dir), jobs)
        if len(jobs) == 2:
            nb_object.parent.mkdir(parents=True, exist_ok=True)
            os.replace(jobs[1][1], nb_object)
        lib = Path(tmp) / out.name
        _link(cxx, [jobs[0][1], nb_object], mlx_dir, lib)
        os.replace(lib, out)  # atomic: a process that did not wait never sees half a file


def _compile_flags(include: Path, mlx_dir: Path) -> list[str]:
    import nanobind

    nb = Path(nanobind.source_dir()).parent
    # MLX's bindings live in nanobind domain "mlx": the extension must join it to take
    # and return mx.array objects.
    return [*_FLAGS, "-fPIC", "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx", f"-I{include}",
            f"-I{mlx_dir / 'include'}", f"-I{nanobind.include_dir()}",
            f"-I{nb / 'ext' / 'robin_map' / 'include'}", f"-I{sysconfig.get_paths()['include']}"]


def _nanobind_object(cxx: str, cache: Path) -> Path:
    """Where nanobind's compiled source is kept: one object per (nanobind, Python, flags,
    compiler, machine), the same bytes whichever extension links it."""
    import nanobind

    key = "|".join([nanobind.__version__, " ".join(_FLAGS), sys.version, cxx, platform.machine(), _cpu_flags()])
    return cache / f"nanobind-{hashlib.sha256(key.encode()).hexdigest()[:16]}" / "nb_combined.o"


def _compile(cxx: str, flags: list[str], jobs: list[tuple[Path, Path]]) -> None:
    """Compile each (source, object) pair, all at once, for this machine's instruction set
    where the compiler takes ``-march=native`` (else the baseline one)."""
    def command(src: Path, obj: Path, native: bool) -> list[str]:
        return [cxx, *(["-march=native"] if native else []), *flags, "-c", str(src), "-o", str(obj)]

    running = [(src, obj, subprocess.Popen(command(src, obj, True), stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, text=True)) for src, obj in jobs]
    for _src, _obj, proc in running:
        proc.communicate(timeout=600)
    for src, obj, proc in running:
        if proc.returncode != 0:
            res = subprocess.run(command(src, obj, False), capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"{Path(cxx).name} failed on {src.name}: {res.stderr.strip()[-400:]}")


def _link(cxx: str, objects: list[Path], mlx_dir: Path, lib: Path) -> None:
    cmd = [cxx, "-shared", *map(str, objects), f"-L{mlx_dir / 'lib'}", "-lmlx",
           f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(lib)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"{Path(cxx).name} failed to link {lib.name}: {res.stderr.strip()[-400:]}")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()
