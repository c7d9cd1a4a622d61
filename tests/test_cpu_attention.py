"""The CPU kernel for affine K/V (``kernels/cpu_attention.cpp``) equals the pure-MLX path.

Tolerances as in test_kernels.py: outputs of unit scale, 1e-4 for f32 queries; f16/bf16
outputs are rounded to the queries' dtype after f32 math that differs in summation order
(4e-3, 3e-2).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from test_kernels import _case as kernel_case
from test_kernels import _mask as kernel_mask

from kvserve.cache import SCHEME_NAMES
from kvserve.cache.affine import QuantizedFormat
from kvserve.cache.base import causal_mask
from kvserve.cache.scheme import parse_scheme
from kvserve.cache.turbo_codec import RawFormat, make_format
from kvserve.kernels import cpu_attention, dispatch
from kvserve.kernels.reference import attend_full

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the CPU kernel could not be built here")

TOL = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}
SCHEMES = ["affine4", "affine8", "affine4-g32", "affine8-g128"]
# (D, L, T, dtype, mask, sinks), cycled over the schemes so each value meets each scheme,
# and thinned to every third.
GRID = itertools.product([64, 128], [1, 4, 40], [1, 63, 300], [mx.float32, mx.float16, mx.bfloat16],
                         ["none", "causal", "padded"], [False, True])
CASES = [(SCHEMES[i % len(SCHEMES)], *c) for i, c in enumerate(GRID)
         if c[1] <= c[2] and c[0] % parse_scheme(SCHEMES[i % len(SCHEMES)]).keys.group_size == 0][::3]


def _rand(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _stored(x: mx.array, fmt, extra: int = 7) -> tuple[mx.array, ...]:
    """Quantized parts as a cache returns them: views of buffers longer than T."""
    T = x.shape[2]
    padded = mx.concatenate([x, mx.zeros((*x.shape[:2], extra, x.shape[3]), x.dtype)], axis=2)
    return tuple(p[:, :, :T] for p in mx.quantize(padded, fmt.group_size, fmt.bits))


def _mask(kind: str, B: int, L: int, T: int):
    if kind == "none" or (kind == "causal" and L == 1):
        return None if kind == "none" else "causal"
    if kind == "causal":
        return "causal"
    pads = mx.array([min(i * 3, T - 1) for i in range(B)])  # never a whole row hidden
    return causal_mask(L, T - L, pads) if L <= T else None


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_equals_the_full_path(case):
    name, D, L, T, dtype, mask_kind, with_sinks = CASES[case]
    scheme = parse_scheme(name)
    B, H_kv, R = 3, 2, 3
    q = _rand((B, H_kv * R, L, D), case, dtype)
    kp = _stored(_rand((B, H_kv, T, D), case + 1, dtype) * 2, scheme.keys)
    vp = _stored(_rand((B, H_kv, T, D), case + 2, dtype), scheme.values)
    kf, vf = QuantizedFormat(scheme.keys), QuantizedFormat(scheme.values)
    mask = _mask(mask_kind, B, L, T)
    sinks = _rand((H_kv * R,), case + 3) if with_sinks else None
    got = cpu_attention.attend_cpu(q, kf, kp, vf, vp, D ** -0.5, mask, sinks=sinks)
    want = attend_full(q, kf, kp, vf, vp, D ** -0.5, mask, sinks=sinks)
    assert got.dtype == dtype and got.shape == want.shape
    assert mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item() <= TOL[dtype]


def test_per_head_mask_and_fully_masked_rows():
    """A (B, H_q, L, T) mask is read per query head; a row with every slot hidden averages
    its values uniformly, as the full path does."""
    scheme = parse_scheme("affine4")
    fmt = QuantizedFormat(scheme.keys)
    q = _rand((2, 4, 1, 64), 1)
    kp, vp = _stored(_rand((2, 2, 40, 64), 2), scheme.keys), _stored(_rand((2, 2, 40, 64), 3), scheme.values)
    mask = _rand((2, 4, 1, 40), 4) > 0
    mask = mx.concatenate([mask[:, :3], mx.zeros((2, 1, 1, 40), mx.bool_)], axis=1)  # head 3: all hidden
    got = cpu_attention.attend_cpu(q, fmt, kp, fmt, vp, 0.125, mask)
    want = attend_full(q, fmt, kp, fmt, vp, 0.125, mask)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_dispatch_picks_the_kernel_for_every_format_it_reads():
    affine = QuantizedFormat(parse_scheme("affine4").keys)
    mx_fmt = QuantizedFormat(parse_scheme("mxfp4").keys)
    assert dispatch.choose(affine, affine, 1, 100, mx.cpu) == "cpu-stored"
    assert dispatch.choose(affine, affine, 256, 100, mx.cpu) == "cpu-stored"
    assert dispatch.choose(mx_fmt, mx_fmt, 1, 100, mx.cpu) == "full"


@pytest.mark.parametrize("mask", ["causal", "array", None])
def test_chunks_past_the_score_bound_run_in_pieces_with_the_same_bits(monkeypatch, mask):
    """The same call, with the bound below its n_rep * L * T scores: the kernel serves it in
    pieces of query rows (3 rows a call here, the last piece 2), bit for bit what one call
    gives; a causal piece reads only the keys its rows see."""
    scheme = parse_scheme("affine4")
    fmt = QuantizedFormat(scheme.keys)
    q = _rand((1, 4, 8, 64), 1)
    kp, vp = _stored(_rand((1, 2, 40, 64), 2), scheme.keys), _stored(_rand((1, 2, 40, 64), 3), scheme.values)
    m = causal_mask(8, 32) if mask == "array" else mask
    whole = cpu_attention.attend_cpu(q, fmt, kp, fmt, vp, 0.125, m)
    monkeypatch.setattr(cpu_attention, "MAX_SCORES", 2 * 3 * 40 + 1)
    lengths = []
    real = cpu_attention._module

    def counting():
        module = real()

        class Counted:
            def stored_attention(self, q, *rest):
                lengths.append((q.shape[2], rest[4][0].shape[2]))  # (rows, keys): after the keys' 4 spec fields
                return module.stored_attention(q, *rest)
        return Counted()

    monkeypatch.setattr(cpu_attention, "_module", counting)
    got = cpu_attention.attend_cpu(q, fmt, kp, fmt, vp, 0.125, m)
    assert lengths == ([(3, 35), (3, 38), (2, 40)] if mask == "causal" else [(3, 40), (3, 40), (2, 40)])
    assert mx.array_equal(got, whole).item()


def test_one_row_past_the_score_bound_takes_the_blockwise_reference(monkeypatch):
    scheme = parse_scheme("affine4")
    fmt = QuantizedFormat(scheme.keys)
    q = _rand((1, 4, 8, 64), 1)
    kp, vp = _stored(_rand((1, 2, 40, 64), 2), scheme.keys), _stored(_rand((1, 2, 40, 64), 3), scheme.values)
    monkeypatch.setattr(cpu_attention, "MAX_SCORES", 2 * 40 - 1)
    calls = []
    monkeypatch.setattr(cpu_attention, "attend_blockwise", lambda *a, **k: calls.append(1) or attend_full(*a, **k))
    got = cpu_attention.attend_cpu(q, fmt, kp, fmt, vp, 0.125, "causal")
    assert calls and mx.allclose(got, attend_full(q, fmt, kp, fmt, vp, 0.125, "causal"), atol=1e-5).item()


@pytest.mark.parametrize("L", [1, 3])
def test_stale_slots_behind_a_mask_never_leak(L):
    """Slots a boolean mask hides (outside a window, padding) may hold anything, even inf:
    the output equals the same call with those slots zeroed. A KV head's 3 L rows are
    weighted together (``accumulate_rows``: 3 at L = 1, then 4, 4 and 1 at L = 3), each row
    keeping its sum where its p is 0, and the first 16 slots, which every row hides, skipped
    whole."""
    fmt = RawFormat(64)
    q = _rand((1, 6, L, 64), 1)
    k, v = _rand((1, 2, 40, 64), 2), _rand((1, 2, 40, 64), 3)
    hidden = mx.arange(40) < 22  # the first 22 slots hidden: one whole block of 16, then 6
    mask = ~hidden[None, None, None]
    stale = lambda x: mx.where(hidden[None, None, :, None], mx.array(float("inf")), x)  # noqa: E731
    clean = lambda x: mx.where(hidden[None, None, :, None], 0.0, x)  # noqa: E731
    got = cpu_attention.attend_cpu(q, fmt, (stale(k),), fmt, (stale(v),), 0.125, mask)
    want = attend_full(q, fmt, (clean(k),), fmt, (clean(v),), 0.125, mask)
    assert mx.all(mx.isfinite(got)).item() and mx.allclose(got, want, atol=1e-5).item()


def test_stale_affine_slots_behind_a_mask_never_leak():
    """Affine keys are scored as codes and scaled after, values weighted as codes: a hidden
    slot whose scales and biases are infinite (a stale slot of a buffer) changes nothing."""
    scheme = parse_scheme("affine4")
    fmt = QuantizedFormat(scheme.keys)
    q = _rand((2, 6, 3, 64), 1)
    hidden = mx.arange(40) < 9
    mask = ~hidden[None, None, None]  # (1, 1, 1, T): every row and query

    def spoiled(parts, fill):
        codes, scales, biases = parts
        where = hidden[None, None, :, None]
        return codes, mx.where(where, fill, scales), mx.where(where, fill, biases)

    kp, vp = _stored(_rand((2, 3, 40, 64), 2), scheme.keys), _stored(_rand((2, 3, 40, 64), 3), scheme.values)
    inf = mx.array(float("inf"))
    got = cpu_attention.attend_cpu(q, fmt, spoiled(kp, inf), fmt, spoiled(vp, inf), 0.125, mask)
    want = attend_full(q, fmt, spoiled(kp, 0.0), fmt, spoiled(vp, 0.0), 0.125, mask)
    assert mx.all(mx.isfinite(got)).item() and mx.allclose(got, want, atol=1e-4).item()


@pytest.mark.parametrize("name", ["fp16", "affine4", "affine8", "affine4-g32", "turbo0v4"])
def test_a_row_gives_the_same_bits_alone_in_a_batch_and_as_a_chunks_last_query(name):
    """Each query row is scored and weighted by the same arithmetic whichever call it is in:
    a decode query alone, the same query in a left-padded batch of 3, and the last query of an
    8-token prompt chunk (which sees every slot) give the same bits, so a request's tokens do
    not depend on its neighbours or on how its prompt was cut."""
    scheme = parse_scheme(name)
    T = 70
    k, v = _rand((3, 3, T, 64), 2), _rand((3, 3, T, 64), 3)
    if name == "fp16":
        kf = vf = RawFormat(64)
        kp, vp = (k.astype(mx.float16),), (v.astype(mx.float16),)
    elif scheme.values.kind == "turbo":
        kf, vf = make_format(scheme.keys, 64), make_format(scheme.values, 64)
        kp, vp = tuple(kf.encode(k)), tuple(vf.encode(v))
    else:
        kf = vf = QuantizedFormat(scheme.keys)
        kp, vp = _stored(k, scheme.keys), _stored(v, scheme.values)
    q = _rand((3, 9, 8, 64), 1)
    row = lambda parts: tuple(p[2:3] for p in parts)  # noqa: E731
    alone = cpu_attention.attend_cpu(q[2:3, :, 7:], kf, row(kp), vf, row(vp), 0.125, None)
    pads = causal_mask(1, T - 1, mx.array([5, 11, 0]))  # row 2 unpadded
    batched = cpu_attention.attend_cpu(q[:, :, 7:], kf, kp, vf, vp, 0.125, pads)[2:3]
    chunk = cpu_attention.attend_cpu(q[2:3], kf, row(kp), vf, row(vp), 0.125, "causal")[:, :, 7:]
    assert mx.array_equal(alone, batched).item() and mx.array_equal(alone, chunk).item()


@pytest.mark.parametrize("name", ["affine4-g32", "affine4-g128", "affine8", "affine8-g128"])
@pytest.mark.parametrize("n_rep", [1, 2, 4])
def test_few_rows_scored_from_the_codes_give_the_block_paths_bits(name, n_rep):
    """A decode step's n_rep rows (at most 4) are scored from the codes in registers, 64
    tokens at a time; a prompt chunk's rows from codes widened to a block of floats. The last
    query of a 6-token chunk and the same query alone get the same bits, over 300 tokens
    (whole 64-token runs, a run of 16-token chunks, a 12-token tail, and a second token block)."""
    scheme = parse_scheme(name)
    fmt = QuantizedFormat(scheme.keys)
    T = 300
    kp, vp = _stored(_rand((1, 2, T, 128), 2), scheme.keys), _stored(_rand((1, 2, T, 128), 3), scheme.values)
    q = _rand((1, 2 * n_rep, 6, 128), 1)
    alone = cpu_attention.attend_cpu(q[:, :, 5:], fmt, kp, fmt, vp, 0.125, None)
    chunk = cpu_attention.attend_cpu(q, fmt, kp, fmt, vp, 0.125, causal_mask(6, T - 6))[:, :, 5:]
    want = attend_full(q[:, :, 5:], fmt, kp, fmt, vp, 0.125, None)
    assert mx.array_equal(alone, chunk).item()
    assert mx.allclose(alone, want, atol=TOL[mx.float32]).item()


def test_head_dim_of_three_groups():
    """D = 96: three groups of 32, three 32-wide steps of the kernel per token."""
    scheme = parse_scheme("affine4-g32")
    fmt = QuantizedFormat(scheme.keys)
    q = _rand((2, 6, 1, 96), 1)
    kp, vp = _stored(_rand((2, 3, 50, 96), 2), scheme.keys), _stored(_rand((2, 3, 50, 96), 3), scheme.values)
    got = cpu_attention.attend_cpu(q, fmt, kp, fmt, vp, 0.1, None)
    assert mx.allclose(got, attend_full(q, fmt, kp, fmt, vp, 0.1, None), atol=1e-4).item()


_UNBUILDABLE = """
import json
from kvserve.kernels import cpu_attention, dispatch
from kvserve.cache.affine import QuantizedFormat
from kvserve.cache.scheme import parse_scheme
from kvserve.cache.turbo_codec import RawFormat, make_format
f = QuantizedFormat(parse_scheme("affine4").keys)
print(json.dumps({"available": cpu_attention.available(), "choice": dispatch.choose(f, f, 1, 10)}))
"""


def test_without_a_compiler_the_mlx_path_serves(tmp_path):
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-c++")}
    env.pop("XDG_CACHE_HOME", None)
    res = subprocess.run([sys.executable, "-c", _UNBUILDABLE], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"available": False, "choice": "full"}


@pytest.mark.parametrize("name", [n for n in SCHEME_NAMES if not n.startswith(("mx", "nv"))])
@pytest.mark.parametrize("combo", range(3))
def test_every_format_it_reads_equals_the_full_path(name, combo):
    """Raw, affine and turbo keys and values (calibrated turbo keys included), through the
    format objects the caches pass, with and without left padding and sinks."""
    B, R, D, dtype = [(1, 1, 64, mx.float32), (3, 2, 128, mx.float16), (3, 3, 64, mx.bfloat16)][combo]
    T, L = [(63, 1), (65, 4), (300, 1)][combo]
    q, kf, kp, vf, vp, key_scale, _ = kernel_case(name, B, R, D, T, L, dtype)
    assert cpu_attention.supports(kf, vf, L)
    mask = kernel_mask(B, L, T, padded=combo > 0)
    sinks = _rand((q.shape[1],), combo) if combo == 1 else None
    got = cpu_attention.attend_cpu(q, kf, kp, vf, vp, D ** -0.5, mask, key_scale, sinks)
    want = attend_full(q, kf, kp, vf, vp, D ** -0.5, mask, key_scale, sinks)
    scale = max(1.0, mx.max(mx.abs(want.astype(mx.float32))).item())
    assert mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item() <= TOL[dtype] * scale


@pytest.mark.parametrize("store", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("D, L, mask_kind", [(64, 1, "padded"), (128, 4, "causal"), (80, 1, "none"), (64, 40, "padded")])
def test_16_bit_raw_kv_under_float32_queries(store, D, L, mask_kind):
    """An fp16 cache on the CPU: float32 queries over K/V stored as 16-bit floats, read 16 at
    a time (D = 80: five of them; every mask kind), equal the reference over the same K/V
    widened to float32."""
    B, H_kv, R, T = 3, 2, 3, 70
    q = _rand((B, H_kv * R, L, D), 7)
    k, v = _rand((B, H_kv, T, D), 8).astype(store), _rand((B, H_kv, T, D), 9).astype(store)
    fmt, mask = RawFormat(D), _mask(mask_kind, B, L, T)
    got = cpu_attention.attend_cpu(q, fmt, (k,), fmt, (v,), D ** -0.5, mask)
    want = attend_full(q, fmt, (k.astype(mx.float32),), fmt, (v.astype(mx.float32),), D ** -0.5, mask)
    assert got.dtype == mx.float32 and mx.max(mx.abs(got - want)).item() <= 1e-5
