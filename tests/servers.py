"""Start the real ``kvserve serve`` process for tests, and build the tiny random-weight model."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def on_gpu() -> bool:
    """Whether servers started here run on a GPU: they take MLX's default device, as this
    process does."""
    import mlx.core as mx

    return mx.default_device() == mx.gpu


_GIVEN: set[int] = set()  # ports free_port() handed out in this process


def free_port() -> int:
    """A loopback port nothing listens on, never one this process was given before: the
    kernel may hand a just-released port to the next ``bind(0)``, and two servers of one
    test started back to back (an in-process one binds later) then shared a port, so the
    second's readiness check was answered by the first."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def ring_ports(n: int) -> list[int]:
    """``n`` consecutive free loopback ports below the kernel's ephemeral range, as the ring
    backend's ranks bind them (``mlx.launch --starting-port P`` gives rank r port P + r).

    Ports from ``bind(0)`` come from the ephemeral range, where any outgoing connection (the
    tests' own HTTP clients) may take P + 1 before the rank binds it; below the range only an
    explicit bind takes a port.

    >>> ports = ring_ports(2); ports[1] - ports[0]
    1
    """
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(10000, low - n)
        if all(_bindable(base + i) for i in range(n)):
            return list(range(base, base + n))
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def make_tiny_llama(dst: Path, tokenizer_dir: Path, seed: int = 0, context: int = 512) -> Path:
    """A 2-layer llama with random weights and the default model's tokenizer (GQA 4:2),
    serving ``context`` tokens."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "max_position_embeddings": context,
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


def random_llama(seed: int, layers: int = 2):
    """A llama of 2 (or ``layers``) layers with random weights, head_dim 64 (quantized groups
    fit), vocab 256."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                           vocab_size=256)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def wait_for(condition, what: str, timeout: float = 120.0, every: float = 0.05) -> None:
    """Poll ``condition()`` until it is true; fail naming ``what`` after ``timeout`` seconds.
    The timeout only bounds a hang: a slower machine waits longer, it never fails sooner."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout:g} s for {what}")
        time.sleep(every)


def wait_idle(base_url: str) -> None:
    """Until the server holds no request (``/health``'s ``inflight``)."""
    wait_for(lambda: httpx.get(f"{base_url}/health", timeout=30).json()["inflight"] == 0,
             f"{base_url} to hold no request")


def wait_healthy(base_url: str, exited, timeout: float) -> bool:
    """Poll ``/health`` until it answers 200 (True), ``exited()`` or the time is up (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not exited():
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def replies_across_a_restart(model: Path | str, body: dict, *args: str, server=None) -> tuple[dict, dict]:
    """``body`` sent to ``/v1/chat/completions`` of a server, then of a second one started
    after the first stopped, both with ``args`` (the same cache folder): a clean stop flushes
    the prefix cache's disk writer, so the second can start from the first one's files.
    ``server``: the class that serves (``ServerProcess`` when None; ``inprocess.InProcessServer``
    where the files, not the process, are what a test checks)."""
    replies = []
    for _ in range(2):
        proc = (server or ServerProcess)(model, *args).wait_ready()
        try:
            replies.append(httpx.post(f"{proc.base_url}/v1/chat/completions", json=body, timeout=120).json())
        finally:
            assert proc.stop() == 0, proc.output()
    return replies[0], replies[1]


# The weight format the automatic choice (``--weight-format auto``, ``server/models/weights.py``)
# picks on the CPU for the quantized models tests serve, by the model directory's name; the
# tiny random-weight models are float32, where nothing is measured ("no other format
# applies"). The choice times the candidates at each start (~1 s of the default model's
# start), and two servers whose replies a test compares could come out in different formats
# (a timing dependence): the test servers take it pinned. Seen in the servers' start-up lines
# on the 2-core x86-64 VM: the default model dense-f32+codes 626 times, dense-f32 44 times;
# Gemma 3 270M dense-f32 32 times, dense-f32+codes 8 times. The choosing itself is
# ``test_weights.py``'s.
PINNED_WEIGHT_FORMATS = {"SmolLM2-135M-Instruct": "dense-f32+codes", "gemma3-270m": "dense-f32"}


def pinned_weight_format(model: Path | str, extra: tuple[str, ...]) -> tuple[str, ...]:
    """``--weight-format`` and the pinned format for ``model``, where the CPU would measure
    one and ``extra`` names none; else nothing (a GPU keeps the model's own weights without
    measuring)."""
    fmt = PINNED_WEIGHT_FORMATS.get(Path(str(model)).name)
    if fmt is None or any(a.split("=")[0] == "--weight-format" for a in extra) or on_gpu():
        return ()
    from kvserve.server.models.blas import codes_library

    if fmt == "dense-f32+codes" and codes_library() is None:  # without the shim: the next fastest
        fmt = "dense-f32"
    return ("--weight-format", fmt)


class ServerProcess:
    """``kvserve serve`` in a subprocess on a free loopback port; stopped with SIGTERM. The
    quantized models' weight format is pinned (``pinned_weight_format``)."""

    def __init__(self, model: Path | str, *extra: str, env: dict | None = None):
        self.port = free_port()
        self.args = extra
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvserve.server.cli", "serve", "--model", str(model),
               "--port", str(self.port), "--log-level", "warning", *extra,
               *pinned_weight_format(model, extra)]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"kvserve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 300) -> "ServerProcess":
        if wait_healthy(self.base_url, lambda: self.proc.poll() is not None, timeout):
            return self
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
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


