"""``kvserve eval-kv``: how far each KV cache scheme moves a model's next-token distribution.

Teacher forcing on a fixed text (the GNU GPL v3, shipped as ``data/eval-gpl-3.0.txt``), the
same weights for every scheme, the fp16 cache as the reference. With N prompt tokens and K
eval tokens, the text's tokens t_0 .. t_{N+K} are used:

    prefill   t_0 .. t_{N-1}       one forward (L = N); its last logits predict t_N
    decode    t_N .. t_{N+K-1}     K forwards of ONE token (L = 1); step i predicts t_{N+i+1}

The K decode steps are the scored positions (KL, top-1, perplexity of t_{N+1} .. t_{N+K}):
each attends over the whole cache in its stored form. A full-sequence forward would measure
nothing for TurboQuant, whose prefill attends over raw keys and values. For the same reason the
prefill's last position (predicting t_N) is reported on its own, ``prefill_kl``, and kept out
of the aggregates: it is exactly 0 for TurboQuant and would only dilute the mean.

Per scheme: KL(p_fp16 || p_scheme) per position, computed in float64 with natural logs (mean,
p99 with linear interpolation, max); top-1 agreement (argmax equal); the perplexity of the
ground-truth continuation under fp16 and under the scheme; KV bytes per token, both allocated
(``cache.nbytes``, which counts capacity) and stored (the arrays of ``cache.state``, which hold
exactly ``offset`` tokens), and compression = fp16 bytes / scheme bytes, measured on the fp16
run (whose cache holds the model's activation dtype, float32 after ``dense-f32`` weights).

The fp16 scheme always runs first and is compared with the reference like any other: it is
the noise floor, and on a deterministic backend its KL is exactly 0.

Example, the KL of one position by hand: p = softmax([0, 0]) = [1/2, 1/2],
q = softmax([0, ln 3]) = [1/4, 3/4]; KL(p || q) = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3):

    >>> round(float(kl_divergence(np.array([[0.0, 0.0]]), np.array([[0.0, np.log(3.0)]]))[0]), 6)
    0.143841
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kvserve.cache import SCHEME_NAMES, PromptCache, UnknownScheme, parse_scheme
from kvserve.server.models.blas import enable_fast_blas

EVAL_TEXT = "eval-gpl-3.0.txt"
PROGRESS_EVERY = 32  # decode steps between progress lines
Progress = Callable[[str], None] | None


# ----------------------------------------------------------------------------- text


def load_eval_text() -> str:
    """The evaluation text shipped with the package (read through importlib.resources, so it
    works from an installed wheel as well as from a checkout)."""
    return (resources.files("kvserve.server.engine") / "data" / EVAL_TEXT).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- metrics


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64, shifted by the row max so large logits cannot overflow.

        >>> np.round(np.exp(log_softmax(np.array([[1000.0, 1000.0]]))), 3).tolist()
        [[0.5, 0.5]]
    """
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(p_ref || p) per row, natural log, float64: sum_v p_ref(v) (log p_ref(v) - log p(v)).

    Rows given as logits (P, V); returns (P,). Identical rows give exactly 0.
    """
    ref, other = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(ref) * (ref - other)).sum(axis=-1)


def negative_log_likelihood(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row, float64: (P, V) logits and (P,) token ids -> (P,)."""
    lp = log_softmax(logits)
    return -lp[np.arange(len(targets)), targets]


def perplexity(nll: np.ndarray) -> float:
    """exp(mean negative log-likelihood)."""
    return float(np.exp(nll.mean()))


# ----------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class ForcedRun:
    """One teacher-forced pass under one scheme.

    ``logits`` (K + 1, V) float32: row 0 is the prefill's last position, row i the i-th
    decode step. Byte counts are summed over every layer after the last step.
    """

    scheme: str
    logits: np.ndarray
    kv_tokens: int
    allocated_bytes: int
    stored_bytes: int
    cache_dtypes: tuple[str, ...]
    seconds: float


def _state_arrays(cache: PromptCache) -> list[mx.array]:
    """Every array of every layer's ``state`` (layers of other attention types included)."""
    return [a for _, a in tree_flatten(cache.state) if isinstance(a, mx.array)]


def _dtype_name(dtype: mx.Dtype) -> str:
    """'float32' for mx.float32 (``str`` gives 'mlx.core.float32')."""
    return str(dtype).rsplit(".", 1)[-1]


def _logits_row(logits: mx.array) -> np.ndarray:
    """The last position's logits as float32 numpy (bf16 / f16 have no exact numpy twin)."""
    return np.array(logits[0, -1].astype(mx.float32))


