"""Give MLX's CPU backend a fast BLAS on Linux.

The Linux ``mlx-cpu`` wheel links ``libmlx.so`` against the netlib *reference*
BLAS it bundles, and every float32 matmul on the CPU goes through its
``cblas_sgemm``: a 128x576 by 576x1536 product takes ~55 ms there instead of
~0.8 ms with OpenBLAS.  ``libmlx.so`` is not linked with -Bsymbolic or DEEPBIND, so a
library that exports ``cblas_sgemm`` and is loaded into the *global* symbol
scope before ``mlx.core`` is imported wins symbol resolution over the bundled
one.

OpenBLAS comes from the ``scipy-openblas32`` wheel (no libgfortran needed) whose
symbols carry a ``scipy_`` prefix, so a few lines of C (compiled once with the
system C compiler into the user cache directory) export ``cblas_sgemm`` and
forward to it.  Decode products (1 to 16 activation rows against a transposed
weight) do not reach OpenBLAS's gemm: it packs the weight matrix on each call, which
makes an M == 1 product up to 5x slower than a gemv (a 1536x576 weight: 0.15 ms
against 0.03 ms) and a whole decode step ~1.7x slower. The shim's own few-rows blocks
compute them, one row as several, with the same sum for each output whatever the
rows around it, so a decode row's logits do not depend on its batch; other single
row or column products go to ``sgemv``.

Call :func:`enable_fast_blas` once, before anything imports ``mlx``.  Where
that is too late (mlx already imported) or no C compiler exists, it falls back
to writing the function's address into libmlx.so's PLT slot for
``cblas_sgemm`` (the slot sits outside RELRO, and is checked before it is
touched); without a compiler that is OpenBLAS's own ``scipy_cblas_sgemm``,
so prefill is as fast but decode misses the gemv path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvserve.configs import BlasSettings, blas_settings

log = logging.getLogger(__name__)

_SHIM_NAME = "libkvserve_blas.so"
# The C source: next to this file, compiled at first use (see _build_shim).
_SHIM_SOURCE = (Path(__file__).with_name("blas_shim.c")).read_text()


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS serves MLX's CPU matmuls in this process, and why."""

    name: str  # "openblas", "reference" or "accelerate"
    active: bool  # True when a fast BLAS serves MLX's float32 matmuls
    reason: str
    library: str | None = None  # the shim / library that provides cblas_sgemm
    openblas: str | None = None  # OpenBLAS's own configuration string
    threads: int | None = None

    def describe(self) -> str:
        """One line, e.g. for the start-up log and ``/v1/models``."""
        extra = f", {self.threads} threads" if self.threads else ""
        return f"{self.name}{extra} ({self.reason})"


_INFO: BlasInfo | None = None


def enable_fast_blas(settings: BlasSettings | None = None) -> BlasInfo:
    """Route MLX's CPU ``cblas_sgemm`` to OpenBLAS; call before importing mlx.

    Idempotent: later calls return the first call's result. ``settings`` defaults to
    ``kvserve.configs.blas_settings()`` (the environment: ``KVSERVE_FAST_BLAS=0`` keeps the
    reference BLAS, ``KVSERVE_BLAS_THREADS`` picks the OpenBLAS thread count, default the
    CPUs this process may run on).
    """
    global _INFO
    if _INFO is None:
        _INFO = _enable(settings or blas_settings())
        (log.info if _INFO.active or _INFO.name == "accelerate" else log.warning)(
            "BLAS: %s", _INFO.describe())
    return _INFO


def blas_info() -> BlasInfo | None:
    """The result of :func:`enable_fast_blas`, or None when it was not called."""
    return _INFO


def codes_library() -> ctypes.CDLL | None:
    """The loaded shim when it serves MLX's products, for ``packed.py``'s registrations
    (signatures declared); None otherwise (no shim, or MLX bound to OpenBLAS directly)."""
    if _INFO is None or not _INFO.active or not _INFO.library:
        return None
    return _shim(_INFO.library)


@functools.cache
def _shim(path: str) -> ctypes.CDLL | None:
    lib = ctypes.CDLL(path)
    if not hasattr(lib, "kvserve_packed_add"):
        return None
    p = ctypes.c_void_p
    lib.kvserve_packed_add.argtypes = [p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, p, p, p]
    lib.kvserve_packed_remove.argtypes = [p]
    lib.kvserve_packed_calls.restype = lib.kvserve_blas_product_ns.restype = ctypes.c_ulonglong
    return lib


