"""Where a served run's time goes while requests come and go: the engine without HTTP.

``kvserve bench``'s workload (``--requests`` chats of about ``--prompt-tokens`` tokens, each
a different passage behind the same instruction, greedy, ``--max-tokens`` out, kept
``--concurrency`` in flight: a request is submitted as one finishes) driven straight into
the real ``Engine`` (the model as ``kvserve serve`` loads it on this device, its warm-up, its
prefix cache). The runner's phases are timed, wall clock on the engine thread, inclusive
(``complete`` holds ``offer``; ``decode`` holds the ``join`` of rows that arrive with it):

  * ``decode``: building the step's forward (or taking the one queued ahead) and queueing it;
  * ``ahead``: building and queueing the next step's forward while this one runs;
  * ``read``: waiting for a step's tokens (what the device still had to do);
  * ``prefill``: a prompt's forward, ``complete`` (converting the raw prefill to the scheme,
    ``offer``: a snapshot into the prefix cache), ``join``: the new row into the batch;
  * ``release``: a finished request's ``offer`` and its row leaving the batch (``keep``);
  * ``undo``: dropping the step queued ahead when the rows change.

``--steps`` also prints each round's steps as the runner took them (decoding rows, planned
prompt chunks, the step's wall ms and the engine's ms before it: what a joining or leaving
row costs the others), and the median of the steps that only decode a full batch.
``--prefill-step-size`` sets the engine's prompt chunk (unset: the device profile's), and
``--dense-rows`` the rows from which a CUDA prompt chunk multiplies dequantized weights
(``few_rows.DENSE_ROWS``; a large value keeps MLX's quantized GEMM), for A/B runs.

With ``--document-tokens N`` every request instead asks its own question about one shared
document of about N tokens (``kvserve bench --document-tokens``), put in the prefix cache by
one request before the clocks start: the long-context workload, whose measured steps decode
over the document.

Each scheme runs ``--rounds`` times on the same prompts, each round on a new engine (its
warm-up served, its prefix cache empty) in the same process: what a later round saves is
what the process keeps from the first (MLX's buffers, compiled kernels). Printed per
round: wall seconds, output tokens/s, TTFT p50, the kernel files the device's cache folder
gained (a GPU compiling while requests wait), the prefix cache's entries on disk, and each
phase's milliseconds per request; with ``--profile TOP`` on a GPU, also the device's busy
time per request and the TOP kernels in it (CUPTI, as ``gpu_decode.py --profile``). The CPU
computes with the server's BLAS, as ``serve``.

    python bench/churn.py --schemes fp16,affine4 --requests 32 --concurrency 8
    python bench/churn.py --schemes affine4 --requests 16 --document-tokens 4000 --max-tokens 64 --rounds 1
    python bench/churn.py --model /root/models/llama3-8b-q4 --requests 8 --document-tokens 16000 \
        --max-tokens 64 --rounds 1      # the 8B shape (bench/shaped_model.py) on a GPU
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

PHASES = {"decode": "_decode", "ahead": "_queue_ahead", "read": "_read", "prefill": "_prefill",
          "complete": "_complete", "offer": "_offer", "join": "_join", "release": "release", "keep": "_keep",
          "undo": "_undo_ahead"}
COLUMNS = (*PHASES, "offer wait")


def waited(clocks: dict, fn):
    """``_offer`` that first evaluates the offered cache (clock ``offer wait``: the prefill
    or queued step it still depends on), so ``offer`` is the snapshot's own time."""
    def wrapper(self, tokens, cache, *rest):
        import mlx.core as mx

        t0 = time.perf_counter()
        mx.eval(cache.state)
        clocks["offer wait"].append(time.perf_counter() - t0)
        return fn(self, tokens, cache, *rest)
    return wrapper


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default="fp16,affine4")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--prompt-cache-disk-gb", type=float, default=None,
                   help="the prefix cache's SSD tier (0: none; unset: the server's default)")
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="on a GPU: the device's busy time per request in each round, and its TOP kernels")
    p.add_argument("--model", default=None,
                   help="a model directory (bench/shaped_model.py writes one) instead of the default model")
    p.add_argument("--steps", action="store_true", help="print each round's steps (rows, chunks, ms)")
    p.add_argument("--prefill-step-size", type=int, default=None, help="prompt tokens per chunk (unset: the device's)")
    p.add_argument("--dense-rows", type=int, default=None,
                   help="CUDA: rows from which prompt chunks multiply dequantized weights (few_rows.DENSE_ROWS)")
    p.add_argument("--document-tokens", type=int, default=0,
                   help="long contexts: every request asks its own question about one shared document "
                        "of about this many tokens, put in the prefix cache before the clocks start")
    return p.parse_args(argv)


