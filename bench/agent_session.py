#!/usr/bin/env python
"""An agent's session against the server: how much of each turn's prompt the prefix cache
serves, across a restart, and the time to first token per turn beside mlx_lm.server.

    python bench/agent_session.py [--model DIR] [--turns 10] [--restart-after 5] \\
        [--out docs/benchmarks/agent-session.md]

The script is a coding agent's loop: a ~2,000-token system prompt (instructions and eight
tools with JSON schemas), a task, then per turn the agent's tool call and the tool's result
fed back, and a request for the next step (greedy, streamed, 16 tokens). The calls and
results are fixed, so both servers see the same conversation. The conversation goes out
already in the Hermes convention (tools listed in the system prompt, calls in
``<tool_call>`` tags, results in ``<tool_response>`` turns), which is what kvserve renders
from OpenAI's ``tools`` / ``tool_calls`` / ``tool`` messages for a template without tool
calling: both servers then get identical prompt tokens, and mlx_lm.server (which passes
``tools`` to a template that ignores them) gets the tools at all.

Each server is restarted after ``--restart-after`` turns: kvserve keeps its prefix cache on
disk, mlx_lm.server's prompt cache lives in memory. Then two new sessions start: the same
system prompt and tools, other tasks.

``--template gemma`` is for a model without a chat template (Gemma 3 270M's GGUF is the base
model's): the bench renders the conversation itself in Gemma's turn format and sends it to
``/v1/completions``, so the server sees no messages, only text.

``--api responses`` runs the session through OpenAI's Responses API as a stateful client
does: each turn sends the instructions and only its new input (the task, then each tool's
result as the user's message) with ``previous_response_id``; the server keeps the
conversation, the model's own replies included, across the restart. mlx_lm.server has no
Responses API: no peer runs.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvserve.bench.cli import default_model_dir, machine
from kvserve.bench.prefix import streamed_ttft
from kvserve.bench.report import publish
from kvserve.bench.targets import Running, Target
from kvserve.server.http.conversation import render_messages
from kvserve.server.http.tools import ToolFormat

TOOL_NAMES = [("read_file", "Read a file of the repository.", {"path": "string"}),
              ("list_dir", "List a directory.", {"path": "string"}),
              ("grep", "Search the repository for a regular expression.", {"pattern": "string", "path": "string"}),
              ("run_tests", "Run the test suite, or one test file.", {"target": "string"}),
              ("edit_file", "Replace a unique snippet of a file.", {"path": "string", "old": "string", "new": "string"}),
              ("create_file", "Create a file with the given content.", {"path": "string", "content": "string"}),
              ("git_diff", "Show the working tree's changes.", {}),
              ("ask_user", "Ask the user a question when the task is unclear.", {"question": "string"})]

RULES = [
    "Read before you edit: open every file you change, and the tests that cover it.",
    "Keep changes minimal and focused on the task; do not reformat unrelated code.",
    "Run the tests after each change and read the failures before changing anything else.",
    "Never invent file contents, function names or test results; call a tool to find out.",
    "Prefer small functions, clear names and comments that explain why, not what.",
    "When a test fails, find the cause: do not weaken the test to make it pass.",
    "Explain each step in one short sentence before calling a tool.",
    "Stop and ask the user when the task is ambiguous or a change would delete data.",
]

CALLS = [("list_dir", {"path": "src"}), ("read_file", {"path": "src/parser.py"}),
         ("grep", {"pattern": "def parse_date", "path": "src"}), ("read_file", {"path": "tests/test_parser.py"}),
         ("run_tests", {"target": "tests/test_parser.py"}),
         ("edit_file", {"path": "src/parser.py", "old": "fmt = '%d/%m/%Y'", "new": "fmt = '%Y-%m-%d'"}),
         ("run_tests", {"target": "tests/test_parser.py"}), ("git_diff", {}),
         ("read_file", {"path": "README.md"}), ("run_tests", {"target": "tests"})]


def tools() -> list[dict]:
    out = []
    for name, description, fields in TOOL_NAMES:
        props = {k: {"type": v, "description": f"The {k} argument of {name}."} for k, v in fields.items()}
        out.append({"type": "function", "function": {"name": name, "description": description, "parameters": {
            "type": "object", "properties": props, "required": list(fields), "additionalProperties": False}}})
    return out


def system_prompt(target_tokens: int) -> str:
    """Agent instructions, repeated with numbered sections up to about ``target_tokens``."""
    parts, n = ["You are a careful software engineer working in a Python repository."], 1
    while sum(len(p) for p in parts) < target_tokens * 3:  # ~3.5 characters per token, tools add more
        parts.append(f"Section {n}. " + " ".join(RULES[(n + i) % len(RULES)] for i in range(4)))
        n += 1
    return "\n\n".join(parts)


def tool_result(turn: int) -> str:
    lines = [f"{turn * 10 + i:4d}  def helper_{turn}_{i}(value):  # parses field {i} of record {turn}"
             for i in range(4)]
    return "\n".join(lines)


TASKS = ["The date parser rejects ISO dates like 2024-05-01. Fix it.",
         "Add a --verbose flag to the command line tool and document it in the README.",
         "The test suite is slow; find the slowest test and make it faster."]


def gemma_text(messages: list[dict]) -> str:
    """Gemma's turn format, the system prompt opening the first user turn (as Gemma 3's own
    template renders it); the tokenizer adds ``<bos>``."""
    out, system = [], ""
    for m in messages:
        if m["role"] == "system":
            system = m["content"] + "\n\n"
            continue
        role = "model" if m["role"] == "assistant" else "user"
        out.append(f"<start_of_turn>{role}\n{system}{m['content']}<end_of_turn>\n")
        system = ""
    return "".join(out) + "<start_of_turn>model\n"


def conversation(turn: int, prompt_tokens: int, task: int = 0) -> list[dict]:
    """Messages up to the request of ``turn`` (0-based), rendered in the Hermes convention."""
    messages = [{"role": "system", "content": system_prompt(prompt_tokens)},
                {"role": "user", "content": TASKS[task]}]
    for t in range(turn):
        name, args = CALLS[t % len(CALLS)]
        messages += [{"role": "assistant", "content": f"Step {t + 1}.", "tool_calls": [
                         {"id": f"call_{t}", "type": "function", "function": {"name": name, "arguments": args}}]},
                     {"role": "tool", "tool_call_id": f"call_{t}", "content": tool_result(t)}]
    return render_messages(messages, tools(), ToolFormat.hermes())


def system_prompt_tokens(model_dir: Path, prompt_tokens: int, template: str | None) -> list[int]:
    """The tokens both tasks' prompts share: the longest common start of the two renderings."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    a, b = (tokenizer.encode(gemma_text(conversation(0, prompt_tokens, t)))
            if template == "gemma" else
            tokenizer.apply_chat_template(conversation(0, prompt_tokens, t), add_generation_prompt=True)
            for t in (0, 1))
    return a[:next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)]


