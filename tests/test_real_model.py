"""End to end on the default model: the real server, the openai client, the real answer.

Also the command line's refusals: one line on stderr, a non-zero exit, no traceback; and
Gemma 3 270M, converted from its K-quant GGUF, with mlx-lm alone and through the server.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from inprocess import InProcessServer
from servers import ServerProcess, on_gpu, replies_across_a_restart
from together import together

from kvserve.bench.batched_vs_lone import QUESTIONS  # the questions its bound was measured on

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module", params=["fp16", "turbo0v4"])
def default_server(request, default_model_dir):
    # No prefix cache: the batched requests below must compute what the lone ones did.
    proc = ServerProcess(default_model_dir, "--kv-scheme", request.param,
                         "--prompt-cache-ram-gb", "0", "--prompt-cache-disk-gb", "0")
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


def test_paris_json_and_stream_agree(default_server):
    client = openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    scheme = client.models.list().data[0].model_extra["kv_scheme"]
    assert scheme == default_server.args[default_server.args.index("--kv-scheme") + 1]
    messages = [{"role": "user", "content": QUESTION}]
    answer = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40)
    text = answer.choices[0].message.content
    assert "Paris" in text
    assert answer.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                            max_tokens=40, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


@pytest.mark.parametrize("scheme", ["fp16", "turbo0v4"])
def test_a_restarted_server_answers_from_its_prompt_cache_files(default_model_dir, tmp_path, scheme):
    """The default model, served, stopped and served again on the same cache folder: the
    second server reads the first one's prefix cache from disk (RAM tier off, so nothing else
    can answer) and starts at the prompt's last token. fp16 gives the cold reply token for
    token; turbo0v4 attends over the stored codes instead of fresh K/V (by design), so it is
    held to the right answer.

    Served in this process (``tests/inprocess.py``: its stop flushes the disk writer as the
    process's SIGTERM does): what is checked is the files; a restart of the process itself is
    test_http.py's (the tiny model) and test_hardening.py's."""
    body = {"model": "default", "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0, "max_tokens": 24}
    cold, warm = replies_across_a_restart(default_model_dir, body, "--kv-scheme", scheme,
                                          "--prompt-cache-ram-gb", "0", "--prompt-cache-dir", str(tmp_path),
                                          server=InProcessServer)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1
    texts = [a["choices"][0]["message"]["content"] for a in (cold, warm)]
    assert all("Paris" in text for text in texts), texts
    if scheme == "fp16":
        assert texts[0] == texts[1]


def _kvserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.server.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def _assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvserve: error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_missing_model_path(tmp_path):
    result = _kvserve("serve", "--model", str(tmp_path / "nope.gguf"), "--port", "0")
    _assert_one_line_error(result, "not found")


def test_non_gguf_file(tmp_path):
    bogus = tmp_path / "notes.gguf"
    bogus.write_bytes(b"this is not a model" * 100)
    result = _kvserve("serve", "--model", str(bogus), "--cache-dir", str(tmp_path / "c"), "--port", "0")
    _assert_one_line_error(result, "GGUF")


def test_truncated_gguf(tmp_path, default_gguf):
    cut = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as src:
        cut.write_bytes(src.read(5_000_000))
    result = _kvserve("convert", str(cut), str(tmp_path / "out"))
    _assert_one_line_error(result, "truncated")
    assert not (tmp_path / "out").exists()


def test_scheme_that_does_not_fit_the_head_size(tmp_path, tiny_model_dir):
    """The tiny model's head_dim is 16: groups of 64 cannot fit, and start-up says so."""
    result = _kvserve("serve", "--model", str(tiny_model_dir), "--kv-scheme", "affine4",
                      "--cache-dir", str(tmp_path), "--port", "0")
    _assert_one_line_error(result, f"KV scheme affine4 does not fit {tiny_model_dir.name}: head_dim 16")


def test_bad_config_value(tmp_path):
    result = _kvserve("serve", "--max-tokens", "0")
    _assert_one_line_error(result, "max_tokens")


def test_unknown_kv_scheme_lists_the_valid_ones():
    result = _kvserve("serve", "--kv-scheme", "turbo5")
    _assert_one_line_error(result, "unknown KV scheme 'turbo5'; valid schemes: fp16, affine8")
    assert "turbo0v4" in result.stderr


def test_unsupported_architecture(tmp_path):
    import numpy as np
    from tiny_gguf import tiny_model

    other = tmp_path / "qwen.gguf"
    tiny_model(other, np.random.default_rng(1), arch="qwen2")
    result = _kvserve("convert", str(other), str(tmp_path / "out"))
    _assert_one_line_error(result, "qwen2")




def test_concurrent_greedy_chats_equal_each_alone(default_server):
    """One decode forward over all rows gives each fp16 row the tokens it gets alone: a row's
    K/V come from its own tokens, other rows' slots and padding are masked.

    Quantized schemes are held to a bound instead: a batched matmul rounds differently from a
    single-row one, and a value that sits on a quantization boundary can then take the other
    code, which moves a logit by a rounding-sized amount. So where a batched answer leaves the
    lone one, the lone run must have had a near-tie there: the batched token is its second
    choice, less than ``NEAR_TIE`` nats below the first. Exact agreement for quantized schemes
    is pinned on the tiny model in test_batching.py. On a GPU fp16 is held to the same bound:
    there a batched product is not bit-identical to a one-row one either (an H100 parted at
    token 7 of 16, " is" for " lies", a near-tie). A quantized scheme on a GPU gets a wider
    one (``near_tie``): rounding-sized differences there flip value codes, and the logprobs
    of tokens both runs agree on already differ by up to 0.32 nats."""
    client = openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    scheme = client.models.list().data[0].model_extra["kv_scheme"]

    def ask(question: str):
        messages = [{"role": "user", "content": question}]
        answer = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=16,
                                                logprobs=True, top_logprobs=2)
        return answer.choices[0].logprobs.content

    alone = [ask(q) for q in QUESTIONS]
    batched = together([lambda q=q: ask(q) for q in QUESTIONS])
    tokens = [[e.token for e in answer] for answer in alone]
    if scheme == "fp16" and not on_gpu():
        assert [[e.token for e in answer] for answer in batched] == tokens
        return
    bound = near_tie(scheme, on_gpu())
    for lone, group in zip(alone, batched):
        gap = divergence_gap(lone, group)
        assert gap is None or gap < bound, (gap, [e.token for e in lone], [e.token for e in group])


