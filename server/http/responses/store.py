"""The responses kvserve keeps for ``GET /v1/responses/{id}`` and ``previous_response_id``: one
SQLite file under the cache folder (``<cache dir>/responses/responses.sqlite3``), so a
conversation goes on after a restart, holding the newest ``max_responses`` (the oldest are
evicted first).

A row is a response exactly as its client got it (its JSON text, served back as is) and
the input items it answered, the earlier turns' included. Continuing from a response needs
its row only, so evicting or deleting an earlier turn never breaks a later one; the price is
that each row repeats its conversation (what ``max_responses`` bounds).

Every call reads or writes one row by its key, but may wait on the disk: the routes run
them in a worker thread (``asyncio.to_thread``), never on the event loop; one connection
serves every thread, under a lock.

A file that is not a database, or is found damaged, never stops the server: it is logged,
moved aside (``responses.sqlite3.corrupt``) and the store starts empty. Where no file can be
made at all (a read-only folder), responses are kept in memory until the server stops.

Example:
    >>> store = ResponseStore(None, max_responses=2)
    >>> [store.put({"id": f"resp_{n}", "output": [{"id": f"msg_{n}"}]}, [{"id": f"in_{n}"}]) for n in range(3)]
    [True, True, True]
    >>> store.response_text("resp_0") is None, store.response_text("resp_2")
    (True, '{"id":"resp_2","output":[{"id":"msg_2"}]}')
    >>> [item["id"] for item in store.conversation("resp_2")]   # input items, then output items
    ['in_2', 'msg_2']
    >>> store.delete("resp_2"), store.delete("resp_2"), store.input_items("resp_2")
    (True, False, None)
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Callable, TypeVar

log = logging.getLogger("kvserve.responses")

FILE_NAME = "responses.sqlite3"
SCHEMA_VERSION = 1  # PRAGMA user_version of a file this code wrote
BUSY_TIMEOUT_S = 5.0  # another server on the same cache folder may hold the write lock
ASIDE = ".corrupt"  # suffix of a file moved aside

SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY,      -- insertion order: the oldest row is evicted first
    id TEXT NOT NULL UNIQUE,
    response TEXT NOT NULL,       -- the response object as its client got it
    input_items TEXT NOT NULL     -- JSON list, the earlier turns' items first
)"""

T = TypeVar("T")


class Unusable(Exception):
    """A database this code did not write (another schema version)."""


class ResponseStore:
    """Responses by id, at most ``max_responses`` of them; ``path`` None keeps them in memory
    (tests, and an app built without a cache folder); ``max_responses`` 0 stores nothing."""

    def __init__(self, path: Path | None, max_responses: int):
        self.path, self.max_responses = path, max_responses
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = self._open() if max_responses > 0 else None

    @classmethod
    def under(cls, cache_dir: Path, max_responses: int) -> "ResponseStore":
        """The server's store: ``<cache_dir>/responses/responses.sqlite3``."""
        return cls(Path(cache_dir) / "responses" / FILE_NAME, max_responses)

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    # ---- the calls (each under the lock; a database error answers ``default``) -------------
    def put(self, response: dict, input_items: list[dict]) -> bool:
        """Keep ``response`` (by its ``id``) and the input items it answered; evict the oldest
        past the bound. False when it could not be written (logged)."""
        row = (response["id"], _dumps(response), _dumps(input_items))

        def write(db: sqlite3.Connection) -> bool:
            with db:  # one transaction: the row and the eviction it makes room with
                db.execute("INSERT OR REPLACE INTO responses (id, response, input_items) VALUES (?, ?, ?)", row)
                db.execute("DELETE FROM responses WHERE seq <= "
                           "(SELECT seq FROM responses ORDER BY seq DESC LIMIT 1 OFFSET ?)", (self.max_responses,))
            return True

        return self._run(write, False)

    def response_text(self, response_id: str) -> str | None:
        """The stored response's JSON text, as its client got it; None when unknown."""
        row = self._row(response_id, "response")
        return None if row is None else row[0]

    def input_items(self, response_id: str) -> list[dict] | None:
        row = self._row(response_id, "input_items")
        return None if row is None else json.loads(row[0])

    def conversation(self, response_id: str) -> list[dict] | None:
        """What a request continuing from the response appends its input to: the response's
        input items, then its output items."""
        row = self._row(response_id, "input_items, response")
        return None if row is None else json.loads(row[0]) + json.loads(row[1])["output"]

    def delete(self, response_id: str) -> bool:
        def remove(db: sqlite3.Connection) -> bool:
            with db:
                return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

        return self._run(remove, False)

    def count(self) -> int:
        return self._run(lambda db: db.execute("SELECT count(*) FROM responses").fetchone()[0], 0)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _row(self, response_id: str, columns: str) -> tuple | None:
        query = f"SELECT {columns} FROM responses WHERE id = ?"
        return self._run(lambda db: db.execute(query, (response_id,)).fetchone(), None)

    def _run(self, work: Callable[[sqlite3.Connection], T], default: T) -> T:
        with self._lock:
            if self._db is None:  # stores nothing, or closed
                return default
            try:
                return work(self._db)
            except sqlite3.DatabaseError as exc:
                self._failed(exc)
                return default

    def _failed(self, exc: sqlite3.DatabaseError) -> None:
        """A damaged file is moved aside and the store starts again, empty; anything else (a
        full disk, a lock held too long by another server) loses this call only."""
        if not _damaged(exc):
            log.warning("responses store %s: %s", self.path or "in memory", exc)
            return
        self._db.close()
        self._db = None
        if self.path is not None:
            self._move_aside(exc)
        self._db = self._open()

    # ---- opening ---------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            return _connect(":memory:")
        try:
            return self._open_file()
        except (sqlite3.Error, OSError) as exc:
            log.error("responses cannot be stored in %s (%s): they are kept in memory until the "
                      "server stops", self.path, exc)
            return _connect(":memory:")

    def _open_file(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return _connect(str(self.path))
        except (sqlite3.DatabaseError, Unusable) as exc:
            if isinstance(exc, sqlite3.DatabaseError) and not _damaged(exc):
                raise
            self._move_aside(exc)
            return _connect(str(self.path))

    def _move_aside(self, why: Exception) -> None:
        """The file (and its journal files, so it can still be opened to look at) renamed to
        ``responses.sqlite3.corrupt``, replacing an earlier one."""
        aside = self.path.with_name(self.path.name + ASIDE)
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(f"{self.path}{suffix}", f"{aside}{suffix}")
            except FileNotFoundError:
                pass
        log.error("responses store %s cannot be used (%s): moved aside to %s; starting empty",
                  self.path, why, aside)


def _connect(where: str) -> sqlite3.Connection:
    """A connection with the table in place; raises for a file that is not a database
    (``sqlite3.DatabaseError``) or one of another schema version (``Unusable``)."""
    db = sqlite3.connect(where, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")  # readers never wait on a writer (another server)
        db.execute("PRAGMA synchronous=NORMAL")  # a crash may lose the last writes, never the file
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise Unusable(f"schema version {version}, this kvserve reads {SCHEMA_VERSION}")
        db.execute(SCHEMA)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        return db
    except BaseException:
        db.close()
        raise


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether the file itself is bad (not a database, or damaged pages), as opposed to a
    failure of this call (locked, disk full, read-only)."""
    name = getattr(exc, "sqlite_errorname", "")
    return name == "SQLITE_NOTADB" or name.startswith("SQLITE_CORRUPT")


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
