"""Batched decoding over long contexts on a GPU: kvserve's engine, and a bare model loop.

A random-weight llama of Llama-3-8B shape (hidden 4096, 32 query heads over 8 KV heads,
head_dim 128, MLP 14336, vocabulary 128256; ``--layers`` layers, default 32) in float16.
For each scheme, ``--batch`` prompts of ``--context`` random tokens are prefilled (chunks
of 2048, at fp16, then converted to the scheme once, as the server does), and two loops
decode greedily, each timed apart:

  * ``engine``: the server's own scheduler and ``ModelRunner`` (default engine settings)
    serve ``--batch`` requests for these prompts. The prompts' caches are in its prefix
    cache, so each request computes its last prompt token only, joins the decode batch, and
    the engine decodes all rows together, one step ahead as it always does (a step's graph
    is built while the device runs the one before). Timed: whole ``execute`` calls of the
    steps that only decode (sampling and reading the tokens back included).
  * ``bare``: the model called on a merged batch cache, each step built and then evaluated
    (no pipelining, no sampler): what the engine did before it decoded ahead.

Reported per scheme and loop: median step ms over the last 3/4 of ``--steps``, output
tokens/s, and the K/V GiB the batch cache holds.

    python bench/gpu_decode.py --schemes fp16,affine4,turbo0v4 --context 16384 --batch 8
    python bench/gpu_decode.py --model default --context 300 --ragged 13 --captured on --profile 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

CHUNK = 2048


def build_model(layers: int):
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=4096, num_hidden_layers=layers,
                           intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                           rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def served_model(rewrites: tuple[str, ...], spec: str | None = None):
    """A model as ``kvserve serve --model SPEC`` loads it on this device (weight format, and
    the device profile with ``rewrites``). The default model (``spec`` None) is the small
    one whose decode step is bound by the host's kernel launches rather than by bytes; a
    ``bench/shaped_model.py`` directory is a real model's shape with its weight format."""
    from dataclasses import replace

    from kvserve.cache import parse_scheme
    from kvserve.configs import ModelConfig
    from kvserve.server.engine.device import choose_profile
    from kvserve.server.engine.model_loader import load_model

    config = ModelConfig(model=spec)
    device = replace(choose_profile(config.resolved_cache_dir()), rewrites=rewrites)
    return load_model(config, parse_scheme("fp16"), "reference", device=device).runner.model


def chosen_rewrites(option: str) -> tuple[str, ...]:
    """``--rewrites``: "profile" (this device's), "none", or names separated by commas."""
    if option == "profile":
        from kvserve.server.engine.device import choose_profile
        from kvserve.configs import ModelConfig

        return choose_profile(ModelConfig().resolved_cache_dir()).rewrites
    return () if option == "none" else tuple(option.split(","))


def vocab_size(model) -> int:
    return model.args.vocab_size


def prompt(row: int, context: int, vocab: int = 128256):
    import mlx.core as mx

    return mx.random.randint(0, vocab, (1, context), key=mx.random.key(row))


def row_cache(model, scheme: str, tokens):
    """One prompt's cache: prefilled at fp16 in chunks, then converted to the scheme."""
    import mlx.core as mx
    from kvserve.cache import PromptCache

    context = tokens.shape[1]
    cache = PromptCache.for_model(model, scheme, quantize_after=context)
    for start in range(0, context, CHUNK):
        model(tokens[:, start:start + CHUNK], cache=cache)
        mx.eval(cache.state)
    cache.maybe_convert()
    cache.quantize_after = 0  # every token is in the scheme now, as the runner leaves a prompt
    mx.eval(cache.state)
    return cache


def batch_cache(model, scheme: str, batch: int, context: int):
    """``batch`` per-row caches of ``context`` random tokens, merged."""
    import mlx.core as mx
    from kvserve.cache import PromptCache

    merged = PromptCache.merge([row_cache(model, scheme, prompt(row, context, vocab_size(model)))
                                for row in range(batch)])
    mx.eval(merged.state)
    return merged


