"""Convert a GGUF file (llama or gemma3 architecture) into an mlx-lm model directory.

The converted directory is what ``mlx_lm.load`` expects::

    <dst>/
      config.json             hyper-parameters + "quantization" (group_size, bits per module)
      model.safetensors       HF tensor names, quantized linears as MLX affine triples
      tokenizer.json          rebuilt from the GGUF vocabulary (see gguf_tokenizer)
      tokenizer_config.json   chat template, bos/eos
      special_tokens_map.json
      kvserve.json            source name, size, mtime, sha256, converter version

The GGUF's own quantized weights are kept: every block type whose groups of 32 are affine
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K) becomes an MLX affine triple of the same bits
(``X.weight`` uint32, ``X.scales``, ``X.biases``), which is exactly the layout of
``nn.QuantizedLinear``; the rest is stored dense (see gguf_tensors). Nothing is
re-quantized, so the converted model computes what the GGUF file describes. What differs
between architectures (names, config.json, fix-ups) is in gguf_arch.

The header is parsed here in pure Python (``struct``) before any tensor is read, so that
a wrong, truncated or unsupported file is reported as a one-line ``ModelLoadError``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvserve.server.models.errors import ModelLoadError
from kvserve.server.models.gguf_arch import ARCHS, Arch, hf_module, unpermute_rope_rows
from kvserve.server.models.gguf_tensors import SUPPORTED_TYPES, mlx_layout, to_affine, to_dense
from kvserve.server.models.gguf_tokenizer import write_tokenizer_files

# Bumped whenever the output of the converter changes; cached conversions made by
# another version are redone.
CONVERTER_VERSION = 1

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml tensor types: id -> (name, elements per block, bytes per block). Types the
# converter cannot load are listed too, so that the truncation check and the error
# message can still name them.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    30: ("BF16", 1, 2),
}
# Further types, named for error messages only (no size: a file using them is
# refused before its size matters).
_OTHER_TYPE_NAMES = {16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
                     21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M", 34: "TQ1_0",
                     35: "TQ2_0", 39: "MXFP4"}
# GGUF metadata value types: id -> struct format (None: variable length).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

@dataclass
class TensorInfo:
    """One tensor info record. ``shape`` is in row-major order (GGUF stores ne0,
    the contiguous dimension, first; it is reversed here), e.g. a q_proj of a model
    with hidden 576 is ``shape == (576, 576)`` and ``token_embd`` is ``(vocab, 576)``."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int

    @property
    def type_name(self) -> str:
        if self.type_id in GGML_TYPES:
            return GGML_TYPES[self.type_id][0]
        return _OTHER_TYPE_NAMES.get(self.type_id, f"#{self.type_id}")

    def nbytes(self) -> int:
        _, block, size = GGML_TYPES[self.type_id]
        count = 1
        for dim in self.shape:
            count *= dim
        return count // block * size


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int
    alignment: int = DEFAULT_ALIGNMENT
    arch: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.arch = str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """Architecture-scoped key: ``get("block_count")`` reads ``llama.block_count``."""
        return self.metadata.get(f"{self.arch}.{key}", default)