def one_turn(running: Running, messages: list[dict], template: str | None = None) -> dict:
    body = {"model": running.model_name, "temperature": 0, "max_tokens": 16,
            "stream": True, "stream_options": {"include_usage": True}}
    if template == "gemma":
        body["prompt"] = gemma_text(messages)
        first, usage = streamed_ttft(running, body, "/v1/completions")
    else:
        body["messages"] = messages
        first, usage = streamed_ttft(running, body)
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": first, "prompt_tokens": usage.get("prompt_tokens"), "cached": details.get("cached_tokens")}


def session(target: Target, model_dir: Path, turns: int, restart_after: int, prompt_tokens: int,
            template: str | None = None) -> list[dict]:
    rows, running = [], Running(target, model_dir)
    try:
        for turn in range(turns):
            if turn == restart_after:
                running.stop()
                running = Running(target, model_dir)
            row = one_turn(running, conversation(turn, prompt_tokens), template)
            rows.append({"turn": turn + 1, "restarted": turn == restart_after, **row})
        for task in (1, 2):  # other sessions with the same system prompt and tools
            row = one_turn(running, conversation(0, prompt_tokens, task), template)
            rows.append({"turn": f"new session {task}", "restarted": False, **row})
    finally:
        running.stop()
    return rows


def responses_session(target: Target, model_dir: Path, turns: int, restart_after: int,
                      prompt_tokens: int) -> list[dict]:
    """Turn by turn through ``/v1/responses``, each turn only its new input after
    ``previous_response_id``: the prompt tokens, the cached ones, the input sent (characters)
    and the seconds to the whole 16-token reply."""
    rows, running, previous = [], Running(target, model_dir), None
    try:
        for turn in range(turns):
            if turn == restart_after:
                running.stop()
                running = Running(target, model_dir)
            text = TASKS[0] if turn == 0 else f"Result of step {turn}:\n{tool_result(turn - 1)}"
            body = {"model": running.model_name, "instructions": system_prompt(prompt_tokens), "input": text,
                    "max_output_tokens": 16, "temperature": 0,
                    **({"previous_response_id": previous} if previous else {})}
            start = time.perf_counter()
            reply = httpx.post(f"{running.base_url}/v1/responses", json=body, timeout=600)
            reply.raise_for_status()
            response, elapsed = reply.json(), time.perf_counter() - start
            previous, usage = response["id"], response["usage"]
            rows.append({"turn": turn + 1, "restarted": turn == restart_after, "sent": len(text),
                         "prompt_tokens": usage["input_tokens"], "elapsed": elapsed,
                         "cached": usage["input_tokens_details"]["cached_tokens"]})
    finally:
        running.stop()
    return rows


