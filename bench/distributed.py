"""What does splitting a model across processes cost: throughput, TTFT and bytes per step of
``kvserve serve --distributed`` (2 processes, ring backend over loopback) against one process.

    python bench/distributed.py [--targets "kvserve:" "kvserve-tp2:"] [--kv-scheme fp16]
        [--out docs/benchmarks/distributed.md]

On one machine this measures communication, not a speed-up: the two processes share the
machine's cores and memory bandwidth, and every layer ends in an ``all_sum`` over TCP.

Scenarios (the default model unless ``--model``; both targets in one weight format, dense
f32, without a prefix cache so every prompt is computed):
  one     one stream at a time: 3 chats of ~100 prompt tokens, 128 output tokens each;
  eight   8 concurrent streams: 16 chats of ~100 prompt tokens, 64 output tokens each.
Reported per scenario: output tok/s, the median stream's decode tok/s, TTFT p50 and p99.
Bytes per decode step: the loopback interface's byte counter (``/proc/net/dev``, Linux)
around one chat answered with 1 token and around the same chat answered with 65 (greedy,
same prompt, no prefix cache: the same prefill), the difference divided by the extra
tokens; the one-process target's figure is its HTTP bytes alone. It includes TCP/IP
headers; the payload the collectives carry is printed beside it: per layer two ``all_sum``
of (rows, hidden) float32 values (a ring of W ranks sends 2(W-1) times their bytes in all),
plus the plan message (a 4 KiB frame per rank, ``all_gather``: W(W-1) frames sent).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import httpx

from kvserve.bench.cli import default_model_dir, machine
from kvserve.bench.load import run_load
from kvserve.bench.report import publish
from kvserve.bench.targets import Running, Target

COMMON = "--weight-format dense-f32 --prompt-cache-ram-gb 0 --prompt-cache-disk-gb 0"
TOPICS = ["the sea", "a mountain village", "a clockmaker", "winter", "a library", "trains",
          "a garden", "the moon", "bees", "a lighthouse", "rivers", "a bakery", "owls", "deserts",
          "a chess game", "autumn"]


def body(model: str, i: int, max_tokens: int) -> dict:
    text = (f"You are a careful writer. Topic {i}: {TOPICS[i % len(TOPICS)]}. Write a calm, detailed "
            "description of it for a travel magazine, in plain sentences, with no lists, no headings, "
            "and no questions. Mention colours, sounds and the time of day, and end with one sentence "
            "about why a visitor would remember it.")
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


def loopback_bytes() -> int | None:
    """Bytes received on the loopback interface so far (Linux), or None."""
    try:
        for line in open("/proc/net/dev"):
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    except OSError:
        pass
    return None


def decode_step_bytes(running: Running) -> float | None:
    """Loopback bytes per decode step of one row (see the module's docstring)."""
    moved = []
    for max_tokens in (1, 65):
        request = {**body(running.model_name, 7, max_tokens), "stream": False}
        request.pop("stream_options")
        before = loopback_bytes()
        if before is None:
            return None
        reply = httpx.post(f"{running.base_url}/v1/chat/completions", json=request, timeout=600).json()
        moved.append((loopback_bytes() - before, reply["usage"]["completion_tokens"]))
    (short, one), (long, many) = moved
    return (long - short) / (many - one)


def run_scenario(running: Running, scenario: str) -> dict:
    count, concurrency, max_tokens = (3, 1, 128) if scenario == "one" else (16, 8, 64)
    bodies = [body(running.model_name, i, max_tokens) for i in range(count)]
    result = run_load(running.base_url, bodies, concurrency)
    decode = [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in result.ok if r.output_tokens > 1 and r.e2e > r.ttft]
    s = result.summary()
    return {"target": running.target.label, "scenario": scenario, "requests": count, "errors": result.errors,
            "output_tok_s": s["output_tok_s"], "decode_tok_s": statistics.median(decode) if decode else None,
            "ttft_p50": s["ttft_p50"], "ttft_p99": s["ttft_p99"], "world": running.target.world}


def measure(target: Target, model_dir: Path) -> list[dict]:
    print(f"distributed: starting {target.label}", file=sys.stderr, flush=True)
    running = Running(target, model_dir)
    try:
        run_load(running.base_url, [body(running.model_name, 99, 8)], 1)  # warm-up
        rows = [run_scenario(running, s) for s in ("one", "eight")]
        rows[0]["step_bytes"] = decode_step_bytes(running)
        for r in rows:
            print(f"distributed: {target.label} {r['scenario']}: {r['output_tok_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
        return rows
    finally:
        running.stop()


def model_shape(model_dir: Path) -> tuple[int, int]:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return int(config["num_hidden_layers"]), int(config["hidden_size"])


def render(rows: list[dict], model_dir: Path, argv: list[str]) -> str:
    base = {r["scenario"]: r for r in rows if r["world"] == 1}
    lines = [f"Machine: {machine()}. Model: `{model_dir.name}`.",
             f"Command: `python bench/distributed.py {' '.join(argv)}`", "",
             "| scenario | server | output tok/s | vs 1 process | decode tok/s (median stream) | "
             "TTFT p50 | TTFT p99 | errors |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = r["output_tok_s"] / base[r["scenario"]]["output_tok_s"] if r["scenario"] in base else float("nan")
        decode = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"
        lines.append(f"| {r['scenario']} | `{r['target']}` | {r['output_tok_s']:.1f} | {ratio:.2f}x | {decode} | "
                     f"{r['ttft_p50']:.2f} s | {r['ttft_p99']:.2f} s | {r['errors']} |")
    lines += ["", "What this means: both processes run on the same machine, so they share its cores (one each "
              "here) and its memory bandwidth, and every layer ends in two all_sum over TCP on loopback. "
              "It measures what splitting costs, not a speed-up: on one machine a split model can only "
              "be slower than one process with every core, except where one process leaves cores idle "
              "(prefill of one prompt: TTFT). Across machines each process has its own cores and "
              "bandwidth, and the bytes below cross the link instead of loopback.",
              "Runs on this VM vary from one to the next (by up to a quarter for one stream); compare rows of one run."]
    layers, hidden = model_shape(model_dir)
    lines += ["", "| server | loopback bytes per decode step (one row) | collective payload |",
              "| --- | ---: | ---: |"]
    for r in rows:
        if r.get("step_bytes") is None:
            continue
        w = r["world"]
        payload = layers * 2 * 2 * (w - 1) * hidden * 4 + 4096 * w * (w - 1)
        formula = f"{layers} layers x 2 all_sum x {2 * (w - 1)} x {hidden} float32 + plan frames = " \
                  f"{payload / 1024:.0f} KiB" if w > 1 else "-"
        lines.append(f"| `{r['target']}` | {r['step_bytes'] / 1024:.1f} KiB | {formula} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: the default model)")
    parser.add_argument("--kv-scheme", default="fp16")
    parser.add_argument("--targets", nargs="+", default=["kvserve:", "kvserve-tp2:"])
    parser.add_argument("--out", help="write the Markdown table here too")
    args = parser.parse_args(argv)
    model_dir = Path(args.model) if args.model else default_model_dir()
    targets = [Target.parse(f"{t} {COMMON} --kv-scheme {args.kv_scheme}") for t in args.targets]
    rows = [row for t in targets for row in measure(t, model_dir)]
    table = render(rows, model_dir, argv)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
