"""TurboQuant KV caches: ``TurboKVCache`` (one request) and ``BatchTurboKVCache``.

Two phases, one direction:

    raw         prefill chunks (L > 1) store K/V as they come; attention is the fused SDPA.
    compressed  the first L = 1 call encodes everything stored (key calibration computed
                here, once), then every new chunk is encoded on arrival; attention runs in
                the rotated basis (``kvserve.kernels.dispatch.attend``; ``turbo_codec.attend_encoded``
                is the full-context reference).

Storage is one ``GrowableBuffer`` whose parts depend on the phase and the key format;
every part is (B, H_kv, T, W), key parts first:

    phase / keys         parts (state adds key_scale (B, 1, 1, D_k) f32 for turbo keys)
    raw                  K (act dtype; 16-bit for K=0, D_k), V (act dtype; 16-bit for K=0, D_v)
    compressed, K=0      K (16-bit, D_k), V packed (uint32, ceil(D_v*b/32)), V norms (f32, 1)
    compressed, K=8      K wq (uint32, D_k/4), K scales, K biases (act dtype, D_k/g), V packed, V norms
    compressed, K=2..4   K packed, K norms, V packed, V norms

Raw keys that the scheme keeps raw (K=0) are stored as the compressed phase keeps them, 16-bit
floats (``RawFormat``), from the first chunk: compressing leaves them as they are. Their
values are then raw-phase 16-bit floats too, so a turbo0 prompt is stored, attended and
snapshotted exactly as the fp16 scheme's (a model computing in float32, a CPU, reads and
copies half the bytes; the 4-bit encoding of a 16-bit value differs from that of its float32
original only where the rounding crosses a codebook boundary). Schemes that encode keys keep
raw K/V as computed until they are encoded.

Example, turbo8v3 at D = 128, per token per KV head: K 128 + 2*2*2 = 136 B, V 48 + 4 = 52 B.
No dequantized copy of the cache is ever kept: attention decodes centroids transiently.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvserve.cache import registry
from kvserve.cache.base import BatchStoredKVCache, StoredKVCache
from kvserve.cache.buffer import DEFAULT_GRANULE, GrowableBuffer
from kvserve.cache.fp16 import as_16_bit, attend_raw
from kvserve.cache.scheme import KEY_SEED, KVScheme, parse_scheme  # noqa: F401 (docstrings)
from kvserve.cache.turbo_codec import F32, RawFormat, make_format

RAW, COMPRESSED = "raw", "compressed"
ENCODE_CHUNK = 1 << 22  # elements (B * H * tokens * D) encoded at once when compressing


def layer_scheme(scheme: KVScheme, layer_index: int, n_layers: int) -> KVScheme:
    """The scheme one KV layer actually uses: with ``protect_boundary_layers`` the first and
    last 2 KV-bearing layers are affine8 (the rule lives in the registry; this is the turbo
    family's name for it). ``layer_index`` / ``n_layers`` count KV-bearing layers only.

        >>> [layer_scheme(parse_scheme("turbo4"), i, 6).name for i in range(6)]
        ['affine8', 'affine8', 'turbo4', 'turbo4', 'affine8', 'affine8']
    """
    return registry.layer_scheme(scheme, layer_index, n_layers)


def component_bits(fmt) -> int:
    """Key/value bits as in the scheme name: 0 raw, 8 affine, 2-4 turbo."""
    return 0 if fmt.kind == "fp16" else fmt.bits


class SharedEncoding:
    """The compressed form of a prefix that several requests restore raw from one prefix-cache
    entry (a shared document), encoded by the first of them to compress and copied by the
    rest instead of encoding it again.

    Exact only where each token is encoded on its own (raw or affine keys, TurboQuant
    values): calibrated turbo keys take their scale from every token stored, so those caches
    never share (``_TurboMixin.shares``). An entry passes ``(encoding, k)`` on: its first k
    tokens are the tokens the encoding was made from (``TurboKVCache.encoding_share``).
    ``parts``: the compressed-phase parts of the first ``size`` tokens (None for raw keys,
    which each copy holds as they are stored compressed), or None until a request
    compresses. Its bytes (36 a token and KV head of 64 dims for turbo0v4 values: a tenth of
    the raw entry's on a CPU, a seventh on a GPU; a quarter for turbo8v3) are not counted in the
    prefix cache's RAM budget: one per shared prefix, freed with the last entry or request
    that holds it."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[mx.array] | None = None

    @property
    def size(self) -> int:
        return 0 if self.parts is None else self.parts[-1].shape[2]


class _TurboMixin:
    """Phase, encoding, compression, attention and state shared by both turbo caches."""

    scheme: KVScheme
    _buf: GrowableBuffer

    def check_scheme(self, scheme: KVScheme) -> None:
        if scheme.values.kind != "turbo":
            raise ValueError(f"scheme {scheme.name} is not a TurboQuant scheme")

    def _init_turbo(self) -> None:
        self.phase = RAW
        self.key_scale: mx.array | None = None  # (B, 1, 1, D_k) f32, turbo keys only
        self._dims: tuple[int, int] | None = None  # (D_k, D_v), known from the first update
        # (encoding, k): the first k stored tokens are those ``encoding`` is (to be) made from.
        self._shared: tuple[SharedEncoding, int] | None = None

    @property
    def shares(self) -> bool:
        """Whether encodings of this scheme can be shared: no key calibration."""
        return self.scheme.keys.kind != "turbo"

    def _set_dims(self, dk: int, dv: int) -> None:
        if self._dims is None:
            self._dims = (dk, dv)
            self._kf = make_format(self.scheme.keys, dk)
            self._vf = make_format(self.scheme.values, dv)

    @property
    def _turbo_keys(self) -> bool:
        return self.scheme.keys.kind == "turbo"

    @property
    def _n_key_parts(self) -> int:
        return {"fp16": 1, "affine": 3, "turbo": 2}[self.scheme.keys.kind]

    def _unit_scale(self, rows: int) -> mx.array:
        return mx.ones((rows, 1, 1, self._dims[0]), F32)  # (B, 1, 1, D_k): uncalibrated

    def _encode(self, keys: mx.array, values: mx.array, scale: mx.array | None) -> list[mx.array]:
        """(B, H, L, D) keys/values -> compressed-phase parts (B, H, L, W_i)."""
        return [*self._kf.encode(keys, scale), *self._vf.encode(values)]

    def present(self, parts: list[mx.array]) -> tuple[Any, Any]:
        """What ``update_and_fetch`` returns: raw (K, V) arrays, or (key parts, value parts)."""
        if self.phase == RAW:
            return parts[0], parts[1]
        return tuple(parts[:self._n_key_parts]), tuple(parts[self._n_key_parts:])

    # --- compression -------------------------------------------------------------------

    def _valid_slots(self) -> mx.array | None:
        """(B, H, T) bool of slots holding real tokens, or None when all do."""
        return None

    def _calibration(self, rotated: mx.array, valid: mx.array | None) -> mx.array:
        """Per-row key scale (B, 1, 1, D_k) from rotated unit keys (B, H, T, D_k); rows that
        skip calibration (too few samples, too little spread) hold exact ones."""
        rows = []
        for b in range(rotated.shape[0]):
            s = None
            if self.scheme.calibrate_keys:
                s = self._kf.codec.calibration_rotated(rotated[b], None if valid is None else valid[b])
            rows.append(mx.ones((rotated.shape[-1],), F32) if s is None else s)
        return mx.stack(rows)[:, None, None, :]

    def _stored(self) -> list[mx.array] | None:
        """Parts holding the stored slots, or None when nothing is stored."""
        return self._buf.views() if self._filled() is not None else None

    def _filled(self) -> GrowableBuffer | None:
        """The buffer, or None when nothing is stored."""
        return self._buf if self._buf.parts is not None and self._buf.size else None

    def _compressed(self, reserve: int = 0) -> tuple[GrowableBuffer | None, mx.array | None]:
        """(buffer, key_scale) holding the stored tokens in compressed form; this cache is
        not changed. A raw cache is encoded in chunks of ~ENCODE_CHUNK elements, each one
        evaluated, so a long prefill's f32 temporaries stay bounded."""
        if self.phase == COMPRESSED or self._filled() is None:
            return self._filled(), self.key_scale
        keys, values = self._stored()  # (B, H, T, D)
        rotated, scale = None, None
        if self._turbo_keys:  # rotate once, for the calibration and the encoding
            rotated = self._kf.codec.unit_rotated(keys)  # (B, H, T, D_k), (B, H, T, 1)
            scale = self._calibration(rotated[0], self._valid_slots())
        B, H, T, D = keys.shape
        buf, step = GrowableBuffer(self._buf.granule), max(1, ENCODE_CHUNK // (B * H * D))
        start = self._copy_shared(buf, T + reserve)
        for a in range(start, T, step):
            if rotated is not None:
                kparts = self._kf.codec.encode_unit(*(r[:, :, a:a + step] for r in rotated), scale)
            else:
                kparts = self._kf.encode(keys[:, :, a:a + step])
            parts = [*kparts, *self._vf.encode(values[:, :, a:a + step])]
            buf.reserve(parts, T + reserve)
            buf.append(parts)
            mx.eval(buf.parts)
        self._fill_shared(buf)
        return buf, scale

    def _copy_shared(self, buf: GrowableBuffer, capacity: int) -> int:
        """Put the shared encoding of this cache's first tokens into ``buf``; returns how
        many tokens it holds (0: none is shared, or none is made yet). Raw keys are this
        cache's own: they are stored as compressed from the first chunk."""
        if self._shared is None:
            return 0
        encoding, k = self._shared
        n = min(k, encoding.size)
        if n:
            own = self._buf.views()
            parts = [(own[0] if p is None else p)[:, :, :n] for p in encoding.parts]
            buf.reserve(parts, capacity)
            buf.append(parts)
        return n

    def _fill_shared(self, buf: GrowableBuffer) -> None:
        """The first to compress makes the shared encoding: copies of its first k tokens'
        encoded parts (the buffer's own storage grows in place, so it is not handed out);
        raw keys stay None, each copy holds them already."""
        if self._shared is not None and self._shared[0].parts is None and self._shared[1]:
            encoding, k = self._shared
            raw_keys = isinstance(self._kf, RawFormat)
            encoding.parts = [None if raw_keys and i == 0 else mx.array(v[:, :, :k])
                              for i, v in enumerate(buf.views())]
            mx.eval([p for p in encoding.parts if p is not None])

    def _compressed_state(self) -> tuple[mx.array, ...]:
        """The state this cache would have once compressed (nothing is changed)."""
        buf, scale = self._compressed()
        return (*(buf.views() if buf is not None else ()), *((scale,) if scale is not None else ()))

    def compress(self, reserve: int = 0) -> None:
        """Encode everything stored (raw -> compressed, once; later calls do nothing).
        ``reserve`` leaves room for that many more slots so the next append does not grow."""
        if self.phase == COMPRESSED:
            return
        buf, self.key_scale = self._compressed(reserve)
        self._buf = buf if buf is not None else GrowableBuffer(self._buf.granule)
        self.phase, self._shared = COMPRESSED, None

    def begin_decode(self) -> None:
        """Compress now: a verify chunk of several tokens would otherwise keep the raw
        phase (only a one-token call compresses), and the cache would decode unquantized."""
        self.compress(reserve=16)  # room for a verify chunk (at most 16 positions)

    # --- update and attention ----------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Append (B, H_kv, L, D) keys/values; the first L = 1 call compresses first."""
        self._set_dims(keys.shape[-1], values.shape[-1])
        if self.phase == RAW and keys.shape[2] == 1:
            self.compress(reserve=1)
        if self.phase == RAW:  # raw keys: both as the fp16 scheme stores them (module doc)
            parts = [*self._kf.encode(keys), as_16_bit(values)] if isinstance(self._kf, RawFormat) else [keys, values]
        else:
            if self._turbo_keys and self.key_scale is None:  # nothing was stored to calibrate on
                self.key_scale = self._unit_scale(keys.shape[0])
            parts = self._encode(keys, values, self.key_scale)
        self._buf.append(parts)
        return self.present(self._buf.views())

    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any,
               sinks: mx.array | None = None) -> mx.array:
        """Attention over what ``update_and_fetch`` returned: queries (B, H_q, L, D) ->
        (B, H_q, L, D_v) in the queries' dtype."""
        if self.phase == RAW:  # a prompt before its first decode step
            return attend_raw(queries, keys, values, scale, mask, sinks)
        from kvserve.kernels import dispatch  # here: kvserve.kernels imports this package

        return dispatch.attend(queries, self._kf, keys, self._vf, values, scale, mask, self.key_scale,
                               sinks=sinks)

    def dequantize(self) -> tuple[mx.array, mx.array]:
        """Stored keys and values decoded to the original basis, (B, H, T, D) float32 each.
        For tests and evaluation only: attention never builds this copy."""
        if self._filled() is None:
            raise ValueError("nothing is stored")
        parts = self._buf.views()
        if self.phase == RAW:
            return parts[0].astype(F32), parts[1].astype(F32)
        keys, values = self.present(parts)
        return self._kf.decode(keys, self.key_scale), self._vf.decode(values)

    @property
    def nbytes(self) -> int:
        """Bytes allocated: every part at capacity, plus the key scale."""
        return self._buf.nbytes + (self.key_scale.nbytes if self.key_scale is not None else 0)

    # --- state -------------------------------------------------------------------------

    def _state_arrays(self) -> tuple[mx.array, ...]:
        arrays = tuple(self._buf.views()) if self._buf.parts is not None else ()
        if self.phase == COMPRESSED and self.key_scale is not None:
            arrays += (self.key_scale,)
        return arrays

    def _meta(self) -> dict[str, str]:
        dk, dv = self._dims or (0, 0)
        return {"scheme": self.scheme.name, "phase": self.phase,
                "bits": str(self.scheme.values.bits), "key_bits": str(component_bits(self.scheme.keys)),
                "value_bits": str(self.scheme.values.bits), "seed": str(KEY_SEED),
                "key_dim": str(dk), "value_dim": str(dv)}

    def _load(self, arrays: tuple[mx.array, ...], meta: dict[str, str], size: int) -> None:
        """Inverse of ``_state_arrays`` / ``_meta``."""
        if meta.get("scheme", self.scheme.name) != self.scheme.name:
            raise ValueError(f"state is {meta['scheme']}, cache is {self.scheme.name}")
        self.phase = meta.get("phase", RAW)
        if self.phase not in (RAW, COMPRESSED):
            raise ValueError(f"unknown phase {self.phase!r}")
        if int(meta.get("key_dim", 0)):
            self._set_dims(int(meta["key_dim"]), int(meta["value_dim"]))
        arrays = tuple(arrays)
        if self.phase == COMPRESSED and self._turbo_keys and arrays:
            self.key_scale, arrays = arrays[-1], arrays[:-1]
        expected = 2 if self.phase == RAW else self._n_key_parts + 2
        if arrays and len(arrays) != expected:
            raise ValueError(f"{self.phase} {self.scheme.name} state needs {expected} arrays, got {len(arrays)}")
        if any(a.shape[2] != size for a in arrays) or (size and not arrays):
            raise ValueError(f"state arrays do not hold {size} tokens")
        if arrays:
            self._buf = GrowableBuffer.adopt(arrays, size, self._buf.granule)


class TurboKVCache(_TurboMixin, StoredKVCache):
    """One request's TurboQuant cache (B = 1); ``offset`` = tokens stored.

    ``state``: the phase's parts holding exactly ``offset`` tokens, then ``key_scale``
    (1, 1, 1, D_k) when compressed with turbo keys. ``meta_state``: offset, scheme, phase,
    bits, key_bits, value_bits, seed (as mlx-swift-lm's metaState), key_dim, value_dim.
    """

    def __init__(self, scheme: KVScheme, granule: int = DEFAULT_GRANULE):
        super().__init__(scheme, granule)
        self._init_turbo()

    @property
    def state(self) -> tuple[mx.array, ...]:
        return self._state_arrays()

    @property
    def meta_state(self) -> dict[str, str]:
        return {"offset": str(self.offset), **self._meta()}

    @classmethod
    def from_state(cls, scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]) -> TurboKVCache:
        cache = cls(scheme)
        cache._load(state, meta, int(meta.get("offset", 0)))
        return cache

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self._shared is not None:  # tokens appended after this are no longer the shared ones
            self._shared = (self._shared[0], min(self._shared[1], self.offset))
        return n

    def encoding_share(self) -> tuple[SharedEncoding, int] | None:
        """For a prefix-cache entry of this raw prompt: the encoding its restored copies
        share, with how many of its first tokens it covers (this cache's own share where it
        was restored with one, else a new encoding of all it holds)."""
        if self.phase != RAW or not self.shares or not self.offset:
            return None
        return self._shared if self._shared is not None else (SharedEncoding(), self.offset)

    def adopt_encoding_share(self, share: tuple[SharedEncoding, int]) -> None:
        """Take an entry's ``encoding_share`` (this cache is a copy restored from it)."""
        if self.phase == RAW and self.shares:
            self._shared = (share[0], min(share[1], self.offset))

    def __repr__(self) -> str:
        return f"TurboKVCache({self.scheme.name}, {self.phase}, offset={self.offset}, capacity={self.capacity})"


class BatchTurboKVCache(_TurboMixin, BatchStoredKVCache):
    """B left-padded sequences in one TurboQuant cache (layout of ``BatchStoredKVCache``),
    plus one key-scale row per sequence (``key_scale`` (B, 1, 1, D_k)).

    The phase is per batch. ``merge`` / ``extend`` of raw with compressed caches compress the
    raw side first, each sequence calibrated on its own tokens only (padding excluded), so a
    sequence is encoded identically whether it was compressed alone or inside a batch.
    """

    single_cls = TurboKVCache

    def __init__(self, scheme: KVScheme, left_padding: list[int], granule: int = DEFAULT_GRANULE):
        super().__init__(scheme, left_padding, granule)
        self._init_turbo()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if keys.shape[0] != self.batch_size:
            raise ValueError(f"batch of {keys.shape[0]} rows for a cache of {self.batch_size}")
        return super().update_and_fetch(keys, values)

    def captured_state(self) -> dict[str, Any] | None:
        """Compressed, and without per-row key scales (turbo0 keys are 16-bit floats): a
        captured step's view encodes and attends as this layer does. Raw prompts compress at
        their first decode step, which stays eager; calibrated turbo keys (turbo4) carry a (B, ...)
        scale that a trace would keep as a constant, so they step eagerly."""
        if self.phase != COMPRESSED or self.key_scale is not None or self._dims is None:
            return None
        return {"phase": COMPRESSED, "key_scale": None, "_dims": self._dims, "_kf": self._kf, "_vf": self._vf}

    def _valid_slots(self) -> mx.array:
        T, H = self._buf.size, self._buf.parts[0].shape[1]
        valid = mx.arange(T)[None, :] >= mx.array(self.left_padding)[:, None]  # (B, T)
        return mx.broadcast_to(valid[:, None, :], (self.batch_size, H, T))

    def _scale_rows(self) -> mx.array | None:
        """(B, 1, 1, D_k) key scale with unit rows where none was computed yet."""
        if not (self._turbo_keys and self.phase == COMPRESSED and self._dims):
            return None
        return self.key_scale if self.key_scale is not None else self._unit_scale(self.batch_size)

    @classmethod
    def merge(cls, caches: list[TurboKVCache]) -> BatchTurboKVCache:
        """Left-pad and stack per-request caches of one scheme (the inputs are not changed).
        Compressed where any of them is, or shares an encoding (``SharedEncoding``: rows
        restored from a prefix entry merge to decode, and each copies the shared part)."""
        if len({c.scheme for c in caches}) != 1:
            raise ValueError("merge needs caches of one scheme")
        compressed = any(c.phase == COMPRESSED or c._shared is not None for c in caches)
        entries = [c._compressed() if compressed else (c._filled(), None) for c in caches]
        sizes = [c.offset if buf is not None else 0 for c, (buf, _) in zip(caches, entries)]
        size = max(sizes)
        batch = cls(caches[0].scheme, [size - n for n in sizes], caches[0]._buf.granule)
        batch.phase = COMPRESSED if compressed else RAW
        dims = next((c._dims for c in caches if c._dims is not None), None)
        if dims is not None:
            batch._set_dims(*dims)
        if size:
            batch._buf = _stack([(buf, 1) for buf, _ in entries], size)
        if batch._scale_rows() is not None:
            batch.key_scale = mx.concatenate([s if s is not None else batch._unit_scale(1) for _, s in entries])
        return batch

    def extract(self, i: int) -> TurboKVCache:
        """Sequence ``i`` as a per-request cache (padding removed, same phase)."""
        single = super().extract(i)
        single.phase = self.phase
        if self._dims is not None:
            single._set_dims(*self._dims)
        if self.key_scale is not None:
            single.key_scale = self.key_scale[i:i + 1]
        return single

    def filter(self, indices: list[int]) -> None:
        super().filter(indices)
        if self.key_scale is not None:
            self.key_scale = self.key_scale[mx.array(indices, dtype=mx.int32)]

    def extend(self, other: BatchTurboKVCache) -> None:
        """Append ``other``'s sequences; the shorter side gets more left padding."""
        if self.phase != other.phase:
            self.compress()
            other.compress()
        for a, b in ((self, other), (other, self)):
            if a._dims is None and b._dims is not None:
                a._set_dims(*b._dims)
        scales = [self._scale_rows(), other._scale_rows()]
        size = max(self.size(), other.size())
        padding = [p + size - self.size() for p in self.left_padding]
        padding += [p + size - other.size() for p in other.left_padding]
        if size:
            self._buf = _stack([(self._filled(), self.batch_size), (other._filled(), other.batch_size)], size)
        self.left_padding = padding
        if scales[0] is not None:
            self.key_scale = mx.concatenate(scales)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The phase's parts (first ``size()`` slots, padding included), then key_scale."""
        return self._state_arrays()

    @property
    def meta_state(self) -> dict[str, str]:
        return {"size": str(self.size()), "left_padding": ",".join(map(str, self.left_padding)),
                **self._meta()}

    @classmethod
    def from_state(cls, scheme: KVScheme, state: tuple[mx.array, ...], meta: dict[str, str]) -> BatchTurboKVCache:
        padding = [int(p) for p in meta["left_padding"].split(",") if p]
        batch = cls(scheme, padding)
        batch._load(state, meta, int(meta.get("size", 0)))
        if state and state[0].shape[0] != len(padding):
            raise ValueError(f"state has {state[0].shape[0]} rows, left_padding {len(padding)}")
        return batch

    def __repr__(self) -> str:
        return (f"BatchTurboKVCache({self.scheme.name}, {self.phase}, lengths={self.lengths}, "
                f"size={self.size()}, capacity={self.capacity})")


def _stack(entries: list[tuple[GrowableBuffer | None, int]], size: int) -> GrowableBuffer:
    """Row-stack buffers right-aligned at slot ``size`` (one copy); an entry (None, rows)
    stands for ``rows`` sequences with nothing stored."""
    template = next(b for b, _ in entries if b is not None)
    bufs = [b if b is not None else template.empty_rows(rows) for b, rows in entries]
    return GrowableBuffer.concat_batch(bufs, [size - b.size for b in bufs], size, template.granule)


registry.register("turbo", TurboKVCache, BatchTurboKVCache)
