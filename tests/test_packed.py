"""Decode products that read the packed codes (``packed.py`` and the shim's kernel).

The shim is called directly (ctypes) for exact layouts, and through MLX in a fresh
interpreter (the shim must be loaded before mlx) for the served path. Tolerance: the
kernel computes the same weight values as the dense float32 matrix, summed in another
order, so products agree to float32 rounding of a K-term sum (1e-5 relative).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvserve.server.models import blas
from kvserve.server.models.packed import codes_layout
from tests.test_weights import _child, needs_openblas

NoTrans, Trans = 111, 112


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    import scipy_openblas32

    lib = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(True)
    return blas._shim(str(blas._build_shim(lib, tmp_path_factory.mktemp("shim"), None)))


def _quantized(n: int, k: int, bits: int, group: int, seed: int) -> nn.QuantizedLinear:
    mx.random.seed(seed)
    return nn.QuantizedLinear(k, n, bias=False, group_size=group, bits=bits)


def _register(shim, dense: np.ndarray, layout) -> None:
    n, k = dense.shape
    assert shim.kvserve_packed_add(dense.ctypes.data, n, k, layout.group, layout.bits, layout.codes.ctypes.data,
                                   layout.scales.ctypes.data, layout.biases.ctypes.data) == 1


def _product(shim, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float, beta: float) -> None:
    """c = alpha * a @ b.T + beta * c through the shim's cblas_sgemm (row-major)."""
    p = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    m, k = a.shape
    shim.cblas_sgemm(101, NoTrans, Trans, m, b.shape[0], k, ctypes.c_float(alpha), p(a), k, p(b), k,
                     ctypes.c_float(beta), p(c), b.shape[0])


def _calls(shim) -> int:
    return shim.kvserve_packed_calls()


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 128)])
def test_layout_dequantizes_to_mlx_values(bits, group):
    q = _quantized(40, 256, bits, group, seed=bits + group)
    dense = mx.dequantize(q.weight, q.scales, q.biases, group_size=group, bits=bits)
    assert np.array_equal(codes_layout(q).dense(), np.array(dense))


def test_layouts_the_kernel_cannot_take_are_none():
    assert codes_layout(_quantized(8, 64, 2, 32, 0)) is None  # 2-bit
    assert codes_layout(_quantized(8, 64, 4, 32, 0)) is not None
    mx.random.seed(0)
    assert codes_layout(nn.QuantizedLinear(64, 8, group_size=32, bits=4, mode="mxfp4")) is None


@needs_openblas
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16, 17])
def test_products_from_codes_match_dense(shim, bits, group, m):
    """Every row count the kernel blocks (8, then the rest in one block), alpha and beta
    applied; 17 rows are past its reach and take the dense product (no call counted)."""
    q = _quantized(136, 192, bits, group, seed=m)
    layout = codes_layout(q)
    dense = np.ascontiguousarray(layout.dense())
    _register(shim, dense, layout)
    try:
        rng = np.random.default_rng(m)
        a = rng.standard_normal((m, 192), np.float32)
        c = rng.standard_normal((m, 136), np.float32)
        want = 0.5 * (a.astype(np.float64) @ dense.T.astype(np.float64)) + 0.25 * c
        before = _calls(shim)
        _product(shim, a, dense, c, 0.5, 0.25)
        np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)
        assert _calls(shim) - before == (1 if m <= 16 else 0)
    finally:
        shim.kvserve_packed_remove(ctypes.c_void_p(dense.ctypes.data))


@needs_openblas
def test_removed_weight_is_read_dense_again(shim):
    """After removal the same address is an ordinary matrix: here its values change (as a
    reused allocation's would) and the product follows the new values, not stale codes."""
    q = _quantized(64, 96, 4, 32, seed=7)
    layout = codes_layout(q)
    dense = np.ascontiguousarray(layout.dense())
    _register(shim, dense, layout)
    shim.kvserve_packed_remove(ctypes.c_void_p(dense.ctypes.data))
    dense[:] = 1.0
    a, c = np.ones((1, 96), np.float32), np.zeros((1, 64), np.float32)
    before = _calls(shim)
    _product(shim, a, dense, c, 1.0, 0.0)
    assert _calls(shim) == before and np.all(c == 96.0)


@needs_openblas
def test_registration_refuses_shapes_the_kernel_cannot_take(shim):
    buf = np.zeros(4096, np.float32)
    for n, k, g, bits in [(8, 64, 16, 4), (8, 48, 32, 4), (8, 64, 32, 3), (0, 64, 32, 4)]:
        assert shim.kvserve_packed_add(buf.ctypes.data, n, k, g, bits, buf.ctypes.data, buf.ctypes.data,
                                       buf.ctypes.data) == 0


_SERVED = """
import gc, json
from kvserve.server.models.blas import enable_fast_blas, codes_library
enable_fast_blas()
import mlx.core as mx
import numpy as np
from kvserve.server.models import weights
from kvserve.server.models.packed import packed_calls
from tests.test_weights import tiny_model
lib = codes_library()
prompt = mx.array([[(7 * i + 3) % 256 for i in range(20)]])
ref = np.array(tiny_model()(prompt))
model = weights.apply_weight_format(tiny_model(), weights.DENSE_CODES)
live = lib.kvserve_packed_live()
calls = [packed_calls(lib)]
prefill = np.array(model(prompt))
calls.append(packed_calls(lib))
step = np.array(model(prompt[:, :1]))
calls.append(packed_calls(lib))
del model
gc.collect()
print(json.dumps({"live": live, "prefill_calls": calls[1] - calls[0], "step_calls": calls[2] - calls[1],
                  "after": lib.kvserve_packed_live(),
                  "prefill_err": float(np.abs(prefill - ref).max() / np.abs(ref).max()),
                  "step_err": float(np.abs(step[0, 0] - ref[0, 0]).max() / np.abs(ref).max())}))
"""


@needs_openblas
def test_served_model_decodes_from_codes_and_lets_them_go():
    """Through MLX: 2 layers x 7 projections and the tied head are registered; a 20-token
    prefill (more rows than the kernel takes) reads none of them, a one-token step reads
    every one; logits match the 4-bit model's (as in test_weights.py); once the model is
    collected nothing stays registered."""
    # The user's cache folder, as the servers' (the shim and the CPU kernels built once; a
    # fresh folder compiled both again, 10-15 s, for what test_weights.py's builds check).
    res = _child(_SERVED, PYTHONPATH=str(Path(__file__).parent.parent))
    assert res["live"] == 2 * 7 + 1
    assert (res["prefill_calls"], res["step_calls"]) == (0, 2 * 7 + 1)
    assert res["prefill_err"] <= 1e-3 and res["step_err"] <= 1e-3
    assert res["after"] == 0
