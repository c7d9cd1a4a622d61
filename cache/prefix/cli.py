"""``kvserve cache stats|ls|clear --prompt-cache-dir DIR``: look at or empty a cache directory.

Only headers are read (no tensor, no model needed). ``stats`` groups entries by namespace
(model, tokenizer, scheme, fp16 threshold, format version); ``ls`` prints one line per entry
file; ``clear`` deletes entry files and leftover temporary files, and nothing else. Run
``clear`` while no server uses the directory: a running server keeps its index in memory.

    >>> import argparse, io, tempfile
    >>> from kvserve.cache.prefix.files import entry_metadata, write_entry
    >>> from kvserve.cache.prefix.namespace import Namespace
    >>> d = Path(tempfile.mkdtemp())
    >>> ns = Namespace("model-a", "tok-a", "affine8")
    >>> _ = write_entry(d / ns.entry_name([1, 2]), entry_metadata(ns, [1, 2], ((1, 2),), {"num_layers": "0"}), [])
    >>> parser = argparse.ArgumentParser(prog="kvserve")
    >>> _ = add_cache_parser(parser.add_subparsers(dest="command"))
    >>> out = io.StringIO()
    >>> cache_command(parser.parse_args(["cache", "stats", "--prompt-cache-dir", str(d)]), out)
    0
    >>> print(out.getvalue().strip())
    1 entry files, 960 bytes; 0 temporary files
      1 files          960 bytes  model model-a  tokenizer tok-a  scheme affine8  quantize_after 0  version 5
    >>> cache_command(parser.parse_args(["cache", "clear", "--prompt-cache-dir", str(d)]), io.StringIO())
    0
    >>> sorted(d.iterdir())
    []
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TextIO

from kvserve.cache.prefix.disk import FileInfo, entry_files, inspect, temp_files
from kvserve.cache.prefix.files import header_digest
from kvserve.cache.prefix.namespace import PREFIX_VERSION

ACTIONS = ("stats", "ls", "clear")


def add_cache_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``cache`` to ``parser.add_subparsers(...)``; dispatch to ``cache_command(args)``."""
    p = subparsers.add_parser("cache", help="show or clear a prompt cache directory")
    p.add_argument("action", choices=ACTIONS, help="stats: totals per namespace; ls: one line "
                                                   "per entry; clear: delete every entry")
    p.add_argument("--prompt-cache-dir", required=True, type=Path, help="the cache directory")
    p.add_argument("--json", action="store_true", help="machine-readable output (stats, ls)")
    return p


def cache_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run one action; returns the exit status (1: the directory does not exist)."""
    out = out or sys.stdout
    root = Path(args.prompt_cache_dir).expanduser()
    if not root.is_dir():
        print(f"kvserve: no prompt cache directory at {root}", file=sys.stderr)
        return 1
    if args.action == "clear":
        return _clear(root, out)
    infos = [inspect(p, None) for p in entry_files(root)]
    if args.action == "ls":
        _ls(infos, out, args.json)
    else:
        _stats(root, infos, out, args.json)
    return 0


def status(info: FileInfo) -> str:
    """"ok", or why no server of this build would load the file."""
    if info.reason is not None:
        return info.reason
    md = info.header.metadata
    if md.get("user.prefix_version") != PREFIX_VERSION:
        return "version"
    return "ok" if md.get("user.header_sha256") == header_digest(md, info.header.table) else "corrupt"


def _describe(info: FileInfo) -> dict:
    md = info.header.metadata if info.header is not None else {}
    return {"file": info.path.name, "bytes": info.size, "status": status(info),
            "tokens": int(md.get("user.num_tokens", 0) or 0), "model": md.get("user.model", ""),
            "tokenizer": md.get("user.tokenizer", ""), "scheme": md.get("user.scheme", ""),
            "quantize_after": md.get("user.quantize_after", ""),
            "version": md.get("user.prefix_version", ""),
            "modified": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.mtime_ns / 1e9))}


def _ls(infos: list[FileInfo], out: TextIO, as_json: bool) -> None:
    rows = [_describe(i) for i in sorted(infos, key=lambda i: i.mtime_ns)]
    if as_json:
        json.dump(rows, out, indent=1)
        out.write("\n")
        return
    for r in rows:
        out.write(f"{r['modified']}  {r['bytes']:>12}  {r['tokens']:>8} tok  {r['scheme']:<12} "
                  f"{r['model'][:12]:<12} {r['status']:<9} {r['file']}\n")


def _stats(root: Path, infos: list[FileInfo], out: TextIO, as_json: bool) -> None:
    rows = [_describe(i) for i in infos]
    groups: Counter = Counter()
    sizes: Counter = Counter()
    for r in rows:
        key = (r["model"], r["tokenizer"], r["scheme"], r["quantize_after"], r["version"], r["status"])
        groups[key] += 1
        sizes[key] += r["bytes"]
    total = {"entry_files": len(rows), "bytes": sum(r["bytes"] for r in rows),
             "temporary_files": len(temp_files(root)),
             "namespaces": [{"model": k[0], "tokenizer": k[1], "scheme": k[2], "quantize_after": k[3],
                             "version": k[4], "status": k[5], "files": n, "bytes": sizes[k]}
                            for k, n in sorted(groups.items())]}
    if as_json:
        json.dump(total, out, indent=1)
        out.write("\n")
        return
    out.write(f"{total['entry_files']} entry files, {total['bytes']} bytes; "
              f"{total['temporary_files']} temporary files\n")
    for g in total["namespaces"]:
        flag = "" if g["status"] == "ok" else f"  ({g['status']})"
        out.write(f"  {g['files']} files {g['bytes']:>12} bytes  model {g['model'][:16]}  tokenizer "
                  f"{g['tokenizer'][:16]}  scheme {g['scheme']}  quantize_after {g['quantize_after']}  "
                  f"version {g['version']}{flag}\n")


def _clear(root: Path, out: TextIO) -> int:
    removed, freed = 0, 0
    for path in entry_files(root) + temp_files(root):
        try:
            freed += path.stat().st_size
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    out.write(f"removed {removed} files, {freed} bytes\n")
    return 0
