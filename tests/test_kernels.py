"""The blockwise reference attention equals each family's full-context path, for every scheme.

Tolerances (max abs difference of outputs of unit scale): 1e-4 for f32 queries; for f16
and bf16 queries both outputs are rounded to the queries' dtype after f32 math that differs
only in summation order, so they may differ by about one ulp: 4e-3 (f16), 3e-2 (bf16).
"""

import doctest
import logging

import mlx.core as mx
import pytest
from kvserve.cache import SCHEME_NAMES, QuantizedKVCache, parse_scheme
from kvserve.cache.affine import QuantizedFormat, attend_quantized, quantize_parts
from kvserve.cache.base import causal_mask
from kvserve.cache.turbo_codec import attend_encoded, make_format
from kvserve.kernels import bench, dispatch, reference
from kvserve.kernels.reference import attend_blockwise, attend_full

TOL = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}
BLOCK = 512  # T = 1100 walks [0, 512), [512, 1024) and the partial [1024, 1100)
# (B, n_rep, D, dtype) combinations, cycled over the (scheme, T, L) grid below so every
# value of each appears with every scheme without a 7,680-case product.
COMBOS = [(1, 1, 64, mx.float32), (3, 2, 128, mx.float16), (3, 3, 64, mx.bfloat16),
          (1, 4, 128, mx.float32), (3, 4, 64, mx.float16), (1, 2, 128, mx.bfloat16),
          (3, 1, 128, mx.float32), (1, 3, 128, mx.float16)]
H_KV = 2


