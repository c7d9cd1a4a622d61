#!/usr/bin/env python
"""Prefill and decode speed: ``mlx_lm.generate`` against kvserve's serving path.

One run measures, on the same model directory and the same prompt:

1. ``python -m mlx_lm generate`` as a subprocess (the model as stored, MLX's
   stock CPU set-up), using the prompt and generation tokens-per-second that
   mlx-lm itself reports;
2. kvserve's path in this process: ``enable_fast_blas()`` before mlx is
   imported, ``mlx_lm.load``, the measured weight format, ``TableRoPE``,
   chunked prefill with last-position logits, and greedy decoding pipelined
   with ``mx.async_eval``.

Usage::

    python bench/speed.py [MODEL_DIR] [--prompt-tokens 512] [--gen-tokens 128] \\
        [--prefill-step 256] [--ablate] [--out docs/benchmarks/cpu-speed.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

# Before anything imports mlx: the BLAS must be in place first.
from kvserve.server.models.blas import enable_fast_blas

_TEXT = (
    "The river town woke slowly. Fishermen checked their nets by lantern light while the "
    "baker pulled the first loaves from a brick oven that had burned since midnight. "
    "Children ran along the quay, counting boats and arguing about which one was fastest. "
    "An old ferryman explained to anyone who listened how the tides had changed over forty "
    "years, how the sandbanks moved, and why the lighthouse keeper never slept before dawn. "
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="mlx-lm model directory; default: the default "
                   "model (SmolLM2-135M-Instruct Q4_1 GGUF) converted into kvserve's cache")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--prefill-step", type=int, default=256, help="prefill chunk size (tokens)")
    p.add_argument("--reps", type=int, default=3, help="runs of each of our measurements (fastest kept)")
    p.add_argument("--base-reps", type=int, default=1, help="runs of mlx_lm.generate (fastest kept)")
    p.add_argument("--weight-format", default="auto")
    p.add_argument("--ablate", action="store_true", help="also measure without each fast-path piece")
    p.add_argument("--skip-mlx-lm", action="store_true", help="do not run mlx_lm.generate")
    p.add_argument("--out", help="write the Markdown report here as well")
    return p.parse_args(argv)


def make_prompt(tokenizer, n: int) -> tuple[str, list[int]]:
    """A plain-text prompt of about ``n`` tokens, and its token ids."""
    text = _TEXT * (n // 40 + 2)
    ids = tokenizer.encode(text)[:n]
    text = tokenizer.decode(ids)
    return text, tokenizer.encode(text)


def run_mlx_lm(model: str, prompt: str, gen_tokens: int) -> dict:
    """mlx_lm.generate's own report, from a fresh process (stock set-up)."""
    cmd = [sys.executable, "-m", "mlx_lm", "generate", "--model", model, "--prompt", "-",
           "--max-tokens", str(gen_tokens), "--temp", "0.0", "--ignore-chat-template",
           "--verbose", "True"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    res = subprocess.run(cmd, input=prompt, capture_output=True, text=True, env=env, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"mlx_lm generate failed: {res.stderr[-2000:]}")
    found = {}
    for key in ("Prompt", "Generation"):
        m = re.search(rf"^{key}: (\d+) tokens, ([\d.]+) tokens-per-sec", res.stdout, re.M)
        if not m:
            raise RuntimeError(f"no '{key}:' line in mlx_lm output:\n{res.stdout[-2000:]}")
        found[key.lower()] = (int(m.group(1)), float(m.group(2)))
    return {"prompt_tokens": found["prompt"][0], "prefill_tps": found["prompt"][1],
            "gen_tokens": found["generation"][0], "decode_tps": found["generation"][1],
            "command": shlex.join(["python"] + cmd[1:])}


def best_mlx_lm(args, prompt: str) -> dict:
    """The fastest of ``--base-reps`` mlx_lm.generate runs, per column."""
    runs = [run_mlx_lm(args.model, prompt, args.gen_tokens) for _ in range(max(1, args.base_reps))]
    best = dict(runs[0], runs=len(runs))
    for key in ("prefill_tps", "decode_tps"):
        best[key] = max(r[key] for r in runs)
    return best


def prefill(model, ids: list[int], cache, step: int, last_only: bool = True):
    """Next-token logits after prefilling ``ids`` in chunks of ``step``, as the
    engine does: earlier chunks only fill the cache (their logits are never
    evaluated, so never computed)."""
    import mlx.core as mx

    from kvserve.server.engine.fastpath import last_logits

    tokens = mx.array(ids)[None]
    start = 0
    while len(ids) - start > step:
        model(tokens[:, start : start + step], cache=cache)
        mx.eval([c.state for c in cache])
        start += step
    rest = tokens[:, start:]
    return last_logits(model, rest, cache) if last_only else model(rest, cache=cache)[:, -1, :]


def prefill_seconds(model, ids: list[int], step: int, last_only: bool) -> float:
    """Seconds to prefill ``ids`` into a fresh cache and get next-token logits."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t = time.perf_counter()
    mx.eval(prefill(model, ids, cache, step, last_only))
    return time.perf_counter() - t


def decode_seconds(model, ids: list[int], n: int, step: int, pipelined: bool = True) -> float:
    """Seconds for ``n`` greedy tokens after prefilling ``ids`` (not timed)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.argmax(prefill(model, ids, cache, step), axis=-1)
    mx.eval(y)

    def step(tok):
        return mx.argmax(model(tok[:, None], cache=cache)[:, -1, :], axis=-1)

    t = time.perf_counter()
    if pipelined:  # build step i+1 while step i computes, as mlx-lm and the engine do
        nxt = step(y)
        mx.async_eval(nxt)
        for _ in range(n - 1):
            after = step(nxt)
            mx.async_eval(after)
            nxt.item()
            nxt = after
        nxt.item()
    else:
        for _ in range(n):
            y = step(y)
            y.item()
    return time.perf_counter() - t


def measure(model, ids: list[int], gen: int, reps: int, step: int, last_only=True, pipelined=True) -> dict:
    prefill_seconds(model, ids[:32], step, last_only)  # warm-up: first-use allocations
    # Fastest of ``reps`` (other processes only ever slow a run down); the
    # slowest is kept too, to show the spread.
    pre = [prefill_seconds(model, ids, step, last_only) for _ in range(reps)]
    dec = [decode_seconds(model, ids, gen, step, pipelined) for _ in range(reps)]
    return {"prefill_tps": len(ids) / min(pre), "decode_tps": gen / min(dec),
            "prefill_slowest": len(ids) / max(pre), "decode_slowest": gen / max(dec)}


def _start_server(model: str) -> tuple[subprocess.Popen, str]:
    import socket

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # No prefix cache: every run must compute its prompt (a cached one is answered at once).
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.server.cli", "serve", "--model", model,
                             "--port", str(port), "--log-level", "warning",
                             "--prompt-cache-ram-gb", "0", "--prompt-cache-disk-gb", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("kvserve serve did not become ready")


def _stream_once(url: str, ids: list[int], gen: int) -> tuple[float, float, int]:
    """(time to first token, seconds from first to last token, generated tokens)."""
    import json

    import httpx

    body = {"model": "default", "prompt": ids, "max_tokens": gen, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, first, last, n = time.perf_counter(), None, None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first, last = first or now, now
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return first - t0, last - first, n


def measure_server(model: str, ids: list[int], gen: int, reps: int) -> dict:
    """The real server over HTTP: prefill from time to first token, decode from the stream."""
    proc, url = _start_server(model)
    try:
        _stream_once(url, ids[:32], 4)  # warm-up
        runs = [_stream_once(url, ids, gen) for _ in range(reps)]
    finally:
        proc.terminate()
        proc.wait(60)
    pre = [len(ids) / ttft for ttft, _, _ in runs]
    dec = [(n - 1) / span for _, span, n in runs]
    return {"prefill_tps": max(pre), "decode_tps": max(dec), "prefill_slowest": min(pre),
            "decode_slowest": min(dec), "gen_tokens": min(n for _, _, n in runs)}


def load_ours(path: str, weight_format: str):
    """The engine's start-up sequence: load, choose + apply weights, fast path."""
    import mlx_lm

    from kvserve.server.engine.fastpath import install_cpu_ops, install_table_rope
    from kvserve.server.models.weights import apply_weight_format, choose_weight_format

    model, tokenizer = mlx_lm.load(path)
    t = time.perf_counter()
    choice = choose_weight_format(model, weight_format)
    chose_s = time.perf_counter() - t
    apply_weight_format(model, choice)
    ropes = install_table_rope(model)
    install_cpu_ops(model)
    return model, tokenizer, choice, chose_s, ropes


def ablations(model, ids: list[int], args) -> list[tuple[str, dict]]:
    """Our path without each piece, one at a time (the CPU primitives, then TableRoPE,
    removed last)."""
    import mlx.nn as nn

    from kvserve.server.engine import fastpath
    from kvserve.server.engine.fastpath import TableRoPE

    gen, reps, step = args.gen_tokens, args.reps, args.prefill_step
    rows = [("without async_eval pipelining (sync per token)",
             measure(model, ids, gen, reps, step, pipelined=False)),
            ("without last-position-only logits", measure(model, ids, gen, reps, step, last_only=False)),
            (f"with the prompt in one {len(ids)}-token chunk", measure(model, ids, gen, reps, len(ids)))]
    for _, mod in model.named_modules():
        if type(mod).__module__ == fastpath.__name__ and type(mod).__name__.startswith("Cpu"):
            mod.__class__ = mod.__class__.__bases__[0]  # the mlx-lm class it was made from
    rows.append(("without the CPU norm/linear/SwiGLU primitives", measure(model, ids, gen, reps, step)))
    for _, mod in model.named_modules():
        for name, child in mod.children().items():
            if isinstance(child, TableRoPE):
                setattr(mod, name, nn.RoPE(child.dims, base=child.base, scale=child.scale))
    rows.append(("without TableRoPE (mx.fast.rope)", measure(model, ids, gen, reps, step)))
    return rows


def machine_info(blas, choice, loads: list[tuple[float, float, float]]) -> list[tuple[str, str]]:
    import mlx.core as mx
    from importlib.metadata import version

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [("CPU", f"{cpu} ({platform.machine()})"), ("cores available", str(cores)),
            ("OS", f"{platform.system()} {platform.release()}"),
            ("Python", platform.python_version()),
            ("mlx / mlx-lm", f"{mx.__version__} / {version('mlx-lm')}"),
            ("BLAS (ours)", blas.describe()), ("OpenBLAS", blas.openblas or "-"),
            ("weight format (ours)", choice.describe()),
            ("load average (1/5/15 min) at start, end", "; ".join(
                "/".join(f"{x:.2f}" for x in la) for la in loads))]


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.1f}x" if b else "-"


def render(args, info, base: dict | None, ours: dict, extra, meta: dict) -> str:
    lines = ["# CPU speed: kvserve vs mlx_lm.generate", "",
             f"Measured {meta['date']} with:", "", "```", meta["command"], "```", "",
             "| machine | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in info]
    default = " (the default model, SmolLM2-135M-Instruct Q4_1 GGUF as converted by kvserve)"
    lines += ["", f"Model: `{args.model}`{default if meta['default_model'] else ''}. "
              f"Prompt: {meta['prompt_tokens']} tokens; "
              f"greedy decoding of {args.gen_tokens} tokens after it. Our prefill runs in "
              f"chunks of {args.prefill_step} tokens.", "",
              "| path | prefill tok/s | decode tok/s |", "| --- | ---: | ---: |"]
    if base:
        lines.append(f"| mlx_lm.generate (model as stored, stock MLX CPU) | "
                     f"{base['prefill_tps']:.1f} | {base['decode_tps']:.1f} |")
    for name, row in [("server: `kvserve serve`, HTTP streaming", ours)] + extra:
        lines.append(f"| kvserve {name} | {row['prefill_tps']:.1f} ({row['prefill_slowest']:.1f}) "
                     f"| {row['decode_tps']:.1f} ({row['decode_slowest']:.1f}) |")
    if base:
        lines += ["", f"Ratio kvserve / mlx_lm.generate: prefill "
                  f"{_ratio(ours['prefill_tps'], base['prefill_tps'])}, decode "
                  f"{_ratio(ours['decode_tps'], base['decode_tps'])}.", "",
                  f"mlx_lm.generate reported a {base['prompt_tokens']}-token prompt and "
                  f"{base['gen_tokens']} generated tokens (fastest of {base['runs']} run(s)); "
                  "it ran as:", "", "```",
                  base["command"], "```"]
    lines += ["", "The server row times the real `kvserve serve` process through the OpenAI API: prefill "
              "is prompt tokens over the time to the first streamed token, decode is the tokens after "
              f"the first over the time to the last ({ours['gen_tokens']} generated). The model loop row "
              "runs the same start-up in this process: `enable_fast_blas()` (the BLAS line above), the weight format "
              "measured at start-up, `TableRoPE` in place of `nn.RoPE`, the one-operation CPU norms, linears "
              "and SwiGLU (`install_cpu_ops`), prefill in chunks with logits for the "
              "last position only, greedy decoding pipelined with `mx.async_eval`." + (
                  " The rows \"without ...\" each leave one piece out (TableRoPE stays out in "
                  "the last row)." if args.ablate else "")]
    lines += ["", f"Weight format chosen in {meta['chose_s']:.2f} s at start-up; "
              f"{meta['ropes']} RoPE modules replaced by TableRoPE. Our numbers are the fastest "
              f"of {args.reps} runs each, the slowest in parentheses.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loads = [os.getloadavg()]  # other processes on the machine skew every number here
    blas = enable_fast_blas()
    default_model = args.model is None
    if default_model:
        from kvserve.configs import ModelConfig
        from kvserve.server.models.source import resolve_model

        args.model = str(resolve_model(None, ModelConfig().resolved_cache_dir()))
    model, tokenizer, choice, chose_s, ropes = load_ours(args.model, args.weight_format)
    text, ids = make_prompt(tokenizer, args.prompt_tokens)
    base = None if args.skip_mlx_lm else best_mlx_lm(args, text)
    loop = measure(model, ids, args.gen_tokens, args.reps, args.prefill_step)
    ours = measure_server(args.model, ids, args.gen_tokens, args.reps)
    extra = [("model loop in this process (no HTTP, no engine)", loop)]
    extra += ablations(model, ids, args) if args.ablate else []
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join(["python", "bench/speed.py"] + (argv if argv is not None else sys.argv[1:])),
            "prompt_tokens": len(ids), "chose_s": chose_s, "ropes": ropes,
            "default_model": default_model}
    loads.append(os.getloadavg())
    report = render(args, machine_info(blas, choice, loads), base, ours, extra, meta)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
