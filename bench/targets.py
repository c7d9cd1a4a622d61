"""Servers the benchmark starts, one at a time, on a free port of the loopback interface.

A target is written ``kind[:args]``: ``kvserve:--kv-scheme affine4`` runs
``kvserve serve --model DIR --kv-scheme affine4``; ``mlx_lm:--kv-bits 4`` runs
``mlx_lm.server --model DIR --kv-bits 4`` through ``kvserve.bench.mlx_lm_peer``;
``kvserve-tp2:ARGS`` runs ``kvserve serve --distributed ARGS`` as two processes on this
machine, joined by MLX's ring backend over loopback (as ``mlx.launch -n 2`` starts them);
``llama:-np 8`` runs a ``llama-server`` binary (``kvserve bench --llama-server PATH``) on the
GGUF file the model directory was converted from.

    >>> t = Target.parse("mlx_lm:--kv-bits 4")
    >>> (t.kind, t.args, t.label)
    ('mlx_lm', ('--kv-bits', '4'), 'mlx_lm.server --kv-bits 4')
    >>> t = Target.parse("kvserve-tp2:--kv-scheme affine4")
    >>> (t.kind, t.world, t.label)
    ('kvserve', 2, 'kvserve serve --distributed (2 processes) --kv-scheme affine4')
    >>> t = Target.parse("llama:-np 8 -ctk q4_0 -ctv q4_0 -fa on")
    >>> t.command(Path("m"), 8080, LlamaServer(Path("/opt/llama-server"), Path("m.gguf")))[:5]
    ['/opt/llama-server', '-m', 'm.gguf', '--host', '127.0.0.1']
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

KINDS = ("kvserve", "mlx_lm", "llama")
_NAMES = {"kvserve": "kvserve serve", "mlx_lm": "mlx_lm.server", "llama": "llama-server"}


@dataclass(frozen=True)
class LlamaServer:
    """A ``llama-server`` binary and the GGUF file it serves (the one the model directory
    was converted from, so both servers compute with the same weights)."""

    binary: Path
    gguf: Path


@dataclass(frozen=True)
class Target:
    kind: str
    args: tuple[str, ...] = ()
    world: int = 1  # processes of one split model (kvserve --distributed)

    @classmethod
    def parse(cls, spec: str) -> Target:
        kind, _, rest = spec.partition(":")
        split = re.fullmatch(r"kvserve-tp(\d+)", kind)
        if kind not in KINDS and not split:
            raise ValueError(f"unknown target kind {kind!r} in {spec!r}; one of {KINDS} or kvserve-tpN")
        if split:
            return cls("kvserve", tuple(shlex.split(rest)), int(split.group(1)))
        return cls(kind, tuple(shlex.split(rest)))

    @property
    def label(self) -> str:
        name = _NAMES[self.kind]
        if self.world > 1:
            name += f" --distributed ({self.world} processes)"
        return " ".join([name, *self.args])

    def command(self, model_dir: Path | None, port: int, llama: LlamaServer | None = None) -> list[str]:
        """The server's command line; without ``model_dir`` kvserve serves its default model."""
        if self.kind == "llama":
            if llama is None:
                raise ValueError("a llama target needs kvserve bench --llama-server PATH")
            threads = [] if {"-t", "--threads"} & set(self.args) else ["-t", str(len(os.sched_getaffinity(0)))]
            return [str(llama.binary), "-m", str(llama.gguf), "--host", "127.0.0.1", "--port", str(port),
                    *threads, *self.args]
        model = ["--model", str(model_dir)] if model_dir is not None else []
        if self.kind == "kvserve":
            split = ["--distributed"] if self.world > 1 else []
            return [sys.executable, "-m", "kvserve.server.cli", "serve", *split, *model,
                    "--port", str(port), "--log-level", "warning", *self.args]
        return [sys.executable, "-m", "kvserve.bench.mlx_lm_peer", *model,
                "--port", str(port), "--log-level", "WARNING", *self.args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A started target; ``stop`` ends it (SIGTERM, then SIGKILL after a grace period)."""

    def __init__(self, target: Target, model_dir: Path | None, timeout: float = 600.0,
                 llama: LlamaServer | None = None):
        self.target = target
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-bench-", suffix=".log")
        command = target.command(model_dir, self.port, llama)
        started = time.monotonic()
        self.procs = [subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
                      for env in self._ring_env(target.world)]
        self.proc = self.procs[0]
        self._wait(timeout)
        self.ready_s = time.monotonic() - started  # start to /health answering 200

    def _ring_env(self, world: int) -> list[dict | None]:
        """Each process's environment: ``MLX_RANK`` and a loopback ``MLX_HOSTFILE`` for a split model."""
        if world == 1:
            return [None]
        self.hostfile = tempfile.NamedTemporaryFile("w", prefix="kvserve-ring-", suffix=".json")
        json.dump([[f"127.0.0.1:{free_port()}"] for _ in range(world)], self.hostfile)
        self.hostfile.flush()
        return [{**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": self.hostfile.name} for r in range(world)]

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                output = self.output()  # before stop, which closes the log
                self.stop()
                raise RuntimeError(f"{self.target.label} exited with {self.proc.returncode}:\n{output}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.target.label} did not answer within {timeout:.0f} s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def model_name(self) -> str:
        """What requests put in ``model`` to reach the model the target was started with."""
        return "default" if self.target.kind == "kvserve" else "default_model"

    def peak_rss(self) -> int | None:
        """Bytes: the peak resident set (``VmHWM``) of the target's processes, summed; None
        where /proc does not say. Read before ``stop``."""
        total = 0
        for p in self.procs:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
            except (OSError, StopIteration, ValueError):
                return None
        return total

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (to rank 0 of a split model: it stops the others), then SIGKILL after
        ``timeout`` seconds; returns rank 0's exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.log.close()
        return self.proc.returncode
