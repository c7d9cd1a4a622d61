"""Soak test: concurrent streams with random aborts for a long time, watching for leaks and hangs.

``--streams`` client threads (default 8) each send streaming chat completions back to back;
a share of them (``--abort-rate``) hang up after a random number of tokens. Every
``--sample-s`` seconds the server's RSS (from ``/proc``) is recorded next to what
``/metrics`` says holds memory: KV bytes, the prefix cache's RAM tier, MLX's buffers in use
and in its buffer cache, and the bytes malloc holds free in its arenas. At the end the
clients stop, the server must drain to zero requests and zero KV bytes, and it is stopped
with SIGTERM (exit code 0 expected).

Reported: requests completed / aborted / failed, hung requests (no byte for ``--hang-s``
seconds), RSS growth after the warm-up, KV bytes when idle, and a table over time.

Example (the full run on the default model; ``--minutes 5`` for a short one):
    KVSERVE_BLAS_THREADS=1 python bench/soak.py --minutes 20 --out docs/benchmarks/soak.md

    >>> growth_pct([100, 102, 101], warm_index=0)
    2.0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvserve.bench.targets import Running, Target

PROMPTS = ["Tell me a story about a lighthouse.", "Explain how bread rises.",
           "List five facts about the moon.", "Write a short poem about winter.",
           "What is a prime number?", "Describe a busy train station.",
           "How do bees make honey?", "Give advice for a first job interview."]


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """``VmRSS`` (all resident memory), ``RssAnon`` (heap: where a leak shows) or ``RssFile``
    (mapped files: weights, and prefix-cache files read back from disk)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} line")


def metrics(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def kv_bytes(values: dict[str, float]) -> float:
    return sum(v for k, v in values.items() if k.startswith("kvserve_kv_cache_bytes"))


def prefix_ram_bytes(values: dict[str, float]) -> float:
    return sum(v for k, v in values.items() if k.startswith("kvserve_prefix_cache_ram_bytes"))


# Sample columns read from /metrics, in MiB (a gauge the server does not report reads 0).
MEMORY_GAUGES = {"mlx_active_mib": "kvserve_mlx_active_memory_bytes",
                 "mlx_cache_mib": "kvserve_mlx_cache_memory_bytes",
                 "heap_free_mib": "kvserve_heap_free_bytes"}


def memory_mib(values: dict[str, float]) -> dict[str, float]:
    """
    >>> memory_mib({"kvserve_mlx_cache_memory_bytes": 2**25})["mlx_cache_mib"]
    32.0
    """
    return {column: values.get(name, 0.0) / 2**20 for column, name in MEMORY_GAUGES.items()}


def warm_index(prefix_mib: list[float], fraction: float) -> int:
    """The RSS baseline sample: after ``fraction`` of the run, and not before the prefix
    cache's RAM tier has filled to its budget (a bounded cache filling up is not a leak).

    >>> warm_index([0, 0, 0, 0], 0.25), warm_index([10, 50, 99, 100, 100, 99, 100, 100], 0.25)
    (1, 2)
    """
    fill = max(prefix_mib, default=0.0)
    full = next((i for i, v in enumerate(prefix_mib) if v >= 0.98 * fill), 0) if fill else 0
    return min(len(prefix_mib) - 1, max(int(len(prefix_mib) * fraction), full))


def growth_pct(rss: list[int], warm_index: int) -> float:
    """Growth of the largest RSS after the warm-up sample over that sample, in percent."""
    base = rss[warm_index]
    return 100.0 * (max(rss[warm_index:]) - base) / base


@dataclass
class Tally:
    completed: int = 0
    aborted: int = 0
    failed: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts) -> None:
        with self.lock:
            for name, value in counts.items():
                if isinstance(value, str):
                    getattr(self, name).append(value)
                else:
                    setattr(self, name, getattr(self, name) + value)


