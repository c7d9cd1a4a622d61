"""Pick, by measurement, how a loaded mlx-lm model keeps its weights.

On the CPU, the representation that is fastest depends on the machine and on
which BLAS MLX uses (see ``blas.py``): MLX's CPU quantized matmul is a scalar
loop (a 1536x576 matrix-vector product: ~0.5 ms with float32 activations,
~22 ms with float16 ones), while the BLAS shim does the dense float32
product in ~0.03 ms, so a 4-bit model is often faster as dense float32, at 8x
the memory.  Rather than guessing,
:func:`choose_weight_format` times each candidate on the model's own layer
shapes for a decode step (M=1) and a prefill chunk (M=128) and keeps the
fastest; :func:`apply_weight_format` then converts the model in place.

On a GPU the model keeps its own quantized weights: that is what MLX's GPU kernels are
built for. Its float32 parameters (a GGUF's norms) go to the half dtype of its other
weights (``HALF``): one float32 norm weight makes every activation after it float32, and
on a GPU that doubles the activations' and fp16 KV cache's bytes and keeps attention off
the tensor cores (the default model, 8 streams on an H200: TPOT 44 ms in float32).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from kvserve.server.models.blas import codes_library
from kvserve.server.models.packed import attach_codes, codes_layout

log = logging.getLogger(__name__)

AS_LOADED = "as-loaded"
AFFINE_F32 = "affine-f32scales"
DENSE_F32 = "dense-f32"
# Dense float32 for prefill, and decode products (at most 16 rows) that read the 4- or
# 8-bit codes the weights came from (``packed.py``): a fifth of the bytes per decode step.
DENSE_CODES = "dense-f32+codes"
# The model's own weights; float32 parameters in the half dtype of the others (a GPU's).
HALF = "as-loaded-half"
FORMATS = (AS_LOADED, AFFINE_F32, DENSE_F32, DENSE_CODES, HALF)

_PREFILL_M = 128
_SAMPLE_BYTES = 96 << 20  # f32 bytes of weights one decode pass streams: beyond on-chip caches
_SLOW_FACTOR = 3.0  # a candidate this much slower on one matrix is not timed further


@dataclass(frozen=True)
class WeightChoice:
    """A weight representation and the start-up measurements behind it.

    ``timings`` maps each candidate to its estimated whole-model milliseconds
    per token: ``{"decode": ms per generated token, "prefill": ms per prompt
    token}`` (scaled from the timed matrices by parameter count; matmuls only).
    """

    name: str
    reason: str
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    device: str = "cpu"

    def describe(self) -> str:
        """One line, e.g. for the start-up log and ``/v1/models``."""
        order = sorted(self.timings, key=lambda n: self.timings[n]["decode"] + self.timings[n]["prefill"])
        parts = [f"{n} {self.timings[n]['decode']:.1f}|{self.timings[n]['prefill']:.2f}" for n in order]
        measured = f"; est. matmul ms/token decode|prefill: {', '.join(parts)}" if parts else ""
        return f"{self.name} ({self.reason}{measured})"


def choose_weight_format(model: nn.Module, format: str = "auto", budget_s: float = 2.0) -> WeightChoice:
    """Measure the candidate weight formats for ``model`` and return the fastest.

    ``format`` other than "auto" (one of ``FORMATS``) is taken as is.
    ``budget_s`` bounds the start-up cost: slow candidates are cut short.
    """
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    if format != "auto":
        if format not in FORMATS:
            raise ValueError(f"unknown weight format {format!r}; one of {FORMATS} or 'auto'")
        _shim_for(format)
        return WeightChoice(format, "requested", {}, device)
    if device == "gpu":
        if half_dtype(model) is not None:
            return WeightChoice(HALF, "GPU: the model's own weights, float32 parameters in its half dtype", {}, device)
        return WeightChoice(AS_LOADED, "GPU: keeps the model's own weights", {}, device)
    candidates = _candidates(model)
    if len(candidates) == 1:
        return WeightChoice(AS_LOADED, "no other format applies", {}, device)
    timings = _measure(model, candidates, budget_s)
    best = min(timings, key=lambda n: timings[n]["decode"] + timings[n]["prefill"])
    return WeightChoice(best, "fastest measured", timings, device)


def apply_weight_format(model: nn.Module, choice: WeightChoice | str) -> nn.Module:
    """Convert ``model`` in place to the chosen format; returns the model."""
    name = choice.name if isinstance(choice, WeightChoice) else choice
    if name == AS_LOADED:
        return model
    if name == HALF:
        return _to_half(model)
    if name in (DENSE_F32, DENSE_CODES):
        _dequantize_modules(model, _shim_for(name))
    elif name != AFFINE_F32:
        raise ValueError(f"unknown weight format {name!r}")
    # Everything else (norms, scales, biases, embeddings) to float32 too, so the
    # activations stay float32 and MLX does no per-op dtype conversions.
    model.update(tree_map(_to_f32, model.parameters()))
    mx.eval(model.parameters())
    return model


def _shim_for(name: str):
    """The shim the format's decode products go through (None for formats without codes);
    raises for ``DENSE_CODES`` where the shim does not serve MLX."""
    if name != DENSE_CODES:
        return None
    lib = codes_library()
    if lib is None:
        raise ValueError(f"{DENSE_CODES} needs kvserve's BLAS shim (Linux, scipy-openblas32, a C compiler)")
    return lib


# -- candidates -------------------------------------------------------------


def _quantized(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def _candidates(model: nn.Module) -> list[str]:
    out = [AS_LOADED]
    quant = _quantized(model)
    affine = [m for m in quant if getattr(m, "mode", "affine") == "affine"]
    if any(m.scales.dtype != mx.float32 for m in affine):
        out.append(AFFINE_F32)
    not_f32 = quant or any(p.dtype != mx.float32 for _, p in _float_params(model))
    # Dense float32 is 8x the memory of 4-bit weights: only where it fits easily.
    if not_f32 and _dense_f32_bytes(model) < 0.5 * _available_memory():
        out.append(DENSE_F32)
        if codes_library() is not None and any(codes_layout(m) is not None for m in quant):
            out.append(DENSE_CODES)
    return out


def _float_params(model: nn.Module):
    return [(k, v) for k, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]


def _dense_f32_bytes(model: nn.Module) -> int:
    """float32 bytes of the model once every weight is dense."""
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            total += 4 * m.scales.shape[0] * m.scales.shape[-1] * m.group_size
        elif isinstance(m, nn.QuantizedEmbedding):
            total += 4 * m.num_embeddings * m.dims
    total += sum(4 * v.size for k, v in _float_params(model) if not k.endswith(("scales", "biases")))
    return total


def _available_memory() -> int:
    """Bytes that can be allocated without swapping: MemAvailable (free memory
    plus reclaimable page cache), else free pages, else unknown (no limit)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def half_dtype(model: nn.Module) -> mx.Dtype | None:
    """The half dtype (float16 or bfloat16) most of ``model``'s floating parameters are in,
    counted by elements, when some are float32; else None (nothing to change).

        >>> m = nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4))
        >>> m.layers[0].set_dtype(mx.float16); half_dtype(m)
        mlx.core.float16
        >>> m.layers[1].set_dtype(mx.float16); half_dtype(m) is None
        True
    """
    sizes: dict = {}
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.size
    halves = {d: n for d, n in sizes.items() if d in (mx.float16, mx.bfloat16)}
    if mx.float32 not in sizes or not halves:
        return None
    return max(halves, key=halves.get)


