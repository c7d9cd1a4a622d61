"""Weight formats, the CPU fast path and the BLAS set-up give the model's own results.

Tolerances: the converted formats compute the same products as the as-loaded
4-bit model (dequantized float32 values are exact).  One difference remains:
the as-loaded embedding dequantizes to float16 (its scales' dtype), the
converted ones to float32, so the first hidden state differs by float16
rounding (2^-11 relative).  Logits must agree to |diff| <= 1e-3 * max|logit|
(seen: 2e-4).  The cos/sin table
of TableRoPE is computed in float64, mx.fast.rope in float32, so rotary outputs
agree to 1e-4 absolute at positions up to ~4100 (angles up to 4100 rad).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from kvserve.server.engine import fastpath
from kvserve.server.models import blas, weights

TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
            head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)


def tiny_model(seed: int = 0) -> llama.Model:
    """A random llama quantized like the default model: 4-bit, group 32, float16
    scales/biases, float32 norms (so activations are float32)."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(**TINY))
    model.update(tree_map(lambda p: (p * 0.2).astype(mx.float16) if p.ndim == 2 else p, model.parameters()))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def close(a: mx.array, b: mx.array) -> bool:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max()) <= 1e-3 * float(np.abs(b).max())


TOKENS = mx.array([[3, 17, 99, 5, 200, 42, 7, 1]])


# The shim is in this process only when a test before these enabled it (after mlx came, by
# the PLT slot): dense-f32+codes is tested in test_packed.py, in processes of its own.
IN_PROCESS = tuple(f for f in weights.FORMATS if f not in (weights.DENSE_CODES, weights.HALF))


def _with_shim() -> set[str]:
    return {weights.DENSE_CODES} if blas.codes_library() is not None else set()


@pytest.mark.parametrize("fmt", IN_PROCESS)
def test_format_logits_match_as_loaded(fmt):
    ref = tiny_model()(TOKENS)
    model = weights.apply_weight_format(tiny_model(), fmt)
    assert close(model(TOKENS), ref)


