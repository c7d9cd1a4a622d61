"""One entry, one safetensors file: how it is written atomically and what makes it load.

Layout (a valid safetensors file: ``mx.load``, ``load_layers`` and the ``safetensors``
package read it):

    8 bytes   N, the header length, little-endian
    N bytes   JSON, space-padded to a multiple of 8:
              {"__metadata__": {...}, "layer.0.0": {"dtype": "U32", "shape": [1, 2, 7, 16],
               "data_offsets": [0, 896]}, ...}
    data      the tensors' bytes back to back, ``layer.<i>.<j>`` in layer order

Metadata, all strings. ``format``, ``format_version``, ``num_layers`` and ``layer.<i>`` are
``kvserve.cache.serialize``'s layer descriptions (class, scheme parameters, offset, meta);
the prefix cache adds:

    user.prefix_version   PREFIX_VERSION: this layout; any other value is refused ("version")
    user.model            model fingerprint                       ("model")
    user.tokenizer        tokenizer hash                          ("tokenizer")
    user.scheme           scheme name                             ("scheme")
    user.scheme_params    JSON of every scheme parameter: bits, group size, mode, seed of
                          keys and values, calibration, boundary layers ("scheme_params")
    user.quantize_after   fp16 threshold of the container         ("scheme_params")
    user.layout           layer kinds in order, e.g. window512*5,kv  ("layout")
    user.shard            a sharded model's part: world size, rank, split, e.g.
                          tp2:rank1:kv_heads=2+1; "" for one process ("shard")
    user.num_tokens       tokens stored (the caches' offset)
    user.tokens           the token ids, base64 of little-endian uint32
    user.tokens_digest    sha256 hex of those bytes
    user.spans            JSON [[lo, hi], ...]: the lengths the entry serves exactly
    checkpoints           JSON [[tokens, [layer indices]], ...]: copies of window and state
                          layers at shorter lengths, described as ``ckpt.<k>.layer.<i>``
                          beside the entry's own ``layer.<i>`` (each with its ``reach``)
    user.data_sha256      sha256 hex of the data section           ("checksum")
    user.header_sha256    sha256 hex of every other field and the tensor table ("corrupt")

Checks, in order: the size the header promises ("truncated"), the JSON and tensor table
("corrupt"), the version, the header checksum, the namespace fields, the name (it must be
the namespace's name for the recorded tokens), then, when an entry is loaded, the data
checksum. The header checksum lets start-up rebuild the index from headers it can trust
without reading any tensor.

Writes go to a unique temporary name in the same directory (``.<name>.<pid>.<n>.tmp``),
are fsynced, renamed over the final name, and the directory is fsynced: a reader sees the
old state or the whole new file, never part of one.

    >>> import tempfile
    >>> from pathlib import Path
    >>> from kvserve.cache.prefix.namespace import Namespace
    >>> ns = Namespace("model-a", "tok-a", "fp16")
    >>> path = Path(tempfile.mkdtemp()) / ns.entry_name([7, 8])
    >>> md = entry_metadata(ns, [7, 8], spans=((1, 2),), layers={"num_layers": "0"})
    >>> size = write_entry(path, md, [("x", "F32", np.arange(4, dtype="<f4"))])
    >>> header = read_header(path)
    >>> check_identity(header, ns, path.name)
    >>> header.tokens(), header.num_tokens, size == path.stat().st_size
    ((7, 8), 2, True)
    >>> read_tensors(path, ns)[1]["x"].tolist()
    [0.0, 1.0, 2.0, 3.0]
    >>> check_identity(header, Namespace("model-b", "tok-a", "fp16"), path.name)
    Traceback (most recent call last):
    ...
    kvserve.cache.prefix.files.FileRefused: model: ...
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.cache.prefix.namespace import PREFIX_VERSION, Namespace, as_tokens, token_bytes
from kvserve.cache.serialize import FORMAT, FORMAT_VERSION

MAX_HEADER = 256 << 20  # a million tokens' ids take ~5.6 MB of base64
NP_DTYPES = {"F16": "<f2", "BF16": "<u2", "F32": "<f4", "F64": "<f8", "U8": "u1", "U16": "<u2",
             "U32": "<u4", "U64": "<u8", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8",
             "BOOL": "?"}

# Why a file is not loaded. The first three mean the file is damaged: it is deleted.
# The others mean it belongs to another server or build: it is kept, never loaded.
DAMAGED = ("truncated", "corrupt", "checksum")
FOREIGN = ("version", "model", "tokenizer", "scheme", "scheme_params", "layout", "shard")
REASONS = DAMAGED + FOREIGN

_temp_counter = itertools.count()


class FileRefused(Exception):
    """A file that must not be loaded; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason

    @property
    def damaged(self) -> bool:
        return self.reason in DAMAGED


