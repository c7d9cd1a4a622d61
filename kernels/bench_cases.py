"""Measurements behind ``kvserve bench-attention``: one decode step (L = 1) of attention over
B x H_kv x T stored tokens per implementation, timed, with its K/V bytes and peak memory.

Imported only after ``kvserve.kernels.bench.main`` has chosen the BLAS (it imports mlx).

    case = build_case("affine4", "ours", Shape(8, 32, 8, 128, 4096))
    row = measure(case, repeats=5)   # {"name": "ours affine4", "ms": ..., "GB/s": ..., ...}
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from kvserve.cache.affine import QuantizedFormat, attend_quantized, quantize_parts
from kvserve.cache.scheme import parse_scheme
from kvserve.cache.turbo_codec import attend_encoded, make_format
from kvserve.kernels import cpu_attention, cuda_attention, dispatch, reference

try:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    UNFUSED = "mlx-lm"
except ImportError:  # mlx-lm installed without its dependencies (e.g. on a bare GPU host)
    UNFUSED = "mlx-lm replica"

    def quantized_scaled_dot_product_attention(queries, q_keys, q_values, scale, mask,
                                               group_size=64, bits=8):
        """mlx-lm 0.32.2's ``models.base.quantized_scaled_dot_product_attention`` for
        mask None: two ``quantized_matmul`` over K/V broadcast to the query groups and an
        f32-precise softmax between them (the same ops, so the same cost)."""
        B, Hq, L, D = queries.shape
        n_rep = Hq // q_keys[0].shape[-3]
        queries = queries * scale
        if n_rep > 1:
            queries = mx.reshape(queries, (B, Hq // n_rep, n_rep, L, D))
            q_keys = [mx.expand_dims(x, axis=-3) for x in q_keys]
            q_values = [mx.expand_dims(x, axis=-3) for x in q_values]
        scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size,
                                     bits=bits)
        scores = mx.softmax(scores, axis=-1, precise=True)
        out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size,
                                  bits=bits)
        return mx.reshape(out, (B, Hq, L, D)) if n_rep > 1 else out

MiB = 1 << 20


@dataclass(frozen=True)
class Shape:
    B: int
    Hq: int
    Hkv: int
    D: int
    T: int
    L: int = 1  # queries per row: 1 a decode step, more a prompt chunk (every one sees all T)


@dataclass
class Case:
    """``run(q)`` is one attention call of queries ``q`` (B, H_q, L, D) over the case's K/V,
    returning the same shape and dtype, so calls chain (see ``measure``); ``check()`` is its
    max abs difference from the family's full-context reference (``attend_quantized`` /
    ``attend_encoded``), "-" for the baselines, which are not ours to check."""

    name: str
    run: Callable[[mx.array], mx.array]
    kv_bytes: int
    check: Callable[[], float | str]
    inputs: list  # queries first

    @property
    def queries(self) -> mx.array:
        return self.inputs[0]


def _nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays)


def _rand(shape: Shape, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """f16 queries (B, H_q, L, D), keys and values (B, H_kv, T, D)."""
    s = shape
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((s.B, s.Hq, s.L, s.D), key=kq).astype(mx.float16)
    k = mx.random.normal((s.B, s.Hkv, s.T, s.D), key=kk).astype(mx.float16)
    v = mx.random.normal((s.B, s.Hkv, s.T, s.D), key=kv).astype(mx.float16)
    return q, k, v


def _fp16_case(shape: Shape) -> Case:
    q, k, v = _rand(shape, 0)
    scale = shape.D ** -0.5
    run = lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=scale)
    return Case("fp16 mx.fast.sdpa", run, k.nbytes + v.nbytes, lambda: "-", [q, k, v])


def _mlx_lm_case(shape: Shape) -> Case:
    q, k, v = _rand(shape, 0)
    qk, qv = mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4)
    scale = shape.D ** -0.5
    run = lambda x: quantized_scaled_dot_product_attention(
        x, qk, qv, scale=scale, mask=None, group_size=64, bits=4)
    return Case(f"{UNFUSED} quantized sdpa 4-bit", run, _nbytes(qk) + _nbytes(qv), lambda: "-",
                [q, *qk, *qv])


def _affine_case(scheme_name: str, shape: Shape, path: str) -> Case:
    scheme, (q, k, v) = parse_scheme(scheme_name), _rand(shape, 0)
    kp, vp = tuple(quantize_parts(k, scheme.keys)), tuple(quantize_parts(v, scheme.values))
    kf, vf, scale = QuantizedFormat(scheme.keys), QuantizedFormat(scheme.values), shape.D ** -0.5
    fn = _path(path)
    run = lambda x: fn(x, kf, kp, vf, vp, scale, None)
    want = lambda: attend_quantized(q, kp, vp, scale, None, scheme.keys, scheme.values)
    return Case(f"ours {scheme_name} ({path})", run, _nbytes(kp) + _nbytes(vp),
                lambda: _diff(run(q), want, shape.T), [q, *kp, *vp])


def _turbo_case(scheme_name: str, shape: Shape, path: str) -> Case:
    scheme, (q, k, v) = parse_scheme(scheme_name), _rand(shape, 0)
    kf, vf = make_format(scheme.keys, shape.D), make_format(scheme.values, shape.D)
    kp, vp = _encode_in_chunks(kf, k), _encode_in_chunks(vf, v)
    scale, fn = shape.D ** -0.5, _path(path)
    run = lambda x: fn(x, kf, kp, vf, vp, scale, None)
    oracle = attend_encoded if scheme.values.kind == "turbo" else reference.attend_full  # fp16: no family oracle
    want = lambda: oracle(q, kf, kp, vf, vp, scale, None)
    return Case(f"ours {scheme_name} ({path})", run, _nbytes(kp) + _nbytes(vp),
                lambda: _diff(run(q), want, shape.T), [q, *kp, *vp])


def _encode_in_chunks(fmt, x: mx.array, chunk: int = 4096) -> tuple[mx.array, ...]:
    """Encode (B, H, T, D) a few thousand tokens at a time: the codec's broadcast
    comparison against the boundaries is (..., D, 2^b - 1) wide (8 GiB at T=64K, B=8)."""
    parts = []
    for start in range(0, x.shape[2], chunk):
        parts.append(fmt.encode(x[:, :, start:start + chunk]))
        mx.eval(parts[-1])
    return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(len(parts[0])))


def _path(path: str) -> Callable[..., mx.array]:
    return {"dispatch": dispatch.attend, "full": reference.attend_full, "cpu": cpu_attention.attend_cpu,
            "blockwise": reference.attend_blockwise, "cuda": cuda_attention.attend_cuda}[path]


CHECK_MAX_T = 8192  # beyond, the full-context references need GiBs (turbo: f32 centroids of all T)


def _diff(a: mx.array, want: Callable[[], mx.array], T: int) -> float | str:
    """max |a - reference|; the reference runs on the CPU stream, where every
    ``quantized_matmul`` shape has an f32 implementation (not so on CUDA)."""
    if T > CHECK_MAX_T:
        return "-"
    with mx.stream(mx.cpu):
        b = want()
        return mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()



def build_case(scheme_name: str, impl: str, shape: Shape) -> Case:
    """impl: "fp16" (mx.fast SDPA), "mlx-lm" (4-bit unfused) or a path of ours:
    "dispatch", "full", "blockwise", "cpu" (the CPU kernel), "cuda" over ``scheme_name``."""
    if impl == "fp16":
        return _fp16_case(shape)
    if impl == "mlx-lm":
        return _mlx_lm_case(shape)
    if parse_scheme(scheme_name).values.kind in ("turbo", "fp16"):  # formats of turbo_codec
        return _turbo_case(scheme_name, shape, impl)
    return _affine_case(scheme_name, shape, impl)


def measure(case: Case, repeats: int = 5, warmup: int = 2, calls: int = 1,
            profile: bool = False) -> dict:
    """Median time, K/V bytes read per ms -> GB/s, peak memory (all live arrays, K/V
    included) and the part of it the call itself added.

    ``ms`` times ``mx.eval`` of a chain of ``calls`` calls, each taking the previous call's
    output as its queries, whose graphs were built before the clock started, divided by
    ``calls``: on a GPU that is the device's work for one call after another, as the layers
    of a model step run (independent calls could overlap on the device, and one
    synchronisation per call would be part of every sub-millisecond figure). ``build_ms``
    is the Python time to build one call's graph, reported apart: in a model step it
    overlaps the device's work on earlier layers. ``profile``: the device's own times too
    (``device_times``)."""
    mx.eval(case.inputs)
    for _ in range(warmup):
        mx.eval(case.run(case.queries))
    times, builds = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = case.queries
        for _ in range(calls):
            x = case.run(x)
        t1 = time.perf_counter()
        mx.eval(x)
        times.append((time.perf_counter() - t1) / calls)
        builds.append((t1 - t0) / calls)
        del x
    ms = 1e3 * statistics.median(times)
    device = device_times(case, calls) if profile else {}
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(case.run(case.queries))
    peak = mx.get_peak_memory()
    return {"name": case.name, "ms": round(ms, 3), "build_ms": round(1e3 * statistics.median(builds), 3),
            "kv_MiB": round(case.kv_bytes / MiB, 2),
            "GB_s": round(case.kv_bytes / (ms * 1e6), 2), "peak_MiB": round(peak / MiB, 2),
            "extra_MiB": round((peak - base) / MiB, 2), "max_abs_diff": case.check(), **device}


def torch_sdpa(shape: Shape, repeats: int = 5, calls: int = 10) -> dict:
    """PyTorch's fp16 ``scaled_dot_product_attention`` (``enable_gqa``) on the same shapes, timed
    as ``measure`` times ours (a chain of ``calls`` calls, each output the next queries, over
    the clock until the device is done): the reference the GPU table is read against. {}
    without PyTorch or a CUDA device.
    """
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape.B, h, t, shape.D, device="cuda", dtype=torch.float16, generator=gen)
               for h, t in ((shape.Hq, shape.L), (shape.Hkv, shape.T), (shape.Hkv, shape.T)))

    def chain():
        x = q
        for _ in range(calls):
            x = F.scaled_dot_product_attention(x, k, v, enable_gqa=True)
        torch.cuda.synchronize()

    chain(), chain()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        chain()
        times.append((time.perf_counter() - t0) / calls)
    ms = 1e3 * statistics.median(times)
    kv_bytes = k.nbytes + v.nbytes
    row = {"name": f"torch {torch.__version__} fp16 sdpa (gqa)", "ms": round(ms, 3), "build_ms": "-",
           "kv_MiB": round(kv_bytes / MiB, 2), "GB_s": round(kv_bytes / (ms * 1e6), 2), "peak_MiB": "-",
           "extra_MiB": "-", "max_abs_diff": "-"}
    row.update(_device_columns(kernel_records(chain), calls, kv_bytes))
    del q, k, v
    torch.cuda.empty_cache()
    return row


def device_times(case: Case, calls: int) -> dict:
    """What the device itself spent on one call, from ``kernel_records`` of ``calls`` chained
    calls ({} where there are none):

    - ``kernel_ms``: the summed durations of one call's kernels; ``kernel_GB_s``: K/V bytes
      over that time, the kernels' own read rate;
    - ``span_ms``: first kernel start to last kernel end, per call. What ``ms`` exceeds
      ``kernel_ms`` by, the device spent waiting between kernels (MLX encoding and launching);
    - ``kernels``: how many kernels one call ran.
    """
    def chain():
        x = case.queries
        for _ in range(calls):
            x = case.run(x)
        mx.eval(x)

    return _device_columns(kernel_records(chain), calls, case.kv_bytes)


def _device_columns(records: list, calls: int, kv_bytes: int) -> dict:
    if not records:
        return {}
    busy_us = sum(end - start for _, start, end in records) / calls
    span_us = (max(r[2] for r in records) - min(r[1] for r in records)) / calls
    return {"kernel_ms": round(busy_us / 1e3, 4), "kernel_GB_s": round(kv_bytes / (busy_us * 1e3), 1),
            "span_ms": round(span_us / 1e3, 4), "kernels": round(len(records) / calls, 2)}


def kernel_records(run: Callable[[], None]) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of each kernel the device ran during ``run()``, from CUPTI's
    activity records through ``torch.profiler``: CUPTI records every kernel of the process,
    MLX's included. [] without PyTorch or a CUDA device.

        records = kernel_records(lambda: mx.eval(model(tokens, cache=cache)))
    """
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        mx.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]


def copy_bandwidth(n_bytes: int = 256 * MiB, repeats: int = 5, calls: int = 1) -> float:
    """GB/s of ``x + 1`` over n_bytes of f32: reads n_bytes and writes n_bytes (best of
    ``repeats``, each a chain of ``calls`` such copies evaluated together, as ``measure``
    chains attention calls)."""
    x = mx.zeros((n_bytes // 4,), mx.float32)
    mx.eval(x)
    mx.eval(x + 0)
    times = []
    for _ in range(repeats):
        y = x
        for _ in range(calls):
            y = y + 1
        t0 = time.perf_counter()
        mx.eval(y)
        times.append((time.perf_counter() - t0) / calls)
        del y
    return round(2 * n_bytes / (min(times) * 1e9), 2)