def test_half_keeps_the_codes_and_computes_in_the_models_half_dtype():
    """A GPU's format: the float32 norms in float16, as the scales are, so activations stay
    float16; the 4-bit codes are untouched and the logits agree within float16 rounding."""
    ref = tiny_model()(TOKENS)
    model = weights.apply_weight_format(tiny_model(), weights.HALF)
    floating = {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    assert floating == {mx.float16} and weights.half_dtype(model) is None
    logits = model(TOKENS)
    assert logits.dtype == mx.float16 and ref.dtype == mx.float32
    a, b = np.array(logits.astype(mx.float32)), np.array(ref)
    assert float(np.abs(a - b).max()) <= 2e-2 * float(np.abs(b).max())


def test_dense_f32_replaces_every_quantized_module():
    model = weights.apply_weight_format(tiny_model(), weights.DENSE_F32)
    kinds = {type(m) for _, m in model.named_modules()}
    assert not kinds & {nn.QuantizedLinear, nn.QuantizedEmbedding}
    assert {str(v.dtype) for _, v in tree_flatten(model.parameters())} == {"mlx.core.float32"}


def test_affine_f32_keeps_4bit_weights_with_f32_scales():
    model = weights.apply_weight_format(tiny_model(), weights.AFFINE_F32)
    q = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert q and all(m.bits == 4 and m.scales.dtype == mx.float32 for m in q)


def test_choose_measures_every_candidate_and_picks_the_fastest():
    model = tiny_model()
    choice = weights.choose_weight_format(model, budget_s=0.5)
    assert set(choice.timings) == set(IN_PROCESS) | _with_shim()
    score = {n: t["decode"] + t["prefill"] for n, t in choice.timings.items()}
    assert choice.name == min(score, key=score.get)
    assert all(t["decode"] > 0 and t["prefill"] > 0 for t in choice.timings.values())
    line = choice.describe()
    assert "\n" not in line and choice.name in line
    assert close(weights.apply_weight_format(model, choice)(TOKENS), tiny_model()(TOKENS))


def test_a_candidate_far_behind_the_best_is_not_probed_further(monkeypatch):
    """A candidate >= _SLOW_FACTOR behind the best on one matrix gets neither the sample
    pass nor the prefill probe (its one-row cost stands for both); a first call that
    overruns its deadline is not repeated. Pinned by counting calls, not by clocks."""
    model = tiny_model()
    mods = weights._matmul_modules(model)
    bench = weights._Bench(weights._sample(mods), 10**6)
    calls = []
    monkeypatch.setattr(weights._Bench, "_decode_sample", lambda *a: calls.append("sample") or 1e-9)
    t = bench.run(weights.AS_LOADED, mx.float32, time.perf_counter() + 5, best_ms=1e-12)
    assert t["decode"] == t["prefill"] > 0 and calls == []
    ran = []
    weights._time(lambda: ran.append(1) or [mx.zeros(1)], deadline=time.perf_counter() - 1, least=3)
    assert len(ran) == 1


def test_explicit_format_is_taken_as_is_and_unknown_is_refused():
    assert weights.choose_weight_format(tiny_model(), "as-loaded").name == "as-loaded"
    with pytest.raises(ValueError):
        weights.choose_weight_format(tiny_model(), "int3-magic")
    if not _with_shim():  # codes need the shim
        with pytest.raises(ValueError, match="shim"):
            weights.choose_weight_format(tiny_model(), weights.DENSE_CODES)


def test_dense_f32_model_has_nothing_to_choose():
    model = weights.apply_weight_format(tiny_model(), weights.DENSE_F32)
    assert weights.choose_weight_format(model).name == weights.AS_LOADED


# --- fast path -------------------------------------------------------------


@pytest.mark.parametrize("dims,offset,length", [(16, 0, 1), (16, 37, 5), (8, 4090, 9), (16, 0, 300)])
def test_table_rope_matches_fast_rope(dims, offset, length):
    x = mx.random.normal((1, 3, length, 16))
    want = mx.fast.rope(x, dims, traditional=False, base=10000.0, scale=1.0, offset=offset)
    got = fastpath.TableRoPE(dims, 10000.0)(x, offset=offset)
    assert float(mx.abs(got - want).max()) < 1e-4


@pytest.mark.parametrize("length", [1, 3])
def test_table_rope_gathers_per_row_offsets(length):
    """A batch cache's offsets (one per row): the gathered rows equal mx.fast.rope's."""
    x = mx.random.normal((3, 4, length, 16))
    offsets = mx.array([0, 37, 2000])
    want = mx.fast.rope(x, 16, traditional=False, base=10000.0, scale=1.0, offset=offsets)
    got = fastpath.TableRoPE(16, 10000.0, positions=2048 + length)(x, offset=offsets)
    assert float(mx.abs(got - want).max()) < 1e-4


def test_fast_path_decode_matches_model():
    """Prefill + three decode steps: logits of the fast path (TableRoPE,
    last-position logits) against the unmodified model, and equal caches."""
    ref_model, model = tiny_model(), tiny_model()
    assert fastpath.install_table_rope(model) == TINY["num_hidden_layers"]
    ref_cache, cache = make_prompt_cache(ref_model), make_prompt_cache(model)
    want = ref_model(TOKENS, cache=ref_cache)[:, -1, :]
    got = fastpath.last_logits(model, TOKENS, cache)
    for tok in (5, 9, 250):
        assert close(got, want) and cache[0].offset == ref_cache[0].offset
        step = mx.array([[tok]])
        want, got = ref_model(step, cache=ref_cache)[:, -1, :], model(step, cache=cache)[:, -1, :]
    assert close(got, want)


# --- BLAS ------------------------------------------------------------------

_HAVE_OPENBLAS = shutil.which("cc") is not None
try:
    import scipy_openblas32  # noqa: F401
except ImportError:
    _HAVE_OPENBLAS = False
needs_openblas = pytest.mark.skipif(not _HAVE_OPENBLAS, reason="needs scipy-openblas32 and a C compiler")


def _child(code: str, **env) -> dict:
    """Run ``code`` in a fresh interpreter (mlx not yet imported); it prints JSON."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


_REPORT = ("import json, dataclasses; from kvserve.server.models.blas import enable_fast_blas; "
           "print(json.dumps(dataclasses.asdict(enable_fast_blas())))")


@needs_openblas
def test_blas_info_reports_openblas_when_active(tmp_path):
    info = _child(_REPORT, XDG_CACHE_HOME=str(tmp_path))
    assert info["name"] == "openblas" and info["active"] and info["threads"] >= 1
    assert "OpenBLAS" in info["openblas"] and os.path.exists(info["library"])


def test_blas_info_reports_reference_when_disabled():
    info = _child(_REPORT, KVSERVE_FAST_BLAS="0")
    assert (info["name"], info["active"]) == ("reference", False) and "KVSERVE_FAST_BLAS" in info["reason"]


@needs_openblas
def test_blas_after_mlx_import_binds_through_the_plt_slot(tmp_path):
    info = _child("import mlx.core as mx; mx.eval(mx.ones((3, 4)) @ mx.ones((4, 5)))\n" + _REPORT,
                  XDG_CACHE_HOME=str(tmp_path))
    assert info["active"] and "PLT slot" in info["reason"] and "shim" in info["reason"]


@needs_openblas
def test_blas_without_compiler_uses_openblas_directly(tmp_path):
    info = _child(_REPORT, XDG_CACHE_HOME=str(tmp_path), CC=str(tmp_path / "no-such-cc"))
    assert info["active"] and info["library"] is None and "scipy_cblas_sgemm" in info["reason"]


@needs_openblas
@pytest.mark.parametrize("compiler", ["cc", "none"])
def test_mlx_matmuls_through_openblas_match_numpy(tmp_path, compiler):
    """Through the shim, and (no compiler) straight through scipy_cblas_sgemm."""
    code = (
        "import json; from kvserve.server.models.blas import enable_fast_blas; i = enable_fast_blas();"
        "import mlx.core as mx, numpy as np; r = np.random.default_rng(1); e = 0.0\n"
        "for m, n, k in [(1, 1536, 576), (1, 7, 3), (128, 1536, 576), (9, 1, 33), (1, 1, 5)]:\n"
        "    a, b = r.standard_normal((m, k), np.float32), r.standard_normal((n, k), np.float32)\n"
        "    for got in (mx.array(a) @ mx.array(b).T, mx.array(b) @ mx.array(a).T):\n"
        "        want = (a.astype(np.float64) @ b.T.astype(np.float64))\n"
        "        got = np.array(got); want = want if got.shape == want.shape else want.T\n"
        "        e = max(e, float(np.abs(got - want).max() / np.abs(want).max()))\n"
        "print(json.dumps({'active': i.active, 'err': e}))")
    env = {"CC": str(tmp_path / "no-such-cc")} if compiler == "none" else {}
    res = _child(code, XDG_CACHE_HOME=str(tmp_path), **env)
    assert res["active"] and res["err"] < 1e-5


def _stored(rng, rows: int, cols: int, ld: int, row_major: bool):
    """A random matrix in a padded buffer, as (buffer, logical rows x cols view)."""
    buf = rng.standard_normal(ld * (rows if row_major else cols)).astype(np.float32)
    view = buf.reshape(-1, ld)[:rows, :cols] if row_major else buf.reshape(-1, ld)[:cols, :rows].T
    return buf, view


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    """The shim compiled once for the module's cases (each compile takes the C compiler ~2 s)."""
    import scipy_openblas32

    lib_path = os.path.join(scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library(True))
    return ctypes.CDLL(str(blas._build_shim(Path(lib_path), tmp_path_factory.mktemp("shim"), None)))


@needs_openblas
@pytest.mark.parametrize("row_major", [True, False])
@pytest.mark.parametrize("ta,tb", [(111, 111), (111, 112), (112, 111), (112, 112)])
@pytest.mark.parametrize("m,n,k", [(1, 37, 19), (23, 1, 19), (1, 1, 8), (17, 29, 31)])
def test_shim_sgemm_matches_numpy(shim, row_major, ta, tb, m, n, k):
    """The shim's cblas_sgemm (gemv for M or N == 1) for every layout, with
    padded leading dimensions, alpha and a non-zero beta."""
    rng = np.random.default_rng(m * 1000 + n + k)
    a_dims, b_dims = ((m, k) if ta == 111 else (k, m)), ((k, n) if tb == 111 else (n, k))
    lda, ldb, ldc = (d[1 if row_major else 0] + 3 for d in (a_dims, b_dims, (m, n)))
    a, av = _stored(rng, *a_dims, lda, row_major)
    b, bv = _stored(rng, *b_dims, ldb, row_major)
    c, cv = _stored(rng, m, n, ldc, row_major)
    op = lambda v, t: v.T if t == 112 else v  # noqa: E731
    want = 0.7 * (op(av, ta).astype(np.float64) @ op(bv, tb)) + 0.3 * cv.astype(np.float64)
    p = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    shim.cblas_sgemm(101 if row_major else 102, ta, tb, m, n, k, ctypes.c_float(0.7), p(a), lda,
                     p(b), ldb, ctypes.c_float(0.3), p(c), ldc)
    np.testing.assert_allclose(cv, want, rtol=1e-5, atol=1e-5)


@needs_openblas
@pytest.mark.parametrize("n,k", [(37, 67), (1536, 576)])
def test_a_rows_product_does_not_depend_on_the_rows_around_it(shim, n, k):
    """A decode step's products (1 to 16 rows against a transposed weight): every row's
    result is bit-identical to the same row multiplied alone, so a seeded row samples the
    same tokens alone and batched. (OpenBLAS's gemv, which once took the lone row, sums in
    another order: up to 4e-6 apart.)"""
    rng = np.random.default_rng(n + k)
    a, b = rng.standard_normal((16, k), np.float32), rng.standard_normal((n, k), np.float32)
    p = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731

    def product(rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows)
        c = np.zeros((rows.shape[0], n), np.float32)
        shim.cblas_sgemm(101, 111, 112, rows.shape[0], n, k, ctypes.c_float(1.0), p(rows), k,
                         p(b), k, ctypes.c_float(0.0), p(c), n)
        return c

    alone = np.concatenate([product(a[i:i + 1]) for i in range(16)])
    for m in (2, 3, 8, 16):
        np.testing.assert_array_equal(product(a[:m]), alone[:m])
    np.testing.assert_allclose(alone, a.astype(np.float64) @ b.T.astype(np.float64), rtol=1e-4, atol=1e-4)