def engine_steps(model, scheme: str, batch: int, context: int, steps: int,
                 profile: int = 0, captured: bool = False, ragged: int = 0) -> tuple[list[float], float]:
    """Seconds of the engine's first ``steps`` decode-only steps over all ``batch`` rows,
    and the GiB its caches hold then; ``profile`` (N > 0): then prints ``device_split`` of a
    few more steps, with the N kernels that took most of them. ``ragged``: row i's prompt
    is ``i * ragged`` tokens shorter, so the batch is left-padded as a served one is."""
    import mlx.core as mx
    from kvserve.cache import parse_scheme
    from kvserve.cache.prefix import Namespace, PrefixCache
    from kvserve.configs import EngineConfig
    from kvserve.server.engine.request import Request, SamplingParams
    from kvserve.server.engine.device import PREFILL_STEP
    from kvserve.server.engine.runner import ModelRunner
    from kvserve.server.engine.scheduler import Scheduler

    prefix = PrefixCache(Namespace("bench", "bench", scheme), ram_bytes=1 << 40)
    requests = []
    for row in range(batch):
        tokens = prompt(row, context - row * ragged, vocab_size(model))
        prefix.insert(tokens[0].tolist(), row_cache(model, scheme, tokens))
        # Never ends by itself: timing stops after ``steps`` steps with every row decoding.
        requests.append(Request(tokens[0].tolist(), SamplingParams(max_tokens=1 << 20, temperature=0.0)))
    # Every prompt is a prefix hit but its last token: the chunk size does not matter here.
    step, step_tokens = EngineConfig().step_sizes(PREFILL_STEP["cpu"])
    scheduler = Scheduler(batch, step, batch, max(step_tokens, batch))
    runner = ModelRunner(model, parse_scheme(scheme), prefix=prefix, captured=captured)
    prefix = None  # the runner drops its reference once every prompt is in
    for r in requests:
        scheduler.add(r)
    times: list[float] = []

    def step() -> None:
        plan = scheduler.schedule()
        t0 = time.perf_counter()
        scheduler.commit(runner.execute(plan))
        if not plan.prefill:  # every prompt is in: time the step, free the prefix cache
            times.append(time.perf_counter() - t0)
            runner.prefix = None

    while len(times) < steps:
        step()
    if profile:
        from kvserve.kernels.bench_cases import kernel_records

        timed = len(times)
        records = kernel_records(lambda: [step() for _ in range(PROFILED_STEPS)])
        del times[timed:]  # the profiled steps are not part of the timing
        print(device_split(records, PROFILED_STEPS, "engine, steps decoded one ahead", profile), flush=True)
    kv = runner.kv_bytes / 2**30
    for r in requests:
        runner.release(r.request_id)
    mx.clear_cache()
    return times, kv


