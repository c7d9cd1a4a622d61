#!/usr/bin/env python
"""Prompt reuse across requests and restarts: kvserve's prefix cache against mlx_lm.server.

    python bench/prefix.py [--model DIR] [--prompt-tokens 2000] [--turns 10] \\
        [--out docs/benchmarks/prefix-cache.md]

For each server, on the same model directory:

1. time to first token of a ~2,000-token prompt, cold (a fresh cache directory);
2. the same prompt again (a RAM hit for kvserve; mlx_lm.server's own prompt cache);
3. the server restarted, the same prompt again (kvserve: an SSD hit);
4. a scripted 10-turn chat (each turn adds the reply and a new question): the prompt tokens
   of each turn and the share the server reports as cached (kvserve only: mlx_lm.server
   does not report cached tokens).

Greedy, streamed, one request at a time. The prompt is real prose (the GPL text shipped
with kvserve), different from every earlier run's cache because the directory is new.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvserve.bench.cli import default_model_dir, machine, make_prompts, tokenizer_counter
from kvserve.bench.load import chat_bodies
from kvserve.bench.report import publish
from kvserve.bench.targets import Running, Target

QUESTIONS = ["What is this text about?", "Who does it protect?", "Name one obligation it creates.",
             "What happens if someone breaks it?", "Does it mention patents?", "Summarize that part.",
             "Is there a warranty?", "Who can change the license?", "What about libraries?",
             "Give a one-line summary of everything."]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--kv-scheme", default="fp16")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--out", help="write the Markdown report here")
    return p.parse_args(argv)


def ttft(running: Running, prompt: str) -> tuple[float, dict]:
    """Seconds to the first streamed token, and the usage the server reported."""
    return streamed_ttft(running, chat_bodies(running.model_name, [prompt], 8)[0])


def streamed_ttft(running: Running, body: dict, path: str = "/v1/chat/completions") -> tuple[float, dict]:
    """Send a streamed chat (or, with ``path`` /v1/completions, completion) ``body``:
    seconds to its first content token, and its usage."""
    start, first, usage = time.perf_counter(), None, {}
    with httpx.stream("POST", f"{running.base_url}{path}", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            texts = [c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices") or []]
            if first is None and any(texts):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError(f"{running.target.label}: no token streamed")
    return first, usage


def chat(running: Running, opening: str, turns: int) -> list[dict]:
    """Each turn: the prompt tokens and the cached tokens the server reported."""
    messages = [{"role": "system", "content": "You answer questions about the text the user shares."},
                {"role": "user", "content": opening}]
    rows = []
    for turn in range(turns):
        body = {"model": running.model_name, "messages": messages, "temperature": 0, "max_tokens": 48}
        answer = httpx.post(f"{running.base_url}/v1/chat/completions", json=body, timeout=600).json()
        usage = answer.get("usage", {})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        rows.append({"turn": turn + 1, "prompt_tokens": usage.get("prompt_tokens"), "cached": cached})
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}]
    return rows


def measure(target: Target, model_dir: Path, prompt: str, opening: str, turns: int) -> dict:
    out: dict = {"label": target.label}
    running = Running(target, model_dir)
    try:
        out["cold"], _ = ttft(running, prompt)
        out["warm"], out["warm_usage"] = ttft(running, prompt)
    finally:
        running.stop()
    running = Running(target, model_dir)
    try:
        out["restart"], out["restart_usage"] = ttft(running, prompt)
        out["chat"] = chat(running, opening, turns)
    finally:
        running.stop()
    return out


def render(rows: list[dict], args, model_dir: Path, argv: list[str]) -> str:
    lines = [f"# Prefix cache: a {args.prompt_tokens}-token prompt across requests and a restart", "",
             f"- date: {datetime.date.today().isoformat()}", f"- machine: {machine()}",
             f"- model: `{model_dir}`", f"- command: `python bench/prefix.py {shlex.join(argv)}`", "",
             "| server | TTFT cold (s) | TTFT repeated (s) | speed-up | TTFT after restart (s) | speed-up |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['cold']:.2f} | {r['warm']:.3f} | {r['cold'] / r['warm']:.1f}x "
                     f"| {r['restart']:.3f} | {r['cold'] / r['restart']:.1f}x |")
    ours = rows[0]
    lines += ["", f"Scripted {args.turns}-turn chat on `{ours['label']}` (each turn adds the reply and a "
              "new question; cached = `usage.prompt_tokens_details.cached_tokens`):", "",
              "| turn | prompt tokens | cached | share |", "|---|---|---|---|"]
    for t in ours["chat"]:
        share = t["cached"] / t["prompt_tokens"] if t["prompt_tokens"] else 0
        lines.append(f"| {t['turn']} | {t['prompt_tokens']} | {t['cached']} | {share:.1%} |")
    later = [t for t in ours["chat"] if t["turn"] >= 2]
    total = sum(t["prompt_tokens"] for t in later)
    lines += ["", f"Turns 2-{args.turns}: {sum(t['cached'] for t in later)} of {total} prompt tokens cached "
              f"({sum(t['cached'] for t in later) / total:.1%})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model_dir = Path(args.model) if args.model else default_model_dir()
    count = tokenizer_counter(model_dir)
    prompt = make_prompts(1, args.prompt_tokens, count)[0]
    opening = make_prompts(2, 400, count)[1]
    with tempfile.TemporaryDirectory(prefix="kvserve-prefix-bench-") as cache:
        ours = Target.parse(f"kvserve:--kv-scheme {args.kv_scheme} --prompt-cache-dir {cache}")
        targets = [ours] + ([] if args.skip_peer else [Target.parse("mlx_lm:")])
        rows = [measure(t, model_dir, prompt, opening, args.turns) for t in targets]
    for r in rows:  # the temporary directory is no part of the label readers compare
        r["label"] = r["label"].split(" --prompt-cache-dir")[0]
    report = render(rows, args, model_dir, argv)
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
