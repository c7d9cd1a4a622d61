"""Stable identities for the two things besides the scheme that decide what a token id means.

``model_fingerprint`` hashes a model directory (or one weight file) without reading whole
weight files: config.json, each weight file's name and size, each safetensors header, and 64
blocks of 4 KiB sampled evenly through every weight file (two fine-tunes of one base model
share names, sizes and headers; their bytes differ everywhere, so the samples tell them apart).
Pass what else changes the computed KV as ``extra``: the weight format chosen at start-up,
an adapter id.

    >>> import tempfile
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "config.json").write_text('{"hidden_size": 64}')
    >>> _ = (d / "model.safetensors").write_bytes(b"\\x02" + bytes(7) + b"{}" + bytes(100))
    >>> a = model_fingerprint(d)
    >>> a == model_fingerprint(d), a == model_fingerprint(d, extra="dense-f32"), len(a)
    (True, False, 64)
    >>> _ = (d / "model.safetensors").write_bytes(b"\\x02" + bytes(7) + b"{}" + bytes(99) + b"\\x01")
    >>> a == model_fingerprint(d)
    False

``tokenizer_hash`` hashes the vocabulary, merges, normalization and special tokens (the
tokenizer's canonical JSON) and the chat template, so it is equal in every process.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
SAMPLES = 64
BLOCK = 4096
MAX_ST_HEADER = 100 << 20  # the safetensors library's own header limit


def model_fingerprint(model_dir_or_path: Path | str, extra: str = "") -> str:
    """sha256 hex over the model's configuration and sampled weight bytes (see module doc)."""
    path = Path(model_dir_or_path)
    h = hashlib.sha256(b"kvserve.model-fingerprint.1\0")
    h.update(extra.encode() + b"\0")
    if path.is_dir():
        config = path / "config.json"
        if config.exists():
            h.update(b"config\0" + _canonical_json(config.read_bytes()) + b"\0")
        for f in sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
            h.update(f.name.encode() + b"\0")
            _hash_weight_file(h, f)
    else:
        _hash_weight_file(h, path)
    return h.hexdigest()


def _canonical_json(raw: bytes) -> bytes:
    try:
        return json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, UnicodeDecodeError):
        return raw  # not JSON: the bytes themselves


def _hash_weight_file(h: Any, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"size={size}\0".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            h.update(_safetensors_header(f, size))
        if size <= SAMPLES * BLOCK:
            f.seek(0)
            h.update(f.read())
            return
        for i in range(SAMPLES):  # evenly spaced, the first at 0 and the last ending at size
            f.seek(i * (size - BLOCK) // (SAMPLES - 1))
            h.update(f.read(BLOCK))


def _safetensors_header(f: Any, size: int) -> bytes:
    raw = f.read(8)
    n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
    return raw + (f.read(n) if 0 < n <= min(MAX_ST_HEADER, size - 8) else b"")


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 hex of a tokenizer: an mlx-lm ``TokenizerWrapper``, a Hugging Face tokenizer
    (fast or slow) or a ``tokenizers.Tokenizer``."""
    # mlx-lm's TokenizerWrapper forwards these attributes to the tokenizer it wraps.
    h = hashlib.sha256(b"kvserve.tokenizer-hash.1\0")
    h.update(_tokenizer_model(tokenizer) + b"\0")
    for name in ("chat_template", "bos_token", "eos_token", "unk_token", "pad_token"):
        h.update(f"{name}=".encode() + _canonical_value(getattr(tokenizer, name, None)) + b"\0")
    return h.hexdigest()


def _tokenizer_model(inner: Any) -> bytes:
    """The tokenizer's canonical JSON (vocabulary, merges, normalizer, pre-tokenizer, added
    tokens); a slow tokenizer without one gives its sorted vocabulary."""
    backend = getattr(inner, "backend_tokenizer", inner)
    to_str = getattr(backend, "to_str", None)
    if callable(to_str):
        return _canonical_tokenizer_json(to_str())
    vocab = inner.get_vocab()
    return json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))).encode()


@functools.lru_cache(maxsize=4)
def _canonical_tokenizer_json(raw: str) -> bytes:
    """``_canonical_json`` of a tokenizer's JSON, remembered: parsing and re-serializing a
    1.5 MB tokenizer takes 0.25 s of a server's start (the serializing in Rust 0.04 s), and
    one process may start several servers on one tokenizer (a test run, a benchmark)."""
    return _canonical_json(raw.encode())


def _canonical_value(value: Any) -> bytes:
    if value is None:
        return b"null"
    try:
        return json.dumps(value, sort_keys=True, default=str).encode()
    except (TypeError, ValueError):
        return repr(value).encode()