# --- writing ---------------------------------------------------------------------------

def entry_metadata(ns: Namespace, tokens: Sequence[int], spans: Sequence[tuple[int, int]],
                   layers: dict[str, str]) -> dict[str, str]:
    """The metadata of an entry, without the two checksums ``write_entry`` adds."""
    raw = token_bytes(tokens)
    ident = ns.identity()
    md = {"format": FORMAT, "format_version": FORMAT_VERSION, **layers}
    md.update({f"user.{k}": ident[k] for k in ("prefix_version", "model", "tokenizer", "scheme",
                                                "scheme_params", "quantize_after", "layout")})
    if ns.shard:
        md["user.shard"] = ns.shard
    md.update({"user.num_tokens": str(len(tokens)), "user.tokens": base64.b64encode(raw).decode(),
               "user.tokens_digest": hashlib.sha256(raw).hexdigest(),
               "user.spans": json.dumps([list(span) for span in spans])})
    return md


def header_digest(metadata: dict[str, str], table: dict[str, dict]) -> str:
    body = {k: v for k, v in metadata.items() if k != "user.header_sha256"}
    canon = json.dumps({"metadata": body, "tensors": table}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def encode_header(metadata: dict[str, str],
                  tensors: Sequence[tuple[str, str, np.ndarray]]) -> tuple[bytes, int]:
    """(8-byte length + padded JSON, data length), with both checksums filled in."""
    table, offset, data_hash = {}, 0, hashlib.sha256()
    for name, dtype, arr in tensors:
        if np.dtype(NP_DTYPES[dtype]).itemsize != arr.itemsize:
            raise ValueError(f"{name}: {arr.dtype} is not {dtype}")
        table[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        data_hash.update(np.ascontiguousarray(arr).data)
    md = {**metadata, "user.data_sha256": data_hash.hexdigest()}
    md["user.header_sha256"] = header_digest(md, table)
    text = json.dumps({"__metadata__": md, **table}, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offset


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{next(_temp_counter)}.tmp")


def write_entry(path: Path, metadata: dict[str, str],
                tensors: Sequence[tuple[str, str, np.ndarray]]) -> int:
    """Write atomically (temp file, fsync, rename, directory fsync); returns the file size.

    ``tensors``: (name, safetensors dtype, little-endian numpy array) in file order.
    """
    head, data_len = encode_header(metadata, tensors)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # prompts are private
    try:
        with open(fd, "wb") as f:
            f.write(head)
            for _, _, arr in tensors:
                f.write(np.ascontiguousarray(arr).data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return len(head) + data_len


def fsync_dir(directory: Path) -> None:
    """Make a rename durable (POSIX: the directory entry lives in the directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- reading ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Header:
    """A parsed header whose layout was checked against the file's size."""

    metadata: dict[str, str]
    table: dict[str, dict]  # tensor name -> dtype, shape, data_offsets
    data_start: int
    size: int

    @property
    def num_tokens(self) -> int:
        return int(self.metadata["user.num_tokens"])

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The lengths the entry serves; ``ValueError`` unless sorted, disjoint, in 1..n."""
        spans = tuple((int(lo), int(hi)) for lo, hi in json.loads(self.metadata["user.spans"]))
        bounds = [b for span in spans for b in span]
        if not spans or bounds != sorted(bounds) or bounds[0] < 1 or bounds[-1] > self.num_tokens:
            raise ValueError(f"spans {spans} for {self.num_tokens} tokens")
        return spans

    def tokens(self) -> tuple[int, ...]:
        raw = base64.b64decode(self.metadata["user.tokens"], validate=True)
        return as_tokens(np.frombuffer(raw, dtype="<u4"))


def read_header(path: Path) -> Header:
    """Parse and check the layout (not the namespace); raises ``FileRefused``."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            raise FileRefused("truncated", f"{size} bytes, no header length")
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise FileRefused("truncated" if n <= MAX_HEADER else "corrupt",
                              f"header of {n} bytes in a file of {size}")
        text = f.read(n)
    return _parse_header(text, size)


def _parse_header(text: bytes, size: int) -> Header:
    try:
        doc = json.loads(text)
        metadata = doc.pop("__metadata__")
    except (ValueError, UnicodeDecodeError, KeyError, AttributeError) as err:
        raise FileRefused("corrupt", f"unreadable header ({err})") from None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FileRefused("corrupt", "metadata is not a map of strings")
    data_len = _check_table(doc)
    data_start = 8 + len(text)
    if data_start + data_len != size:
        reason = "truncated" if data_start + data_len > size else "corrupt"
        raise FileRefused(reason, f"{size} bytes, the header describes {data_start + data_len}")
    return Header(metadata, doc, data_start, size)


def _check_table(table: dict) -> int:
    """The tensors must tile the data section exactly; returns its length."""
    spans = []
    for name, info in table.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            ok = (dtype in NP_DTYPES and all(type(d) is int and d >= 0 for d in shape)
                  and type(begin) is int and type(end) is int
                  and end - begin == count * np.dtype(NP_DTYPES[dtype]).itemsize)
        except (TypeError, ValueError, KeyError):
            ok = False
        if not ok:
            raise FileRefused("corrupt", f"tensor {name!r} is described inconsistently")
        spans.append((begin, end))
    at = 0
    for begin, end in sorted(spans):
        if begin != at:
            raise FileRefused("corrupt", "tensors overlap or leave gaps")
        at = end
    return at


def check_identity(header: Header, ns: Namespace, name: str) -> None:
    """Refuse a header of another version or namespace, a damaged one, or a misnamed file."""
    md = header.metadata
    if md.get("format") != FORMAT or "user.prefix_version" not in md:
        raise FileRefused("corrupt", "not a prefix-cache entry")
    if md["user.prefix_version"] != PREFIX_VERSION or md.get("format_version") != FORMAT_VERSION:
        raise FileRefused("version", f"format {md['user.prefix_version']}/{md.get('format_version')}, "
                                     f"this build reads {PREFIX_VERSION}/{FORMAT_VERSION}")
    if md.get("user.header_sha256") != header_digest(md, header.table):
        raise FileRefused("corrupt", "header checksum mismatch")
    _check_namespace(md, ns)
    try:
        tokens = header.tokens()
        digest_ok = hashlib.sha256(token_bytes(tokens)).hexdigest() == md["user.tokens_digest"]
        counts_ok = len(tokens) == header.num_tokens and bool(header.spans)
    except (ValueError, KeyError, TypeError) as err:
        raise FileRefused("corrupt", f"token fields unusable ({err})") from None
    if not (digest_ok and counts_ok):
        raise FileRefused("corrupt", "token ids do not match their digest or count")
    if ns.entry_name(tokens) != name:
        raise FileRefused("corrupt", "file name does not match its contents")


def _check_namespace(md: dict[str, str], ns: Namespace) -> None:
    ident = {"shard": "", **ns.identity()}
    for field, reason in (("model", "model"), ("tokenizer", "tokenizer"), ("scheme", "scheme"),
                          ("scheme_params", "scheme_params"), ("quantize_after", "scheme_params"),
                          ("layout", "layout"), ("shard", "shard")):
        found = md.get(f"user.{field}", "" if field == "shard" else None)
        if found != ident[field]:
            raise FileRefused(reason, f"{field} {found!r}, this server has {ident[field]!r}")


def read_tensors(path: Path, ns: Namespace) -> tuple[Header, dict[str, np.ndarray]]:
    """Read a whole entry, check everything including the data checksum; raises ``FileRefused``.

    The arrays are numpy views of one buffer read from the file (little-endian host)."""
    with open(path, "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        got = f.readinto(buf)
    view = memoryview(buf)[:got]
    if got < 8:
        raise FileRefused("truncated", f"{got} bytes, no header length")
    n = int.from_bytes(view[:8], "little")
    if n > MAX_HEADER or 8 + n > got:
        raise FileRefused("truncated" if n <= MAX_HEADER else "corrupt", f"header of {n} bytes in {got}")
    header = _parse_header(bytes(view[8:8 + n]), got)
    check_identity(header, ns, path.name)
    data = view[header.data_start:]
    if hashlib.sha256(data).hexdigest() != header.metadata.get("user.data_sha256"):
        raise FileRefused("checksum", "tensor bytes do not match their checksum")
    tensors = {}
    for name, info in header.table.items():
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[begin:end], dtype=NP_DTYPES[info["dtype"]])
        tensors[name] = arr.reshape(info["shape"])
    return header, tensors

