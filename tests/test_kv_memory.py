"""The KV memory budget (``--kv-memory``): sizes, what a token costs per scheme, and the served
budget admitting and preempting by bytes."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest
from archs import build_model
from inprocess import InProcessServer
from servers import random_llama

from kvserve.cache import parse_scheme
from kvserve.configs import ConfigError, EngineConfig, parse_size
from kvserve.server.engine.kv_memory import KVBudget, kv_budget, machine_memory, token_bytes


def test_sizes_parse_in_powers_of_1024_and_bad_ones_are_refused():
    assert parse_size("4GiB") == parse_size("4G") == parse_size("4gb") == 4 << 30
    assert parse_size("1.5MiB") == 3 << 19 and parse_size(" 64 M ") == 64 << 20
    assert EngineConfig(kv_memory="256MiB").kv_memory == 256 << 20
    for bad in ("lots", "", "12Q", "0.5MiB", 1000):
        with pytest.raises(ConfigError, match="engine.kv_memory"):
            EngineConfig(kv_memory=bad)


def test_default_budget_is_a_quarter_of_memory():
    b = kv_budget(None, 1000)
    assert b.bytes == int(machine_memory() * 0.25) and "25% of" in b.source
    assert kv_budget(64 << 20, 1000) == KVBudget(64 << 20, 1000, "--kv-memory")
    assert KVBudget(64 << 20, 1000, "x").tokens == (64 << 20) // 1000


def test_token_bytes_follow_each_scheme():
    """2 layers x 2 KV heads x head_dim 64, float32 activations: fp16 holds 16-bit floats
    (256 B per head for K and V: 2 x layers x KV heads x head_dim x 2), affine4 32 B of nibbles + a float32 scale and bias per group of
    64 (40 B), turbo0v4 16-bit keys (128 B) and 4-bit values with a float32 norm (36 B)."""
    model = random_llama(1)
    per_head = {"fp16": 2 * 128, "affine4": 2 * 40, "affine8": 2 * 72, "turbo0v4": 128 + 36}
    for name, b in per_head.items():
        assert token_bytes(model, parse_scheme(name)) == 2 * 2 * b, name


def test_sliding_and_recurrent_layers_count_what_they_store():
    """(tests/archs.py: 2 KV heads of 64, so 512 fp16 bytes per layer and token.)
    Qwen3-Next and Qwen3.5: recurrent layers hold a state of fixed size, so only the
    full-attention layers count (2 of 4, 1 of 4). Gemma 3: its sliding layers (window 16)
    count in full, as they store a whole prompt chunk while it is prefilled: the budget is
    conservative for them once decoding runs past the window."""
    expected = {"qwen3_next": 2, "qwen3_5": 1, "gemma3_text": 4, "llama": 2}
    for arch, layers in expected.items():
        assert token_bytes(build_model(arch), parse_scheme("fp16")) == layers * 512, arch


PROMPTS = [f"Write two sentences about the number {n} and what it means to people." for n in (3, 7, 12, 40)]


def _complete(base_url: str, prompt: str) -> str:
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=300,
                   json={"model": "default", "messages": [{"role": "user", "content": prompt}],
                         "max_tokens": 48, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _served(model_dir, *args) -> tuple[list[str], dict[str, float]]:
    """The 4 prompts sent at once to a fresh server (in this process: the command's
    configuration, engine and app; what is checked is the budget, not the process); its
    replies and /metrics values."""
    server = InProcessServer(model_dir, "--prompt-cache-disk-gb", "0", "--prompt-cache-ram-gb", "0", *args).wait_ready()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: _complete(server.base_url, p), PROMPTS))
        metrics = httpx.get(f"{server.base_url}/metrics").text
    finally:
        server.stop()
    values = {m[1]: float(m[2]) for m in re.finditer(r"^(kvserve_\w+)(?:\{[^}]*\})? (\S+)$", metrics, re.M)}
    return texts, values


def test_budget_admits_by_bytes_and_preempts_without_changing_replies(default_model_dir):
    """6 MiB hold 273 fp16 tokens of the default model (23,040 B each). Four ~45-token chat
    prompts decode until their caches outgrow the budget: requests are preempted, swapped
    out and resumed, and the greedy replies equal those of a server without a tight budget.
    affine4 (7,200 B a token) holds 873 tokens in the same bytes: all four run to the end
    without a preemption."""
    free, _ = _served(default_model_dir, "--kv-scheme", "fp16")
    budget = 6 << 20
    fp16, m16 = _served(default_model_dir, "--kv-scheme", "fp16", "--kv-memory", "6MiB")
    assert fp16 == free
    assert m16["kvserve_kv_budget_bytes"] == budget and m16["kvserve_preemptions_total"] > 0
    q4, m4 = _served(default_model_dir, "--kv-scheme", "affine4", "--kv-memory", "6MiB")
    assert all(q4) and m4["kvserve_preemptions_total"] == 0
