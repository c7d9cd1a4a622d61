"""GGUF -> mlx-lm conversion and model resolution, on the real default model and on tiny
GGUF files written byte by byte (tiny_gguf.py: a llama with a byte-level BPE vocabulary, and
a gemma3 with K-quant tensors and a SentencePiece vocabulary)."""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest

from kvserve.configs import default_cache_dir
from kvserve.server.models.gguf import convert_gguf, read_header, sha256_file
from kvserve.server.models.gguf_arch import unpermute_rope_rows
from kvserve.server.models.gguf_tensors import AFFINE_BITS, to_affine, to_dense
from kvserve.server.models.source import ModelLoadError, gguf_model_dir, resolve_model
from tiny_gguf import (gguf_values, llama_cpp_permute, random_blocks, tiny_gemma3, tiny_metadata,
                       tiny_model, write_gguf)

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

    from kvserve.server.models.gguf_tokenizer import write_tokenizer_files

    write_tokenizer_files(tiny_metadata() | {"tokenizer.ggml.add_bos_token": add_bos}, tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("he") == ([1] if add_bos else []) + [259]
    assert tokenizer.decode(tokenizer.encode("he h\n")) == ("<|im_start|>" if add_bos else "") + "he h\n"


def test_pre_tokenizer_names():
    from kvserve.server.models.gguf_tokenizer import build_tokenizer

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


def test_long_prompt_stays_coherent(default_model_dir):
    """Mean loss over the last 100 tokens of a 300+ token text: about 1.8 nats when q/k
    are in the right order, above 5 when they are left permuted. Computed with the weights
    dequantized, as the server computes on the CPU (MLX's CPU kernels for the codes took
    30 s over these 300 tokens)."""
    from kvserve.server.models.weights import DENSE_F32, apply_weight_format

    model, tokenizer = mlx_lm.load(str(default_model_dir))
    apply_weight_format(model, DENSE_F32)
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
            setattr(proj, name, mx.array(llama_cpp_permute(np.array(getattr(proj, name)), heads)))
    gguf_layout.rope.traditional = True
    x = mx.random.normal((1, 300, 576), key=mx.random.key(0))
    expected, got = gguf_layout(x, mask="causal"), attention(x, mask="causal")
    assert mx.abs(expected - got).max().item() < 1e-2 * mx.abs(expected).max().item()


def test_unpermute_rope_rows_layout():
    rows = np.arange(8)[:, None] * np.ones((1, 3))
    assert unpermute_rope_rows(mx.array(llama_cpp_permute(rows, 2)), 2).tolist() == rows.tolist()
    # One head, head_dim 4: GGUF rows r0, r2, r1, r3 -> r0, r1, r2, r3.
    assert unpermute_rope_rows(mx.array([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]


_EIGHT, _FOUR = ({"group_size": 32, "bits": b, "mode": "affine"} for b in (8, 4))
TINY = {  # architecture -> (GGUF writer, the quantization entry its conversion gets)
    "llama": (tiny_model, {"group_size": 32, "bits": 4, "mode": "affine", "lm_head": _EIGHT,
                           "model.embed_tokens": False, "model.layers.0.self_attn.q_proj": _EIGHT}),
    "gemma3": (tiny_gemma3, {"group_size": 32, "bits": 5, "mode": "affine", "model.embed_tokens": _EIGHT} | {
        f"model.layers.{i}.{name}": layout for i in range(2) for name, layout in (
            ("self_attn.k_proj", _FOUR), ("self_attn.o_proj", _FOUR), ("mlp.up_proj", False),
            ("mlp.down_proj", False))}),
}


def _dense(module) -> mx.array:
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return mx.dequantize(module.weight, module.scales, module.biases, group_size=module.group_size,
                             bits=module.bits)
    return module.weight


def _float_reference(config: dict, hf: dict[str, np.ndarray]):
    """The mlx-lm model of ``config`` in float32, from the HF-layout values."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.load_weights(list(model.sanitize({k: mx.array(v) for k, v in hf.items()}).items()))
    return model


@pytest.mark.parametrize("arch", TINY)
def test_converted_model_computes_the_gguf_values(tmp_path, arch):
    """Every converted weight equals the GGUF's values (llama: its q/k rows un-permuted;
    gemma3: norms minus 1, q/k as stored), and the model gives the logits of a float32
    model built from those values."""
    write, quantization = TINY[arch]
    hf = write(tmp_path / "tiny.gguf", np.random.default_rng(0))
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == quantization
    model, tokenizer = mlx_lm.load(str(out))
    modules = dict(model.named_modules())
    for name, values in hf.items():
        got = _dense(modules[name.removesuffix(".weight")])
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), values, atol=1e-6, err_msg=name)
    ids = mx.array([tokenizer.encode("hello he\nhe <|im_end|> é")])
    np.testing.assert_allclose(np.array(model(ids)), np.array(_float_reference(config, hf)(ids)),
                               atol=2e-3, rtol=1e-4)


def test_gemma3_config_and_float32_activations(tmp_path):
    """Keys llama.cpp leaves out take its runtime's values; every scale is float32, so the
    residual stream never runs in float16 (where Gemma's overflows)."""
    tiny_gemma3(tmp_path / "g.gguf", np.random.default_rng(1))
    config = json.loads((convert_gguf(tmp_path / "g.gguf", tmp_path / "g") / "config.json").read_text())
    expected = {"model_type": "gemma3_text", "head_dim": 128, "num_key_value_heads": 1,
                "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 128,
                "sliding_window": 8, "sliding_window_pattern": 2, "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 5]}
    assert {k: config[k] for k in expected} == expected
    model, _ = mlx_lm.load(str(tmp_path / "g"))
    scales = [m.scales.dtype for _, m in model.named_modules() if hasattr(m, "scales")]
    assert scales and set(scales) == {mx.float32}
    assert model(mx.array([[2, 273]])).dtype == mx.float32


@pytest.mark.parametrize("type_name", AFFINE_BITS)
def test_affine_codes_reproduce_the_gguf_package(type_name):
    """Random blocks of each affine type: MLX's dequantization of the converted triple is
    the gguf package's, bit for bit with float32 scales; float16 scales hold d (and m)."""
    raw = random_blocks(type_name, 4, 512, np.random.default_rng(7))
    expected = gguf_values(raw, type_name)
    for half in (False, True):
        parts = {k: mx.array(v) for k, v in to_affine(raw, type_name, half).items()}
        if half and not type_name.endswith("_K"):
            assert parts["scales"].dtype == mx.float16
            parts = {k: v.astype(mx.float32) if k != "weight" else v for k, v in parts.items()}
        assert parts["scales"].dtype == mx.float32
        got = mx.dequantize(parts["weight"], parts["scales"], parts["biases"], group_size=32,
                            bits=AFFINE_BITS[type_name])
        assert np.array_equal(np.array(got), expected), (type_name, half)


@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K", "Q2_K", "BF16", "F16"])
def test_dense_types(type_name):
    rng = np.random.default_rng(8)
    if type_name.endswith("_K"):
        raw = random_blocks(type_name, 4, 512, rng)
        expected = gguf_values(raw, type_name)
    else:
        values = rng.standard_normal((4, 512)).astype(np.float32)
        half = values.astype(np.float16)
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)
        raw = (half if type_name == "F16" else bits).view(np.uint8)
        expected = half.astype(np.float32) if type_name == "F16" \
            else (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(to_dense(raw, type_name, (4, 512)).astype(np.float32), expected)


def test_sentencepiece_tokenizer(tmp_path):
    """Gemma-style SentencePiece: bos first, merges implied by token order, "▁" for space,
    runs of spaces through their respelled tokens, unknown characters as byte tokens."""
    tiny_gemma3(tmp_path / "g.gguf", np.random.default_rng(2))
    _, tokenizer = mlx_lm.load(str(convert_gguf(tmp_path / "g.gguf", tmp_path / "g")))
    assert tokenizer.encode("hello he") == [2, 273, 270]
    assert tokenizer.encode("  hi") == [2, 6, 265, 8 + ord("i")]
    assert tokenizer.encode("é\n<start_of_turn>") == [2, 8 + 0xC3, 8 + 0xA9, 7, 4]
    for text in ("hello he", "  two  spaces\n", "café 東京", "<end_of_turn>x"):
        assert tokenizer.decode(tokenizer.encode(text)[1:]) == text
    assert tokenizer.decode([2, 273, 5], skip_special_tokens=True) == "hello"
    assert tokenizer.eos_token_ids == {1, 5}


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


def test_unsupported_tensor_type(tmp_path):
    metadata = tiny_metadata()
    write_gguf(tmp_path / "iq.gguf", metadata, [("token_embd.weight", (4, 256), 20, b"\0" * 4 * 136)])
    message = _raises_one_line(convert_gguf, tmp_path / "iq.gguf", tmp_path / "out", fragment="IQ4_NL")
    assert "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, F32, F16, BF16, Q6_K" in message


def test_sentencepiece_with_space_prefix_refused(tmp_path):
    """A SentencePiece vocabulary that prepends a space (Llama 2 style) is not converted."""
    tiny_model(tmp_path / "spm.gguf", np.random.default_rng(2), tokenizer="llama")
    _raises_one_line(convert_gguf, tmp_path / "spm.gguf", tmp_path / "out", fragment="space prefix")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.gguf"]  # the partial output is gone


def test_missing_tensor(tmp_path):
    write_gguf(tmp_path / "bare.gguf", tiny_metadata(), [])
    _raises_one_line(convert_gguf, tmp_path / "bare.gguf", tmp_path / "out", fragment="token_embd.weight")


# --- resolution and caching ----------------------------------------------------------

def test_conversion_is_cached(tmp_path):
    """On a tiny GGUF (the rule is the file's, not the model's: the default model's takes 5 s
    a conversion, and ``test_resolve_other_specs`` converts it)."""
    cache = tmp_path / "cache"
    gguf = tmp_path / "src" / "tiny.Q8_0.gguf"
    gguf.parent.mkdir()
    tiny_model(gguf, np.random.default_rng(0))
    first = resolve_model(str(gguf), cache)
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert resolve_model(str(gguf), cache) == first
    assert weights.stat().st_mtime_ns == stamp
    record = json.loads((first / "kvserve.json").read_text())
    assert first.name == f"tiny.Q8_0-{record['sha256'][:12]}"
    # A copy with a new mtime is recognized by its hash, not converted again.
    copied = tmp_path / gguf.name
    shutil.copy(gguf, copied)
    os.utime(copied, ns=(stamp, stamp + 10**9))
    assert gguf_model_dir(copied, cache) == first and weights.stat().st_mtime_ns == stamp
    # A conversion from another converter version is redone.
    record["converter_version"] = 0
    (first / "kvserve.json").write_text(json.dumps(record))
    assert resolve_model(str(gguf), cache) == first
    assert weights.stat().st_mtime_ns != stamp and sha256_file(gguf) == record["sha256"]


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


def test_a_process_loads_a_tokenizer_once_until_its_files_change(tmp_path, default_model_dir):
    """``load_tokenizer`` hands every server of the process the same wrapper for the same
    files (loading one costs ~0.6 s of CPU per server start); a file rewritten since loads
    anew."""
    from kvserve.server.models.load import load_tokenizer

    for f in default_model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, tmp_path / f.name)
    first = load_tokenizer(tmp_path, 2)
    assert load_tokenizer(tmp_path, 2) is first
    config = tmp_path / "tokenizer_config.json"
    later = config.stat().st_mtime_ns + 10**9
    os.utime(config, ns=(later, later))
    again = load_tokenizer(tmp_path, 2)
    assert again is not first and again.encode("Paris") == first.encode("Paris")
