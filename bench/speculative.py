"""Speculative decoding: how much faster does a server decode with prompt lookup or a draft
model, where the output repeats its context and where it does not?

    python bench/speculative.py [--targets "kvserve:" "kvserve:--speculative ngram" "mlx_lm:" ...]
        [--scenarios edit1,edit8,stories8] [--max-tokens 256] [--out docs/benchmarks/speculative.md]
    python bench/speculative.py --costs [--context 1100]
    python bench/speculative.py --engine-steps [--fit 0.2,0.1] [--max-tokens 160]

``--costs`` measures, in process, what ``position_cost`` in ``server/engine/speculation.py``
is fitted to: the time of a forward of 1 and 8 rows at 1..5 positions, and of realigning 8
rows that keep different counts (``trim_rows``), when most of them move and when one does.
``--engine-steps`` runs edit8's eight requests in process through the scheduler and runner
(greedy, no HTTP), without speculation and with prompt lookup under ``position_cost = A +
B * (rows - 1)`` (``--fit A,B``; default: the server's), and reports the steps that decode
all eight rows and nothing else: how many, their tokens and tok/s, and the verify steps.

Scenarios, all on one model (the default unless ``--model``):
  edit1     one stream at a time: a ~900-token passage of the GPL, then "the same text with
            'works' replaced by 'programs':" and its first words (``/v1/completions``, greedy),
            so the model copies the passage with an edit; 3 passages in turn;
  edit8     8 such streams at once (8 passages);
  stories8  8 concurrent chats asking for a short story, sampled (temperature 0.7, seeded),
            16 requests: output that does not repeat its prompt.
The default targets: kvserve without speculation, with prompt lookup, and with the model as
its own draft (``{model}``: no smaller model with its tokenizer ships on PyPI), then
``mlx_lm.server`` without and with that draft. Each target is started once and runs every
scenario; kvserve runs without its SSD prefix tier
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


def engine_steps(model_dir: Path, fit: tuple[float, float] | None, max_tokens: int) -> str:
    """edit8 in process, plain and with prompt lookup: the all-eight-rows decode steps."""
    import time

    from kvserve.server.models.blas import enable_fast_blas

    blas = enable_fast_blas()
    from kvserve.cache import parse_scheme
    from kvserve.configs import ModelConfig
    from kvserve.server.engine.model_loader import load_model
    from kvserve.server.engine.request import Request, SamplingParams
    from kvserve.server.engine.scheduler import Scheduler

    lines = ["| speculative | 8-row decode steps | tokens | tok/s | verify steps | verify ms | plain step ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode in ("off", "ngram"):
        loaded = load_model(ModelConfig(model=str(model_dir)), parse_scheme("fp16"), blas.describe(), speculative=mode)
        runner, tokenizer = loaded.runner, loaded.tokenizer
        if fit is not None and runner.speculation is not None:
            runner.speculation.position_cost = lambda rows: fit[0] + fit[1] * (rows - 1)
        scheduler = Scheduler(max_running=8, prefill_step_size=256, max_waiting=16, max_step_tokens=256,
                              max_draft_tokens=4 if mode != "off" else 0)
        for i, p in enumerate(passages(8)):
            prompt = tokenizer.encode(edit_body("m", p, 1)["prompt"])
            scheduler.add(Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), request_id=f"r{i}"))
        steps = []  # (tokens, seconds, verified) of the steps that decode all eight rows only
        while scheduler.has_work:
            plan = scheduler.schedule()
            start = time.perf_counter()
            result = runner.execute(plan)
            seconds = time.perf_counter() - start
            scheduler.commit(result)
            if len(plan.decode) == 8 and not plan.prefill:
                steps.append((len(result.sampled) + sum(map(len, result.accepted.values())), seconds,
                              bool(result.proposed)))
            for r in list(scheduler.running):
                if r.num_generated >= r.params.max_tokens:
                    scheduler.finish(r, None)
                    runner.release(r.request_id)
        tokens, seconds = sum(t for t, _, _ in steps), sum(s for _, s, _ in steps)
        verify = [s for _, s, v in steps if v]
        plain = [s for _, s, v in steps if not v]
        ms = lambda xs: f"{1000 * statistics.mean(xs):.1f}" if xs else "-"  # noqa: E731
        lines.append(f"| {mode} | {len(steps)} | {tokens} | {tokens / seconds:.1f} | {len(verify)} | "
                     f"{ms(verify)} | {ms(plain)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: the default model)")
    parser.add_argument("--targets", nargs="+", default=[
        "kvserve:--prompt-cache-disk-gb 0", "kvserve:--prompt-cache-disk-gb 0 --speculative ngram",
        "kvserve:--prompt-cache-disk-gb 0 --speculative draft --draft-model {model}",
        "mlx_lm:", "mlx_lm:--draft-model {model}"])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", help="write the Markdown table here too")
    parser.add_argument("--costs", action="store_true", help="measure a verified position's cost instead")
    parser.add_argument("--context", type=int, default=1100, help="cached tokens per row (--costs)")
    parser.add_argument("--engine-steps", action="store_true", help="time edit8's engine steps in process instead")
    parser.add_argument("--fit", help="A,B: position_cost = A + B * (rows - 1) for --engine-steps")
    args = parser.parse_args(argv)
    model_dir = Path(args.model) if args.model else default_model_dir()
    if args.costs:
        print(f"Machine: {machine()}. Model: `{model_dir.name}`.\n\n{costs(model_dir, args.context)}")
        return 0
    if args.engine_steps:
        fit = tuple(float(x) for x in args.fit.split(",")) if args.fit else None
        print(f"Machine: {machine()}. Model: `{model_dir.name}`.\n\n{engine_steps(model_dir, fit, args.max_tokens)}")
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