def _forward(model: Any, cache: PromptCache, tokens: Sequence[int]) -> np.ndarray:
    """One forward over ``tokens``; converts inside the container afterwards, as a server does."""
    logits = model(mx.array(list(tokens), dtype=mx.int32)[None], cache=cache)
    cache.maybe_convert()
    return _logits_row(logits)


def teacher_forced(model: Any, tokens: Sequence[int], scheme: str, prompt_tokens: int,
                   eval_tokens: int, progress: Progress = None) -> ForcedRun:
    """Prefill ``prompt_tokens`` tokens, then feed ``eval_tokens`` ground-truth tokens one at
    a time, keeping the logits of every step (row 0: the prefill's last position)."""
    start = time.perf_counter()
    cache = PromptCache.for_model(model, scheme)
    first = _forward(model, cache, tokens[:prompt_tokens])
    rows = np.empty((eval_tokens + 1, first.shape[-1]), np.float32)
    rows[0] = first
    for i in range(eval_tokens):
        rows[i + 1] = _forward(model, cache, tokens[prompt_tokens + i: prompt_tokens + i + 1])
        if progress and ((i + 1) % PROGRESS_EVERY == 0 or i + 1 == eval_tokens):
            progress(f"{scheme}: {i + 1}/{eval_tokens}")
    arrays = _state_arrays(cache)
    return ForcedRun(scheme, rows, int(cache.offset), int(cache.nbytes),
                     sum(a.nbytes for a in arrays), tuple(sorted({_dtype_name(a.dtype) for a in arrays})),
                     time.perf_counter() - start)


# ----------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class SchemeReport:
    """One scheme against the fp16 reference. Metrics are None when the scheme failed
    (``error`` says why). ``top1_agreement`` is a fraction; perplexities are per token."""

    scheme: str
    positions: int
    kv_tokens: int | None = None
    allocated_bytes_per_token: float | None = None
    stored_bytes_per_token: float | None = None
    compression_allocated: float | None = None
    compression_stored: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None
    ppl_fp16: float | None = None
    ppl_scheme: float | None = None
    prefill_kl: float | None = None
    cache_dtypes: tuple[str, ...] = ()
    seconds: float | None = None
    error: str | None = None


def compare(ref: ForcedRun, run: ForcedRun, targets: np.ndarray,
            fp16_bytes: tuple[float, float]) -> SchemeReport:
    """Score ``run`` against ``ref`` on the decode positions (rows 1..K); ``targets`` (K,)
    are the ground-truth next tokens, ``fp16_bytes`` the fp16 (allocated, stored) bytes/token."""
    kl = kl_divergence(ref.logits[1:], run.logits[1:])
    prefill_kl = kl_divergence(ref.logits[:1], run.logits[:1])[0]
    allocated = run.allocated_bytes / run.kv_tokens
    stored = run.stored_bytes / run.kv_tokens
    return SchemeReport(
        scheme=run.scheme, positions=len(kl), kv_tokens=run.kv_tokens,
        allocated_bytes_per_token=allocated, stored_bytes_per_token=stored,
        compression_allocated=fp16_bytes[0] / allocated, compression_stored=fp16_bytes[1] / stored,
        kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)), kl_max=float(kl.max()),
        top1_agreement=float(np.mean(ref.logits[1:].argmax(-1) == run.logits[1:].argmax(-1))),
        ppl_fp16=perplexity(negative_log_likelihood(ref.logits[1:], targets)),
        ppl_scheme=perplexity(negative_log_likelihood(run.logits[1:], targets)),
        prefill_kl=float(prefill_kl), cache_dtypes=run.cache_dtypes, seconds=run.seconds)


def scheme_order(schemes: Sequence[str]) -> list[str]:
    """Canonical names, fp16 first (the noise floor), duplicates dropped.

        >>> scheme_order(["affine4-g64", "turbo0v4", "affine4"])
        ['fp16', 'affine4', 'turbo0v4']
    """
    names = ["fp16"] + [parse_scheme(s).name for s in schemes]
    return list(dict.fromkeys(names))


