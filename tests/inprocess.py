"""``kvserve serve`` inside the test process, a stand-in for ``servers.ServerProcess`` where a
test needs many servers: the configuration the command line builds from the same arguments,
the engine and its loader, the HTTP app and uvicorn on a loopback port, as ``serve`` in
``kvserve.server.cli`` puts them together, in threads of this process (a change there
belongs here too, except what the routes its tests call never read: that may be left to
``create_app``'s defaults).

What it leaves out is the process: its imports (a process takes about 3 s of CPU to serve
a tiny model, this about 1.3 s, most of it loading and hashing the tokenizer), the malloc
setting (``pin_mmap_threshold``), the signal handlers and the exit. ``stop`` stops uvicorn
and then the engine, which finishes its requests and flushes the prefix cache's disk
writer, as the process does after SIGTERM (the drain before that, which only matters while
requests run, is the process's own: tests/test_hardening.py). Tests of the process itself
(its start-up lines, SIGTERM, exit codes) use ``ServerProcess``.
"""

from __future__ import annotations

import os
import threading
import traceback
from pathlib import Path

from servers import free_port, pinned_weight_format


class InProcessServer:
    """Started on construction (loading in a thread of its own, as a process loads while
    the caller goes on); the interface of ``ServerProcess``, with ``error``: what a start
    that failed raised (the command prints it in one line and exits 1). The quantized models'
    weight format is pinned, as ``ServerProcess``'s (``servers.pinned_weight_format``)."""

    def __init__(self, model: Path | str, *extra: str):
        from kvserve.server import cli

        self.port = free_port()
        self.args = extra
        self.base_url = f"http://127.0.0.1:{self.port}"
        args = cli._parser().parse_args(["serve", "--model", str(model), "--port", str(self.port),
                                         "--log-level", "warning", *extra,
                                         *pinned_weight_format(model, extra)])
        self.config = cli._serve_config(args)
        self.lines: list[str] = []  # the start-up lines the command prints
        self.error: BaseException | None = None
        self.returncode: int | None = None
        self._server = None  # uvicorn's, once the engine is up
        self._stopping = threading.Event()
        self._settled = threading.Event()  # listening, or ended
        self._thread = threading.Thread(target=self._serve, name=f"kvserve-{self.port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.returncode = self._run()
        except BaseException as exc:  # a failed start, where the command exits 1
            self.error = exc
            self.lines.append(traceback.format_exc())
            self.returncode = 1
        finally:
            self._settled.set()

    def _run(self) -> int:
        import asyncio

        import uvicorn

        from kvserve.cache import parse_scheme
        from kvserve.server import cli
        from kvserve.server.engine.loop import Engine
        from kvserve.server.engine.model_loader import make_loader
        from kvserve.server.http.app import create_app
        from kvserve.server.http.guard import Gate
        from kvserve.server.models.blas import enable_fast_blas

        config, settled = self.config, self._settled
        load = make_loader(config.model, parse_scheme(config.cache.kv_scheme), enable_fast_blas().describe(),
                           self.lines.append, cache=config.cache, speculative=config.engine.speculative,
                           draft_model=config.engine.draft_model, device=_device_profile(config),
                           draft_cost=config.engine.draft_cost)
        engine = Engine(load, config.engine)
        engine.start()

        class Server(uvicorn.Server):
            async def startup(self, sockets=None) -> None:
                self.loop, self.wake = asyncio.get_running_loop(), asyncio.Event()
                await super().startup(sockets)
                settled.set()  # listening: what /health's first answer tells of a process

            async def main_loop(self) -> None:
                """uvicorn's loop, a tick every 0.1 s (the Date header, ``should_exit``), woken
                at once by ``stop`` (``wake``) as a process is by its signal: not up to a tick
                later, for each of the hundreds of servers a run stops."""
                counter = 0
                while not await self.on_tick(counter):
                    counter = (counter + 1) % 864000
                    try:
                        await asyncio.wait_for(self.wake.wait(), 0.1)
                    except asyncio.TimeoutError:
                        pass

        try:
            http = config.http
            uv_config = uvicorn.Config(create_app(engine, http, Gate()), host=http.host, port=http.port,
                                       log_level=http.log_level, timeout_keep_alive=cli.KEEP_ALIVE_S,
                                       h11_max_incomplete_event_size=cli.PARSER_HEAD_FACTOR * http.max_header_bytes,
                                       log_config=None)  # this process's logging stays as it is
            self._server = Server(uv_config)
            if not self._stopping.is_set():
                self._server.run()  # off the main thread uvicorn installs no signal handlers
        finally:
            stopped = engine.stop(timeout=cli.ENGINE_STOP_S)
        return 0 if stopped and engine.down is None else 1

    def wait_ready(self, timeout: float = 300) -> "InProcessServer":
        """Until it listens (no polling: the thread says so); raises when the start failed."""
        if not self._settled.wait(timeout):
            self.stop()
            raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")
        if not self._thread.is_alive() or self.returncode is not None:
            raise RuntimeError(f"server exited with {self.returncode}:\n{self.output()}")
        return self

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> int:
        """Stop serving, finish the engine and flush its writers; 0 when all of it ended."""
        self._stopping.set()
        if self._server is not None:
            self._server.should_exit = True  # uvicorn's main loop checks this every 0.1 s
            wake = getattr(self._server, "wake", None)
            if wake is not None:  # listening: its loop checks at once
                try:
                    self._server.loop.call_soon_threadsafe(wake.set)
                except RuntimeError:  # the loop already ended
                    pass
        self._thread.join()
        _forget_endpoints()
        return self.returncode


def _forget_endpoints() -> None:
    """FastAPI keeps the endpoints it classified in caches of its module (4096 each), and an
    endpoint's closure holds the engine, model and tokenizer (tens of MiB for a tiny model):
    a process serves one app, but here every stopped server's would stay for the whole run."""
    from fastapi.dependencies import models

    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cached = getattr(models, name, None)  # absent from other FastAPI versions: nothing to free
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def _device_profile(config):
    """``choose_profile`` as the command calls it, leaving this process's environment as it
    was (on CUDA it points ``MLX_PTX_CACHE_DIR`` at the cache folder for what runs after)."""
    from kvserve.server.engine.device import KERNEL_CACHE_ENV, choose_profile

    before = os.environ.get(KERNEL_CACHE_ENV)
    try:
        return choose_profile(config.model.resolved_cache_dir(), config.engine.warmup,
                              captured=config.engine.captured_decode)
    finally:
        if before is None:
            os.environ.pop(KERNEL_CACHE_ENV, None)