NEAR_TIE = 0.25  # nats; the largest gap measured at a divergence was 0.057


def near_tie(scheme: str, gpu: bool) -> float:
    """The widest gap a divergence may have. Measured on an H100, the eight questions alone
    and then in 3-4 batches of eight (``docs/benchmarks/gpu-serve.md``, fifteenth round):
    fp16's logprobs on agreed tokens moved by at most 0.055 nats and its divergences were
    exact ties; turbo0v4's moved by up to 0.32, and its divergences had gaps up to 0.375,
    with prompt chunks on MLX's SDPA or on the fused kernels alike. Twice that is allowed:
    a batch that let rows see each other would part by nats, or pick a token that was not
    even the lone run's runner-up (``divergence_gap`` checks that). On the CPU every scheme
    keeps ``NEAR_TIE``."""
    return 0.75 if gpu and scheme != "fp16" else NEAR_TIE


def divergence_gap(lone, group) -> float | None:
    """At the first differing token: how far the batched pick sat below the lone pick in the
    lone run (None when the answers agree)."""
    for mine, theirs in zip(lone, group):
        if mine.token != theirs.token:
            ranked = {t.token: t.logprob for t in mine.top_logprobs}
            assert theirs.token in ranked, "the batched token was not even the lone run's runner-up"
            return mine.logprob - ranked[theirs.token]
    return None


# --- Gemma 3 270M base (Q4_K_M GGUF: Q4_K, Q5_0, Q6_K, Q8_0 tensors; SentencePiece vocabulary) ---

GEMMA3_QUESTION = "Question: What is the capital of France?\nAnswer:"


