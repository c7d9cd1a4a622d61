"""Tiny GGUF files written byte by byte: a llama with a byte-level BPE vocabulary and
llama.cpp's q/k row order, and a gemma3 with every tensor type the converter reads and a
Gemma-style SentencePiece vocabulary. Each writer returns the float weights in HF layout."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

def _gguf_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _gguf_value(value) -> bytes:
    """Type id + payload: bool, int (u32), float (f32), str, list of str / int (i32) / float (f32)."""
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + _gguf_string(value)
    if value and isinstance(value[0], str):
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_gguf_string(v) for v in value)
    if value and isinstance(value[0], float):
        return struct.pack("<IIQ", 9, 6, len(value)) + struct.pack(f"<{len(value)}f", *value)
    return struct.pack("<IIQ", 9, 5, len(value)) + struct.pack(f"<{len(value)}i", *value)


def write_gguf(path: Path, metadata: dict, tensors: list[tuple[str, tuple, int, bytes]]) -> Path:
    """GGUF v3; ``tensors`` are (name, row-major shape, ggml type id, data)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    head += b"".join(_gguf_string(k) + _gguf_value(v) for k, v in metadata.items())
    data, offset = b"", 0
    for name, shape, type_id, raw in tensors:
        dims = b"".join(struct.pack("<Q", d) for d in reversed(shape))
        head += _gguf_string(name) + struct.pack("<I", len(shape)) + dims + struct.pack("<IQ", type_id, offset)
        padded = raw + b"\0" * (-len(raw) % 32)
        data, offset = data + padded, offset + len(padded)
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)
    return path