class _Reader:
    """Sequential little-endian reader over a buffer; running past the end means the
    file is truncated."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"GGUF file is truncated (header cut short): {self.path}")
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.pos + length > len(self.buf):
            raise ModelLoadError(f"GGUF file is truncated (header cut short): {self.path}")
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            return [self.value(item_type) for _ in range(count)]
        fmt = _SCALARS.get(type_id)
        if fmt is None:
            raise ModelLoadError(f"GGUF header has an unknown value type {type_id}: {self.path}")
        raw = self.unpack(fmt)
        return _short_float(raw) if type_id == 6 else raw


def _short_float(value: float) -> float:
    """The shortest decimal that is still the same float32, so that config.json says
    ``1e-05`` rather than ``9.999999747378752e-06``."""
    exact = struct.pack("<f", value)
    for digits in range(6, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == exact:
            return candidate
    return value


def read_header(path: Path) -> GGUFHeader:
    """Parse the GGUF header (metadata and tensor infos) and check that the file is
    long enough for every tensor it declares.

    Layout (little-endian)::

        "GGUF" | version u32 | n_tensors u64 | n_kv u64
        n_kv x (key string, value type u32, value)      string = u64 length + bytes
        n_tensors x (name string, n_dims u32, n_dims x u64 (ne0 first), type u32, offset u64)
        padding to general.alignment (default 32), then tensor data at the offsets
    """
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"not a GGUF file (starts with {magic!r}, expected b'GGUF'): {path}")
        if size < 24:
            raise ModelLoadError(f"GGUF file is truncated ({size} bytes): {path}")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _parse(_Reader(buf, path), size)
    _check_size(header, path)
    return header


def _parse(reader: _Reader, size: int) -> GGUFHeader:
    reader.pos = 4
    version = reader.unpack("<I")
    if version not in (2, 3):
        # Version 1 used 32-bit counts; a byte-swapped version means a big-endian file.
        raise ModelLoadError(f"unsupported GGUF version {version} (supported: 2, 3): {reader.path}")
    n_tensors, n_kv = reader.unpack("<Q"), reader.unpack("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.unpack("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = reader.string()
        dims = [reader.unpack("<Q") for _ in range(reader.unpack("<I"))]
        type_id, offset = reader.unpack("<I"), reader.unpack("<Q")
        tensors.append(TensorInfo(name, tuple(reversed(dims)), type_id, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
    data_offset = -(-reader.pos // alignment) * alignment
    return GGUFHeader(version, metadata, tensors, data_offset, size, alignment)


def _check_size(header: GGUFHeader, path: Path) -> None:
    needed = header.data_offset
    for info in header.tensors:
        if info.type_id in GGML_TYPES:  # other types are refused by check_supported
            needed = max(needed, header.data_offset + info.offset + info.nbytes())
    if header.file_size < needed:
        raise ModelLoadError(
            f"GGUF file is truncated ({header.file_size} of {needed} bytes): {path}")


def _unsupported_type(info: TensorInfo) -> ModelLoadError:
    return ModelLoadError(
        f"unsupported tensor type {info.type_name} in {info.name} "
        f"(supported: {', '.join(SUPPORTED_TYPES)})")


def arch_of(header: GGUFHeader, path: Path) -> Arch:
    """The architecture description for ``header``, or a one-line refusal."""
    if header.arch not in ARCHS:
        found = header.arch or "none"
        raise ModelLoadError(
            f"unsupported architecture {found!r} (supported: {', '.join(ARCHS)}): {path}")
    return ARCHS[header.arch]


def check_supported(header: GGUFHeader, path: Path) -> None:
    """Refuse what the converter cannot turn into a working mlx-lm model."""
    arch = arch_of(header, path)
    for info in header.tensors:
        if info.type_name not in SUPPORTED_TYPES:
            raise _unsupported_type(info)
        if info.name == "rope_freqs.weight":
            continue  # refused below with its reason
        if hf_module(arch, _split_name(info.name)[0]) is None:
            raise ModelLoadError(f"unexpected tensor {info.name!r} in a {arch.name} GGUF file")
    _check_required(header, arch, path)
    if reason := arch.refuse(header):
        raise ModelLoadError(f"{reason}: {path}")


def _check_required(header: GGUFHeader, arch: Arch, path: Path) -> None:
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if header.get(key) is None:
            raise ModelLoadError(f"GGUF metadata lacks {header.arch}.{key}: {path}")
    names = {t.name for t in header.tensors}
    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{part}.weight" for i in range(int(header.get("block_count"))) for part in arch.layer_names]
    missing = [name for name in required if name not in names]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(f"GGUF file lacks tensor {missing[0]}{more}: {path}")


def _split_name(name: str) -> tuple[str, str]:
    """``blk.0.attn_q.weight`` -> (``blk.0.attn_q``, ``weight``)."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ModelLoadError(f"unexpected tensor {name!r} in a GGUF file")
    return base, suffix


