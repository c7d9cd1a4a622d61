"""``PrefixCache``: the index, the RAM tier and the disk tier behind four calls.

Every method runs on the engine thread (the one that owns the MLX arrays); the only other
thread is the disk writer, which reports back through events drained at each call.

An entry is reachable while it has at least one home:

    RAM        its snapshot, counted against ``ram_bytes`` (LRU by bytes)
    queued     a write job holding the snapshot (lookups use it until the file exists)
    disk       a written file, counted against ``disk_bytes`` (LRU by bytes, by mtime across restarts)

Inserting queues a write (write-behind); RAM eviction keeps entries that are on disk or
queued and spills the others (a full queue drops the spill, counted); disk eviction deletes
the file. An entry that loses its last home leaves the index.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvserve.cache.container import PromptCache
from kvserve.cache.prefix.disk import ensure_dir, scan
from kvserve.cache.prefix.files import DAMAGED, REASONS, FileRefused, Header, entry_metadata, read_tensors
from kvserve.cache.prefix.index import RadixIndex
from kvserve.cache.prefix.lru import LRUBytes
from kvserve.cache.prefix.namespace import SUFFIX, Namespace, as_tokens
from kvserve.cache.prefix.checkpoints import Checkpoint, Span, best_length, covers
from kvserve.cache.prefix.snapshot import (
    Snapshot,
    device_array,
    as_checkpoints,
    host_tensors,
    keep_checkpoints,
    layer_descriptions,
    reaches,
    rebuild,
    restore,
    stored_layer_count,
    take_snapshot,
    unsupported,
)
from kvserve.cache.prefix.writer import DeleteJob, TouchJob, WriteFailed, WriteJob, Writer, Written
from kvserve.cache.serialize import CacheFileError, _load_layer  # the layer allowlist and checks

log = logging.getLogger("kvserve.cache.prefix")

FOREIGN_KEY = "foreign:"  # disk-tier keys of files this server can never load


@dataclass
class Hit:
    """A lookup's answer: ``cache`` holds exactly the first ``num_tokens`` prompt tokens and
    belongs to the caller; ``source`` is "ram" or "disk"."""

    num_tokens: int
    cache: PromptCache
    source: str


@dataclass(eq=False)
class _Entry:
    key: str
    tokens: tuple[int, ...]
    spans: tuple[Span, ...]  # the lengths it serves exactly
    nbytes: int  # the snapshot's bytes (its RAM cost)
    snap: Snapshot | None = None  # resident in RAM
    job: WriteJob | None = None  # queued for disk
    on_disk: bool = False  # a written file, counted in the disk tier
    used: int = 0  # recency clock: among equal matches the most recent serves
    checkpoints: int = 0  # how many it keeps (unknown, 0, for files found at start-up)

    def payload(self) -> Snapshot | None:
        return self.snap if self.snap is not None else (self.job.payload if self.job else None)


class PrefixCache:
    """Longest-prefix reuse of prompt caches for one namespace, in RAM and on disk."""

    def __init__(self, ns: Namespace, ram_bytes: int, disk_dir: Path | str | None = None,
                 disk_bytes: int = 0, max_pending_writes: int = 16, max_pending_bytes: int = 1 << 30):
        self.ns = ns
        self._index = RadixIndex()
        self._entries: dict[str, _Entry] = {}
        self._ram = LRUBytes(ram_bytes)
        self._dir = ensure_dir(Path(disk_dir)) if disk_dir is not None else None
        self._disk = LRUBytes(disk_bytes) if self._dir else None
        self._writer = Writer() if self._dir else None
        self._foreign: dict[str, Path] = {}
        self._max_pending = (max_pending_writes, max_pending_bytes)
        self._pending = [0, 0]  # write jobs, bytes
        self._clock = itertools.count(1)
        self._count = dict.fromkeys(("hits", "misses", "hit_tokens", "disk_hits", "inserts",
                                     "unsupported", "dropped_spills", "write_errors",
                                     "ram_evictions", "disk_evictions", "missing_files",
                                     "checkpoints_stored", "checkpoint_hits", "checkpoints_evicted"), 0)
        self._refused = dict.fromkeys(REASONS, 0)
        self._closed = False
        if self._dir:
            self._open_directory()

    # --- start-up --------------------------------------------------------------------

    def _open_directory(self) -> None:
        """Rebuild the disk tier from headers: files of other namespaces are the oldest (the
        budget evicts them first: this server can never load them), then ours by mtime."""
        found = scan(self._dir, self.ns)
        for info in found.damaged + found.foreign:
            self._refused[info.reason] += 1
        for info in found.foreign:
            key = FOREIGN_KEY + info.path.name
            self._foreign[key] = info.path
            self._evict_disk_keys(self._disk.add(key, info.size))
        for info in found.ours:
            e = _Entry(info.path.name[: -len(SUFFIX)], info.header.tokens(), info.header.spans, 0)
            if self._redundant(e):  # e.g. a crash between writing an entry and dropping its prefix
                self._delete_file(e.key)
                continue
            self._admit(e)
            e.on_disk = True
            self._evict_disk_keys(self._disk.add(e.key, info.size))
        if found.foreign or found.damaged or found.temps_removed:
            log.info("prefix cache: %d entries in %s; %d files of other versions or namespaces kept, "
                     "%d damaged deleted, %d temporary removed", len(self._entries), self._dir,
                     len(found.foreign), len(found.damaged), found.temps_removed)

    # --- the public calls ------------------------------------------------------------

    def lookup(self, prompt: Iterable[int]) -> Hit | None:
        """The longest cached prefix of ``prompt``, at most ``len(prompt) - 1`` tokens (the
        last prompt token is always computed), as a new container; None on a miss."""
        self._check_open()
        self._drain()
        tokens = as_tokens(prompt)
        for m, entries in self._candidates(tokens):
            for e in sorted(entries, key=lambda e: (e.payload() is not None, e.used), reverse=True):
                if self._entries.get(e.key) is not e:
                    continue  # a failed load just removed it
                hit = self._serve(e, m)
                if hit is not None:
                    self._count["hits"] += 1
                    self._count["hit_tokens"] += m
                    self._count["disk_hits"] += hit.source == "disk"
                    return hit
        self._count["misses"] += 1
        return None

    def parting(self, prompt: Iterable[int]) -> int:
        """How many first tokens of ``prompt`` some stored entry starts with: where this
        prompt parts from what is cached. A model whose layers cannot trim keeps a checkpoint
        there, so the next prompt with that same start resumes at its end (the way two
        conversations with one system prompt tell where it ends, without a template)."""
        self._check_open()
        return self._index.shared(as_tokens(prompt))

    def insert(self, tokens: Iterable[int], cache: PromptCache, checkpoints: Iterable[Checkpoint] = ()) -> bool:
        """Store a snapshot of ``cache`` (B = 1, ``offset == len(tokens)``) for ``tokens``,
        with ``checkpoints`` of its window and state layers at shorter lengths
        (``checkpoints.capture``). A stored entry whose tokens it extends, held in RAM,
        gives it its checkpoints and its own layers as one more (``as_checkpoints``).

        Returns False when nothing new was stored: the tokens are empty, an entry that
        extends them already serves every lookup they would, the cache holds layers the
        store cannot copy (counted as ``unsupported``), or it fits in no tier."""
        self._check_open()
        self._drain()
        tokens = as_tokens(tokens)
        if unsupported(cache):
            self._count["unsupported"] += 1
            return False
        self._check_matches(tokens, cache)
        if not tokens:
            return False
        kept, served = keep_checkpoints(reaches(cache), len(tokens), [*checkpoints, *self._inherited(tokens)])
        e = _Entry(self.ns.entry_key(tokens), tokens, served, 0, checkpoints=len(kept))
        if self._redundant(e):
            return False  # decided before any array is copied
        snap = take_snapshot(cache, kept)
        e.nbytes = snap.nbytes
        self._count["checkpoints_stored"] += e.checkpoints
        self._admit(e)
        self._put_ram(e, snap)
        if self._entries.get(e.key) is not e:  # larger than RAM and not spillable
            return False
        if self._writer is not None and e.job is None:
            self._queue_write(e, snap)
        if e.payload() is None:
            self._forget(e)
            return False
        self._count["inserts"] += 1
        return True

    def stats(self) -> dict:
        """Counters and sizes (for /metrics); ``refused`` counts files by reason."""
        self._drain()
        disk = self._disk
        return {**self._count,
                "ram_bytes": self._ram.total, "ram_entries": len(self._ram),
                "disk_bytes": disk.total if disk else 0,
                "disk_entries": sum(e.on_disk for e in self._entries.values()),
                "foreign_files": len(self._foreign), "entries": len(self._entries),
                "pending_writes": self._pending[0], "refused": dict(self._refused)}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued disk job is done; False if ``timeout`` ran out first."""
        if self._writer is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # draining may queue more work (the deletes of evicted files)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = self._writer.flush(left)
            self._drain()
            if not done or (self._writer.unfinished == 0 and not self._writer.events):
                return done

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued writes and stop the writer; the cache cannot be used afterwards."""
        if self._closed:
            return True
        done = self.flush(timeout)
        if self._writer is not None:
            done = self._writer.close(timeout) and done
        self._closed = True
        return done

    # --- checks ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the prefix cache is closed")

    def _check_matches(self, tokens: tuple[int, ...], cache: PromptCache) -> None:
        if int(cache.offset) != len(tokens):
            raise ValueError(f"the cache holds {int(cache.offset)} tokens, {len(tokens)} were given")
        if cache.scheme != self.ns.scheme or cache.quantize_after != self.ns.quantize_after:
            raise ValueError(f"a {cache.scheme.name} cache (quantize_after {cache.quantize_after}) "
                             f"in a {self.ns.scheme.name} namespace (quantize_after {self.ns.quantize_after})")

    # --- the index ---------------------------------------------------------------------

    def _inherited(self, tokens: tuple[int, ...]) -> list[Checkpoint]:
        """What the stored entries that ``tokens`` extend, held in RAM, pass on
        (``as_checkpoints``), so one entry keeps the checkpoints of a whole conversation."""
        out: list[Checkpoint] = []
        for key in self._index.prefixes_of(tokens):
            older = self._entries[key].payload()
            if older is not None and len(self._entries[key].tokens) < len(tokens):
                out += as_checkpoints(older)
        return out

    def _redundant(self, e: _Entry) -> bool:
        """True (and that entry is touched) when a stored entry extending ``e``'s tokens
        serves every length ``e`` would."""
        for key in self._index.extensions_of(e.tokens):
            other = self._entries[key]
            if covers(other.spans, e.spans):
                self._touch(other)
                return True
        return False

    def _admit(self, e: _Entry) -> None:
        """Put ``e`` in the index; the stored prefixes of its tokens it makes redundant go."""
        for key in self._index.prefixes_of(e.tokens):
            if covers(e.spans, self._entries[key].spans):
                self._drop(self._entries[key])
        e.used = next(self._clock)
        self._entries[e.key] = e
        self._index.add(e.key, e.tokens)

    def _candidates(self, tokens: tuple[int, ...]) -> Iterator[tuple[int, list[_Entry]]]:
        """(length m, entries that serve m exactly), largest m first: an entry serves the
        longest of its lengths within the common prefix (and below the last prompt token)."""
        limit = len(tokens) - 1
        groups: dict[int, list[_Entry]] = {}
        for common, keys in self._index.matches(tokens):
            if min(common, limit) < 1:
                break
            for key in keys:
                e = self._entries[key]
                m = best_length(e.spans, min(common, limit))
                if m is not None:
                    groups.setdefault(m, []).append(e)
        for m in sorted(groups, reverse=True):
            yield m, groups[m]

    def _touch(self, e: _Entry) -> None:
        e.used = next(self._clock)
        if e.key in self._ram:
            self._ram.touch(e.key)
        if e.on_disk:
            self._disk.touch(e.key)
            self._writer.submit(TouchJob(self._path(e.key)))

    def _drop(self, e: _Entry) -> None:
        """Remove ``e`` from every tier (its file too): replaced by an entry that serves
        what it served."""
        self._ram.remove(e.key)
        e.snap = None
        if e.job is not None:
            e.job.cancelled = True
            e.job = None
            self._delete_file(e.key)  # after the write, should it already be running
        if e.on_disk:
            e.on_disk = False
            self._disk.remove(e.key)
            self._delete_file(e.key)
        self._forget(e, replaced=True)

    def _forget(self, e: _Entry, replaced: bool = False) -> None:
        """``e`` leaves the index: evicted from its last tier, or ``replaced`` by an entry
        that serves what it served (its checkpoints went there)."""
        if not replaced:
            self._count["checkpoints_evicted"] += e.checkpoints
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
            self._index.remove(e.key)

    # --- serving -----------------------------------------------------------------------

    def _serve(self, e: _Entry, m: int) -> Hit | None:
        snap, source = e.payload(), "ram"
        if snap is None:
            snap, source = self._load(e), "disk"
            if snap is None:
                return None
            e.nbytes, e.checkpoints = snap.nbytes, len(snap.checkpoints)  # unknown until loaded
            self._put_ram(e, snap)
        self._touch(e)
        self._count["checkpoint_hits"] += m < snap.num_tokens - min(s.reach for s in snap.layers)
        return Hit(m, restore(snap, m), source)

    def _load(self, e: _Entry) -> Snapshot | None:
        """Read ``e``'s file; a refused file leaves the index (and is deleted if damaged)."""
        path = self._path(e.key)
        try:
            header, arrays = read_tensors(path, self.ns)
            snap = self._rebuild(header, arrays, path)
            if header.tokens() != e.tokens or snap.num_tokens != len(e.tokens) or snap.spans != e.spans:
                raise FileRefused("corrupt", "contents differ from what the index recorded")
            return snap
        except FileNotFoundError:
            self._count["missing_files"] += 1
        except (FileRefused, CacheFileError, ValueError, KeyError, OSError) as err:
            reason = err.reason if isinstance(err, FileRefused) else "corrupt"
            self._refused[reason] += 1
            log.warning("prefix cache: refusing %s (%s)", path.name, err)
            if reason in DAMAGED:  # it can never load
                path.unlink(missing_ok=True)
        e.on_disk = False
        self._disk.remove(e.key)
        if e.payload() is None:
            self._forget(e)
        return None

    def _rebuild(self, header: Header, arrays: dict, path: Path) -> Snapshot:
        """Layers through ``kvserve.cache.serialize``'s class allowlist and state checks."""
        md = header.metadata
        tensors = {name: device_array(a, header.table[name]["dtype"]) for name, a in arrays.items()}
        used = [0]

        def load(i: int, prefix: str):
            layer = _load_layer(path, i, md, tensors, prefix)
            used[0] += len(layer.state)
            return layer

        snap = rebuild(md, load, self.ns.scheme, self.ns.quantize_after)
        if not snap.layers or used[0] != len(tensors) or stored_layer_count(md) != \
                len(snap.layers) + sum(len(c.layers) for c in snap.checkpoints):
            raise FileRefused("corrupt", "tensors the layers do not describe")
        return snap

    # --- tiers ---------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self._dir / (key + SUFFIX)

    def _delete_file(self, key: str) -> None:
        if self._writer is not None:
            self._writer.submit(DeleteJob(self._path(key)))

    def _put_ram(self, e: _Entry, snap: Snapshot) -> None:
        e.snap = snap
        for key in self._ram.add(e.key, e.nbytes):
            self._evict_ram(self._entries[key])

    def _evict_ram(self, e: _Entry) -> None:
        """RAM is full: keep ``e`` if it has a disk home, spill it if possible, else forget it."""
        snap, e.snap = e.snap, None
        self._count["ram_evictions"] += 1
        if e.on_disk or e.job is not None:
            return
        if self._writer is None or not self._queue_write(e, snap):
            self._forget(e)

    def _queue_write(self, e: _Entry, snap: Snapshot) -> bool:
        """Hand ``e`` to the writer unless the queue is full (then the spill is dropped)."""
        jobs, nbytes = self._pending
        if jobs >= self._max_pending[0] or nbytes + e.nbytes > self._max_pending[1]:
            self._count["dropped_spills"] += 1
            return False
        md = entry_metadata(self.ns, e.tokens, e.spans, layer_descriptions(snap))
        e.job = WriteJob(e.key, self._path(e.key), md, host_tensors(snap), e.nbytes, payload=snap)
        self._pending = [jobs + 1, nbytes + e.nbytes]
        self._writer.submit(e.job)
        return True

    def _evict_disk_keys(self, keys: list[str]) -> None:
        for key in keys:
            self._count["disk_evictions"] += 1
            if key.startswith(FOREIGN_KEY):
                self._writer.submit(DeleteJob(self._foreign.pop(key)))
                continue
            e = self._entries[key]
            e.on_disk = False
            self._delete_file(key)
            if e.payload() is None:
                self._forget(e)

    def _drain(self) -> None:
        """Apply what the writer finished since the last call."""
        events = self._writer.events if self._writer is not None else ()
        while events:
            event = events.popleft()
            job = event.job
            self._pending = [self._pending[0] - 1, self._pending[1] - job.nbytes]
            e = self._entries.get(job.key)
            if e is None or e.job is not job:
                continue  # dropped or replaced meanwhile; its delete is queued behind the write
            e.job = None
            if isinstance(event, Written):
                e.on_disk = True
                self._evict_disk_keys(self._disk.add(e.key, event.size))
            elif isinstance(event, WriteFailed):
                self._count["write_errors"] += 1
                if e.payload() is None:
                    self._forget(e)
