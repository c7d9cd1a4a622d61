"""Start the real ``kvserve serve`` process for tests, and build the tiny random-weight model."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_llama(dst: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer llama with random weights and the default model's tokenizer (GQA 4:2)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "max_position_embeddings": 512,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dst / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dst / name)
    return dst


def random_llama(seed: int):
    """A 2-layer llama with random weights, head_dim 64 (quantized groups fit), vocab 256."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                           vocab_size=256)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


class ServerProcess:
    """``kvserve serve`` in a subprocess on a free loopback port; stopped with SIGTERM."""

    def __init__(self, model: Path | str, *extra: str, env: dict | None = None):
        self.port = free_port()
        self.args = extra
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvserve.server.cli", "serve", "--model", str(model),
               "--port", str(self.port), "--log-level", "warning", *extra]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"kvserve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 300) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        if self.log.closed:
            return self._final_output
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self._final_output = self.output()
            self.log.close()
        return self.proc.returncode
