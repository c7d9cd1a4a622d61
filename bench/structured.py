#!/usr/bin/env python
"""Does structured output hold every time? Sampled requests through the official clients,
each output checked against its schema.

    python bench/structured.py [--model DIR] [--requests 100] [--concurrency 8] \\
        [--checks valid,ending] [--out docs/benchmarks/structured-output.md]

Against one ``kvserve serve`` on the model (the default model unless given), at
temperature 1 with a different seed per request, ``--concurrency`` requests in flight:

1. OpenAI chat completions, a named ``tool_choice``: the call's arguments validate
   against the tool's parameter schema;
2. OpenAI ``response_format`` json_schema: the content validates against the schema;
3. a streamed forced tool call, assembled by the openai client's stream helper;
4. Anthropic messages with ``tool_choice`` {"type": "tool"}: the tool_use input validates,
   through ``messages.create`` and through ``messages.stream``;
5. (``ending``) does a forced call end the reply? A named ``tool_choice`` (OpenAI) and a
   ``tool`` choice (Anthropic) with parallel calls allowed, as the APIs default, and
   ``max_tokens`` 80: how many end with ``finish_reason: "tool_calls"`` / ``stop_reason:
   "tool_use"`` and one valid call, how many run on to ``max_tokens`` (what a grammar that
   let the model open a second call after the first did).

A request counts as valid only when it finished because the output was complete and the
parsed output validates; one that ``max_tokens`` cut first (a sampled small model can write a
long string where the schema sets no length) is counted apart, as is a complete output that
does not validate (which constrained decoding must make impossible).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai

from kvserve.bench.cli import default_model_dir, machine
from kvserve.bench.report import publish
from kvserve.bench.targets import Running, Target

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email", "maxLength": 60},
    "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de", "es", "ja"]},
                  "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 60},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "languages", "address"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What will the weather be in Paris this week?"}]
MAX_TOKENS = 200
ENDING_MAX_TOKENS = 80


# Each check returns "valid", "cut" (max_tokens ended it first: a sampled model may write a
# long string) or "invalid" (complete but not matching: what the grammar must rule out).

def openai_forced(client, seed: int) -> str:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}}
    r = client.chat.completions.create(model="default", messages=ASK, tools=[tool], temperature=1.0, seed=seed,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       parallel_tool_calls=False, max_tokens=MAX_TOKENS)
    choice = r.choices[0]
    if choice.finish_reason == "length":
        return "cut"
    calls = choice.message.tool_calls or []
    return _verdict(choice.finish_reason == "tool_calls" and len(calls) == 1 and _valid(calls[0].function.arguments, WEATHER))


def openai_schema(client, seed: int) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model="default", temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": "Invent a person, as JSON."}],
                                       response_format=fmt)
    if r.choices[0].finish_reason == "length":
        return "cut"
    return _verdict(r.choices[0].finish_reason == "stop" and _valid(r.choices[0].message.content, PERSON))


def openai_streamed(client, seed: int) -> str:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    with client.chat.completions.stream(model="default", messages=ASK, tools=[tool], temperature=1.0, seed=seed,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        parallel_tool_calls=False, max_tokens=MAX_TOKENS) as stream:
        try:
            final = stream.get_final_completion().choices[0]
        except openai.LengthFinishReasonError:
            return "cut"
    calls = final.message.tool_calls or []
    return _verdict(final.finish_reason == "tool_calls" and len(calls) == 1 and _valid(calls[0].function.arguments, WEATHER))


def anthropic_forced(client, seed: int, stream: bool) -> str:
    kwargs = dict(model="default", max_tokens=MAX_TOKENS, messages=ASK,  # the API default: temperature 1
                  tools=[{"name": "get_weather", "description": "Forecast", "input_schema": WEATHER}],
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    if stream:
        with client.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    if message.stop_reason == "max_tokens":
        return "cut"
    blocks = [b for b in message.content if b.type == "tool_use"]
    return _verdict(message.stop_reason == "tool_use" and len(blocks) == 1 and _valid(blocks[0].input, WEATHER))


# The "ending" checks return how the reply ended: "call" (the right finish or stop reason
# and one valid call), "cut" (max_tokens), or the reason it gave instead.

def openai_ending(client, seed: int) -> str:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    r = client.chat.completions.create(model="default", messages=ASK, tools=[tool], temperature=1.0, seed=seed,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=ENDING_MAX_TOKENS)
    choice = r.choices[0]
    calls = choice.message.tool_calls or []
    one = len(calls) == 1 and _valid(calls[0].function.arguments, WEATHER)
    return _ending(choice.finish_reason, "tool_calls", "length", one)


def anthropic_ending(client, seed: int) -> str:
    message = client.messages.create(model="default", max_tokens=ENDING_MAX_TOKENS, messages=ASK,  # temperature 1
                                      tools=[{"name": "get_weather", "input_schema": WEATHER}],
                                      tool_choice={"type": "tool", "name": "get_weather"})
    blocks = [b for b in message.content if b.type == "tool_use"]
    one = len(blocks) == 1 and _valid(blocks[0].input, WEATHER)
    return _ending(message.stop_reason, "tool_use", "max_tokens", one)


def _ending(reason: str, call: str, cut: str, one_valid_call: bool) -> str:
    if reason == call:
        return "call" if one_valid_call else f"{call} without one valid call"
    return "cut" if reason == cut else reason


def _verdict(ok: bool) -> str:
    return "valid" if ok else "invalid"


def _valid(document, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(document) if isinstance(document, str) else document, schema,
                            format_checker=jsonschema.FormatChecker())
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def count(check, n: int, concurrency: int) -> Counter:
    with ThreadPoolExecutor(concurrency) as pool:
        return Counter(pool.map(check, range(n)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kv-scheme", default="fp16")
    p.add_argument("--checks", default="valid,ending", help="valid (checks 1-4), ending (check 5), or both")
    p.add_argument("--out")
    args = p.parse_args(argv)
    import anthropic

    model_dir = Path(args.model) if args.model else default_model_dir()
    running = Running(Target.parse(f"kvserve:--kv-scheme {args.kv_scheme}"), model_dir)
    try:
        oai = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        ant = anthropic.Anthropic(base_url=running.base_url, api_key="unused", max_retries=0, timeout=600)
        groups = {"valid": _validity_checks(oai, ant), "ending": _ending_checks(oai, ant)}
        rows = {group: [(name, count(check, args.requests, args.concurrency)) for name, check in groups[group]]
                for group in args.checks.split(",")}
    finally:
        running.stop()
    lines = [f"# Structured output: {args.requests} sampled requests per check", "",
             f"- date: {datetime.date.today().isoformat()}", f"- machine: {machine()}",
             f"- model: `{model_dir}`, KV {args.kv_scheme}, temperature 1, a seed per request, "
             f"{args.concurrency} in flight",
             f"- command: `python bench/structured.py {shlex.join(argv)}`", ""]
    lines += _validity_table(rows["valid"], args.requests) if "valid" in rows else []
    lines += _ending_table(rows["ending"], args.requests) if "ending" in rows else []
    publish("\n".join(lines).rstrip() + "\n", args.out)
    valid = all(c["valid"] == args.requests for _, c in rows.get("valid", []))
    return 0 if valid and all(c["call"] == args.requests for _, c in rows.get("ending", [])) else 1


def _validity_checks(oai, ant) -> list:
    return [("OpenAI chat, named tool_choice", lambda s: openai_forced(oai, s)),
            ("OpenAI chat, response_format json_schema (PERSON)", lambda s: openai_schema(oai, s)),
            ("OpenAI chat, streamed named tool_choice (stream helper)", lambda s: openai_streamed(oai, s)),
            ("Anthropic messages.create, tool_choice tool", lambda s: anthropic_forced(ant, s, False)),
            ("Anthropic messages.stream, tool_choice tool", lambda s: anthropic_forced(ant, s, True))]


def _ending_checks(oai, ant) -> list:
    return [('OpenAI chat, named tool_choice: finish_reason "tool_calls"', lambda s: openai_ending(oai, s)),
            ('Anthropic messages, tool_choice tool: stop_reason "tool_use"', lambda s: anthropic_ending(ant, s))]


def _validity_table(rows: list, n: int) -> list[str]:
    return [f"- max_tokens {MAX_TOKENS} per request", "",
            "| check | valid | cut by max_tokens | complete but invalid |", "|---|---|---|---|",
            *(f"| {name} | {c['valid']} of {n} | {c['cut']} | {c['invalid']} |" for name, c in rows), ""]


def _ending_table(rows: list, n: int) -> list[str]:
    """How forced calls ended; "other" names any other ending with its count."""
    def other(c: Counter) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(c.items()) if k not in ("call", "cut")) or "0"

    return [f"Forced calls, parallel calls allowed (the APIs' default), max_tokens {ENDING_MAX_TOKENS}:", "",
            "| check | ended with one valid call | cut by max_tokens | other |", "|---|---|---|---|",
            *(f"| {name} | {c['call']} of {n} | {c['cut']} | {other(c)} |" for name, c in rows), ""]


if __name__ == "__main__":
    raise SystemExit(main())
