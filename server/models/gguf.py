"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

The converted directory is what ``mlx_lm.load`` expects::

    <dst>/
      config.json             llama hyper-parameters + "quantization" (group_size, bits)
      model.safetensors       HF tensor names, quantized linears as MLX affine triples
      tokenizer.json          rebuilt from the GGUF vocabulary (see gguf_tokenizer)
      tokenizer_config.json   chat template, bos/eos
      special_tokens_map.json
      kvserve.json            source name, size, mtime, sha256, converter version

The GGUF's own quantized weights are kept: ``mx.load`` turns Q4_0/Q4_1 blocks into
4-bit and Q8_0 blocks into 8-bit affine-quantized triples with group size 32
(``X.weight`` uint32, ``X.scales`` and ``X.biases`` fp16), which is exactly the layout
of ``nn.QuantizedLinear``. Nothing is re-quantized, so the converted model computes
what the GGUF file describes.

The header is parsed here in pure Python (``struct``) before ``mx.load`` sees the
file, so that a wrong, truncated or unsupported file is reported as a one-line
``ModelLoadError`` instead of a traceback from the native loader.
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

from .gguf_tokenizer import write_tokenizer_files
from .model_source import ModelLoadError

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
# What mx.load reads, and the MLX (bits, group_size) a quantized type becomes.
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "F32")
QUANT_LAYOUT = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32)}

# GGUF metadata value types: id -> struct format (None: variable length).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# GGUF tensor name (without ".weight"/".bias") -> HF llama module name.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


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
        f"(supported: {', '.join(SUPPORTED_TYPES)}); use a GGUF quantized as Q4_0, Q4_1 or Q8_0")


def check_supported(header: GGUFHeader, path: Path) -> None:
    """Refuse what the converter cannot turn into a working mlx-lm llama model."""
    if header.arch != "llama":
        found = header.arch or "none"
        raise ModelLoadError(f"unsupported architecture {found!r} (supported: llama): {path}")
    for info in header.tensors:
        if info.type_name not in SUPPORTED_TYPES:
            raise _unsupported_type(info)
        if info.name == "rope_freqs.weight":
            raise ModelLoadError(f"unsupported RoPE frequency table (llama3-style rope scaling): {path}")
        _hf_module(_split_name(info.name)[0])  # every tensor must have a place in the model
    _check_required(header, path)
    rope_type = header.get("rope.scaling.type", "none")
    if rope_type not in ("none", "linear"):
        raise ModelLoadError(f"unsupported RoPE scaling {rope_type!r} (supported: none, linear): {path}")


def _check_required(header: GGUFHeader, path: Path) -> None:
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if header.get(key) is None:
            raise ModelLoadError(f"GGUF metadata lacks {header.arch}.{key}: {path}")
    names = {t.name for t in header.tensors}
    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{part}.weight" for i in range(int(header.get("block_count"))) for part in _LAYER_NAMES]
    missing = [name for name in required if name not in names]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(f"GGUF file lacks tensor {missing[0]}{more}: {path}")


def _hf_module(gguf_base: str) -> str:
    """``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``; ``output`` -> ``lm_head``."""
    if gguf_base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_base]
    parts = gguf_base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ModelLoadError(f"unexpected tensor {gguf_base!r} in a llama GGUF file")


def _split_name(name: str) -> tuple[str, str]:
    """``blk.0.attn_q.weight`` -> (``blk.0.attn_q``, ``weight``)."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ModelLoadError(f"unexpected tensor {name!r} in a llama GGUF file")
    return base, suffix


def unpermute_rope_rows(x, n_heads: int):
    """Undo llama.cpp's row permutation of ``attn_q``/``attn_k`` (applied to every
    tensor of the module: weight, scales, biases, bias; rows are output features).

    llama.cpp stores each head's rotary pairs interleaved, HF keeps the two halves
    apart. For one head with head_dim 4 the GGUF rows are ``[r0, r2, r1, r3]`` and
    HF rows are ``[r0, r1, r2, r3]``: reshape the rows as (heads, half, 2), swap the
    last two axes and flatten back.
    """
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def build_config(header: GGUFHeader, quantization: dict | None) -> dict:
    """config.json for mlx-lm's llama model, every value taken from the metadata."""
    by_name = {t.name: t for t in header.tensors}
    hidden = int(header.get("embedding_length"))
    heads = int(header.get("attention.head_count"))
    embed = by_name["token_embd.weight"]
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(header.get("block_count")),
        "intermediate_size": int(header.get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.get("attention.head_count_kv", heads)),
        "head_dim": int(header.get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(header.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(header.get("rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "vocab_size": embed.shape[0],
        "max_position_embeddings": int(header.get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in by_name,
        "attention_bias": "blk.0.attn_q.bias" in by_name,
        "mlp_bias": "blk.0.ffn_up.bias" in by_name,
    }
    if header.get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(header.get("rope.scaling.factor", 1.0))}
    config.update(_special_ids(header.metadata))
    if quantization:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


def _special_ids(meta: dict) -> dict:
    """bos/eos ids for config.json. A separate end-of-turn token (llama-3's
    ``<|eot_id|>``) is listed as a second eos so that chat replies stop on it."""
    out = {}
    if (bos := meta.get("tokenizer.ggml.bos_token_id")) is not None:
        out["bos_token_id"] = int(bos)
    stops = [int(meta[f"tokenizer.ggml.{key}"]) for key in ("eos_token_id", "eot_token_id")
             if meta.get(f"tokenizer.ggml.{key}") is not None]
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
    layouts: dict[str, tuple[int, int] | None] = {}
    for info in header.tensors:
        base, suffix = _split_name(info.name)
        if suffix == "weight" and len(info.shape) == 2:
            layouts[_hf_module(base)] = QUANT_LAYOUT.get(info.type_name)
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


def _load_tensors(path: Path) -> dict:
    import mlx.core as mx

    try:
        return mx.load(str(path))
    except Exception as exc:  # the native loader's errors are multi-line and technical
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not read the tensors of {path.name}: {first}") from exc


def convert_weights(header: GGUFHeader, tensors: dict, progress: Callable[[int, int], None]) -> dict:
    """Rename mx.load's GGUF tensors to HF llama names and undo the q/k permutation.

    mx.load names a quantized ``blk.0.attn_q.weight`` as ``blk.0.attn_q.weight``,
    ``blk.0.attn_q.scales`` and ``blk.0.attn_q.biases``; a tensor name without the
    ``.weight`` suffix keeps its bare name for the packed values.
    """
    heads = {"attn_q": int(header.get("attention.head_count")),
             "attn_k": int(header.get("attention.head_count_kv", header.get("attention.head_count")))}
    layers = int(header.get("block_count"))
    out, done = {}, 0
    for info in header.tensors:
        base, suffix = _split_name(info.name)
        module = _hf_module(base)
        parts = {suffix: tensors[info.name]}
        if info.type_name in QUANT_LAYOUT:
            parts.update(scales=tensors[f"{base}.scales"], biases=tensors[f"{base}.biases"])
        n_heads = heads.get(base.rsplit(".", 1)[-1])
        for key, value in parts.items():
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
    weights = convert_weights(header, _load_tensors(src), _layer_reporter(say, src.name))
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