def _rand(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _mask(B, L, T, padded):
    """"causal" or None for one unpadded row; a (B, 1, L, T) left-padding mask otherwise.
    Padding never hides a whole query row (the fp16 oracle, SDPA, would give NaN there)."""
    if not padded:
        return "causal" if L > 1 else None
    pads = [0, min(5, T - L), min(2, T - L)][:B]
    return causal_mask(L, T - L, mx.array(pads))


def _case(name, B, R, D, T, L, dtype, seed=0):
    """(queries, key fmt, key parts, value fmt, value parts, key_scale, oracle)."""
    scheme = parse_scheme(name)
    q = _rand((B, H_KV * R, L, D), seed, dtype)
    k, v = _rand((B, H_KV, T, D), seed + 1, dtype) * 2, _rand((B, H_KV, T, D), seed + 2, dtype)
    if scheme.values.kind != "turbo" and scheme.keys.kind != "fp16":
        kp, vp = tuple(quantize_parts(k, scheme.keys)), tuple(quantize_parts(v, scheme.values))
        oracle = lambda s, m: attend_quantized(q, kp, vp, s, m, scheme.keys, scheme.values)
        return q, QuantizedFormat(scheme.keys), kp, QuantizedFormat(scheme.values), vp, None, oracle
    kf, vf = make_format(scheme.keys, D), make_format(scheme.values, D)
    key_scale = None
    if scheme.keys.kind == "turbo":  # a calibrated key basis: queries must be scaled too
        key_scale = 0.5 + mx.random.uniform(shape=(B, 1, 1, D), key=mx.random.key(seed + 3))
    kp, vp = tuple(kf.encode(k, key_scale)), tuple(vf.encode(v))
    if scheme.name == "fp16":  # over the 16-bit floats stored (float32 K/V are rounded)
        ks, vs = kp[0].astype(dtype), vp[0].astype(dtype)
        oracle = lambda s, m: mx.fast.scaled_dot_product_attention(q, ks, vs, scale=s, mask=m)
    else:
        oracle = lambda s, m: attend_encoded(q, kf, kp, vf, vp, s, m, key_scale)
    return q, kf, kp, vf, vp, key_scale, oracle


GRID = [(name, T, L) for name in SCHEME_NAMES for T in (1, 63, 64, 65, 1100) for L in (1, 4)
        if L <= T]


@pytest.mark.parametrize("name,T,L", GRID)
@pytest.mark.parametrize("padded", [False, True])
def test_blockwise_equals_full_path(name, T, L, padded):
    B, R, D, dtype = COMBOS[(GRID.index((name, T, L)) + padded) % len(COMBOS)]
    if padded:
        B = 3
    q, kf, kp, vf, vp, key_scale, oracle = _case(name, B, R, D, T, L, dtype)
    scale, mask = D ** -0.5, _mask(B, L, T, padded)
    want = oracle(scale, mask)
    got = attend_blockwise(q, kf, kp, vf, vp, scale, mask, key_scale, block=BLOCK)
    full = attend_full(q, kf, kp, vf, vp, scale, mask, key_scale)
    assert got.dtype == dtype and got.shape == (B, H_KV * R, L, D)
    tol = TOL[dtype]
    assert mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item() <= tol
    assert mx.max(mx.abs(full.astype(mx.float32) - want.astype(mx.float32))).item() <= tol


@pytest.mark.parametrize("name", SCHEME_NAMES)
@pytest.mark.parametrize("dtype,padded", [(mx.float32, True), (mx.float16, False), (mx.bfloat16, True)])
def test_dense_path_equals_the_reference_for_prompt_chunks(name, dtype, padded):
    """A GPU's path where no kernel serves (chunks of 20 queries): every format decodes its
    rows (turbo keys with their calibration) and MLX's SDPA attends over them, with
    attention sinks in the padded cases; the difference to the blockwise reference is the
    rounding of K/V to the queries' dtype."""
    B, T, L = (3 if padded else 1), 300, 20
    q, kf, kp, vf, vp, key_scale, oracle = _case(name, B, 2, 64, T, L, dtype, seed=7)
    scale, mask = 64 ** -0.5, _mask(B, L, T, padded)
    sinks = mx.array([2.0, -1.0, 0.5, 0.0]) if padded else None  # one logit per query head
    got = reference.attend_dense(q, kf, kp, vf, vp, scale, mask, key_scale, sinks=sinks)
    want = dispatch.reference(q, kf, kp, vf, vp, scale, mask, key_scale, sinks=sinks)  # CPU stream
    assert got.dtype == dtype and got.shape == want.shape == (B, 2 * H_KV, L, 64)
    diff = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()
    assert diff <= _dense_tolerance(dtype), diff


def _dense_tolerance(dtype) -> float:
    """Twice the blockwise tolerance; on a GPU, f32 as f16: MLX's CUDA SDPA gave f32
    outputs 1.0e-3 to 2.1e-3 from the CPU reference on an H100, raw fp16 K/V included,
    so the difference is the device's f32 attention, not the decoding."""
    if dtype == mx.float32 and mx.default_device() == mx.gpu:
        return TOL[mx.float16]
    return 2 * TOL[dtype]


@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_groups_and_dtypes_over_several_blocks(R, dtype):
    for name in ("affine4", "nvfp4", "turbo8v3", "turbo4"):
        q, kf, kp, vf, vp, key_scale, oracle = _case(name, 3, R, 128, 1100, 1, dtype, seed=R)
        got = attend_blockwise(q, kf, kp, vf, vp, 0.1, None, key_scale, block=BLOCK)
        diff = mx.abs(got.astype(mx.float32) - oracle(0.1, None).astype(mx.float32))
        assert mx.max(diff).item() <= TOL[dtype], name


def test_fully_masked_row_averages_like_the_full_path():
    q, kf, kp, vf, vp, _, oracle = _case("affine8", 1, 2, 64, 700, 1, mx.float32)
    mask = mx.zeros((1, 1, 1, 700), mx.bool_)  # a padding query sees nothing
    got = attend_blockwise(q, kf, kp, vf, vp, 0.1, mask, block=BLOCK)
    assert not mx.any(mx.isnan(got)).item()
    assert mx.allclose(got, oracle(0.1, mask), atol=1e-4).item()


def test_block_mask_slices_causal_and_arrays():
    assert reference.block_mask("causal", 1, 1, 1, 10, 0, 5) is None
    assert reference.block_mask(None, 2, 2, 1, 10, 0, 5) is None
    pad = causal_mask(2, 3, mx.array([1, 0]))  # (2, 1, 2, 5)
    got = reference.block_mask(pad, 2, 2, 2, 5, 2, 5)
    assert got.shape == (2, 1, 1, 2, 3)
    assert mx.array_equal(got[:, 0, 0], pad[:, 0, :, 2:5]).item()


def test_choose_follows_the_cpu_crossover():
    T = dispatch.CPU_FULL_MAX_T
    assert dispatch.choose(None, None, 1, T, mx.cpu) == "full"
    assert dispatch.choose(None, None, 1, T + 1, mx.cpu) == "blockwise"
    assert dispatch.choose(None, None, 1, 64, mx.gpu) == "dense"


@pytest.fixture
def without_cpu_kernel(monkeypatch):
    """The dispatch as it is without the CPU kernel for stored K/V (test_cpu_attention.py
    covers it), so that the paths and kernels below are what serves these calls."""
    monkeypatch.setattr(dispatch, "_KERNELS", [k for k in dispatch._KERNELS if k.name != "cpu-stored"])
    monkeypatch.setattr(dispatch, "_CANDIDATES", {})


def test_cache_attend_goes_through_the_dispatch(monkeypatch, without_cpu_kernel):
    scheme, calls = parse_scheme("affine4"), []
    cache = QuantizedKVCache(scheme)
    keys, values = cache.update_and_fetch(_rand((1, 2, 70, 64), 1), _rand((1, 2, 70, 64), 2))
    q = _rand((1, 4, 1, 64), 3)
    monkeypatch.setattr(dispatch, "CPU_FULL_MAX_T", 0)  # force the blockwise path
    monkeypatch.setattr(dispatch, "attend_blockwise",
                        lambda *a, **k: calls.append(1) or attend_blockwise(*a, **k, block=32))
    got = cache.attend(q, keys, values, 0.125, None)
    want = attend_quantized(q, keys, values, 0.125, None, scheme.keys, scheme.values)
    assert calls and mx.allclose(got, want, atol=1e-5).item()


def _kernel(name, fn):
    return dispatch.FusedKernel(name, mx.cpu, lambda kf, vf, L: True, fn)


@pytest.mark.parametrize("good", [True, False])
def test_unverified_kernel_runs_only_after_its_self_check(good, caplog, without_cpu_kernel):
    q, kf, kp, vf, vp, _, oracle = _case("affine4", 1, 2, 64, 80, 1, mx.float32)
    wrong = lambda *a, **k: attend_full(*a, **k) + 1.0
    kernel = _kernel("test-kernel", attend_full if good else wrong)
    dispatch.register_kernel(kernel)
    try:
        with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
            assert dispatch.choose(kf, vf, 1, 80, mx.cpu) == "test-kernel"
            out = dispatch.attend(q, kf, kp, vf, vp, 0.125, None)
        assert kernel.checked is good
        assert mx.allclose(out, oracle(0.125, None), atol=1e-4).item()
        assert ("failed its self-check" in caplog.text) is not good
        assert dispatch.choose(kf, vf, 1, 80, mx.cpu) == ("test-kernel" if good else "full")
    finally:
        dispatch.unregister_kernel("test-kernel")


def test_calls_with_sinks_are_self_checked_on_their_own(without_cpu_kernel):
    """A kernel whose plain calls passed is not trusted with attention sinks until a call
    with sinks has passed too (the sinks change its merge)."""
    q, kf, kp, vf, vp, _, _ = _case("affine4", 1, 2, 64, 80, 1, mx.float32)
    no_sinks = lambda *a, sinks=None, **k: attend_full(*a, **k)  # noqa: E731 (ignores them)
    kernel = _kernel("test-kernel", no_sinks)
    dispatch.register_kernel(kernel)
    try:
        dispatch.attend(q, kf, kp, vf, vp, 0.125, None)
        sinks = mx.array([4.0, 0.0, 1.0, -1.0])
        out = dispatch.attend(q, kf, kp, vf, vp, 0.125, None, sinks=sinks)
        assert (kernel.checked, kernel.checked_sinks) == (True, False)
        assert mx.allclose(out, attend_full(q, kf, kp, vf, vp, 0.125, None, sinks=sinks), atol=1e-5).item()
    finally:
        dispatch.unregister_kernel("test-kernel")


@pytest.mark.parametrize("module", [reference, dispatch, bench])
def test_doctests(module):
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
