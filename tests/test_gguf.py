"""GGUF -> mlx-lm conversion and model resolution, on the real default model and on
tiny GGUF files written here byte by byte."""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from kvserve.server.engine.gguf import convert_gguf, read_header, sha256_file, unpermute_rope_rows
from kvserve.configs import default_cache_dir
from kvserve.server.engine.model_source import (ModelLoadError, gguf_model_dir,
                                                resolve_model)

QUESTION = "What is the capital of France? Answer in one sentence."

# A natural text of 300+ tokens: with q/k rows left in llama.cpp's order the model
# still produces plausible first words but loses track as positions grow.
LONG_TEXT = (
    "The history of the city of Paris spans more than two thousand years. It began as a small "
    "settlement of a Celtic tribe called the Parisii on an island in the river Seine. The Romans "
    "conquered the area in 52 BC and built a town they called Lutetia, with a forum, baths, temples "
    "and an amphitheatre. During the Middle Ages, Paris grew into one of the largest cities in Europe, "
    "a centre of learning with its famous university, and of commerce along the river. The kings of "
    "France made it their capital, and great churches such as Notre-Dame were built on the island "
    "where the city began. In the sixteenth and seventeenth centuries the city expanded beyond its old "
    "walls, and the royal court built palaces such as the Louvre and the Tuileries. The French "
    "Revolution began in Paris in 1789 with the storming of the Bastille, a royal fortress and prison. "
    "In the nineteenth century, under Napoleon III, the prefect Baron Haussmann rebuilt much of the "
    "city, creating wide boulevards, parks, sewers and the uniform stone buildings that still give "
    "Paris its character today. The Eiffel Tower was built for the World's Fair of 1889 and became the "
    "symbol of the city. In the twentieth century Paris was occupied during the Second World War and "
    "liberated in August 1944. Today Paris is a global centre of art, fashion, gastronomy and culture, "
    "and it attracts millions of visitors every year who come to see its museums, monuments and "
    "neighbourhoods."
)


@pytest.fixture(scope="module")
def loaded(default_model_dir):
    return mlx_lm.load(str(default_model_dir))


# --- tiny GGUF writer ------------------------------------------------------------

def _gguf_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _gguf_value(value) -> bytes:
    """Type id + payload: bool, int (u32), float (f32), str, list of str / int (i32)."""
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


def _llama_cpp_permute(x: np.ndarray, n_heads: int) -> np.ndarray:
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
                codes, scales = _llama_cpp_permute(codes, heads), _llama_cpp_permute(scales, heads)
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