def _enable(settings: BlasSettings) -> BlasInfo:
    if sys.platform == "darwin":
        return BlasInfo("accelerate", False, "macOS: MLX uses Accelerate/Metal; nothing to do")
    if not sys.platform.startswith("linux"):
        return BlasInfo("reference", False, f"no fast BLAS set-up for {sys.platform}")
    if not settings.enabled:
        return BlasInfo("reference", False, "disabled by KVSERVE_FAST_BLAS")
    # OpenBLAS's idle threads poll for ~2^28 cycles after each product before they sleep; on
    # a 2-core machine that polling took a core from the shim's helper and the engine (a
    # 4 ms time slice lost after a small product). 2^4 cycles: they sleep at once. Read once,
    # when the library loads, which importing the package does.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    try:
        import scipy_openblas32  # noqa: PLC0415  (optional dependency)
    except ImportError:
        return BlasInfo("reference", False, "scipy-openblas32 is not installed")
    openblas = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(True)
    ob = ctypes.CDLL(str(openblas))
    n = _thread_count(settings.threads)
    ob.scipy_openblas_set_num_threads(ctypes.c_int(n))
    ob.scipy_openblas_get_config.restype = ctypes.c_char_p
    config = ob.scipy_openblas_get_config().decode(errors="replace")
    try:
        shim, note = _build_shim(openblas, settings.cache_dir, settings.compiler), ""
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        shim, note = None, f"no C shim: {exc}"
    if shim is not None and "mlx.core" not in sys.modules:
        # RTLD_GLOBAL puts cblas_sgemm in the global scope, which the dynamic
        # linker searches before libmlx.so's own dependencies (reference libblas).
        lib = ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
        lib.kvserve_blas_set_threads(ctypes.c_int(n))
        ok, why = _verify(lib)
        if ok:
            return BlasInfo("openblas", True, why, str(shim), config, n)
        note = f"preloading the shim did not work: {why}"
    elif shim is not None:
        note = "mlx was imported first"
    return _activate_by_slot(shim, ob, config, n, note)


def _activate_by_slot(shim: Path | None, ob: ctypes.CDLL, config: str, n: int, note: str) -> BlasInfo:
    """Fallback when mlx is already loaded or no C compiler is available:
    point libmlx.so's lazily bound PLT slot for cblas_sgemm at the shim, or
    straight at OpenBLAS's (ABI-identical) scipy_cblas_sgemm."""
    import mlx.core  # noqa: F401, PLC0415  (loads libmlx.so, whose slot is patched)

    lib = ctypes.CDLL(str(shim)) if shim is not None else None
    if lib is not None:
        lib.kvserve_blas_set_threads(ctypes.c_int(n))
    target = ctypes.cast(lib.cblas_sgemm if lib else ob.scipy_cblas_sgemm, ctypes.c_void_p).value
    try:
        previous = _patch_plt_slot("libmlx.so", "cblas_sgemm", target)
    except (OSError, RuntimeError, ValueError) as exc:
        return BlasInfo("reference", False, f"{note}; cannot redirect libmlx.so: {exc}".lstrip("; "))
    ok, why = _verify(lib)
    if not ok:
        _patch_plt_slot("libmlx.so", "cblas_sgemm", previous)  # back to what it was
        return BlasInfo("reference", False, why)
    why += f"; bound through libmlx.so's cblas_sgemm PLT slot ({note})"
    return BlasInfo("openblas", True, why, str(shim) if shim else None, config, n)


def _verify(lib: ctypes.CDLL | None) -> tuple[bool, str]:
    """Import mlx, run one gemm and one gemv through it, and check that the
    results match numpy and (with the shim) that the shim served them."""
    import mlx.core as mx  # noqa: PLC0415  (must come after the shim is loaded)
    import numpy as np  # noqa: PLC0415

    def calls() -> int:
        if lib is None:
            return 0
        counters = (lib.kvserve_blas_sgemm_calls, lib.kvserve_blas_sgemv_calls, lib.kvserve_blas_small_calls)
        for counter in counters:
            counter.restype = ctypes.c_ulonglong
        return sum(counter() for counter in counters)

    before = calls()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((33, 70), np.float32), rng.standard_normal((50, 70), np.float32)
    with mx.stream(mx.cpu):
        got = [np.array(mx.array(x) @ mx.array(b).T) for x in (a, a[:1])]
    if lib is not None and calls() - before < 2:
        return False, "libmlx.so did not resolve cblas_sgemm to the shim"
    want = a.astype(np.float64) @ b.T.astype(np.float64)
    err = max(float(np.abs(got[0] - want).max()), float(np.abs(got[1] - want[:1]).max()))
    if err > 1e-3:
        return False, f"OpenBLAS result differs from numpy by {err:.2e}"
    via = "cblas shim (M<=16 -> few-rows blocks)" if lib is not None else "scipy_cblas_sgemm"
    return True, f"scipy-openblas32 via {via}, verified against numpy"