def one_stream(base_url: str, rng: random.Random, abort_rate: float, hang_s: float, tally: Tally) -> None:
    """One streaming chat; hangs up after a random number of tokens with ``abort_rate``."""
    leave_after = rng.randint(1, 40) if rng.random() < abort_rate else None
    body = {"model": "default", "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(16, 160), "temperature": 0.8, "stream": True}
    seen, finished, done = 0, False, False
    try:
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                          timeout=httpx.Timeout(10, read=hang_s)) as response:
            if response.status_code != 200:
                return tally.add(failed=f"status {response.status_code}: {response.read()[:200]!r}")
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return tally.add(failed=f"stream error: {chunk['error']}")
                    for choice in chunk.get("choices", []):
                        seen += bool(choice.get("delta", {}).get("content"))
                        finished |= choice.get("finish_reason") is not None
                    if leave_after is not None and seen >= leave_after:
                        return tally.add(aborted=1, tokens=seen)
    except httpx.ReadTimeout:
        return tally.add(hung=f"no data for {hang_s} s after {seen} tokens")
    except httpx.HTTPError as exc:
        return tally.add(failed=f"{type(exc).__name__}: {exc}")
    if done and finished:
        tally.add(completed=1, tokens=seen)
    else:
        tally.add(failed=f"stream ended without finish_reason/[DONE] after {seen} tokens")


def soak(base_url: str, pid: int, minutes: float, streams: int, abort_rate: float, hang_s: float,
         sample_s: float, seed: int, log) -> dict:
    tally, stop = Tally(), threading.Event()

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while not stop.is_set():
            one_stream(base_url, rng, abort_rate, hang_s, tally)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    started = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    while (elapsed := time.monotonic() - started) < minutes * 60:
        time.sleep(min(sample_s, max(0.0, minutes * 60 - elapsed)))
        values = metrics(base_url)
        sample = {"t_s": round(time.monotonic() - started), "rss_mib": rss_bytes(pid) / 2**20,
                  "anon_mib": rss_bytes(pid, "RssAnon") / 2**20, "file_mib": rss_bytes(pid, "RssFile") / 2**20,
                  **memory_mib(values),
                  "kv_mib": kv_bytes(values) / 2**20, "prefix_mib": prefix_ram_bytes(values) / 2**20,
                  "running": values.get("kvserve_requests_running", 0),
                  "completed": tally.completed, "aborted": tally.aborted,
                  "failed": len(tally.failed), "hung": len(tally.hung)}
        samples.append(sample)
        log(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in sample.items()))
    stop.set()
    for t in threads:
        t.join(hang_s + 30)
    idle = _wait_idle(base_url)
    return {"tally": tally, "samples": samples, "idle": idle, "rss_idle_mib": rss_bytes(pid) / 2**20}


