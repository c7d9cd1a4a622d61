"""The cache directory at start-up: leftover temporary files, entries, refusals.

Only names the prefix cache makes are ever looked at or removed:

    <16 hex namespace>-<32 hex entry>.safetensors                  an entry
    .<16 hex>-<32 hex>.safetensors.<pid>.<n>.tmp                   a write in progress

Every other file in the directory is left alone. ``scan`` reads headers only (no tensor):
damaged files are deleted and logged; files of another version or namespace are kept and
counted by reason; this namespace's entries come back oldest first (by mtime, which hits
refresh), the order their least-recently-used bookkeeping starts in.

    >>> import tempfile
    >>> from kvserve.cache.prefix.namespace import Namespace
    >>> from kvserve.cache.prefix.files import entry_metadata, write_entry
    >>> root = Path(tempfile.mkdtemp())
    >>> ns = Namespace("model-a", "tok-a", "fp16")
    >>> md = entry_metadata(ns, [1, 2, 3], spans=((1, 3),), layers={"num_layers": "0"})
    >>> _ = write_entry(root / ns.entry_name([1, 2, 3]), md, [])
    >>> _ = (root / ("." + ns.entry_name([4]) + ".123.0.tmp")).write_bytes(b"partial")
    >>> _ = (root / ns.entry_name([9])).write_bytes(b"\\x00" * 3)      # damaged
    >>> _ = (root / "notes.txt").write_text("kept")
    >>> s = scan(root, Namespace("model-b", "tok-a", "fp16"))
    >>> s.temps_removed, [f.reason for f in s.damaged], [f.reason for f in s.foreign], s.ours
    (1, ['truncated'], ['model'], [])
    >>> [f.header.tokens() for f in scan(root, ns).ours], sorted(p.name for p in root.iterdir())[1:]
    ([(1, 2, 3)], ['notes.txt'])
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvserve.cache.prefix.files import DAMAGED, FileRefused, Header, check_identity, read_header
from kvserve.cache.prefix.namespace import Namespace

log = logging.getLogger("kvserve.cache.prefix")

NAME_RE = re.compile(r"[0-9a-f]{16}-[0-9a-f]{32}\.safetensors")
TEMP_RE = re.compile(r"\.[0-9a-f]{16}-[0-9a-f]{32}\.safetensors\.\d+\.\d+\.tmp")


@dataclass
class FileInfo:
    """One entry file as start-up sees it: a trusted header, or why it is refused."""

    path: Path
    size: int
    mtime_ns: int
    header: Header | None = None
    reason: str | None = None  # None: a usable entry of the namespace it was checked against
    message: str = ""


@dataclass
class Scan:
    ours: list[FileInfo]  # oldest first
    foreign: list[FileInfo]  # oldest first; kept on disk, never loaded
    damaged: list[FileInfo]  # deleted
    temps_removed: int


def entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if NAME_RE.fullmatch(p.name) and p.is_file())


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if TEMP_RE.fullmatch(p.name))


def remove_temp_files(root: Path) -> int:
    """Delete leftovers of interrupted writes (a live writer in another process that shares
    the directory loses its write, which it reports as a failure; nothing is half-read)."""
    removed = 0
    for p in temp_files(root):
        try:
            p.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def inspect(path: Path, ns: Namespace | None) -> FileInfo:
    """Read and check one header; with ``ns`` None only the layout is checked."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return FileInfo(path, 0, 0, None, "truncated", "vanished")
    info = FileInfo(path, st.st_size, st.st_mtime_ns)
    try:
        info.header = read_header(path)
        if ns is not None:
            check_identity(info.header, ns, path.name)
    except FileRefused as refused:
        info.reason, info.message = refused.reason, str(refused)
    except OSError as err:
        info.reason, info.message = "corrupt", f"unreadable ({err})"
    return info


def delete_damaged(info: FileInfo) -> None:
    log.warning("prefix cache: deleting %s (%s)", info.path.name, info.message)
    try:
        info.path.unlink()
    except FileNotFoundError:
        pass


def scan(root: Path, ns: Namespace) -> Scan:
    """Start-up: remove temporary files, delete damaged entries, sort the rest (module doc)."""
    result = Scan([], [], [], remove_temp_files(root))
    for path in entry_files(root):
        info = inspect(path, ns)
        if info.reason is None:
            result.ours.append(info)
        elif info.reason in DAMAGED:
            delete_damaged(info)
            result.damaged.append(info)
        else:
            result.foreign.append(info)
    result.ours.sort(key=lambda f: (f.mtime_ns, f.path.name))
    result.foreign.sort(key=lambda f: (f.mtime_ns, f.path.name))
    return result


def ensure_dir(root: Path) -> Path:
    """Create the directory (private: entries hold prompt token ids)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not os.access(root, os.W_OK):
        raise PermissionError(f"prompt cache directory {root} is not writable")
    return root
