"""Servers the benchmark starts, one at a time, on a free port of the loopback interface.

A target is written ``kind[:args]``: ``kvserve:--kv-scheme affine4`` runs
``kvserve serve --model DIR --kv-scheme affine4``; ``mlx_lm:--kv-bits 4`` runs
``mlx_lm.server --model DIR --kv-bits 4`` through ``kvserve.bench.mlx_lm_peer``.

    >>> t = Target.parse("mlx_lm:--kv-bits 4")
    >>> (t.kind, t.args, t.label)
    ('mlx_lm', ('--kv-bits', '4'), 'mlx_lm.server --kv-bits 4')
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

KINDS = ("kvserve", "mlx_lm")


@dataclass(frozen=True)
class Target:
    kind: str
    args: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> Target:
        kind, _, rest = spec.partition(":")
        if kind not in KINDS:
            raise ValueError(f"unknown target kind {kind!r} in {spec!r}; one of {KINDS}")
        return cls(kind, tuple(shlex.split(rest)))

    @property
    def label(self) -> str:
        name = "kvserve serve" if self.kind == "kvserve" else "mlx_lm.server"
        return " ".join([name, *self.args])

    def command(self, model_dir: Path | None, port: int) -> list[str]:
        """The server's command line; without ``model_dir`` kvserve serves its default model."""
        model = ["--model", str(model_dir)] if model_dir is not None else []
        if self.kind == "kvserve":
            return [sys.executable, "-m", "kvserve.server.cli", "serve", *model,
                    "--port", str(port), "--log-level", "warning", *self.args]
        return [sys.executable, "-m", "kvserve.bench.mlx_lm_peer", *model,
                "--port", str(port), "--log-level", "WARNING", *self.args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A started target; ``stop`` ends it (SIGTERM, then SIGKILL after a grace period)."""

    def __init__(self, target: Target, model_dir: Path | None, timeout: float = 600.0):
        self.target = target
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-bench-", suffix=".log")
        self.proc = subprocess.Popen(target.command(model_dir, self.port), stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.target.label} exited with {self.proc.returncode}:\n{self.output()}")
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

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