def _q8_0(codes: np.ndarray, scales: np.ndarray) -> bytes:
    """Blocks of 32: fp16 d, 32 x int8; value = code * d."""
    rows, cols = codes.shape
    block = np.zeros((rows, cols // 32), dtype=[("d", "<f2"), ("q", "i1", 32)])
    block["d"], block["q"] = scales, codes.reshape(rows, cols // 32, 32)
    return block.tobytes()


def _q4_0(codes: np.ndarray, scales: np.ndarray) -> bytes:
    """Blocks of 32: fp16 d, 16 bytes; byte j = code j | code (j + 16) << 4; value = (code - 8) * d."""
    rows, cols = codes.shape
    grouped = codes.reshape(rows, cols // 32, 32).astype(np.uint8)
    block = np.zeros((rows, cols // 32), dtype=[("d", "<f2"), ("q", "u1", 16)])
    block["d"], block["q"] = scales, grouped[..., :16] | (grouped[..., 16:] << 4)
    return block.tobytes()


def llama_cpp_permute(x: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes for attn_q / attn_k."""
    rows = x.shape[0]
    return x.reshape(n_heads, 2, rows // n_heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in keep]
    mapping = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return [mapping[b] for b in range(256)]


def tiny_metadata(arch: str = "llama", tokenizer: str = "gpt2") -> dict:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_tokens() + ["he"]
    return {
        "general.architecture": arch, "general.alignment": 32,
        f"{arch}.block_count": 1, f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 64,
        f"{arch}.attention.head_count": 2, f"{arch}.attention.head_count_kv": 1,
        f"{arch}.context_length": 256, f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": tokenizer, "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["h e"],
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * 257,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }


def tiny_model(path: Path, rng: np.random.Generator, arch: str = "llama",
               tokenizer: str = "gpt2") -> dict[str, np.ndarray]:
    """A one-layer llama GGUF with F32 norms, an F16 embedding, a Q8_0 q_proj and
    lm_head, Q4_0 elsewhere. Returns the float weights in HF layout."""
    hf, tensors = {}, []

    def add(gguf_name, hf_name, shape, kind, heads=0):
        if kind == "f32":
            values = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            hf[hf_name], raw, type_id = values, values.tobytes(), 0
        elif kind == "f16":
            values = (0.5 * rng.standard_normal(shape)).astype(np.float16)
            hf[hf_name], raw, type_id = values.astype(np.float32), values.tobytes(), 1
        else:  # powers of two as scales: every value is exact in fp16 and in MLX's layout
            scales = (2.0 ** -rng.integers(4, 7, (shape[0], shape[1] // 32))).astype(np.float16)
            low, high, type_id = (-127, 128, 8) if kind == "q8_0" else (0, 16, 2)
            codes = rng.integers(low, high, shape)
            offset = 0 if kind == "q8_0" else 8
            hf[hf_name] = (codes - offset) * np.repeat(scales.astype(np.float32), 32, axis=1)
            if heads:
                codes, scales = llama_cpp_permute(codes, heads), llama_cpp_permute(scales, heads)
            raw = _q8_0(codes, scales) if kind == "q8_0" else _q4_0(codes, scales)
        tensors.append((gguf_name, shape, type_id, raw))

    vocab = len(tiny_metadata()["tokenizer.ggml.tokens"])
    add("token_embd.weight", "model.embed_tokens.weight", (vocab, 64), "f16")
    add("output_norm.weight", "model.norm.weight", (64,), "f32")
    add("output.weight", "lm_head.weight", (vocab, 64), "q8_0")
    add("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", (64,), "f32")
    add("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight", (64,), "f32")
    add("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", (64, 64), "q8_0", heads=2)
    add("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", (32, 64), "q4_0", heads=1)
    for gguf, name, shape in (("attn_v", "self_attn.v_proj", (32, 64)), ("attn_output", "self_attn.o_proj", (64, 64)),
                              ("ffn_gate", "mlp.gate_proj", (64, 64)), ("ffn_up", "mlp.up_proj", (64, 64)),
                              ("ffn_down", "mlp.down_proj", (64, 64))):
        add(f"blk.0.{gguf}.weight", f"model.layers.0.{name}.weight", shape, "q4_0")
    write_gguf(path, tiny_metadata(arch, tokenizer), tensors)
    return hf


# ggml types by id, and where a block keeps its float16 fields (first byte, count): random
# bytes elsewhere are valid codes, random float16 bytes could be inf or NaN.
_TYPE_IDS = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12,
             "Q5_K": 13, "Q6_K": 14, "BF16": 30}
_F16_FIELDS = {"Q4_0": (0, 1), "Q4_1": (0, 2), "Q5_0": (0, 1), "Q5_1": (0, 2), "Q8_0": (0, 1),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2, 1), "Q2_K": (-4, 2), "Q3_K": (-2, 1)}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random ``rows x cols`` tensor bytes of a ggml block type, (rows, bytes per row), with
    block scales in [-1/16, 1/16]."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    start, count = _F16_FIELDS[type_name]
    start %= size
    scales = rng.uniform(-1 / 16, 1 / 16, (raw.shape[0], count)).astype(np.float16)
    raw[:, start:start + 2 * count] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def gguf_values(raw: np.ndarray, type_name: str) -> np.ndarray:
    """What the ``gguf`` package (llama.cpp's own Python reference) reads from ``raw``."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float32)


# A SentencePiece vocabulary laid out like Gemma's: control tokens, user-defined runs of
# spaces (stored with real spaces) and newlines, 256 byte tokens, then normal tokens
# best-first (score -rank).
SPM_TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "  ", "\n"]
              + [f"<0x{b:02X}>" for b in range(256)]
              + ["\u2581", "h", "e", "l", "o", "he", "\u2581he", "ll", "llo", "hello", "\u2581hello"])
_SPM_TYPES = [3] * 6 + [4, 4] + [6] * 256 + [1] * 11


def gemma3_metadata() -> dict:
    return {
        "general.architecture": "gemma3", "general.alignment": 32,
        "gemma3.block_count": 2, "gemma3.embedding_length": 256, "gemma3.feed_forward_length": 256,
        "gemma3.attention.head_count": 2, "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 128, "gemma3.attention.value_length": 128,
        "gemma3.context_length": 1024, "gemma3.rope.freq_base": 1000000.0,
        "gemma3.attention.sliding_window": 8, "gemma3.attention.sliding_window_pattern": 2,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": SPM_TOKENS, "tokenizer.ggml.token_type": _SPM_TYPES,
        "tokenizer.ggml.scores": [-1000.0] * 264 + [-float(i) for i in range(11)],
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False,
    }


# Tensor types of the tiny gemma3: every kind the converter handles, each on a different module.
GEMMA3_TYPES = {"attn_q": "Q5_0", "attn_k": "Q4_K", "attn_v": "Q5_K", "attn_output": "Q4_K",
                "ffn_gate": "Q5_1", "ffn_up": "BF16", "ffn_down": "Q6_K"}
_GEMMA3_NORMS = {"attn_norm": ("input_layernorm", 256), "attn_q_norm": ("self_attn.q_norm", 128),
                 "attn_k_norm": ("self_attn.k_norm", 128),
                 "post_attention_norm": ("post_attention_layernorm", 256),
                 "ffn_norm": ("pre_feedforward_layernorm", 256),
                 "post_ffw_norm": ("post_feedforward_layernorm", 256)}


_GEMMA3_LINEARS = {"attn_q": ("self_attn.q_proj", 256), "attn_k": ("self_attn.k_proj", 128),
                   "attn_v": ("self_attn.v_proj", 128), "attn_output": ("self_attn.o_proj", 256),
                   "ffn_gate": ("mlp.gate_proj", 256), "ffn_up": ("mlp.up_proj", 256),
                   "ffn_down": ("mlp.down_proj", 256)}


def tiny_gemma3(path: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A two-layer gemma3 GGUF (hidden 256: K-quant rows are 256 wide) with a Q8_0
    embedding, the layer types of ``GEMMA3_TYPES`` and F32 norms written as 1 + w, as
    llama.cpp writes Gemma's. Returns the float weights in HF layout (norms as w)."""
    hf, tensors = {}, []

    def add(gguf_name, hf_name, shape, kind):
        if kind == "F32":  # a norm
            values = (0.1 * rng.standard_normal(shape)).astype(np.float32)
            hf[hf_name], raw = values, (values + 1).tobytes()
        elif kind == "BF16":
            bits = (rng.standard_normal(shape).astype(np.float32) / 16).view(np.uint32) >> 16
            raw = bits.astype(np.uint16).tobytes()
            hf[hf_name] = (bits.astype(np.uint32) << 16).view(np.float32)
        else:
            blocks = random_blocks(kind, shape[0], shape[1], rng)
            hf[hf_name], raw = gguf_values(blocks, kind), blocks.tobytes()
        tensors.append((gguf_name, shape, _TYPE_IDS[kind], raw))

    add("token_embd.weight", "model.embed_tokens.weight", (len(SPM_TOKENS), 256), "Q8_0")
    add("output_norm.weight", "model.norm.weight", (256,), "F32")
    for layer in range(2):
        for part, (name, size) in _GEMMA3_NORMS.items():
            add(f"blk.{layer}.{part}.weight", f"model.layers.{layer}.{name}.weight", (size,), "F32")
        for part, kind in GEMMA3_TYPES.items():
            name, rows = _GEMMA3_LINEARS[part]
            add(f"blk.{layer}.{part}.weight", f"model.layers.{layer}.{name}.weight", (rows, 256), kind)
    write_gguf(path, gemma3_metadata(), tensors)
    return hf
