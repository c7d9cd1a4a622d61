"""Speculative decoding: how much faster does a server decode with prompt lookup, where the
output repeats its context and where it does not?

    python bench/speculative.py [--targets "kvserve:" "kvserve:--speculative ngram" "mlx_lm:"
        "kvserve:--speculative draft --draft-model {model}" "mlx_lm:--draft-model {model}"]
        [--scenarios edit1,edit8,stories8] [--max-tokens 256] [--out docs/benchmarks/speculative.md]
    python bench/speculative.py --costs [--context 1100]

``--costs`` measures, in process, what ``position_cost`` in ``server/engine/speculation.py``
is fitted to: the time of a forward of 1 and 8 rows at 1..5 positions, and of realigning 8
rows that keep different counts (``trim_rows``), when most of them move and when one does.

Scenarios, all on one model (the default unless ``--model``):
  edit1     one stream at a time: a ~900-token passage of the GPL, then "the same text with
            'works' replaced by 'programs':" and its first words (``/v1/completions``, greedy),
            so the model copies the passage with an edit; 3 passages in turn;
  edit8     8 such streams at once (8 passages);
  stories8  8 concurrent chats asking for a short story, sampled (temperature 0.7, seeded),
            16 requests: output that does not repeat its prompt.
Each target is started once and runs every scenario; kvserve runs without its SSD prefix tier
(``--prompt-cache-disk-gb 0``) so no target reads another's files. Reported per scenario:
aggregate output tok/s, the median stream's decode tok/s ((tokens - 1) / (end - first token)),
TTFT p50 and, for kvserve, the proposed and accepted tokens from ``/metrics``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import httpx

from kvserve.bench.cli import default_model_dir, machine
from kvserve.bench.load import run_load
from kvserve.bench.report import publish
from kvserve.bench.targets import Running, Target

SCENARIOS = ("edit1", "edit8", "stories8")
TOPICS = ["a lighthouse keeper", "a lost robot", "two rival bakers", "a comet", "a chess prodigy",
          "a haunted library", "a desert caravan", "a submarine crew"]


def passages(n: int, words: int = 650) -> list[str]:
    text = (Path(__file__).resolve().parents[1] / "server/engine/data/eval-gpl-3.0.txt").read_text().split()
    return [" ".join(text[200 + i * 300 : 200 + i * 300 + words]) for i in range(n)]


def edit_body(model: str, passage: str, max_tokens: int) -> dict:
    edited = passage.replace(" works", " programs").split()
    prompt = (f"Original text:\n\n{passage}\n\nThe same text with \"works\" replaced by \"programs\":\n\n"
              + " ".join(edited[:8]))
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def story_body(model: str, i: int, max_tokens: int) -> dict:
    topic = TOPICS[i % len(TOPICS)]
    return {"model": model, "messages": [{"role": "user", "content": f"Write a short story about {topic}."}],
            "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}


def bodies(scenario: str, model: str, max_tokens: int) -> tuple[list[dict], int]:
    """The requests of a scenario and how many run at once."""
    if scenario == "edit1":
        return [edit_body(model, p, max_tokens) for p in passages(3)], 1
    if scenario == "edit8":
        return [edit_body(model, p, max_tokens) for p in passages(8)], 8
    return [story_body(model, i, max_tokens // 2) for i in range(16)], 8


def counters(running: Running) -> dict[str, float]:
    """The speculative counters of a kvserve target (empty for a peer)."""
    if running.target.kind != "kvserve":
        return {}
    out = {}
    for line in httpx.get(f"{running.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvserve_speculative_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].split("_")[2]] = float(value)
    return out


def run_scenario(running: Running, scenario: str, max_tokens: int, label: str) -> dict:
    requests, concurrency = bodies(scenario, running.model_name, max_tokens)
    before = counters(running)
    result = run_load(running.base_url, requests, concurrency)
    after = counters(running)
    decode = [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in result.ok if r.output_tokens > 1 and r.e2e > r.ttft]
    summary = result.summary()
    row = {"target": label, "scenario": scenario, "requests": len(requests),
           "errors": result.errors, "output_tok_s": summary["output_tok_s"],
           "decode_tok_s": statistics.median(decode) if decode else None, "ttft_p50": summary["ttft_p50"],
           "tokens": result.output_tokens}
    if after:
        row["proposed"] = after.get("proposed", 0) - before.get("proposed", 0)
        row["accepted"] = after.get("accepted", 0) - before.get("accepted", 0)
    return row


def measure(target: Target, model_dir: Path, scenarios: list[str], max_tokens: int) -> list[dict]:
    """Start ``target`` (``{model}`` in its arguments: the model directory, e.g. as its own
    draft model) and run the scenarios on it; rows are labelled with ``{model}`` kept."""
    print(f"speculative: starting {target.label}", file=sys.stderr, flush=True)
    args = tuple(a.replace("{model}", str(model_dir)) for a in target.args)
    running = Running(replace(target, args=args), model_dir)
    try:
        run_load(running.base_url, [story_body(running.model_name, 99, 8)], 1)  # warm-up
        rows = []
        for scenario in scenarios:
            rows.append(run_scenario(running, scenario, max_tokens, target.label))
            print(f"speculative: {target.label} {scenario}: {rows[-1]['output_tok_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
        return rows
    finally:
        running.stop()


def render(rows: list[dict], baseline: str, args, model_dir: Path, argv: list[str]) -> str:
    base = {r["scenario"]: r for r in rows if r["target"] == baseline}
    lines = [f"Machine: {machine()}. Model: `{model_dir.name}`.",
             f"Command: `python bench/speculative.py {' '.join(argv)}`", "",
             "| scenario | server | output tok/s | vs first | decode tok/s (median stream) | TTFT p50 | "
             "accepted / proposed | errors |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: SCENARIOS.index(r["scenario"])):
        ratio = r["output_tok_s"] / base[r["scenario"]]["output_tok_s"] if r["scenario"] in base else None
        accept = f"{int(r['accepted'])} / {int(r['proposed'])}" if r.get("proposed") else "-"
        decode = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"
        lines.append(f"| {r['scenario']} | `{r['target']}` | {r['output_tok_s']:.1f} | "
                     f"{ratio:.2f}x | {decode} | {r['ttft_p50']:.2f} s | {accept} | {r['errors']} |")
    return "\n".join(lines) + "\n"


def _median_ms(fn, reps: int = 7) -> float:
    import time

    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def costs(model_dir: Path, context: int) -> str:
    """Forward time by rows and positions over ``context`` cached tokens, and the time of
    realigning 8 rows, as a Markdown table."""
    import mlx.core as mx

    from kvserve.server.models.blas import enable_fast_blas

    blas = enable_fast_blas()
    from kvserve.cache import PromptCache, parse_scheme
    from kvserve.configs import ModelConfig
    from kvserve.server.engine.model_loader import load_model

    model = load_model(ModelConfig(model=str(model_dir)), parse_scheme("fp16"), blas=blas.describe()).runner.model
    lines = ["| rows | positions | forward ms | vs 1 position |", "| ---: | ---: | ---: | ---: |"]
    for rows in (1, 8):
        singles = []
        for b in range(rows):
            cache = PromptCache.for_model(model, "fp16")
            model(mx.array([[100 + (7 * b + 13 * i) % 5000 for i in range(context)]]), cache=cache)
            cache.begin_decode()  # the form a row decodes in
            mx.eval(cache.state)
            singles.append(cache)
        batch = PromptCache.merge(singles)
        one = None
        for width in range(1, 6):
            def forward():
                mx.eval(mx.argmax(model(mx.array([[5] * width] * rows), cache=batch), axis=-1))
                batch.trim(width)
            forward()  # the first call also evaluates the merge: not timed
            ms = _median_ms(forward)
            one = one or ms
            lines.append(f"| {rows} | {width} | {ms:.1f} | {ms / one:.2f}x |")
    for shifts in ([[0, 1, 2, 3, 0, 1, 2, 3], [3, 0, 2, 0, 1, 3, 0, 2]], [[3, 0, 0, 0, 0, 0, 0, 0], [0, 3] + [0] * 6]):
        def realign():
            batch.trim_rows(shifts[0])
            mx.eval(batch.state)
            shifts.reverse()

        moving = sum(1 for c in shifts[0] if c > min(shifts[0]))
        lines.append(f"\nRealigning 8 rows of {context} tokens (`trim_rows` {shifts[0]}, {moving} of 8 moving): "
                     f"{_median_ms(realign):.1f} ms")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: the default model)")
    parser.add_argument("--targets", nargs="+", default=["kvserve:--prompt-cache-disk-gb 0",
                                                         "kvserve:--prompt-cache-disk-gb 0 --speculative ngram",
                                                         "mlx_lm:"])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", help="write the Markdown table here too")
    parser.add_argument("--costs", action="store_true", help="measure a verified position's cost instead")
    parser.add_argument("--context", type=int, default=1100, help="cached tokens per row (--costs)")
    args = parser.parse_args(argv)
    model_dir = Path(args.model) if args.model else default_model_dir()
    if args.costs:
        print(f"Machine: {machine()}. Model: `{model_dir.name}`.\n\n{costs(model_dir, args.context)}")
        return 0
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    targets = [Target.parse(t) for t in args.targets]
    rows = [row for t in targets for row in measure(t, model_dir, scenarios, args.max_tokens)]
    table = render(rows, targets[0].label, args, model_dir, argv)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