def _to_half(model: nn.Module) -> nn.Module:
    dtype = half_dtype(model)
    if dtype is not None:
        model.update(tree_map(lambda p: p.astype(dtype) if p.dtype == mx.float32 else p, model.parameters()))
        mx.eval(model.parameters())
    return model


def _to_f32(p: mx.array) -> mx.array:
    return p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) and p.dtype != mx.float32 else p


def _dense_weight(m: nn.Module) -> mx.array:
    # float32 scales first: MLX's CPU dequantize is ~4x slower on float16 ones.
    biases = m["biases"].astype(mx.float32) if "biases" in m else None
    return mx.dequantize(
        m.weight, m.scales.astype(mx.float32), biases, group_size=m.group_size,
        bits=m.bits, mode=getattr(m, "mode", "affine"),
    ).astype(mx.float32)


def _dequantize_modules(model: nn.Module, codes_lib=None) -> None:
    """Replace QuantizedLinear/QuantizedEmbedding with float32 Linear/Embedding; with
    ``codes_lib`` (the BLAS shim), each keeps the codes it came from for decode products."""
    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = _dense_weight(m)
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            new.weight = w
            if "bias" in m:
                new.bias = m.bias.astype(mx.float32)
        elif isinstance(m, nn.QuantizedEmbedding):
            w = _dense_weight(m)
            new = nn.Embedding(w.shape[0], w.shape[1])
            new.weight = w
        else:
            continue
        mx.eval(new.parameters())  # one module at a time: peak memory stays low
        if codes_lib is not None:
            attach_codes(new, m, codes_lib)
        swaps.append((path, new))
    if swaps:
        model.update_modules(tree_unflatten(swaps))


