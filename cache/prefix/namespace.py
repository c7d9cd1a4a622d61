"""What an entry must share with a server to be reused there, and how entries are named.

A ``Namespace`` is everything besides the token ids that decides the KV values: the model
(weights and configuration, as a fingerprint), the tokenizer, the full KV scheme with every
parameter, ``quantize_after`` (which tokens a container holds in fp16) and the layout of
layer kinds (``PromptCache.layout``, e.g. ``kv,window16*3,kv``: full attention, sliding
windows, recurrent state). A server split across processes adds ``shard``, this process's part
of the model (``tp2:rank1:kv_heads=2+1``): each rank keeps its own part of every entry, and a
part never serves another layout. Entries of one namespace never serve another: files record
it and are refused on any difference, with the field that differs as the reason.

    >>> from kvserve.cache.scheme import parse_scheme
    >>> ns = Namespace(model="m1", tokenizer="t1", scheme=parse_scheme("affine4-g32"))
    >>> len(ns.key), ns.identity()["scheme"]
    (16, 'affine4-g32')
    >>> json.loads(ns.identity()["scheme_params"])["keys.group_size"]
    '32'
    >>> name = ns.entry_name([1, 2, 3])
    >>> name.startswith(ns.key + "-") and name.endswith(".safetensors") and len(name) == 61
    True
    >>> ns.entry_name([1, 2, 3]) == name, ns.entry_name([1, 2]) == name
    (True, False)

File names come only from these hashes, never from request text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvserve.cache.scheme import KVScheme, parse_scheme

PREFIX_VERSION = "5"  # the prefix-cache file format (files.py); any other value is refused.
# 3: fp16 entries hold 16-bit floats on every device (float32 on the CPU before).
# 4: so do the keys of TurboQuant's turbo0 schemes (float32 on the CPU before).
# 5: and their raw prompts' values (float32 on the CPU before).
SUFFIX = ".safetensors"
TOKEN_LIMIT = 1 << 32  # token ids are stored as uint32


def token_bytes(tokens: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (what digests and files hold).

    >>> token_bytes([1, 256])
    b'\\x01\\x00\\x00\\x00\\x00\\x01\\x00\\x00'
    """
    return np.asarray(as_tokens(tokens), dtype="<u4").tobytes()


def as_tokens(tokens: Iterable[int]) -> tuple[int, ...]:
    """A tuple of ints in [0, 2**32); anything else is a ``ValueError``.

    >>> as_tokens(np.array([5, 6]))
    (5, 6)
    """
    out = tuple(int(t) for t in tokens)
    if any(t < 0 or t >= TOKEN_LIMIT for t in out):
        raise ValueError("token ids must lie in [0, 2**32)")
    return out


def tokens_digest(tokens: Iterable[int]) -> str:
    return hashlib.sha256(token_bytes(tokens)).hexdigest()


@dataclass(frozen=True)
class Namespace:
    """Model fingerprint, tokenizer hash, KV scheme and fp16 threshold of one server.

    ``scheme`` takes a ``KVScheme`` or a scheme name; ``quantize_after`` is the threshold the
    server gives ``PromptCache.for_model`` (0: layers start in the scheme).
    """

    model: str
    tokenizer: str
    scheme: KVScheme
    quantize_after: int = 0
    layout: str = ""
    shard: str = ""  # a sharded model's part (world size, rank, split); "" for one process

    def __post_init__(self):
        if isinstance(self.scheme, str):
            object.__setattr__(self, "scheme", parse_scheme(self.scheme))
        if not isinstance(self.model, str) or not isinstance(self.tokenizer, str):
            raise TypeError("model and tokenizer must be strings (a fingerprint and a hash)")
        if self.quantize_after < 0:
            raise ValueError("quantize_after must be >= 0")

    def identity(self) -> dict[str, str]:
        """The fields every file records and every load compares, as strings. ``shard`` is
        there only when set, so the names of one process's entries stay what they were."""
        out = {"prefix_version": PREFIX_VERSION, "model": self.model, "tokenizer": self.tokenizer,
               "scheme": self.scheme.name,
               "scheme_params": json.dumps(self.scheme.params(), sort_keys=True),
               "quantize_after": str(self.quantize_after), "layout": self.layout}
        if self.shard:
            out["shard"] = self.shard
        return out

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()

    @property
    def key(self) -> str:
        """16 hex digits that start every file name of this namespace."""
        return self.digest[:16]

    def entry_key(self, tokens: Iterable[int]) -> str:
        """``<namespace key>-<32 hex of sha256(namespace, tokens)>``: the entry's id and file stem."""
        h = hashlib.sha256(self.digest.encode())
        h.update(token_bytes(tokens))
        return f"{self.key}-{h.hexdigest()[:32]}"

    def entry_name(self, tokens: Iterable[int]) -> str:
        return self.entry_key(tokens) + SUFFIX
