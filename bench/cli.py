"""``kvserve bench``: C concurrent streams against servers, with mlx_lm.server as the peer.

    kvserve bench --target "kvserve:--kv-scheme affine4" --target "mlx_lm:" \\
        --concurrency 8 --requests 16 --prompt-tokens 100 --max-tokens 64 --out docs/benchmarks/batching
    kvserve bench --url http://127.0.0.1:8000 --model default     # a server already running
    kvserve bench --llama-server ~/llama.cpp/build/bin/llama-server \
        --target "llama:-np 8" --target "kvserve:--kv-scheme fp16"   # llama.cpp on the same GGUF

Targets run one after another on the same model directory (default: the default model),
each warmed up with one request first. A server given by ``--url`` is warmed up the same
way, and its prompts are sized by its own count of tokens (the usage of a one-token
completion) unless ``--model`` names a model directory. ``--overhead`` adds, for kvserve
targets, a steady phase (``--concurrency`` streams that start together) whose inter-token
latency is compared with the model step alone (``kvserve.bench.step``). ``--out`` writes PATH.md and PATH.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path

import httpx

from kvserve.bench.load import chat_bodies, run_load
from kvserve.bench.report import markdown_table, write_chart
from kvserve.bench.targets import LlamaServer, Running, Target

_TEXT = files("kvserve.server.engine") / "data" / "eval-gpl-3.0.txt"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvserve bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append", default=[], help="kind[:args], kind kvserve, mlx_lm or llama")
    p.add_argument("--llama-server", help="llama-server binary for llama targets")
    p.add_argument("--gguf", help="GGUF file for llama targets (default: the one the model directory "
                                  "was converted from, when kvserve ships it)")
    p.add_argument("--url", help="drive a server that is already running instead")
    p.add_argument("--model", help="model directory for targets; with --url, the requests' model name, or a "
                                  "model directory whose tokenizer sizes the prompts (requests then name \"default\")")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--document-tokens", type=int, default=0,
                   help="long contexts: every request asks its own question about one shared document of "
                        "about this many tokens, which the warm-up puts in the prompt cache (replaces "
                        "--prompt-tokens)")
    p.add_argument("--baseline", help="label of the target the ratios refer to (default: the last; a label that "
                   "repeats means its last run)")
    p.add_argument("--overhead", action="store_true", help="measure kvserve's overhead over the model step")
    p.add_argument("--completions", action="store_true",
                   help="raw prompts through /v1/completions (chosen by itself for a model "
                        "directory without a chat template: a base model)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask every request for exactly --max-tokens (ignore_eos, which kvserve and "
                        "llama-server take; mlx_lm.server ignores it), so schemes whose greedy answers "
                        "end at different lengths are timed over the same tokens")
    p.add_argument("--out", help="write OUT.md and OUT.png")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    args.warm_prompt = "Say hello."
    return args


def make_prompts(n: int, tokens: int, count: Callable[[str], int] | None = None) -> list[str]:
    """``n`` different passages of about ``tokens`` tokens (distinct, so no server can
    answer one from another's prompt cache), as counted by ``count`` (a text's tokens:
    ``tokenizer_counter``, ``server_counter``), else by a rule of thumb (~1.4 tokens a word).

        >>> one_per_word = lambda text: len(text.split())
        >>> [len(p.split()) for p in make_prompts(2, 100, one_per_word)]  # 7 + 100 words
        [107, 107]
    """
    words = _TEXT.read_text().split()
    per = max(8, int(tokens * 0.72))  # English prose: ~1.4 tokens per word
    if count is not None:
        per = max(8, int(per * tokens / count(" ".join(words[:per]))))
    return [f"Summarize this passage in a few sentences:\n{' '.join(words[i * per:(i + 1) * per])}"
            for i in range(n)]


def document_prompts(n: int, tokens: int, count: Callable[[str], int] | None = None) -> tuple[list[str], str]:
    """``n`` chats over one shared document of about ``tokens`` tokens (RAG, code review, a
    long system prompt), each asking its own question, and one more prompt over the same
    document for the warm-up, which puts the document in the server's prompt cache: the
    measured requests then prefill only their question and decode over the long context.
    The document repeats the shipped text as often as it takes.

        >>> one_per_word = lambda text: len(text.split())
        >>> prompts, warm = document_prompts(2, 50, one_per_word)
        >>> [p.split("Question ")[1] for p in prompts]
        ['1: which words of the document come right after its 1st sentence?', \
'2: which words of the document come right after its 2nd sentence?']
        >>> len({p.split("Question ")[0] for p in [*prompts, warm]}), warm.split("Question ")[1][:2]
        (1, '0:')
    """
    words = _TEXT.read_text().split()
    per = max(8, int(tokens * 0.72))
    if count is not None:
        per = max(8, int(per * tokens / count(" ".join((words * (per // len(words) + 1))[:per]))))
    document = " ".join((words * (per // len(words) + 1))[:per])

    def ask(i: int) -> str:
        nth = {1: "st", 2: "nd", 3: "rd"}.get(i % 10 if i % 100 not in (11, 12, 13) else 0, "th")
        return f"{document}\n\nQuestion {i}: which words of the document come right after its {i}{nth} sentence?"

    return [ask(i + 1) for i in range(n)], ask(0)


def tokenizer_counter(model_dir: Path) -> Callable[[str], int]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(Path(model_dir))
    return lambda text: len(tok.encode(text))


def server_counter(url: str, model: str) -> Callable[[str], int]:
    """A text's tokens as the running server counts them: the prompt tokens its usage
    reports for the text sent as a raw completion prompt (one token generated)."""
    def count(text: str) -> int:
        r = httpx.post(f"{url}/v1/completions", timeout=300,
                       json={"model": model, "prompt": text, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens"])
    return count


def sized_prompts(args, count: Callable[[str], int] | None) -> list[str]:
    """The measured prompts: distinct passages, or with ``--document-tokens`` questions over
    one shared document (the warm-up's prompt goes to ``args.warm_prompt``)."""
    if args.document_tokens:
        prompts, args.warm_prompt = document_prompts(args.requests, args.document_tokens, count)
        return prompts
    return make_prompts(args.requests, args.prompt_tokens, count)


def request_model(model: str | None) -> str:
    """The ``model`` field of ``--url`` requests: a model directory given to size the prompts
    is sent as "default" (a server names its model after itself, not after a path here).

        >>> request_model(None), request_model("SmolLM2-135M-Instruct"), request_model(".")
        ('default', 'SmolLM2-135M-Instruct', 'default')
    """
    return "default" if not model or Path(model).is_dir() else model


def url_prompts(args) -> list[str]:
    """Prompts for ``--url``: sized by the model directory's tokenizer when ``--model`` is
    one, else by the server's own count; by the rule of thumb where the server cannot count."""
    if args.model and Path(args.model).is_dir():
        return sized_prompts(args, tokenizer_counter(Path(args.model)))
    try:
        count = server_counter(args.url, request_model(args.model))
        prompts = sized_prompts(args, count)
        print("bench: prompt sizes counted by the server", file=sys.stderr, flush=True)
        return prompts
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        print(f"bench: the server could not count tokens ({exc}); prompt sizes are estimated",
              file=sys.stderr, flush=True)
        return sized_prompts(args, None)


def warm_up(base_url: str, model: str, chat: bool, prompt: str = "Say hello.") -> None:
    """One request with a prompt outside the measured set, so that no server may answer
    from it later, and first-call costs (compiling, self-checks) stay out of the figures.
    With ``--document-tokens`` the prompt is the shared document with a question of its own:
    the document is then in the server's prompt cache, as it would be in a RAG service."""
    run_load(base_url, chat_bodies(model, [prompt], 8, chat), 1)


def has_chat_template(model_dir: Path) -> bool:
    """Whether the model's tokenizer formats chats (a base model's has no template)."""
    config = Path(model_dir) / "tokenizer_config.json"
    return (Path(model_dir) / "chat_template.jinja").is_file() or (
        config.is_file() and bool(json.loads(config.read_text()).get("chat_template")))


def default_model_dir(spec: str | None = None) -> Path:
    """The model directory ``kvserve serve --model spec`` serves (a shipped model's name is
    fetched and converted once; None: the default model)."""
    from kvserve.configs import ModelConfig
    from kvserve.server.models.source import resolve_model

    return Path(resolve_model(spec, ModelConfig().resolved_cache_dir()))


def source_gguf(model_dir: Path) -> Path:
    """The GGUF file ``model_dir`` was converted from, when it is one that kvserve ships
    (``kvserve.json`` names it)."""
    from kvserve.configs import ModelConfig
    from kvserve.server.models.registry import SHIPPED, fetch_gguf

    record = Path(model_dir) / "kvserve.json"
    name = json.loads(record.read_text()).get("source") if record.is_file() else None
    shipped = next((m for m in SHIPPED.values() if m.gguf == name), None)
    if shipped is None:
        raise SystemExit(f"kvserve bench: no GGUF known for {model_dir}; give --gguf PATH")
    return fetch_gguf(shipped, ModelConfig().resolved_cache_dir())


def llama_server(args, model_dir: Path, targets: list[Target]) -> LlamaServer | None:
    """The binary and GGUF for llama targets; None when there are none."""
    if not any(t.kind == "llama" for t in targets):
        return None
    if not args.llama_server or not Path(args.llama_server).is_file():
        raise SystemExit("kvserve bench: llama targets need --llama-server PATH (a llama-server binary)")
    return LlamaServer(Path(args.llama_server), Path(args.gguf) if args.gguf else source_gguf(model_dir))


def bench_target(target: Target, model_dir: Path, args, prompts: list[str], llama: LlamaServer | None = None) -> dict:
    print(f"bench: starting {target.label}", file=sys.stderr, flush=True)
    running = Running(target, model_dir, llama=llama)
    try:
        warm_up(running.base_url, running.model_name, args.chat, args.warm_prompt)
        result = run_load(running.base_url,
                          chat_bodies(running.model_name, prompts, args.max_tokens, args.chat, args.ignore_eos),
                          args.concurrency)
        row = {"label": target.label, **result.summary()}
        if args.overhead and target.kind == "kvserve":
            row["overhead"] = steady_itl(running, prompts, args)
        row["peak_rss"], row["ready_s"] = running.peak_rss(), running.ready_s
        start_up = [line for line in running.output().splitlines() if "warm-up:" in line or "device:" in line]
    finally:
        running.stop()
    print(f"bench: {target.label}: {row['output_tok_s']:.1f} output tok/s, {row['errors']} errors, "
          f"TTFT p99 {_ms(row['ttft_p99'])}, TPOT p50 {_ms(row['tpot_p50'])}, ready in {row['ready_s']:.1f} s",
          *start_up, sep="\n  ", file=sys.stderr, flush=True)
    return row


def _ms(seconds: float | None) -> str:
    """A latency for the progress line, printed as each target finishes, so a run cut
    short still shows the targets it measured.

        >>> _ms(0.0441), _ms(None)
        ('44 ms', '-')
    """
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def steady_itl(running: Running, prompts: list[str], args) -> dict:
    """All streams start together with equal prompts lengths: median gap between tokens."""
    bodies = chat_bodies(running.model_name, prompts[: args.concurrency], 2 * args.max_tokens, args.chat)
    result = run_load(running.base_url, bodies, args.concurrency)
    return {"itl_p50": result.summary()["itl_p50"]}


def add_model_steps(rows: list[dict], targets: list[Target], model_dir: Path, args) -> None:
    from kvserve.bench.step import model_step_seconds

    for row, target in zip(rows, targets):
        if "overhead" not in row:
            continue
        scheme = target.args[target.args.index("--kv-scheme") + 1] if "--kv-scheme" in target.args else "fp16"
        step = model_step_seconds(model_dir, scheme, batch=args.concurrency,
                                  context=args.prompt_tokens + args.max_tokens)
        row["overhead"].update(model_step_s=step, ratio=row["overhead"]["itl_p50"] / step)


def machine() -> str:
    cpu = platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name")) + f" ({platform.machine()})"
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def render(rows: list[dict], args, model: str, argv: list[str], chart: str | None) -> str:
    from importlib.metadata import version

    baseline = args.baseline or rows[-1]["label"]
    prompts = (f"one shared document of about {args.document_tokens} tokens (in the prompt cache from the "
               "warm-up), each request asking its own question about it" if args.document_tokens
               else f"prompts of about {args.prompt_tokens} tokens (all different)")
    lines = [f"# Concurrent streams: {args.concurrency} streams, {args.requests} requests", "",
             f"- date: {datetime.date.today().isoformat()}", f"- machine: {machine()}",
             f"- mlx {version('mlx')}, mlx-lm {version('mlx-lm')}", f"- model: `{model}`",
             f"- {prompts}, {'exactly' if args.ignore_eos else 'up to'} {args.max_tokens} output tokens"
             f"{' (ignore_eos)' if args.ignore_eos else ''}, greedy, streamed, through "
             f"`{'/v1/chat/completions' if args.chat else '/v1/completions'}`",
             f"- command: `kvserve bench {shlex.join(argv)}`", "",
             markdown_table(rows, baseline), "",
             f"Ratios are output tokens/s against `{baseline}`. TTFT is from sending the request "
             "to the first streamed text; TPOT is (E2E - TTFT) / (tokens - 1); ITL is the gap "
             "between streamed chunks. Peak RSS is the server processes' resident-set high-water "
             "mark (`VmHWM`), model loading included."]
    overhead = [r for r in rows if "model_step_s" in r.get("overhead", {})]
    if overhead:
        lines += ["", "Steady decoding (all streams start together): the inter-token latency "
                  "clients see against the model step alone, measured in-process on the same "
                  "model, scheme and batch size.", "",
                  "| server | ITL p50 (ms) | model step (ms) | server adds |", "|---|---|---|---|"]
        for r in overhead:
            o = r["overhead"]
            lines.append(f"| {r['label']} | {o['itl_p50'] * 1000:.1f} | {o['model_step_s'] * 1000:.1f} "
                         f"| {(o['ratio'] - 1) * 100:+.1f}% |")
    if chart:
        lines += ["", f"![chart]({chart})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.url:
        prompts = url_prompts(args)
        args.chat = not args.completions
        warm_up(args.url, request_model(args.model), args.chat, args.warm_prompt)
        result = run_load(args.url, chat_bodies(request_model(args.model), prompts, args.max_tokens,
                                                args.chat, args.ignore_eos), args.concurrency)
        rows = [{"label": args.url, **result.summary()}]
        model = args.model or "default"
    else:
        if not args.target:
            print("kvserve bench: give --url or at least one --target", file=sys.stderr)
            return 2
        targets = [Target.parse(t) for t in args.target]
        labels = [t.label for t in targets]
        if args.baseline and args.baseline not in labels:  # found out now, not after the runs
            print(f"kvserve bench: --baseline {args.baseline!r} is none of the targets' labels: "
                  f"{', '.join(dict.fromkeys(labels))}", file=sys.stderr)
            return 2
        model_dir = Path(args.model) if args.model else default_model_dir()
        args.chat = not args.completions and has_chat_template(model_dir)
        prompts = sized_prompts(args, tokenizer_counter(model_dir))
        llama = llama_server(args, model_dir, targets)
        rows = [bench_target(t, model_dir, args, prompts, llama) for t in targets]
        if args.overhead:
            add_model_steps(rows, targets, model_dir, args)
        model = str(model_dir)
    chart = None
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        title = f"{args.concurrency} concurrent streams, {args.prompt_tokens}-token prompts, {args.max_tokens} output tokens"
        chart = out.with_suffix(".png").name if write_chart(rows, out.with_suffix(".png"), title) else None
        out.with_suffix(".md").write_text(render(rows, args, model, argv, chart))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(markdown_table(rows, args.baseline or rows[-1]["label"]))
    return 0 if all(r["errors"] == 0 for r in rows) else 1
