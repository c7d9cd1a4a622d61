"""Growable storage for KV caches: several (B, H, T, W) arrays that share the T axis.

A cache family encodes keys and values into one or more parts (raw K and V; or packed
words + scales + biases for each), all indexed by token along axis 2. ``GrowableBuffer``
keeps them together: one ``size`` (slots written) and one ``capacity`` (slots allocated).

Growth is geometric up to ``MAX_GROWTH`` slots: when an append does not fit, every part is
copied once into arrays of ``capacity + min(capacity, MAX_GROWTH)`` slots (or ``need`` rounded
up to the granule, if larger). Reaching 32,768 tokens one at a time from a 256-slot start
takes 11 growths (256 -> 512 -> ... -> 4096, then 4,096 at a time), where a fixed 256-slot
step would take 127. The cap bounds what a long row holds beyond its tokens: doubling took
a batch of 16K-token rows to 32K slots at its next step, twice the bytes ``--kv-memory``
counted for them (the budget counts tokens), where now it takes them to 20K. Allocation is
the first ``append``; it is not a growth.

    >>> next_capacity(256, 257, granule=256)
    512
    >>> next_capacity(512, 3000, granule=256)   # a prefill larger than twice the capacity
    3072
    >>> next_capacity(16384, 16385, granule=256)
    20480
    >>> growths_to_reach(32768, chunk=1, granule=256)
    11

The batch operations at the end (``take``, ``align``, ``concat_batch``, ``roll_rows``) are
the storage half of the batch algebra (merge / filter / extend / finalize): they move
slots and rows, and know nothing about how a family encodes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

DEFAULT_GRANULE = 256
# Slots a growth adds at most (module doc). A row growing past it copies itself every 4,096
# tokens it decodes; at 16K tokens that copy is a small share of the 4,096 steps' attention.
MAX_GROWTH = 4096


def round_up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def row_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """``rows`` as [start, stop) runs of consecutive rows, in order (``take``'s slices)."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def _kept(part: mx.array, runs: list[tuple[int, int]], drop_front: int) -> mx.array:
    """The rows of ``runs`` (and slots from ``drop_front`` on) as a new array of their own."""
    pieces = [part[a:b, :, drop_front:] for a, b in runs] or [part[:0, :, drop_front:]]
    return mx.concatenate(pieces, axis=0) if len(pieces) > 1 else mx.contiguous(pieces[0])


def next_capacity(capacity: int, need: int, granule: int = DEFAULT_GRANULE) -> int:
    """Capacity after a growth: double up to ``MAX_GROWTH`` slots more, or straight to ``need``
    (granule-rounded) if larger."""
    return max(capacity + min(capacity, MAX_GROWTH), round_up(need, granule))


def growths_to_reach(tokens: int, chunk: int = 1, granule: int = DEFAULT_GRANULE) -> int:
    """How many growths appending ``tokens`` in chunks of ``chunk`` costs (pure arithmetic)."""
    capacity, size, growths = 0, 0, 0
    while size < tokens:
        need = min(size + chunk, tokens)
        if capacity == 0:
            capacity = round_up(need, granule)
        elif need > capacity:
            capacity, growths = next_capacity(capacity, need, granule), growths + 1
        size = need
    return growths


class GrowableBuffer:
    """Parts of shape (B, H, capacity, W_i) written up to ``size`` along axis 2.

    Example, granule 4, one part of width 1 (``.`` = allocated, not written):

        append 3 tokens   [a b c .]          size 3, capacity 4, growths 0
        append 2 tokens   [a b c d e . . .]  size 5, capacity 8, growths 1 (one copy)
        trim 1            [a b c d | e . . .]  size 4 (slot 4 is stale, overwritten next)
    """

    def __init__(self, granule: int = DEFAULT_GRANULE):
        self.granule = granule
        self.parts: list[mx.array] | None = None
        self.size = 0
        self.growths = 0

    @classmethod
    def adopt(cls, parts: Sequence[mx.array], size: int | None = None,
              granule: int = DEFAULT_GRANULE) -> GrowableBuffer:
        """Wrap existing arrays (capacity = their T; ``size`` defaults to all of it)."""
        buf = cls(granule)
        if parts:
            buf.parts = [p[:, :, :] for p in parts]  # own handles: appends must not reach the caller's
            buf.size = buf.capacity if size is None else size
        return buf

    @property
    def capacity(self) -> int:
        return 0 if self.parts is None else self.parts[0].shape[2]

    @property
    def batch_size(self) -> int:
        return 0 if self.parts is None else self.parts[0].shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not size)."""
        return 0 if self.parts is None else sum(p.nbytes for p in self.parts)

    def views(self) -> list[mx.array]:
        """Each part's first ``size`` slots, as new arrays: ``append`` writes into the parts
        in place (``a[...] = x`` rebinds ``a`` itself), so handing the parts out would let a
        later append change what a caller already holds."""
        if self.parts is None:
            return []
        return [p[:, :, : self.size] for p in self.parts]  # (B, H, size, W_i)

    def reserve(self, templates: Sequence[mx.array], need: int) -> None:
        """Make room for ``need`` slots; ``templates`` give batch, heads, widths and dtypes."""
        if self.parts is None:
            cap = round_up(max(need, 1), self.granule)
            self.parts = [mx.zeros((t.shape[0], t.shape[1], cap, t.shape[3]), t.dtype) for t in templates]
        elif need > self.capacity:
            cap = next_capacity(self.capacity, need, self.granule)
            # Slice + pad is one copy of the written slots into the new allocation.
            pad = [(0, 0), (0, 0), (0, cap - self.size), (0, 0)]
            self.parts = [mx.pad(p[:, :, : self.size], pad) for p in self.parts]
            self.growths += 1

    def append(self, parts: Sequence[mx.array]) -> None:
        """Write (B, H, L, W_i) parts at slots [size, size + L)."""
        if self.parts is not None and len(parts) != len(self.parts):
            raise ValueError(f"expected {len(self.parts)} parts, got {len(parts)}")
        n = parts[0].shape[2]
        self.reserve(parts, self.size + n)
        for dst, src in zip(self.parts, parts):
            dst[:, :, self.size : self.size + n] = src
        self.size += n

    def trim(self, n: int) -> int:
        n = min(self.size, n)
        self.size -= n
        return n

    def drop_front(self, n: int, capacity: int) -> None:
        """Forget the first ``n`` written slots: the rest moves to the front of new arrays of
        ``capacity`` slots (one copy), so a sliding window's storage stays bounded.

            size 6, capacity 8   [a b c d e f . .]
            drop_front(4, 4)     [e f . .]          size 2, capacity 4
        """
        keep = self.size - n
        if self.parts is None or n <= 0:
            return
        pad = [(0, 0), (0, 0), (0, max(capacity, keep) - keep), (0, 0)]
        self.parts = [mx.pad(p[:, :, n : self.size], pad) for p in self.parts]
        self.size = keep

    # --- batch algebra on storage (rows = sequences along axis 0) ---

    def take(self, rows: Sequence[int], drop_front: int = 0) -> None:
        """Keep ``rows`` (in that order) and drop the first ``drop_front`` slots, keeping the
        spare capacity. Each run of consecutive rows is one slice, and the kept rows are one
        contiguous copy: an index array took MLX's gather, which on CUDA copies element by
        element. A single run is copied too (``mx.contiguous``), not kept as a view of the
        old parts: MLX writes an append into a view's buffer by copying all of it (a 7-row
        view of 4,096 slots: 1.0 ms an append on the CPU against 0.05 ms into its own).

            >>> b = GrowableBuffer.adopt([mx.arange(4).reshape(4, 1, 1, 1)], 1)
            >>> b.take([0, 1, 3]); b.parts[0].reshape(-1).tolist()
            [0, 1, 3]
            >>> row_runs([0, 1, 3, 4, 5, 2])
            [(0, 2), (3, 6), (2, 3)]
        """
        runs = row_runs(rows)
        if self.parts is not None and (drop_front or runs != [(0, self.parts[0].shape[0])]):
            self.parts = [_kept(p, runs, drop_front) for p in self.parts]
        self.size = max(self.size - drop_front, 0)

    def row(self, i: int, start: int) -> GrowableBuffer:
        """Row ``i``'s slots [start, size) as a one-row buffer with spare room (one copy)."""
        n = self.size - start
        cap = round_up(n + 1, self.granule)
        pad = [(0, 0), (0, 0), (0, cap - n), (0, 0)]
        parts = [mx.pad(p[i : i + 1, :, start : self.size], pad) for p in self.parts]
        return GrowableBuffer.adopt(parts, n, self.granule)

    def align(self, left: int, capacity: int) -> list[mx.array]:
        """Parts with ``left`` empty slots in front and ``capacity`` slots in all (one copy)."""
        pad = [(0, 0), (0, 0), (left, capacity - left - self.size), (0, 0)]
        return [mx.pad(p[:, :, : self.size], pad) for p in self.parts]

    def roll_rows(self, shifts: Sequence[int]) -> None:
        """Rotate each row's written slots right by its shift (right padding -> left padding).

        Only the rows that move are copied: each one's rotated slots are made first (one
        evaluation for all of them, after which nothing else reads the parts), then written
        back into its row, which MLX does in place when no one else holds the part; that is
        evaluated here too, so the rotated copies are freed before the next layer's reuse
        their memory. Rows that do not move, and the spare capacity, are not touched (a
        verify step where one row of eight rejects a guess moves one row, not the cache)."""
        if self.parts is None or self.size == 0 or not any(shifts):
            return
        n = self.size
        moved = [(i, b, mx.concatenate([p[b : b + 1, :, n - r % n : n], p[b : b + 1, :, : n - r % n]], axis=2))
                 for i, p in enumerate(self.parts) for b, r in enumerate(shifts) if r % n]
        mx.eval([rolled for _, _, rolled in moved])
        for i, b, rolled in moved:
            self.parts[i][b : b + 1, :, :n] = rolled
        mx.eval(self.parts)

    @staticmethod
    def concat_batch(buffers: Sequence[GrowableBuffer], fronts: Sequence[int], size: int,
                     granule: int = DEFAULT_GRANULE) -> GrowableBuffer:
        """Stack buffers along rows, each shifted right by its ``fronts`` entry so that all
        end at slot ``size``; the result has room for at least one more slot (one copy)."""
        cap = round_up(size + 1, granule)
        rows = sum(b.batch_size for b in buffers)
        template = buffers[0].parts
        out = [mx.zeros((rows, t.shape[1], cap, t.shape[3]), t.dtype) for t in template]
        r = 0
        for b, front in zip(buffers, fronts):
            for dst, src in zip(out, b.parts):
                dst[r : r + b.batch_size, :, front : front + b.size] = src[:, :, : b.size]
            r += b.batch_size
        stacked = GrowableBuffer(granule)
        stacked.parts, stacked.size = out, size
        return stacked

    def empty_rows(self, rows: int) -> GrowableBuffer:
        """A buffer of ``rows`` rows with no written slots, shaped like this one's parts."""
        parts = [mx.zeros((rows, p.shape[1], 0, p.shape[3]), p.dtype) for p in self.parts]
        return GrowableBuffer.adopt(parts, 0, self.granule)