def time_steps(model, cache, batch: int, steps: int) -> list[float]:
    import mlx.core as mx

    tokens = mx.zeros((batch, 1), dtype=mx.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(tokens, cache=cache)[:, -1, :]
        tokens = mx.argmax(logits, axis=-1)[:, None]
        mx.eval(tokens)
        times.append(time.perf_counter() - t0)
    return times


PROFILED_STEPS = 4


def device_split(records: list, steps: int, loop: str, top: int = 6, unit: str = "step") -> str:
    """Where the device's time in ``steps`` steps goes (``records``: ``kernel_records`` of
    them): kernel-busy ms per step against the span from the first kernel to the last, and
    the kernels that take most of it (``unit``: what ``steps`` counts, as printed)."""
    from collections import defaultdict

    if not records:
        return "  (no kernel records: PyTorch with CUDA is needed to read them)"
    by_name: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for name, start, end in records:
        by_name[name] += (end - start) / steps
        launches[name] += 1
    busy = sum(by_name.values())
    span = (max(r[2] for r in records) - min(r[1] for r in records)) / steps
    lines = [f"  {loop}: device busy {busy / 1e3:.2f} ms per {unit} in {len(records) / steps:.0f} kernels, "
             f"first to last kernel {span / 1e3:.2f} ms"]
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {us / 1e3:7.3f} ms {launches[name] / steps:5.0f}x  {name[:110]}")
    return "\n".join(lines)


def report(scheme: str, loop: str, times: list[float], batch: int, kv_gib: float) -> None:
    ms = 1e3 * statistics.median(times[len(times) // 4:])
    print(f"| {scheme} | {loop} | {ms:.2f} | {batch * 1e3 / ms:.1f} | {kv_gib:.2f} |", flush=True)


def parser(doc: str, schemes: str, steps: int) -> argparse.ArgumentParser:
    """The options the GPU decode benchmarks share (model depth, batch, context, steps)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--schemes", default=schemes)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--captured", choices=("auto", "on", "off", "both"), default="auto",
                   help="the engine's decode steps captured and replayed (server/engine/captured.py): "
                        "auto as the device profile says; both: one engine loop each way")
    return p


def captured_modes(option: str) -> list[bool]:
    """``--captured`` as the engine loops to run: False eager, True captured."""
    if option == "auto":
        from kvserve.configs import ModelConfig
        from kvserve.server.engine.device import choose_profile

        return [choose_profile(ModelConfig().resolved_cache_dir()).captured]
    return {"on": [True], "off": [False], "both": [False, True]}[option]


def main(argv=None) -> int:
    p = parser(__doc__, "fp16,affine4,turbo0v4", 24)
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--model", default="8b-shape",
                   help="'default': the served default model instead; or a model directory "
                        "(bench/shaped_model.py), loaded as kvserve serves it (--layers is ignored)")
    p.add_argument("--profile", nargs="?", type=int, const=6, default=0, metavar="TOP",
                   help="after each loop, its kernels' device time per step and the TOP kernels "
                        "that take most of it, with their launches per step (CUPTI, needs PyTorch)")
    p.add_argument("--ragged", type=int, default=0, metavar="N",
                   help="engine loops: row i's prompt N * i tokens shorter (a left-padded batch)")
    p.add_argument("--rewrites", default="profile",
                   help="model rewrites: 'profile' (the device profile's), 'none', or names with commas")
    args = p.parse_args(argv)
    import mlx.core as mx
    from kvserve.server.engine.fastpath import apply_rewrites

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    rewrites = chosen_rewrites(args.rewrites)
    if args.model == "8b-shape":
        model = build_model(args.layers)
        apply_rewrites(model, rewrites)
    else:
        model = served_model(rewrites, None if args.model == "default" else args.model)
    shape = {"8b-shape": f"llama 8B shape, {args.layers} layers, f16", "default": "the default model"}.get(
        args.model, args.model)
    print(f"device: {mx.device_info().get('device_name', mx.default_device())}, mlx {mx.__version__}; "
          f"{shape}, batch {args.batch}, context {args.context}, rewrites {', '.join(rewrites) or 'none'}")
    print("| scheme | loop | step ms (median) | output tok/s | K/V GiB |\n|---|---|---|---|---|")
    for scheme in args.schemes.split(","):
        for captured in captured_modes(args.captured):
            times, kv = engine_steps(model, scheme, args.batch, args.context, args.steps, args.profile, captured,
                                     args.ragged)
            report(scheme, "engine, captured" if captured else "engine", times, args.batch, kv)
        cache = batch_cache(model, scheme, args.batch, args.context)
        times = time_steps(model, cache, args.batch, args.steps)
        # After decoding: turbo caches hold the raw prefill until their first decode step.
        report(scheme, "bare", times, args.batch, cache.nbytes / 2**30)
        if args.profile:
            from kvserve.kernels.bench_cases import kernel_records

            records = kernel_records(lambda: time_steps(model, cache, args.batch, PROFILED_STEPS))
            print(device_split(records, PROFILED_STEPS, "bare, steps evaluated one at a time", args.profile),
                  flush=True)
        del cache
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