def _wait_idle(base_url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        inflight = httpx.get(f"{base_url}/health", timeout=10).json().get("inflight", -1)
        if inflight == 0 or time.monotonic() > deadline:
            values = metrics(base_url)
            return {"inflight": inflight, "kv_bytes": kv_bytes(values),
                    "running": values.get("kvserve_requests_running"),
                    "waiting": values.get("kvserve_requests_waiting")}
        time.sleep(0.2)


def report(result: dict, args, exit_code: int) -> tuple[str, bool]:
    tally, samples, idle = result["tally"], result["samples"], result["idle"]
    rss = [s["rss_mib"] for s in samples]
    warm = warm_index([s["prefix_mib"] for s in samples], args.warmup_fraction)
    growth = growth_pct(rss, warm) if rss else float("nan")
    ok = (not tally.hung and not tally.failed and idle["kv_bytes"] == 0 and idle["inflight"] == 0
          and growth < 5.0 and exit_code == 0)
    step = max(1, len(samples) // 20)

    def spread(column: str) -> str:
        values = [s[column] for s in samples[warm:]]
        return f"{min(values):.1f} -> {max(values):.1f}"

    rows = "\n".join(f"| {s['t_s']} | {s['rss_mib']:.1f} | {s['anon_mib']:.1f} | {s['file_mib']:.1f} | "
                     f"{s['mlx_active_mib']:.1f} | {s['mlx_cache_mib']:.1f} | {s['heap_free_mib']:.1f} | "
                     f"{s['kv_mib']:.2f} | {s['prefix_mib']:.0f} | "
                     f"{s['running']:.0f} | "
                     f"{s['completed']} | {s['aborted']} | {s['failed']} | {s['hung']} |"
                     for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []))
    text = f"""{args.minutes:g} minutes, {args.streams} concurrent streams, {args.abort_rate:.0%} hang up after 1-40 tokens,
max_tokens 16-160, temperature 0.8, model `{args.model or 'default'}`, KV scheme `{args.kv_scheme}`.

- requests: **{tally.completed}** completed, **{tally.aborted}** aborted by the client,
  **{len(tally.failed)}** failed, **{len(tally.hung)}** hung (no byte for {args.hang_s:g} s); {tally.tokens} tokens streamed
- RSS: {rss[warm]:.1f} MiB after the warm-up (sample at {samples[warm]['t_s']} s: past {args.warmup_fraction:.0%}
  of the run, and the prefix cache's RAM tier within 2% of its largest, {samples[warm]['prefix_mib']:.0f} MiB), largest after it
  {max(rss[warm:]):.1f} MiB (**{growth:+.2f}%**), at the end {rss[-1]:.1f} MiB, idle {result['rss_idle_mib']:.1f} MiB;
  anonymous memory {samples[warm]['anon_mib']:.1f} -> {max(s['anon_mib'] for s in samples[warm:]):.1f} MiB
  (**{growth_pct([s['anon_mib'] for s in samples], warm):+.2f}%**), mapped files
  {samples[warm]['file_mib']:.1f} -> {max(s['file_mib'] for s in samples[warm:]):.1f} MiB
- after the warm-up sample, smallest -> largest: {spread('mlx_active_mib')} MiB of MLX buffers in use,
  {spread('mlx_cache_mib')} MiB in MLX's buffer cache, {spread('heap_free_mib')} MiB free in malloc's arenas,
  {spread('kv_mib')} MiB of live KV caches
- idle after the clients stopped: {idle['inflight']} in flight, **{idle['kv_bytes']:.0f} KV bytes**,
  {idle['running']:.0f} running, {idle['waiting']:.0f} waiting
- server exit code after SIGTERM: {exit_code}
- verdict: **{'pass' if ok else 'FAIL'}** (0 hung, 0 failed, 0 KV bytes idle, RSS growth < 5%, exit 0)

| t (s) | RSS (MiB) | anon | file | MLX active | MLX cache | heap free | KV (MiB) | prefix cache RAM (MiB) | running | completed | aborted | failed | hung |
| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{rows}
"""
    for line in (tally.failed + tally.hung)[:10]:
        text += f"\n    {line}"
    return text, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--abort-rate", type=float, default=0.3)
    parser.add_argument("--hang-s", type=float, default=120, help="no byte for this long = hung")
    parser.add_argument("--sample-s", type=float, default=15)
    parser.add_argument("--warmup-fraction", type=float, default=0.25,
                        help="share of the run before the RSS baseline is taken (later if the "
                             "prefix cache's RAM tier is still filling)")
    parser.add_argument("--model", help="passed to kvserve serve (default: the default model)")
    parser.add_argument("--kv-scheme", default="fp16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-args", default="", help="more flags for kvserve serve, quoted")
    parser.add_argument("--out", help="write the markdown report here")
    args = parser.parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    serve_args = ["--kv-scheme", args.kv_scheme, *(["--model", args.model] if args.model else []),
                  *shlex.split(args.serve_args)]
    os.environ.setdefault("KVSERVE_BLAS_THREADS", "1")  # the server shares 2 cores with the clients
    log(f"starting kvserve serve {' '.join(serve_args)}")
    server = Running(Target("kvserve", tuple(serve_args)), None, timeout=900)
    try:
        result = soak(server.base_url, server.pid, args.minutes, args.streams, args.abort_rate,
                      args.hang_s, args.sample_s, args.seed, log)
    finally:
        code = server.stop(timeout=60)
    text, ok = report(result, args, code)
    print(text)
    if args.out:
        command = " ".join(["python bench/soak.py", *(argv if argv is not None else sys.argv[1:])])
        Path(args.out).write_text(f"# Soak\n\n`KVSERVE_BLAS_THREADS=1 {command}`\n\n{text}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