# -- measurement ------------------------------------------------------------


def _matmul_modules(model: nn.Module) -> list[nn.Module]:
    """The model's projection matrices (embedding excluded), in layer order."""
    return [
        m for _, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and "weight" in m
    ]


def _in_out(m: nn.Module) -> tuple[int, int]:
    if isinstance(m, nn.QuantizedLinear):
        return m.scales.shape[-1] * m.group_size, m.weight.shape[0]
    return m.weight.shape[1], m.weight.shape[0]


def _sample(mods: list[nn.Module]) -> list[nn.Module]:
    """Leading matrices whose float32 size reaches _SAMPLE_BYTES, so a decode
    pass streams weights from memory as a real step does."""
    out, size = [], 0
    for m in mods:
        out.append(m)
        i, o = _in_out(m)
        size += 4 * i * o
        if size >= _SAMPLE_BYTES:
            break
    return out


def _activation_dtype(model: nn.Module, fallback: mx.Dtype) -> mx.Dtype:
    """The dtype the model's matmuls see: a lazily built forward's output dtype
    (nothing is computed).  Models with float32 norms run float32 activations
    even over float16 scales, which MLX's CPU kernels handle very differently."""
    try:
        return model(mx.array([[0]])).dtype
    except Exception:  # noqa: BLE001  (any model-specific failure: use the weights' dtype)
        return fallback


def _op(m: nn.Module, fmt: str, act: mx.Dtype) -> Callable[[mx.array], mx.array]:
    """A matmul with ``m``'s weights in format ``fmt``; inputs of dtype ``act``
    for "as-loaded", float32 otherwise."""
    if fmt == AS_LOADED:
        return lambda x: m(x.astype(act))
    if fmt == AFFINE_F32 and isinstance(m, nn.QuantizedLinear) and "biases" in m:
        w, s, b = m.weight, m.scales.astype(mx.float32), m.biases.astype(mx.float32)
        mx.eval(s, b)
        gs, bits = m.group_size, m.bits
        return lambda x: mx.quantized_matmul(x, w, s, b, True, gs, bits)
    dense = nn.Linear(1, 1, bias=False)
    dense.weight = _dense_weight(m) if isinstance(m, nn.QuantizedLinear) else m.weight.astype(mx.float32)
    mx.eval(dense.weight)
    if fmt == DENSE_CODES and isinstance(m, nn.QuantizedLinear):
        attach_codes(dense, m, _shim_for(fmt))
    return lambda x: x @ dense.weight.T


def _time(fn: Callable[[], list[mx.array]], deadline: float, reps: int = 20, least: int = 3) -> float:
    """Best seconds of one evaluated call, repeating until ``reps`` or the
    deadline.  Best-of, because the first passes over freshly made weights pay
    page faults and cold caches that serving does not; but a first call that alone
    overruns the deadline is not repeated: a candidate that slow is out of the running
    whatever its warm time (MLX's CPU quantized matmul with float16 activations: 10 s
    for one row through a 4096 x 49152 head, where three passes were 30 s of start-up)."""
    best = float("inf")
    for i in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline and (i + 1 >= least or i == 0):
            break
    return best


