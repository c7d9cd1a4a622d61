"""The background thread that does the prefix cache's disk writes, deletes and touches.

The engine thread decides everything (which entry goes to disk, which file is evicted) and
submits jobs; this thread only performs them, in order, and reports what happened to writes through
``events`` (a deque the engine thread drains). It never touches MLX: write jobs carry numpy
views of arrays the engine thread has already evaluated.

    >>> import tempfile
    >>> from pathlib import Path
    >>> w = Writer()
    >>> p = Path(tempfile.mkdtemp()) / "x"
    >>> _ = p.write_bytes(b"1")
    >>> w.submit(DeleteJob(p)); w.flush(timeout=10)
    True
    >>> p.exists(), len(w.events)      # deletes report nothing; writes report Written / WriteFailed
    (False, 0)
    >>> w.close()
    True

Jobs run first in, first out, so a delete submitted after a write of the same path removes
what that write made.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("kvserve.cache.prefix")


@dataclass(eq=False)
class WriteJob:
    """Write one entry file. ``cancelled`` may be set by the engine thread while queued."""

    key: str
    path: Path
    metadata: dict[str, str]
    tensors: list  # (name, safetensors dtype, numpy view)
    nbytes: int
    payload: Any = None  # the snapshot, so a lookup can use the entry while it is queued
    cancelled: bool = False


@dataclass(eq=False)
class DeleteJob:
    path: Path


@dataclass(eq=False)
class TouchJob:
    """Set a file's mtime to now: start-up orders entries by mtime (least recently used first)."""

    path: Path


@dataclass
class Written:
    job: WriteJob
    size: int


@dataclass
class WriteSkipped:
    """A write cancelled before it started."""

    job: WriteJob


@dataclass
class WriteFailed:
    job: WriteJob
    error: str


class Writer:
    """One daemon thread running jobs; ``write_fn(path, metadata, tensors) -> size``."""

    def __init__(self, write_fn: Callable[..., int] | None = None):
        from kvserve.cache.prefix.files import write_entry

        self._write = write_fn or write_entry
        self.events: deque = deque()
        self._jobs: deque = deque()
        self._cond = threading.Condition()
        self._unfinished = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvserve-prefix-writer", daemon=True)
        self._thread.start()

    @property
    def unfinished(self) -> int:
        return self._unfinished

    def submit(self, job: WriteJob | DeleteJob | TouchJob) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("the writer is closed")
            self._jobs.append(job)
            self._unfinished += 1
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job is done; False if ``timeout`` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued jobs, then stop the thread; False if it did not stop in time."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _next(self) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: self._jobs or self._closing)
            return self._jobs.popleft() if self._jobs else None

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._do(job)
            finally:
                with self._cond:
                    self._unfinished -= 1
                    self._cond.notify_all()

    def _do(self, job: Any) -> None:
        if isinstance(job, WriteJob):
            if job.cancelled:
                self.events.append(WriteSkipped(job))
                return
            try:
                self.events.append(Written(job, self._write(job.path, job.metadata, job.tensors)))
            except Exception as err:  # ENOSPC, permissions, a vanished directory: never fatal
                log.warning("prefix cache: could not write %s: %s", job.path.name, err)
                self.events.append(WriteFailed(job, str(err)))
        elif isinstance(job, DeleteJob):
            try:
                job.path.unlink(missing_ok=True)
            except OSError as err:
                log.warning("prefix cache: could not delete %s: %s", job.path.name, err)
        elif isinstance(job, TouchJob):
            try:
                os.utime(job.path)
            except OSError:
                pass  # deleted meanwhile: nothing to order
