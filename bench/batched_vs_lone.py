"""How far a batched greedy answer moves from the same question answered alone.

The eight questions of ``tests/test_real_model.py::test_concurrent_greedy_chats_equal_each_alone``
are served alone, then ``--repeats`` times as a batch of eight, by one ``kvserve serve`` per
``--target``, its prefix cache off (16 tokens each, greedy, the top two logprobs). Printed per target: the largest
and mean change of a token's logprob between the lone and the batched run over the tokens
both agree on (the rounding noise a batch adds), and each divergence as (question, position,
the lone run's gap between its pick and the batched pick). That test's ``near_tie`` bound
comes from these figures (docs/benchmarks/gpu-serve.md, fifteenth round).

    python bench/batched_vs_lone.py --target "kvserve:--kv-scheme turbo0v4" --repeats 4
"""

from __future__ import annotations

import argparse
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvserve.bench.targets import Running, Target

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?",
             "Who wrote Hamlet?", "What do bees make?", "Name a planet.",
             "What is water made of?", "How many legs does a spider have?"]
Answer = list[tuple[str, float, dict[str, float]]]  # (token, logprob, top-2 logprobs) per position


def ask(base_url: str, question: str) -> Answer:
    body = {"model": "default", "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 16, "logprobs": True, "top_logprobs": 2}
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300).raise_for_status().json()
    return [(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
            for e in reply["choices"][0]["logprobs"]["content"]]


def compare(lone: Answer, group: Answer) -> tuple[float, float | None, int | None]:
    """(largest logprob change on agreed tokens, gap at the first divergence, its position).

        >>> a = [("x", -0.1, {"x": -0.1, "y": -2.0}), ("p", -0.5, {"p": -0.5, "q": -0.7})]
        >>> b = [("x", -0.15, {}), ("q", -0.6, {})]
        >>> tuple(round(v, 3) for v in compare(a, b)[:2]), compare(a, b)[2]
        ((0.05, 0.2), 1)
    """
    noise = 0.0
    for i, (mine, theirs) in enumerate(zip(lone, group)):
        if mine[0] != theirs[0]:
            return noise, mine[1] - mine[2].get(theirs[0], float("-inf")), i
        noise = max(noise, abs(mine[1] - theirs[1]))
    return noise, None, None


def measure(target: Target, repeats: int) -> str:
    # No prefix cache, as in the test: each batched prompt is computed, not restored.
    server = Running(dataclasses.replace(target, args=(*target.args, "--prompt-cache-ram-gb", "0",
                                                       "--prompt-cache-disk-gb", "0")), None)
    try:
        lone = [ask(server.base_url, q) for q in QUESTIONS]
        noises, divergences = [], []
        for _ in range(repeats):
            with ThreadPoolExecutor(len(QUESTIONS)) as pool:
                group = list(pool.map(lambda q: ask(server.base_url, q), QUESTIONS))
            for i, (mine, theirs) in enumerate(zip(lone, group)):
                noise, gap, at = compare(mine, theirs)
                noises.append(noise)
                if gap is not None:
                    divergences.append((i, at, round(gap, 3)))
    finally:
        server.stop()
    return (f"{target.label}: logprob change on agreed tokens max {max(noises):.3f} mean "
            f"{sum(noises) / len(noises):.3f}; divergences (question, position, gap) {divergences}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", action="append", help='"kvserve:ARGS" (repeatable; default: fp16 and turbo0v4)')
    parser.add_argument("--repeats", type=int, default=3, help="batches of eight per target")
    args = parser.parse_args(argv)
    for spec in args.target or ["kvserve:--kv-scheme fp16", "kvserve:--kv-scheme turbo0v4"]:
        print(measure(Target.parse(spec), args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
