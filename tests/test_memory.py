"""Where memory goes: glibc's mmap threshold pinned by the server, heap counters, and prefix
cache entries as one allocation each."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.cache.prefix.snapshot import PACK_ALIGN, restore, take_snapshot
from kvserve.server.engine.heap import MMAP_THRESHOLD, heap_stats

# In a fresh interpreter: free a 4 MiB malloc, then take 2 MiB; print the bytes mmapped.
PROBE = """
import ctypes, sys
from kvserve.server.engine.heap import heap_stats, pin_mmap_threshold
if sys.argv[1] == "pinned":
    assert pin_mmap_threshold()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
libc.free(libc.malloc(4 << 20))
before = heap_stats().mapped
keep = libc.malloc(2 << 20)
print(heap_stats().mapped - before)
"""

glibc_only = pytest.mark.skipif(heap_stats() is None, reason="needs glibc's mallinfo2")


def mapped_after_free(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@glibc_only
def test_a_pinned_threshold_keeps_large_buffers_out_of_the_arenas():
    # glibc alone: freeing the 4 MiB mapping raised the threshold past 2 MiB, so the 2 MiB
    # buffer came from an arena (where its pages would stay after a free).
    assert mapped_after_free("dynamic") == 0
    # Pinned at 1 MiB: it gets a mapping of its own (2 MiB and glibc's page of bookkeeping).
    assert 2 << 20 <= mapped_after_free("pinned") <= (2 << 20) + 4096
    assert MMAP_THRESHOLD == 1 << 20


# In a fresh interpreter: malloc 64 MiB, free it; print the bytes mmapped at each point.
MAPPING_PROBE = """
import ctypes
from kvserve.server.engine.heap import heap_stats
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
before = heap_stats().mapped
block = libc.malloc(64 << 20)
during = heap_stats().mapped
libc.free(block)
print(before, during, heap_stats().mapped)
"""


@glibc_only
def test_heap_stats_count_a_mapping_and_its_free():
    # A fresh interpreter, because a request is served from an arena's free chunks before
    # any threshold applies: after the rest of the suite, this process's arenas hold enough
    # free bytes to place 64 MiB there, and no mapping would appear.
    out = subprocess.run([sys.executable, "-c", MAPPING_PROBE], capture_output=True, text=True, check=True)
    before, during, after = map(int, out.stdout.split())
    # 64 MiB is past the highest threshold glibc raises to (32 MiB): a mapping of its own,
    # with glibc's page of bookkeeping, gone again once freed.
    assert 64 << 20 <= during - before <= (64 << 20) + 4096
    assert after == before


def test_a_prefix_entry_is_one_allocation():
    """Its arrays lie back to back in one buffer (each at a 64-byte boundary), so evicting
    the entry frees one block: from 1 MiB up, a mapping the OS gets back whole."""
    import numpy as np
    from prefix_helpers import filled, state_bytes

    cache = filled("affine4-g32", 300, layers=4)
    snap = take_snapshot(cache)
    arrays = [a for layer in snap.layers for a in layer.arrays]
    starts = [np.asarray(a).__array_interface__["data"][0] for a in arrays]
    expected, at = [], starts[0]
    for a in arrays:
        expected.append(at)
        at += -(-a.nbytes // PACK_ALIGN) * PACK_ALIGN
    assert starts == expected and len(arrays) == 4 * 2  # per affine layer its two records
    assert state_bytes(restore(snap, 300)) == state_bytes(cache)


def test_an_entry_past_2_gib_packs_into_one_buffer():
    """MLX's shape dimensions are 32-bit: the packed buffer is rows of PACK_ALIGN bytes, so
    an entry may hold more than 2 GiB (an 8B model's fp16 cache at 16K tokens is 2 GiB)."""
    import mlx.core as mx
    import numpy as np

    from kvserve.cache.prefix.snapshot import pack

    big = mx.broadcast_to(mx.array(7, mx.uint8), (3, 1 << 29))  # 1.5 GiB, no memory of its own
    small = mx.arange(10, dtype=mx.uint16)
    last = mx.broadcast_to(mx.array(9, mx.uint8), (1 << 29, 2))  # 1 GiB
    a, b, c = pack([big, small, last])
    assert (a.shape, b.shape, c.shape) == (big.shape, small.shape, last.shape)
    assert b.tolist() == list(range(10))
    assert a[2, -3:].tolist() == [7] * 3 and c[-1].tolist() == [9, 9] and c[0].tolist() == [9, 9]
    at = [np.asarray(x[:1] if x.ndim == 1 else x[:1, :1]).__array_interface__["data"][0] for x in (a, b, c)]
    assert at[1] - at[0] == big.nbytes and at[2] - at[1] == PACK_ALIGN