# -- redirecting one PLT slot of an already loaded library ------------------

_JUMP_SLOT = {62: 7, 183: 1026}  # e_machine -> R_*_JUMP_SLOT: x86-64, aarch64


def _patch_plt_slot(lib_name: str, symbol: str, target: int) -> int:
    """Store ``target`` in the GOT entry through which ``lib_name`` calls
    ``symbol``; returns the address the entry held before.

    Refuses (raises) unless: the library is mapped in this process, ``symbol``
    has exactly one relocation there and it is a PLT jump slot, the slot is
    writable (not RELRO), and it currently points into the library itself (not
    yet bound) or into a BLAS library (bound): anything else is not understood.
    """
    maps = _mappings()
    path, base = next(((p, lo) for lo, hi, perm, off, p in maps
                       if os.path.basename(p) == lib_name and off == 0), (None, None))
    if path is None:
        raise RuntimeError(f"{lib_name} is not loaded")
    slot = base + _jump_slot_offset(Path(path), symbol)
    region = next((m for m in maps if m[0] <= slot < m[1]), None)
    if region is None or "w" not in region[2]:
        raise RuntimeError(f"the {symbol} slot of {lib_name} is not writable")
    cell = ctypes.c_uint64.from_address(slot)
    owner = next((os.path.basename(m[4]) for m in maps if m[0] <= cell.value < m[1]), "")
    if owner != lib_name and "blas" not in owner:
        raise RuntimeError(f"the {symbol} slot points into unexpected code ({owner or 'unmapped'})")
    previous = cell.value
    cell.value = target  # one aligned 8-byte store: atomic on the supported CPUs
    return previous


def _mappings() -> list[tuple[int, int, str, int, str]]:
    """(start, end, perms, file offset, path) for each mapping of this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[1], int(parts[2], 16), parts[5].strip() if len(parts) > 5 else ""))
    return out


def _jump_slot_offset(path: Path, symbol: str) -> int:
    """Address (relative to the load base) of ``symbol``'s PLT slot in the ELF file."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path.name}: not a 64-bit little-endian ELF file")
    machine, = struct.unpack_from("<H", data, 0x12)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # Elf64_Shdr: name type flags addr offset size link info align entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    found = []
    for sh in sections:
        if sh[1] != 4 or sections[sh[6]][1] != 11:  # SHT_RELA against SHT_DYNSYM
            continue
        symtab, strtab = sections[sh[6]], sections[sections[sh[6]][6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            r_offset, r_info = struct.unpack_from("<QQ", data, off)
            name_at = strtab[4] + struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * 24)[0]
            if data[name_at : data.index(b"\0", name_at)] == symbol.encode():
                found.append((r_offset, r_info & 0xFFFFFFFF))
    if len(found) != 1 or found[0][1] != _JUMP_SLOT.get(machine):
        raise ValueError(f"{path.name}: {symbol} is not reached through exactly one PLT slot")
    return found[0][0]


def _thread_count(threads: int | None) -> int:
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, int(threads or 1))


def _cpu_model() -> str:
    """Part of the shim's cache key: it is compiled for this CPU's vector instructions."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return platform.processor()


def _build_shim(openblas: Path, cache: Path, compiler: str | None) -> Path:
    """Compile the shim once per (source, OpenBLAS file, machine) into the cache."""
    stat = openblas.stat()
    key = f"{_SHIM_SOURCE}|{openblas}|{stat.st_size}|{stat.st_mtime_ns}|{platform.machine()}|{_cpu_model()}"
    out = cache / hashlib.sha256(key.encode()).hexdigest()[:16] / _SHIM_NAME
    if out.exists():
        return out
    cc = compiler or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "shim.c", Path(tmp) / _SHIM_NAME
        src.write_text(_SHIM_SOURCE)
        # Link the OpenBLAS file itself, with an rpath to its folder, so the shim
        # finds it without LD_LIBRARY_PATH.
        cmd = [cc, "-O3", "-shared", "-fPIC", "-pthread", "-o", str(lib), str(src), str(openblas),
               f"-Wl,-rpath,{openblas.parent}"]
        # The machine's own vector width for the small-M kernel; compilers without the
        # flag build the same code with the baseline instruction set.
        res = subprocess.run(cmd[:2] + ["-march=native"] + cmd[2:], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: {res.stderr.strip()[-300:]}")
        os.replace(lib, out)  # atomic: concurrent start-ups never see half a file
    return out