def run_eval(model: Any, tokens: Sequence[int], schemes: Sequence[str], prompt_tokens: int = 512,
             eval_tokens: int = 256, progress: Progress = None) -> list[SchemeReport]:
    """Teacher-forced comparison of ``schemes`` with an fp16 reference run; fp16 is always
    evaluated too (first) and its report is the noise floor. A scheme that raises gets a
    report with ``error`` set; the others still run."""
    if prompt_tokens < 1 or eval_tokens < 1:
        raise ValueError("prompt_tokens and eval_tokens must be at least 1")
    need = prompt_tokens + eval_tokens + 1
    if len(tokens) < need:
        raise ValueError(f"the text has {len(tokens)} tokens; {need} are needed")
    tokens = [int(t) for t in tokens[:need]]
    targets = np.array(tokens[prompt_tokens + 1:], dtype=np.int64)  # t_{N+1} .. t_{N+K}
    ref = teacher_forced(model, tokens, "fp16", prompt_tokens, eval_tokens,
                         progress and (lambda line: progress(f"reference {line}")))
    fp16_bytes = (ref.allocated_bytes / ref.kv_tokens, ref.stored_bytes / ref.kv_tokens)
    reports = []
    for name in scheme_order(schemes):
        try:
            run = teacher_forced(model, tokens, name, prompt_tokens, eval_tokens, progress)
        except Exception as exc:  # noqa: BLE001  (one broken scheme must not hide the others)
            if progress:
                progress(f"{name}: FAILED\n{traceback.format_exc()}")
            reports.append(SchemeReport(name, eval_tokens, error=f"{type(exc).__name__}: {exc}"))
            continue
        reports.append(compare(ref, run, targets, fp16_bytes))
    return reports


# ----------------------------------------------------------------------------- output


@dataclass(frozen=True)
class EvalContext:
    """Where and how a table was measured."""

    command: str
    date: str
    machine: str
    mlx: str
    mlx_lm: str
    model: str
    weights: str
    text: str
    prompt_tokens: int
    eval_tokens: int
    seconds: float


def machine_description() -> str:
    """CPU model (from /proc/cpuinfo where there is one), core counts and OS.

    e.g. "Intel(R) Xeon(R) Processor, 2 cores (2 usable), Linux-6.8 x86_64"."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {os.cpu_count()} cores ({usable} usable), {platform.platform()}"


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _row(r: SchemeReport) -> str:
    if r.error is not None:
        return f"| {r.scheme} | failed: {r.error.replace('|', '/')} |" + " |" * 9
    ppl = f"{r.ppl_fp16:.3f} → {r.ppl_scheme:.3f}"
    cells = [r.scheme, _num(r.stored_bytes_per_token, ".0f"), _num(r.allocated_bytes_per_token, ".0f"),
             f"{r.compression_stored:.2f}× / {r.compression_allocated:.2f}×", _num(r.kl_mean, ".5f"),
             _num(r.kl_p99, ".5f"), _num(r.kl_max, ".4f"), f"{100 * r.top1_agreement:.1f}%", ppl,
             _num(r.prefill_kl, ".5f"), _num(r.seconds, ".1f")]
    return "| " + " | ".join(cells) + " |"


TABLE_HEAD = ("| scheme | B/token stored | B/token allocated | compression stored / alloc. | mean KL "
              "| p99 KL | max KL | top-1 | perplexity fp16 → scheme | prefill KL | s |\n"
              "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")


def format_markdown(reports: Sequence[SchemeReport], context: EvalContext) -> str:
    """The table, then the context it was measured in and how to read it."""
    c = context
    floor = next((r for r in reports if r.scheme == "fp16" and r.error is None), None)
    lines = [
        "| | |", "|---|---|",
        f"| command | `{c.command}` |", f"| date | {c.date} |", f"| machine | {c.machine} |",
        f"| mlx / mlx-lm | {c.mlx} / {c.mlx_lm} |", f"| model | {c.model} |",
        f"| weights | {c.weights} |", f"| text | {c.text} |",
        (f"| positions | prefill {c.prompt_tokens} tokens, then {c.eval_tokens} fed one at a time "
         f"(scored: the {c.eval_tokens} decode steps) |"),
        f"| total time | {c.seconds:.0f} s |", "",
        TABLE_HEAD, *(_row(r) for r in reports), "",
        "KL is KL(p_fp16 ‖ p_scheme) per position (nats, float64). The fp16 row is a second fp16 "
        "run: the noise floor" + ("" if floor is None else f" (mean KL {floor.kl_mean:g}, "
                                  f"top-1 {100 * floor.top1_agreement:.1f}%)") + ". "
        "Prefill KL is the prefill's last position, kept out of the other columns. "
        "Bytes are all layers' K+V per token: stored = the arrays of `cache.state`, allocated = "
        "`cache.nbytes` (capacity); compression is measured against the fp16 run, whose cache "
        "holds the activation dtype (" + ", ".join(floor.cache_dtypes if floor else ()) + ").",
    ]
    return "\n".join(lines) + "\n"


def _clean(x: Any) -> Any:
    """NaN / inf -> None, so the output is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def to_json(reports: Sequence[SchemeReport], context: EvalContext) -> str:
    """``{"context": {...}, "reports": [{...}, ...]}`` as strict JSON."""
    data = {"context": asdict(context), "reports": [asdict(r) for r in reports]}
    return json.dumps(_clean(data), indent=2, allow_nan=False)