class DistributedServer:
    """``kvserve serve --distributed`` as ``world`` processes on loopback (the ring backend),
    started as ``mlx.launch`` starts them (``MLX_RANK``, ``MLX_HOSTFILE``) so each rank is a
    process of its own here: rank 0 serves HTTP; ``ranks[r]`` is rank r's process.
    ``launcher=True`` starts them through ``mlx.launch`` itself (one process here)."""

    def __init__(self, model: Path | str, *extra: str, world: int = 2, launcher: bool = False):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        serve = ["serve", "--distributed", "--model", str(model), "--port", str(self.port),
                 "--log-level", "warning", *extra]
        self.launcher = launcher
        self.logs = [open(tmp / f"kvserve-{self.port}-rank{r}.log", "w+") for r in range(1 if launcher else world)]
        if launcher:
            launch = Path(sys.executable).parent / "mlx.launch"
            cmd = [str(launch), "-n", str(world), "--backend", "ring", "--starting-port", str(ring_ports(world)[0]),
                   "--", str(Path(sys.executable).parent / "kvserve"), *serve]
            self.ranks = [subprocess.Popen(cmd, stdout=self.logs[0], stderr=subprocess.STDOUT)]
            return
        hostfile = tmp / f"kvserve-{self.port}-hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ring_ports(world)]))
        self.ranks = [subprocess.Popen([sys.executable, "-m", "kvserve.server.cli", *serve], stdout=log,
                                       stderr=subprocess.STDOUT,
                                       env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)})
                      for r, log in enumerate(self.logs)]

    def wait_ready(self, timeout: float = 300) -> "DistributedServer":
        if wait_healthy(self.base_url, lambda: any(p.poll() is not None for p in self.ranks), timeout):
            return self
        self.stop()
        raise RuntimeError(f"not ready after {timeout} s, or a rank exited:\n{self.output()}")

    def output(self, rank: int | None = None) -> str:
        out = []
        for r, log in enumerate(self.logs):
            if rank is None or r == rank:
                log.flush()
                log.seek(0)
                out.append(log.read())
        return "\n".join(out)

    def wait_exit(self, timeout: float) -> list[int | None]:
        """Each rank's exit code after at most ``timeout`` seconds (None: still running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.ranks):
            time.sleep(0.1)
        return [p.poll() for p in self.ranks]

    def pid(self, rank: int) -> int:
        """A rank's process id, as it printed it at start-up."""
        import re

        return int(re.search(rf"rank {rank} of \d+, pid (\d+)", self.output()).group(1))

    def stop(self) -> list[int | None]:
        """SIGTERM to rank 0 (it tells the others to finish); any rank left after 30 s is killed."""
        if self.ranks[0].poll() is None:
            if self.launcher:  # mlx.launch itself would die at once and leave the ranks running
                os.kill(self.pid(0), 15)
            else:
                self.ranks[0].terminate()
        codes = self.wait_exit(30)
        for p in self.ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        return codes