def run_round(engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[float, int, list[float]]:
    """Seconds, output tokens and TTFTs of ``prompts`` kept ``concurrency`` in flight."""
    from kvserve.server.engine.request import Request, SamplingParams

    pending, lock, done = list(prompts), threading.Lock(), threading.Event()
    live = {"running": 0, "tokens": 0}
    ttft: list[float] = []

    def submit() -> None:
        tokens = pending.pop()
        request = Request(tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        start = time.perf_counter()
        first = []

        def sink(event) -> None:
            with lock:
                if not first:
                    first.append(time.perf_counter())
                    ttft.append(first[0] - start)
                if event.finish_reason is None:
                    return
                live["tokens"] += event.usage.completion_tokens
                live["running"] -= 1
                if pending:
                    live["running"] += 1
                    submit()
                elif not live["running"]:
                    done.set()

        engine.submit(request, sink)

    t0 = time.perf_counter()
    with lock:
        for _ in range(min(concurrency, len(pending))):
            live["running"] += 1
            submit()
    done.wait()
    return time.perf_counter() - t0, live["tokens"], ttft


def logged(steps: list, fn):
    """``ModelRunner.execute`` that logs (decoding rows, planned chunk sizes, its ms, the
    engine's ms since the previous step ended)."""
    def wrapper(self, plan):
        t0 = time.perf_counter()
        try:
            return fn(self, plan)
        finally:
            end = time.perf_counter()
            gap = t0 - steps[-1][-1] if steps else 0.0
            steps.append((len(plan.decode), tuple(c.num_tokens for c in plan.prefill), end - t0, gap, end))
    return wrapper


def step_lines(steps: list, full: int) -> list[str]:
    """The logged steps: every one that prefills or follows a change of rows, and the median
    of those that decode ``full`` rows and nothing else."""
    out, rows = [], None
    for i, (decode, chunks, ms, gap, _) in enumerate(steps):
        if chunks or decode != rows:
            out.append(f"  step {i}: {decode} decoding, chunks {list(chunks)}: {1e3 * ms:.1f} ms, "
                       f"{1e3 * gap:.1f} ms before it")
        rows = decode
    steady = [ms for decode, chunks, ms, *_ in steps if decode == full and not chunks]
    if steady:
        out.append(f"  {len(steady)} steps decoding {full} rows alone: median {1e3 * statistics.median(steady):.2f} ms")
    return out


def one_round(scheme: str, model, texts: list[str], warm: str | None, args, blas: str, clocks: dict,
              steps: list) -> tuple:
    """The same prompts on a new engine (its warm-up served, an empty prefix cache in a folder
    of its own): a later round differs from the first only by what the process keeps (MLX's
    buffers and compiled kernels). ``clocks`` restart after the warm-up. Returns seconds, tokens, TTFTs, kernel files compiled
    and prefix-cache entries on disk."""
    from gpu_decode import device_split
    from kvserve.cache import parse_scheme
    from kvserve.configs import CacheConfig, EngineConfig
    from kvserve.kernels.bench_cases import kernel_records
    from kvserve.server.engine.device import kernel_files
    from kvserve.server.engine.loop import Engine
    from kvserve.server.engine.model_loader import make_loader

    folder = tempfile.mkdtemp(prefix="kvserve-churn-")
    disk = {} if args.prompt_cache_disk_gb is None else {"prompt_cache_disk_gb": args.prompt_cache_disk_gb}
    cache = None if args.no_prefix_cache else CacheConfig(kv_scheme=scheme, prompt_cache_dir=folder, **disk)
    engine = Engine(make_loader(model, parse_scheme(scheme), blas, cache=cache),
                    EngineConfig(prefill_step_size=args.prefill_step_size))
    loaded = engine.start()
    chat = lambda text: list(loaded.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True))
    prompts = [chat(t) for t in texts]
    if warm is not None:  # the shared document into the prefix cache, as kvserve bench's warm-up does
        run_round(engine, [chat(warm)], 1, 8)
    clocks.clear()  # the warm-ups ran through the same phases: only the round's own count
    steps.clear()
    kernels = kernel_files(loaded.device) if loaded.device is not None else 0
    result = []

    def run() -> None:
        result.append(run_round(engine, prompts, args.concurrency, args.max_tokens))

    records = kernel_records(run) if args.profile else []
    if not result:  # not profiled, or no CUPTI here (kernel_records then runs nothing)
        run()
    seconds, tokens, ttft = result[0]
    if args.profile:
        print(device_split(records, len(prompts), f"{scheme}, {loaded.device.backend if loaded.device else ''}",
                           args.profile, unit="request"), flush=True)
    compiled = (kernel_files(loaded.device) if loaded.device is not None else 0) - kernels
    if args.steps:
        print("\n".join(step_lines(steps, args.concurrency)), flush=True)
    prefix = loaded.runner.prefix  # the engine is idle after the round
    disk = prefix.stats()["disk_entries"] if prefix is not None else 0
    engine.stop()
    shutil.rmtree(folder, ignore_errors=True)
    return seconds, tokens, ttft, compiled, disk


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from kvserve.server.models.blas import enable_fast_blas

    blas = enable_fast_blas()
    import mlx.core as mx

    from kvserve.bench.cli import default_model_dir, document_prompts, make_prompts, tokenizer_counter
    from kvserve.configs import ModelConfig
    from kvserve.server.engine.runner import ModelRunner

    from gpu_engine_split import timed

    clocks: dict[str, list[float]] = defaultdict(list)
    for name, attr in PHASES.items():
        setattr(ModelRunner, attr, timed(clocks, name, getattr(ModelRunner, attr)))
    steps: list[tuple] = []
    ModelRunner.execute = logged(steps, ModelRunner.execute)
    if args.dense_rows is not None:
        from kvserve.server.engine import few_rows

        few_rows.DENSE_ROWS = args.dense_rows
    ModelRunner._offer = waited(clocks, ModelRunner._offer)  # outside its clock
    model = ModelConfig(model=args.model)
    count = tokenizer_counter(default_model_dir())
    warm = None
    if args.document_tokens:
        texts, warm = document_prompts(args.requests, args.document_tokens, count)
    else:
        texts = make_prompts(args.requests, args.prompt_tokens, count)
    print(f"device: {mx.device_info().get('device_name', mx.default_device())}, mlx {mx.__version__}; "
          f"{args.model or 'the default model'}, {args.requests} requests, {args.concurrency} in flight, "
          + (f"questions over one ~{args.document_tokens}-token document" if args.document_tokens
             else f"~{args.prompt_tokens} prompt tokens") + f", {args.max_tokens} out")
    print("| scheme | round | s | tok/s | TTFT p50 ms | compiled | on disk | "
          + " | ".join(f"{p} ms/req" for p in COLUMNS) + " |\n" + "|---" * (7 + len(COLUMNS)) + "|", flush=True)
    for scheme in args.schemes.split(","):
        for rnd in range(args.rounds):
            seconds, tokens, ttft, compiled, disk = one_round(scheme, model, texts, warm, args, blas.describe(),
                                                              clocks, steps)
            per = " | ".join(f"{1e3 * sum(clocks[p]) / args.requests:.1f}" for p in COLUMNS)
            print(f"| {scheme} | {rnd + 1} | {seconds:.2f} | {tokens / seconds:.1f} | "
                  f"{1e3 * statistics.median(ttft):.0f} | {compiled} | {disk} | {per} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