def render_responses(rows: list[dict], args, model_dir: Path, argv: list[str]) -> str:
    lines = [f"# A Responses session: {args.turns} turns with previous_response_id, restarted after turn "
             f"{args.restart_after}", "", f"- date: {datetime.date.today().isoformat()}", f"- machine: {machine()}",
             f"- model: `{model_dir}`", f"- command: `python bench/agent_session.py {shlex.join(argv)}`", "",
             "| turn | input sent (chars) | prompt tokens | cached | share | reply time (s, 16 tokens) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (after restart)" if r["restarted"] else ""
        lines.append(f"| {r['turn']}{mark} | {r['sent']} | {r['prompt_tokens']} | {r['cached']} "
                     f"| {r['cached'] / r['prompt_tokens']:.1%} | {r['elapsed']:.3f} |")
    later = rows[1:]
    cached, total = sum(r["cached"] for r in later), sum(r["prompt_tokens"] for r in later)
    lines += ["", f"Turns 2-{args.turns}: {cached} of {total} prompt tokens served from the prefix cache "
              f"({cached / total:.1%}); lowest turn {min(r['cached'] / r['prompt_tokens'] for r in later):.1%}."]
    return "\n".join(lines) + "\n"


def render(ours: list[dict], peer: list[dict] | None, args, model_dir: Path, argv: list[str]) -> str:
    lines = [f"# An agent session: {args.turns} turns, restarted after turn {args.restart_after}", "",
             f"- date: {datetime.date.today().isoformat()}", f"- machine: {machine()}",
             f"- model: `{model_dir}`", f"- command: `python bench/agent_session.py {shlex.join(argv)}`", "",
             "| turn | prompt tokens | new this turn | cached (kvserve) | share | kvserve TTFT (s) "
             "| mlx_lm.server TTFT (s) |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(ours):
        share = (r["cached"] or 0) / r["prompt_tokens"]
        new = r["prompt_tokens"] - (ours[i - 1]["prompt_tokens"] if i and isinstance(r["turn"], int) else 0)
        theirs = f"{peer[i]['ttft']:.3f}" if peer else "-"
        mark = " (after restart)" if r["restarted"] else ""
        lines.append(f"| {r['turn']}{mark} | {r['prompt_tokens']} | {new} | {r['cached']} | {share:.1%} "
                     f"| {r['ttft']:.3f} | {theirs} |")
    fresh, ours = ours[-2:], ours[:-2]
    later = ours[1:]
    cached, total = sum(r["cached"] or 0 for r in later), sum(r["prompt_tokens"] for r in later)
    lines += ["", f"Turns 2-{args.turns}: {cached} of {total} prompt tokens served from the prefix cache "
              f"({cached / total:.1%}); lowest turn {min((r['cached'] or 0) / r['prompt_tokens'] for r in later):.1%}."]
    system = len(system_prompt_tokens(model_dir, args.prompt_tokens, args.template))
    for r in fresh:
        lines.append(f"{r['turn'].capitalize()} (same system prompt and tools, another task): {r['cached']} of "
                     f"{r['prompt_tokens']} prompt tokens cached (the shared start is {system} tokens), "
                     f"TTFT {r['ttft']:.3f} s = {r['ttft'] / ours[0]['ttft']:.2f}x turn 1's.")
    if peer:
        ours_t, peer_t = sum(r["ttft"] for r in later), sum(r["ttft"] for r in peer[1:-2])
        lines.append(f"TTFT summed over turns 2-{args.turns}: kvserve {ours_t:.2f} s, mlx_lm.server {peer_t:.2f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory or shipped model name (default: the default model)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--restart-after", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=2000, help="about this many in the system prompt")
    p.add_argument("--kv-scheme", default="fp16")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--template", choices=("gemma",), help="render the chat here and send completions")
    p.add_argument("--api", choices=("chat", "responses"), default="chat",
                   help="responses: each turn sends only its new input with previous_response_id (no peer)")
    p.add_argument("--out", help="write the Markdown report here")
    args = p.parse_args(argv)
    model_dir = default_model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="kvserve-agent-bench-") as cache:
        target = Target.parse(f"kvserve:--kv-scheme {args.kv_scheme} --prompt-cache-dir {cache}")
        if args.api == "responses":  # the kept responses in this run's folder too
            target = Target.parse(f"kvserve:--kv-scheme {args.kv_scheme} --prompt-cache-dir {cache} "
                                  f"--cache-dir {cache}")
            rows = responses_session(target, model_dir, args.turns, args.restart_after, args.prompt_tokens)
            publish(render_responses(rows, args, model_dir, argv), args.out)
            return 0
        ours = session(target, model_dir, args.turns, args.restart_after, args.prompt_tokens, args.template)
    peer = None if args.skip_peer else session(Target.parse("mlx_lm:"), model_dir, args.turns,
                                               args.restart_after, args.prompt_tokens, args.template)
    report = render(ours, peer, args, model_dir, argv)
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