def build_config(header: GGUFHeader, quantization: dict | None) -> dict:
    """config.json for the mlx-lm model of the file's architecture, every value taken
    from the metadata (or, where the file is silent, from what llama.cpp assumes)."""
    arch = ARCHS[header.arch]
    config = arch.build_config(header)
    config.update(_special_ids(header.metadata, arch))
    if quantization:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


def _special_ids(meta: dict, arch: Arch) -> dict:
    """bos/eos ids for config.json. A separate end-of-turn token (llama-3's
    ``<|eot_id|>``, Gemma's ``<end_of_turn>``) is listed as a further eos so that chat
    replies stop on it."""
    out = {}
    if (bos := meta.get("tokenizer.ggml.bos_token_id")) is not None:
        out["bos_token_id"] = int(bos)
    stops = [int(meta[f"tokenizer.ggml.{key}"]) for key in ("eos_token_id", "eot_token_id")
             if meta.get(f"tokenizer.ggml.{key}") is not None]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    stops += [tokens.index(text) for text in arch.extra_stops if text in tokens]
    stops = list(dict.fromkeys(stops))
    if stops:
        out["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return out


def _check_shapes(header: GGUFHeader, config: dict) -> None:
    """Catch metadata that disagrees with the tensors before mlx-lm does, with a
    message that names the tensor."""
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])
    rope_dims = int(header.get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(f"unsupported partial RoPE ({rope_dims} of {head_dim} head dims)")
    expect = {"attn_q": heads * head_dim, "attn_k": kv_heads * head_dim,
              "attn_v": kv_heads * head_dim, "ffn_up": config["intermediate_size"]}
    for info in header.tensors:
        base = info.name.split(".")[-2] if info.name.startswith("blk.") else ""
        if base in expect and info.name.endswith(".weight") and info.shape[0] != expect[base]:
            raise ModelLoadError(
                f"tensor {info.name} has {info.shape[0]} rows, metadata implies {expect[base]}")


def quantization_entry(header: GGUFHeader) -> dict | None:
    """mlx-lm ``quantization`` config: the most common (bits, group_size) as the
    default, plus per-module overrides where a tensor differs, e.g. for a Q4_1 file
    with a Q8_0 embedding and an F16 q_proj::

        {"group_size": 32, "bits": 4, "mode": "affine",
         "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
         "model.layers.0.self_attn.q_proj": false}
    """
    arch = ARCHS[header.arch]
    layouts: dict[str, tuple[int, int] | None] = {}
    for info in header.tensors:
        base, suffix = _split_name(info.name)
        if suffix == "weight" and len(info.shape) == 2:
            layouts[hf_module(arch, base)] = mlx_layout(info.type_name)
    counts: dict[tuple[int, int], int] = {}
    for layout in filter(None, layouts.values()):
        counts[layout] = counts.get(layout, 0) + 1
    if not counts:
        return None
    bits, group = max(counts, key=counts.get)
    entry: dict[str, Any] = {"group_size": group, "bits": bits, "mode": "affine"}
    for module, layout in sorted(layouts.items()):
        if layout is None:
            entry[module] = False
        elif layout != (bits, group):
            entry[module] = {"group_size": layout[1], "bits": layout[0], "mode": "affine"}
    return entry


def _raw(buf, header: GGUFHeader, info: TensorInfo):
    """The bytes of one tensor as a (rows, bytes per row) uint8 view of the mapped file."""
    import numpy as np

    start = header.data_offset + info.offset
    rows = 1
    for dim in info.shape[:-1]:
        rows *= dim
    return np.frombuffer(buf, np.uint8, info.nbytes(), start).reshape(rows, -1)


def _arrays(buf, header: GGUFHeader, info: TensorInfo, arch: Arch) -> dict:
    """``{"weight": ..., ["scales": ..., "biases": ...]}`` (numpy) of one tensor, with the
    architecture's norm shift applied."""
    import numpy as np

    raw, suffix = _raw(buf, header, info), _split_name(info.name)[1]
    if mlx_layout(info.type_name) and len(info.shape) == 2:
        parts = to_affine(raw, info.type_name, arch.half_scales)
        return {suffix: parts.pop("weight"), **parts}
    value = to_dense(raw, info.type_name, info.shape)
    if arch.norm_shift and info.name.endswith("norm.weight"):
        value = value.astype(np.float32) - np.float32(arch.norm_shift)
    elif not arch.half_scales and value.dtype == np.float16:
        value = value.astype(np.float32)  # a float16 norm would bring float16 activations
    return {suffix: value}


def convert_weights(header: GGUFHeader, buf, progress: Callable[[int, int], None]) -> dict:
    """Every tensor of the file (``buf``: its mapped bytes) as MLX arrays under HF names,
    q/k rows un-permuted where the architecture needs it."""
    import mlx.core as mx

    arch = ARCHS[header.arch]
    heads = {"attn_q": int(header.get("attention.head_count")),
             "attn_k": int(header.get("attention.head_count_kv", header.get("attention.head_count")))}
    layers = int(header.get("block_count"))
    out, done = {}, 0
    for info in header.tensors:
        base = _split_name(info.name)[0]
        module = hf_module(arch, base)
        n_heads = heads.get(base.rsplit(".", 1)[-1]) if arch.permute_qk else None
        for key, value in _arrays(buf, header, info, arch).items():
            value = mx.array(value)
            out[f"{module}.{key}"] = unpermute_rope_rows(value, n_heads) if n_heads else value
        if base.endswith(".ffn_down"):  # one per layer; files need not be in layer order
            done += 1
            progress(done, layers)
    return out


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def source_record(src: Path, sha256: str | None = None) -> dict:
    """What kvserve.json records about the GGUF file a directory was made from."""
    stat = src.stat()
    return {"source": src.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": sha256 or sha256_file(src), "converter_version": CONVERTER_VERSION}


def _layer_reporter(progress: Callable[[str], None] | None, name: str) -> Callable[[int, int], None]:
    """Report layers at about every quarter, so a log gets a handful of lines."""
    def report(done: int, total: int) -> None:
        step = max(1, total // 4)
        if progress and (done % step == 0 or done == total):
            progress(f"converting {name}: {done}/{total} layers")
    return report


def convert_gguf(src: Path, dst: Path, progress: Callable[[str], None] | None = None,
                 *, sha256: str | None = None) -> Path:
    """Convert the GGUF file ``src`` into the mlx-lm model directory ``dst``.

    Everything is written into a temporary directory next to ``dst`` which is renamed
    to ``dst`` at the end, so an interrupted conversion leaves no half directory.
    ``sha256`` may be passed when the caller has already hashed ``src``.

    Example::

        convert_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), Path("/tmp/smollm2"))
        model, tokenizer = mlx_lm.load("/tmp/smollm2")
    """
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    say = progress or (lambda _line: None)
    header = read_header(src)
    check_supported(header, src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        _write_model(header, src, tmp, say, sha256)
        _replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"converted {src.name} -> {dst}")
    return dst


def _write_model(header: GGUFHeader, src: Path, out: Path, say: Callable[[str], None],
                 sha256: str | None) -> None:
    import mlx.core as mx

    config = build_config(header, quantization_entry(header))
    _check_shapes(header, config)
    # The tokenizer first: an unsupported vocabulary fails before the slow part.
    write_tokenizer_files(header.metadata, out)
    say(f"converting {src.name}: reading tensors")
    with open(src, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        weights = convert_weights(header, buf, _layer_reporter(say, src.name))
        mx.eval(weights)  # every array copied out of the mapping before it closes
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    record = source_record(src, sha256)
    (out / "kvserve.json").write_text(json.dumps(record, indent=2) + "\n")


def _remove_stale_tmp(dst: Path, age_s: float = 3600.0) -> None:
    """Remove what a killed conversion into ``dst`` left behind. Only old ones: a
    young one may belong to a conversion still running in another process."""
    now = time.time()
    for stale in dst.parent.glob(f".{dst.name}.*.tmp"):
        try:
            if now - stale.stat().st_mtime > age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _replace_dir(tmp: Path, dst: Path) -> None:
    """Move ``tmp`` to ``dst``; an older ``dst`` is moved aside first and removed
    after, because a directory cannot be renamed over a non-empty one."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
