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


def test_arrays_from_1_mib_up_are_copied_on_their_own():
    """Arrays under OWN_BUFFER share one buffer, back to back; each larger one is one copy of
    its own (a mapping of its own under the threshold the server pins), strided or not."""
    import mlx.core as mx
    import numpy as np

    from kvserve.cache.prefix.snapshot import OWN_BUFFER, pack

    stored = mx.arange(2 * 3 * 4096 * 64, dtype=mx.uint32).reshape(2, 3, 4096, 64).astype(mx.float16)
    big = stored[:1, :, :3000]  # a strided view of a growable buffer: 1.1 MiB
    whole = stored[1:]  # contiguous, the whole of its part of the buffer
    small = mx.arange(10, dtype=mx.uint16)
    last = mx.ones((3, 5), mx.uint32)
    a, b, c, d = pack([big, small, whole, last])
    assert big.nbytes >= OWN_BUFFER and whole.nbytes >= OWN_BUFFER
    assert mx.array_equal(a, big).item() and mx.array_equal(c, whole).item()
    assert b.tolist() == list(range(10)) and d.tolist() == [[1] * 5] * 3
    at = [np.asarray(x).__array_interface__["data"][0] for x in (a, b, c, d, stored)]
    assert at[3] - at[1] == PACK_ALIGN  # the small ones share a buffer
    base = at[4]  # where big and whole lie in the caller's buffer: base and its second half
    assert len({at[0], at[1], at[2], base, base + stored.nbytes // 2}) == 5  # a copy each


def test_the_own_buffer_size_is_the_pinned_mmap_threshold():
    from kvserve.cache.prefix.snapshot import OWN_BUFFER

    assert OWN_BUFFER == MMAP_THRESHOLD