@pytest.fixture(scope="module")
def gemma3(gemma3_model_dir):
    """The converted model with its weights dequantized, as the server computes them on the
    CPU: MLX's own CPU kernels for 4- to 8-bit codes took 75-90 s for one 309-token forward
    pass (the 262,144-row tied embedding), the dense weights well under a second."""
    import mlx_lm

    from kvserve.server.models.weights import DENSE_F32, apply_weight_format

    model, tokenizer = mlx_lm.load(str(gemma3_model_dir))
    return apply_weight_format(model, DENSE_F32), tokenizer


def test_gemma3_prompt_starts_with_bos(gemma3):
    _, tokenizer = gemma3
    ids = tokenizer.encode("The capital of France is")
    assert ids == [2, 818, 5279, 529, 7001, 563]  # <bos> The ▁capital ▁of ▁France ▁is
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The capital of France is"
    assert tokenizer.eos_token_ids == {1, 106}  # <eos>, <end_of_turn>


def test_gemma3_tokenizer_matches_transformers(gemma3, gemma3_gguf):
    """The same ids as transformers' own GGUF converter for Gemma (the reference tokenizer's
    rules: respelled space runs, merges in file order, byte fallback), after our bos."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from test_gguf import LONG_TEXT

    from kvserve.server.models.gguf import read_header

    meta = read_header(gemma3_gguf).metadata
    renames = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]  # llama.cpp key -> transformers name
    fields = {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
    reference, _ = mapping.convert_gguf_tokenizer("gemma3", fields)
    _, tokenizer = gemma3
    for text in (LONG_TEXT, "  two  spaces\n\n\ttab 2024 café 東京 🙂",
                 "<start_of_turn>user\nhi<end_of_turn>\n", "def f(x):\n    return x**2  # comment\n",
                 "[multimodal] </iframe> <0x41>"):
        assert tokenizer.encode(text) == [2] + reference.encode(text).ids, text


def test_gemma3_knows_paris(gemma3):
    """A base model: asked as a question it answers " Paris"; after the bare "The capital of
    France is" its greedy pick is " the" (" the capital of the country of France."), with
    " Paris" third (p 0.08, behind " the" 0.19 and " a" 0.11)."""
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = gemma3
    answer = mlx_lm.generate(model, tokenizer, GEMMA3_QUESTION, max_tokens=3)
    assert answer.startswith(" Paris")
    logits = model(mx.array([tokenizer.encode("The capital of France is")]))[0, -1]
    top = mx.argsort(-logits)[:3].tolist()
    assert " Paris" in [tokenizer.decode([i]) for i in top]


def test_gemma3_long_text_loss(gemma3):
    """Mean next-token loss over a 300+ token text: 2.1 nats as converted; 4.1 with the norm
    weights left at llama.cpp's 1 + w, 5.4 with q/k rows permuted as for llama."""
    import mlx.core as mx
    from test_gguf import LONG_TEXT

    model, tokenizer = gemma3
    ids = tokenizer.encode(LONG_TEXT)
    logits = model(mx.array([ids]))[0, :-1].astype(mx.float32)
    targets = mx.array(ids[1:])
    loss = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    assert loss.mean().item() < 2.6


@pytest.mark.sliding_window
def test_gemma3_served_over_http(gemma3_model_dir, tmp_path):
    """The real server on Gemma 3: five of every six layers attend through a 512-token
    sliding window, which the engine's caches must keep. (Served in this process: the
    command's configuration, engine and app without its process start.)"""
    proc = InProcessServer(gemma3_model_dir, "--cache-dir", str(tmp_path),
                         "--prompt-cache-ram-gb", "0", "--prompt-cache-disk-gb", "0").wait_ready()
    try:
        body = {"model": "gemma3-270m", "prompt": GEMMA3_QUESTION, "temperature": 0, "max_tokens": 8}
        reply = httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=120).json()
        assert "Paris" in reply["choices"][0]["text"], reply
        body["prompt"] = "The capital of France is"
        reply = httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=120).json()
        assert reply["usage"]["prompt_tokens"] == 6, reply  # <bos> counted
    finally:
        assert proc.stop() == 0, proc.output()
