"""The C heap under MLX: on a CPU, MLX takes every buffer from ``malloc`` (and keeps at most
32 MiB of freed ones for reuse), so the process's memory is whatever glibc's malloc holds.

glibc serves an allocation of at least its *mmap threshold* from a mapping of its own, which
goes back to the OS when freed; smaller ones come from arenas, whose freed gaps stay
resident until malloc reuses them. The threshold starts at 128 KiB, but glibc raises it to
the size of every such mapping freed (up to 32 MiB). Loading and measuring the weights at
start-up frees large buffers, so afterwards nearly every buffer came from the engine
thread's arena, where long-lived prefix-cache entries sat between short-lived batch caches,
logits and activations: once the prefix cache started evicting, the arenas' free bytes and
RSS grew by ~70 MiB while MLX's own counters stayed flat (docs/hardening.md, "Soak").
``pin_mmap_threshold`` fixes the threshold at ``MMAP_THRESHOLD`` before the model loads.

``heap_stats`` reads glibc's ``mallinfo2``; both are no-ops elsewhere (macOS, musl,
glibc < 2.33):

    >>> stats = heap_stats()
    >>> stats is None or (stats.in_use > 0 and stats.free >= 0 and stats.mapped >= 0)
    True
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from functools import cache


# Buffers of at least this size get their own mapping: weights, batch KV caches, logits,
# prefix-cache entries (one allocation each, ``kvserve.cache.prefix.snapshot.pack``).
# Smaller ones stay in the arenas, so the number of mappings stays far below the kernel's
# limit (vm.max_map_count, 65,530 by default).
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@dataclass(frozen=True)
class HeapStats:
    in_use: int  # bytes of live allocations in malloc's arenas
    free: int  # bytes malloc holds free in its arenas (resident until reused or trimmed)
    mapped: int  # bytes of allocations malloc gave their own mmap (returned to the OS on free)


@cache
def _glibc():
    """The C library when it is glibc with ``mallinfo2``, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    except (AttributeError, OSError):
        return None
    return libc


def heap_stats() -> HeapStats | None:
    """malloc's counters over all arenas (glibc locks each arena while it counts)."""
    libc = _glibc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return HeapStats(in_use=info.uordblks, free=info.fordblks, mapped=info.hblkhd)


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (setting it turns glibc's raising off); False where the C
    library is not glibc. Call before the model loads."""
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, nbytes) == 1