# ----------------------------------------------------------------------------- command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve eval-kv",
        description="Teacher-forced comparison of KV cache schemes against the fp16 cache.")
    p.add_argument("--model", help="anything --model of serve takes (default: SmolLM2-135M-Instruct)")
    p.add_argument("--schemes", default="all",
                   help=f"comma-separated schemes, or 'all' ({', '.join(SCHEME_NAMES)})")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens prefilled (default 512)")
    p.add_argument("--eval-tokens", type=int, default=256,
                   help="ground-truth tokens fed one at a time and scored (default 256)")
    # Not "auto": serve's start-up measurement can pick another format from one run to the
    # next on a busy machine, and a table should be reproducible. The comparison itself holds
    # for any format, since every scheme and the reference share the weights of one run.
    p.add_argument("--weight-format", default="dense-f32",
                   help="dense-f32 (default), affine-f32scales, as-loaded, or 'auto' (measured, as serve does)")
    p.add_argument("--cache-dir", help="where converted models are kept")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    return p


def parse_scheme_list(text: str) -> list[str]:
    """'all' or a comma-separated list -> canonical names; raises ``UnknownScheme``."""
    if text.strip().lower() == "all":
        return list(SCHEME_NAMES)
    return [parse_scheme(s).name for s in text.split(",") if s.strip()]


def load_model(spec: str | None, weight_format: str, cache_dir: str | None,
               progress: Progress = None) -> tuple[Any, Any, str, str]:
    """(model, tokenizer, model path, weight choice description), weights converted as serve does."""
    import mlx_lm
    from kvserve.configs import default_cache_dir
    from kvserve.server.models.source import resolve_model
    from kvserve.server.models.weights import apply_weight_format, choose_weight_format

    path = resolve_model(spec, Path(cache_dir) if cache_dir else default_cache_dir(), progress)
    model, tokenizer = mlx_lm.load(str(path))
    choice = choose_weight_format(model, weight_format)
    apply_weight_format(model, choice)
    return model, tokenizer, str(path), choice.name


def _progress(line: str) -> None:
    print(f"eval-kv: {line}", file=sys.stderr, flush=True)


def _context(args: list[str], opts: argparse.Namespace, path: str, weights: str,
             seconds: float) -> EvalContext:
    import mlx_lm

    return EvalContext(
        command="kvserve eval-kv " + shlex.join(args),
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine_description(), mlx=mx.__version__, mlx_lm=mlx_lm.__version__,
        model=path, weights=weights, text=f"{EVAL_TEXT} (GNU GPL v3, verbatim)",
        prompt_tokens=opts.prompt_tokens, eval_tokens=opts.eval_tokens, seconds=seconds)


def main(args: list[str]) -> int:
    """``kvserve eval-kv [options]``: 0 when every scheme ran, 1 when one failed or the model
    could not be loaded, 2 for bad arguments."""
    from kvserve.server.models.errors import ModelLoadError

    opts = _parser().parse_args(args)
    enable_fast_blas()  # a no-op when the CLI did it already
    try:
        schemes = parse_scheme_list(opts.schemes)
        model, tokenizer, path, weights = load_model(opts.model, opts.weight_format,
                                                     opts.cache_dir, _progress)
    except (UnknownScheme, ValueError) as exc:
        print(f"kvserve eval-kv: error: {exc}", file=sys.stderr)
        return 2
    except ModelLoadError as exc:
        print(f"kvserve eval-kv: error: {exc}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    try:
        reports = run_eval(model, tokenizer.encode(load_eval_text()), schemes,
                           opts.prompt_tokens, opts.eval_tokens, _progress)
    except ValueError as exc:  # too few tokens, bad counts
        print(f"kvserve eval-kv: error: {exc}", file=sys.stderr)
        return 2
    context = _context(args, opts, path, weights, time.perf_counter() - start)
    print(to_json(reports, context) if opts.json else format_markdown(reports, context), end="")
    return 0 if all(r.error is None for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