def _raises_one_line(fn, *args, fragment: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message and fragment in message, message
    return message


# --- tokenizer -----------------------------------------------------------------------

def test_known_sentence_ids(loaded):
    _, tokenizer = loaded
    assert tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_special_tokens_are_single_ids(loaded):
    _, tokenizer = loaded
    for text, token_id in (("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)):
        assert tokenizer.encode(text) == [token_id]
        assert tokenizer.decode([token_id]) == text
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tokenizer.eos_token_ids == {2}


def test_unicode_round_trip_and_digits(loaded):
    _, tokenizer = loaded
    for text in ("café 東京 🙂", "naïve — “quoted” 日本語", "  two  spaces\n\ttab\r\n"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # The "smollm" pre-tokenizer splits numbers into single digits.
    digits = tokenizer.encode("2024")
    assert [tokenizer.decode([i]) for i in digits] == ["2", "0", "2", "4"]


def test_chat_template_from_metadata(loaded):
    _, tokenizer = loaded
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == tokenizer.encode(text)


@pytest.mark.parametrize("add_bos", [False, True])
def test_add_bos_token_flag(tmp_path, add_bos):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from kvserve.server.engine.gguf_tokenizer import write_tokenizer_files

    write_tokenizer_files(tiny_metadata() | {"tokenizer.ggml.add_bos_token": add_bos}, tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("he") == ([1] if add_bos else []) + [259]
    assert tokenizer.decode(tokenizer.encode("he h\n")) == ("<|im_start|>" if add_bos else "") + "he h\n"


def test_pre_tokenizer_names():
    from kvserve.server.engine.gguf_tokenizer import build_tokenizer

    text = "he said 12345 times\n\n  hello"
    for pre in ("smollm", "llama-bpe", "gpt2", "default"):
        tokenizer = build_tokenizer(tiny_metadata() | {"tokenizer.ggml.pre": pre})
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    _raises_one_line(build_tokenizer, tiny_metadata() | {"tokenizer.ggml.pre": "qwen2"}, fragment="'qwen2'")


# --- model ---------------------------------------------------------------------------

def test_config_read_from_metadata(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    expected = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576, "intermediate_size": 1536,
                "vocab_size": 49152, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": True, "max_position_embeddings": 8192}
    assert {k: config[k] for k in expected} == expected
    # Q4_1 everywhere but the Q8_0 token embedding.
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine",
                                      "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"}}
    record = json.loads((default_model_dir / "kvserve.json").read_text())
    assert record["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(record["sha256"]) == 64


def test_greedy_next_token_is_paris(loaded):
    model, tokenizer = loaded
    logits = model(mx.array([tokenizer.encode("The capital of France is")]))
    assert tokenizer.decode([mx.argmax(logits[0, -1]).item()]) == " Paris"


def test_greedy_chat_answer(loaded):
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=20)
    assert answer.strip() == "The capital of France is Paris."


def test_long_prompt_stays_coherent(loaded):
    """Mean loss over the last 100 tokens of a 300+ token text: about 1.8 nats when q/k
    are in the right order, above 5 when they are left permuted."""
    model, tokenizer = loaded
    ids = tokenizer.encode(LONG_TEXT)
    assert len(ids) >= 300
    hidden = model.model(mx.array([ids]))[0, -101:-1]
    logits = model.model.embed_tokens.as_linear(hidden).astype(mx.float32)
    targets = mx.array(ids[-100:])
    loss = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    accuracy = (mx.argmax(logits, axis=-1) == targets).astype(mx.float32).mean().item()
    assert loss.mean().item() < 2.6 and accuracy > 0.4


def test_unpermuted_attention_equals_llama_cpp_layout(loaded):
    """Converted q/k rows with HF rotary halves compute what the GGUF's own row order
    computes with interleaved rotary pairs (llama.cpp's convention), at 300 positions."""
    model, _ = loaded
    attention = model.model.layers[3].self_attn
    gguf_layout = copy.deepcopy(attention)
    for proj, heads in ((gguf_layout.q_proj, attention.n_heads), (gguf_layout.k_proj, attention.n_kv_heads)):
        for name in ("weight", "scales", "biases"):
            setattr(proj, name, mx.array(_llama_cpp_permute(np.array(getattr(proj, name)), heads)))
    gguf_layout.rope.traditional = True
    x = mx.random.normal((1, 300, 576), key=mx.random.key(0))
    expected, got = gguf_layout(x, mask="causal"), attention(x, mask="causal")
    assert mx.abs(expected - got).max().item() < 1e-2 * mx.abs(expected).max().item()


def test_unpermute_rope_rows_layout():
    rows = np.arange(8)[:, None] * np.ones((1, 3))
    assert unpermute_rope_rows(mx.array(_llama_cpp_permute(rows, 2)), 2).tolist() == rows.tolist()
    # One head, head_dim 4: GGUF rows r0, r2, r1, r3 -> r0, r1, r2, r3.
    assert unpermute_rope_rows(mx.array([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]


def test_mixed_tensor_types(tmp_path):
    hf = tiny_model(tmp_path / "tiny.gguf", np.random.default_rng(0))
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny")
    config = json.loads((out / "config.json").read_text())
    eight = {"group_size": 32, "bits": 8, "mode": "affine"}
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine", "lm_head": eight,
                                      "model.embed_tokens": False, "model.layers.0.self_attn.q_proj": eight}
    assert config["tie_word_embeddings"] is False
    model, tokenizer = mlx_lm.load(str(out))
    for name in ("q_proj", "k_proj", "v_proj"):
        layer = getattr(model.model.layers[0].self_attn, name)
        weight = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=layer.bits)
        np.testing.assert_allclose(np.array(weight), hf[f"model.layers.0.self_attn.{name}.weight"], atol=1e-6)
    # The same network in float, built from the HF-layout values, gives the same logits.
    reference = mlx_lm.models.llama.Model(mlx_lm.models.llama.ModelArgs.from_dict(config))
    reference.load_weights([(k, mx.array(v)) for k, v in hf.items()])
    ids = mx.array([tokenizer.encode("hello <|im_end|>")])
    np.testing.assert_allclose(np.array(model(ids)), np.array(reference(ids)), atol=2e-3)
    assert tokenizer.encode("he") == [259]


def test_stale_partial_output_is_removed(tmp_path):
    tiny_model(tmp_path / "tiny.gguf", np.random.default_rng(3))
    stale, fresh = tmp_path / ".tiny.killed.tmp", tmp_path / ".tiny.running.tmp"
    stale.mkdir(), fresh.mkdir()
    os.utime(stale, (0, 0))
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny")
    assert not stale.exists() and fresh.exists()  # a young one may be another live conversion


# --- errors --------------------------------------------------------------------------

def test_missing_paths(tmp_path):
    _raises_one_line(resolve_model, str(tmp_path / "nope.gguf"), tmp_path, fragment="model path not found")
    _raises_one_line(resolve_model, str(tmp_path / "nope"), tmp_path, fragment="model path not found")
    _raises_one_line(convert_gguf, tmp_path / "nope.gguf", tmp_path / "out", fragment="not found")
    (tmp_path / "empty").mkdir()
    _raises_one_line(resolve_model, str(tmp_path / "empty"), tmp_path, fragment="no config.json")


def test_not_a_gguf(tmp_path):
    bogus = tmp_path / "notes.gguf"
    bogus.write_bytes(b"this is not a model" * 100)
    _raises_one_line(resolve_model, str(bogus), tmp_path / "cache", fragment="not a GGUF file")
    (tmp_path / "tiny.gguf").write_bytes(b"GG")
    _raises_one_line(convert_gguf, tmp_path / "tiny.gguf", tmp_path / "out", fragment="not a GGUF file")


def test_truncated_copies(tmp_path, default_gguf):
    data = default_gguf.read_bytes()
    for keep in (len(data) // 2, 1_000_000, 100):  # in the tensors, in the vocabulary, in the counts
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        _raises_one_line(convert_gguf, cut, tmp_path / "out", fragment="truncated")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".gguf")] == []


def test_other_architecture(tmp_path):
    tiny_model(tmp_path / "qwen.gguf", np.random.default_rng(1), arch="qwen2")
    message = _raises_one_line(convert_gguf, tmp_path / "qwen.gguf", tmp_path / "out", fragment="architecture")
    assert "'qwen2'" in message


def test_k_quant_tensor(tmp_path):
    metadata = tiny_metadata()
    write_gguf(tmp_path / "k.gguf", metadata, [("token_embd.weight", (4, 256), 12, b"\0" * 4 * 144)])
    message = _raises_one_line(convert_gguf, tmp_path / "k.gguf", tmp_path / "out", fragment="Q4_K")
    assert "Q4_0, Q4_1, Q8_0, F16, F32" in message


def test_sentencepiece_vocabulary_refused(tmp_path):
    tiny_model(tmp_path / "spm.gguf", np.random.default_rng(2), tokenizer="llama")
    _raises_one_line(convert_gguf, tmp_path / "spm.gguf", tmp_path / "out", fragment="tokenizer model 'llama'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.gguf"]  # the partial output is gone


def test_missing_tensor(tmp_path):
    write_gguf(tmp_path / "bare.gguf", tiny_metadata(), [])
    _raises_one_line(convert_gguf, tmp_path / "bare.gguf", tmp_path / "out", fragment="token_embd.weight")


# --- resolution and caching ----------------------------------------------------------

def test_conversion_is_cached(tmp_path, default_gguf):
    cache = tmp_path / "cache"
    first = resolve_model(str(default_gguf), cache)
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert resolve_model(str(default_gguf), cache) == first
    assert weights.stat().st_mtime_ns == stamp
    record = json.loads((first / "kvserve.json").read_text())
    assert first.name == f"SmolLM2-135M-Instruct.Q4_1-{record['sha256'][:12]}"
    # A copy with a new mtime is recognized by its hash, not converted again.
    copied = tmp_path / default_gguf.name
    shutil.copy(default_gguf, copied)
    os.utime(copied, ns=(stamp, stamp + 10**9))
    assert gguf_model_dir(copied, cache) == first and weights.stat().st_mtime_ns == stamp
    # A conversion from another converter version is redone.
    record["converter_version"] = 0
    (first / "kvserve.json").write_text(json.dumps(record))
    assert resolve_model(str(default_gguf), cache) == first
    assert weights.stat().st_mtime_ns != stamp and sha256_file(default_gguf) == record["sha256"]


def test_resolve_other_specs(tmp_path, default_model_dir):
    assert resolve_model(str(default_model_dir), tmp_path) == default_model_dir
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    lines = []
    default = resolve_model(None, tmp_path, lines.append)
    assert default.parent == tmp_path / "models" and (default / "config.json").is_file()
    assert resolve_model("default", tmp_path) == default
    assert any("30/30 layers" in line for line in lines), lines


def test_header_reader(default_gguf):
    header = read_header(default_gguf)
    assert header.arch == "llama" and header.version in (2, 3)
    assert len(header.tensors) == 2 + 30 * 9
    assert header.metadata["tokenizer.ggml.eos_token_id"] == 2


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("KVSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "kvserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir().name == "kvserve"