def _measure(model: nn.Module, candidates: list[str], budget_s: float) -> dict[str, dict[str, float]]:
    mods = _matmul_modules(model)
    bench = _Bench(_sample(mods), sum(i * o for i, o in map(_in_out, mods)) + _head_params(model))
    act = _activation_dtype(model, mx.float32)
    timings: dict[str, dict[str, float]] = {}
    # Likely-fastest first, so that slow candidates can be cut short against it.
    for n, fmt in enumerate(sorted(candidates, key=[DENSE_CODES, DENSE_F32, AFFINE_F32, AS_LOADED].index)):
        budget = budget_s * (0.5 if n == 0 else 0.5 / (len(candidates) - 1))
        best = min((t["decode"] for t in timings.values()), default=float("inf"))
        timings[fmt] = bench.run(fmt, act, time.perf_counter() + budget, best)
        log.info("weight format %s: %s", fmt, timings[fmt])
    return timings


def _head_params(model: nn.Module) -> int:
    """Parameters of the output projection when it is the tied embedding."""
    if "lm_head" in model.children():
        return 0  # an untied lm_head is already among the Linear modules
    embed = [m for _, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
    if not embed:
        return 0
    e = embed[0]
    return e.weight.shape[0] * (e.dims if isinstance(e, nn.QuantizedEmbedding) else e.weight.shape[1])


@dataclass
class _Bench:
    """Times one candidate on the model's own matrices and scales the result,
    by parameter count, to whole-model milliseconds per token."""

    sample: list  # the matrices a decode pass is timed over
    total: int  # parameters of all the model's matmuls, tied output head included

    def run(self, fmt: str, act: mx.Dtype, deadline: float, best_ms: float) -> dict[str, float]:
        big = max(self.sample, key=lambda m: _in_out(m)[0] * _in_out(m)[1])
        i, o = _in_out(big)
        per_param = self._decode_one(big, fmt, act, deadline) / (i * o)
        # Only a candidate in the running streams the whole sample: that is
        # what shows the memory traffic of a real decode step.
        if per_param * self.total * 1e3 >= _SLOW_FACTOR * best_ms:
            # Out of the running: no prefill probe (rows x passes of a slow kernel were
            # minutes of start-up). A prompt row costs at most what a lone row does.
            ms = per_param * self.total * 1e3
            return {"decode": ms, "prefill": ms}
        per_param = self._decode_sample(fmt, act, deadline)
        rows = self._prefill_rows(per_param * i * o, deadline)
        f, x = _op(big, fmt, act), mx.random.normal((rows, i))
        mx.eval(x)
        prefill = _time(lambda: [f(x)], deadline, reps=3) / rows
        return {"decode": per_param * self.total * 1e3, "prefill": prefill / (i * o) * self.total * 1e3}

    def _decode_one(self, m, fmt, act, deadline) -> float:
        f, x = _op(m, fmt, act), mx.random.normal((1, _in_out(m)[0]))
        mx.eval(x)
        return _time(lambda: [f(x)], min(deadline, time.perf_counter() + 0.1), reps=5)

    def _decode_sample(self, fmt, act, deadline) -> float:
        ops = [_op(m, fmt, act) for m in self.sample]
        xs = [mx.random.normal((1, _in_out(m)[0])) for m in self.sample]
        mx.eval(xs)
        params = sum(a * b for a, b in map(_in_out, self.sample))
        # At least 8 passes: the first few over new weights run 2-3x slow.
        return _time(lambda: [f(x) for f, x in zip(ops, xs)], deadline, least=8) / params

    @staticmethod
    def _prefill_rows(one_row_s: float, deadline: float) -> int:
        """Rows for the prefill probe: _PREFILL_M, or fewer when a kernel is so
        slow (per-row cost, no batching gain) that M=128 would blow the budget."""
        left = max(deadline - time.perf_counter(), 0.05)
        return int(min(_PREFILL_M, max(8, left / 4 / max(one_row_s, 1e-9))))
