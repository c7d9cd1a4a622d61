"""What constrained decoding costs a decode step: the served model's engine step at batch 8
with no row constrained, every row constrained by a JSON schema, and half of them.

Runs the engine's own runner and scheduler (no HTTP), with the model loaded as ``kvserve
serve`` loads it. The masks are llguidance's, filled for all constrained rows at once;
their time is measured apart (``Grammars.masks`` wrapped with a timer), as is the time to
feed sampled tokens to the matchers. A batch with a constrained row cannot queue its next
step before the tokens are read (the grammar needs the token first); that loss is in the
step time, and is what the unconstrained rows of a mixed batch pay.

    python bench/grammar_step.py [--model default] [--kv-scheme fp16] [--steps 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

# A schema no reply completes within the measured steps (every step then needs a mask).
CATS = {"type": "array", "minItems": 40, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "colors": {"type": "array", "items": {"type": "string", "enum": ["black", "white", "orange"]}, "maxItems": 3}},
    "required": ["name", "age", "colors"], "additionalProperties": False}}


class Timed:
    """Wraps a method (of an object, or of a class: then a function, so it still binds),
    adding each call's seconds to ``total``; ``restore`` puts the original back."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.inner, self.total = owner, name, getattr(owner, name), 0.0
        inner = self.inner

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.inner)


def run(loaded, constrained: int, batch: int, steps: int, temperature: float) -> dict:
    from kvserve.server.engine.grammar import Grammar, RowGrammar
    from kvserve.server.engine.request import Request, SamplingParams
    from kvserve.server.engine.scheduler import Scheduler

    runner, tokenizer = loaded.runner, loaded.tokenizer
    grammar = Grammar.from_json_schema(CATS)
    scheduler = Scheduler(max_running=batch, prefill_step_size=512, max_waiting=batch * 2,
                          max_step_tokens=4096, max_kv_tokens=None)
    for row in range(batch):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List forty cats as JSON, request {row}."}], add_generation_prompt=True)
        params = SamplingParams(max_tokens=steps + 8, temperature=temperature, seed=row,
                                grammar=grammar if row < constrained else None)
        scheduler.add(Request(list(prompt), params))
    masks = Timed(runner.grammars, "masks")
    consume = Timed(RowGrammar, "consume")
    times, mask_s, consume_s = [], [], []
    try:
        while scheduler.has_work:
            plan = scheduler.schedule()
            m0, c0, start = masks.total, consume.total, time.perf_counter()
            result = runner.execute(plan)
            if len(plan.decode) == batch and not plan.prefill:
                times.append(time.perf_counter() - start)
                mask_s.append(masks.total - m0)
                consume_s.append(consume.total - c0)
            scheduler.commit(result)
            for request_id in result.sampled:
                request = scheduler.find(request_id)
                if request.num_generated >= request.params.max_tokens:
                    scheduler.finish(request, _length())
                    runner.release(request_id)
    finally:
        masks.restore()
        consume.restore()
    skip = len(times) // 4  # warm-up
    return {"step_ms": 1e3 * statistics.median(times[skip:]), "mask_ms": 1e3 * statistics.mean(mask_s[skip:]),
            "consume_ms": 1e3 * statistics.mean(consume_s[skip:]), "steps": len(times) - skip}


def _length():
    from kvserve.server.engine.request import FinishReason

    return FinishReason.LENGTH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--kv-scheme", default="fp16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--temperatures", default="0,1")
    args = parser.parse_args()

    from kvserve.cache import parse_scheme
    from kvserve.configs import ModelConfig
    from kvserve.server.engine.model_loader import load_model
    from kvserve.server.models.blas import enable_fast_blas

    blas = enable_fast_blas()
    loaded = load_model(ModelConfig(model=args.model), parse_scheme(args.kv_scheme), blas=blas.describe())
    loaded.grammars.tokenizer  # noqa: B018 - built once, before timing
    print(f"model {loaded.info.model_id}, KV {args.kv_scheme}, batch {args.batch}, {args.steps} decode steps\n")
    print("| temperature | rows with a grammar | step ms (median) | mask ms / step | consume ms / step "
          "| mask + consume share of step |")
    print("|---|---|---|---|---|---|")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for constrained in (0, args.batch // 2, args.batch):
            r = run(loaded, constrained, args.batch, args.steps, temperature)
            share = (r["mask_ms"] + r["consume_ms"]) / r["step_ms"]
            print(f"| {temperature:g} | {constrained} of {args.batch} | {r['step_ms']:.1f} | {r['mask_ms']:.2f} | "
                  f"{r['consume_ms']:.2f} | {100 * share:.1f}% |")


if __name__ == "__main__":
    main()
