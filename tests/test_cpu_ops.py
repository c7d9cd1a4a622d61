"""RMSNorm, table RoPE, linear, SwiGLU and turbo encoding as one CPU operation each (``kernels/cpu_ops.cpp``).

Each primitive equals the MLX operations it replaces: RMSNorm to float32 rounding of a
D-term sum (1e-6 relative), RoPE to float32 rounding of x * cos + y * sin (1e-6 for unit
inputs), linear exactly (the same ``cblas_sgemm`` call), SwiGLU to 1e-5 relative (its
own vectorized exp), turbo codes exactly (a rotated
coordinate within float rounding of a centroid boundary could round the other way; none did
in these cases). A row's result never
depends on the rows beside it.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from kvserve.cache.turbo_codec import _NORM_EPS, get_codec, pack_indices, unpack_indices
from kvserve.kernels import cpu_ops
from kvserve.server.engine import fastpath
from tests.test_weights import TINY, _child, close, needs_openblas, tiny_model

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the CPU primitives could not be built here")


def _ops(out: mx.array) -> list[str]:
    """The operations of ``out``'s graph (inputs evaluated before the call count none)."""
    graph = io.StringIO()
    mx.export_to_dot(graph, out)
    return re.findall(r'label ="([A-Za-z][^"]*)"', graph.getvalue())


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 7, 64), (300, 96)])
def test_rms_norm_equals_mlx_and_is_one_operation(shape):
    x, w = mx.random.normal(shape) * 3, mx.random.normal(shape[-1:])
    mx.eval(x, w)
    got = cpu_ops.rms_norm(x, w, 1e-5)
    assert _ops(got) == ["KvserveRmsNorm"]
    want = mx.fast.rms_norm(x, w, 1e-5)
    assert float(mx.abs(got - want).max() / mx.abs(want).max()) < 1e-6


def test_rms_norm_reads_strided_rows_and_rows_alone():
    """A transposed view (rows not adjacent), a strided last axis, a broadcast row; and a
    row's bits are the same alone as in its batch."""
    w = mx.random.normal((64,))
    x = mx.random.normal((5, 3, 64))
    for view in (x.transpose(1, 0, 2), mx.random.normal((3, 64, 2))[..., 0], mx.broadcast_to(x[:1], (4, 3, 64))):
        assert float(mx.abs(cpu_ops.rms_norm(view, w, 1e-6) - mx.fast.rms_norm(view, w, 1e-6)).max()) < 1e-5
    batch = cpu_ops.rms_norm(x, w, 1e-6)
    assert all(mx.array_equal(cpu_ops.rms_norm(x[i : i + 1], w, 1e-6)[0], batch[i]) for i in range(5))


@pytest.mark.parametrize("x,w", [(mx.ones((2, 8), mx.float16), mx.ones((8,))),
                                 (mx.ones((2, 8)), mx.ones((8,), mx.bfloat16)),
                                 (mx.ones((2, 8)), mx.ones((2, 8)))])
def test_rms_norm_declines_what_it_does_not_compute(x, w):
    assert cpu_ops.rms_norm(x, w, 1e-5) is None


@pytest.mark.parametrize("dims,offset,length", [(16, 0, 1), (16, 37, 5), (8, 4090, 9), (16, 0, 300)])
def test_table_rope_is_one_operation_equal_to_the_table_ops(dims, offset, length, monkeypatch):
    """Equal to TableRoPE's MLX operations on the same table (which test_weights.py holds
    to mx.fast.rope), the rotated dimensions and those past ``dims``."""
    rope = fastpath.TableRoPE(dims, 10000.0)
    x = mx.random.normal((1, 3, length, 16))
    mx.eval(x)
    got = rope(x, offset=offset)
    assert _ops(got) == ["KvserveTableRope"]
    monkeypatch.setattr(fastpath.TableRoPE, "_fused", lambda *a: None)
    assert float(mx.abs(got - rope(x, offset=offset)).max()) < 1e-6


def test_table_rope_per_row_offsets_strided_and_clamped(monkeypatch):
    """Per-row offsets over the transposed projection layout (B, L, H, D) -> (B, H, L, D),
    equal to TableRoPE's MLX operations, including a row past the table (clamped to its
    last position, as the MLX path clamps) and a row starting at -3: a prompt of a batched
    prefill left-padded by 3, whose padding is masked; its first 3 positions take the
    table's row 0, never memory before the table (reading there crashed a server)."""
    rope = fastpath.TableRoPE(16, 10000.0, positions=64)
    x = mx.random.normal((4, 5, 4, 16))
    mx.eval(x)
    x, offsets = x.transpose(0, 2, 1, 3), mx.array([0, 37, 62, -3])
    got = rope(x, offset=offsets)
    assert _ops(got) == ["Transpose", "Reshape", "KvserveTableRope"]
    at = [0, 0, 0, 0, 1]  # row 3's table rows
    assert all(mx.array_equal(got[3, :, i], rope(x[3:, :, i : i + 1], offset=p)[0, :, 0]) for i, p in enumerate(at))
    monkeypatch.setattr(fastpath.TableRoPE, "_fused", lambda *a: None)
    want = rope(x, offset=offsets)
    assert float(mx.abs(got - want).max()) < 1e-6
    rows = [rope(x[i : i + 1], offset=offsets[i : i + 1]) for i in range(4)]
    assert all(mx.array_equal(r[0], want[i]) for i, r in enumerate(rows))


def test_table_rope_declines_other_dtypes():
    x = mx.random.normal((1, 2, 3, 16)).astype(mx.float16)
    got = fastpath.TableRoPE(16, 10000.0)(x, offset=3)
    assert got.dtype == mx.float16 and "KvserveTableRope" not in _ops(got)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("dim,bits", [(64, 1), (64, 3), (64, 4), (128, 2), (128, 4), (64, 8), (48, 4), (72, 3)])
def test_turbo_encode_equals_the_codec_ops(dim, bits, dtype):
    """The CPU operation gives the codes and norms of the codec's MLX operations (rotate the
    unit vector, count the boundaries below, pack), a zero (padding) row and a transposed
    view included, for float16 input too; widths that are not a multiple of 64 (48) or 16
    (72) take its narrower loops. Where the codec encodes on the Walsh-Hadamard path
    (power-of-two widths), ``TurboCodec.encode`` is that one operation."""
    codec = get_codec(dim, bits, 43)
    x = mx.random.normal((2, 40, 3, dim)).astype(dtype)
    x[0, 0, 0] = 0
    mx.eval(x)
    x = x.transpose(0, 2, 1, 3)
    packed, norms = cpu_ops.turbo_encode(x, codec.pi, codec.boundaries, bits, _NORM_EPS)
    y, want_norms = codec.unit_rotated(x)
    want_packed = pack_indices(codec.quantize(y), bits)
    assert mx.array_equal(unpack_indices(packed, bits, dim), unpack_indices(want_packed, bits, dim))
    assert mx.array_equal(packed, want_packed)
    assert float(mx.abs(norms - want_norms).max() / mx.abs(want_norms).max()) < 1e-6
    if not codec.norm_corrected:
        encoded = codec.encode(x)
        assert _ops(encoded[0])[-1] == "KvserveTurboEncode"
        assert mx.array_equal(encoded[0], packed)


def test_swiglu_equals_mlx_lm_and_is_one_operation():
    """mlx-lm's compiled ``swiglu`` against the vectorized one: to 1e-5 relative (another exp),
    at large and tiny gates, for views too; other dtypes are declined."""
    from mlx_lm.models.activations import swiglu

    gate = mx.concatenate([mx.random.normal((2, 5, 96)) * 8, mx.array([[[-200.0, -90, 0, 90, 200] * 19 + [1.0]] * 5] * 2)], -1)
    up = mx.random.normal(gate.shape)
    mx.eval(gate, up)
    got = cpu_ops.swiglu(gate, up)
    assert _ops(got) == ["KvserveSwiGLU"]
    want = swiglu(gate, up)
    assert float(mx.max(mx.abs(got - want) / (mx.abs(want) + 1e-30))) < 1e-5
    view = cpu_ops.swiglu(gate.transpose(1, 0, 2), up.transpose(1, 0, 2))
    assert float(mx.abs(view - want.transpose(1, 0, 2)).max()) <= float(mx.abs(want).max()) * 1e-5
    assert cpu_ops.swiglu(gate.astype(mx.float16), up.astype(mx.float16)) is None


def test_install_cpu_ops_keeps_the_model_results():
    """Every plain norm, linear and SwiGLU MLP of the tiny llama takes its CPU class, parameters
    untouched; prefill and decode logits equal the unmodified model's. (In this process
    the BLAS shim is not loaded, so the linears keep MLX's matmul: the child test below
    covers the linear primitive.)"""
    ref_model, model = tiny_model(), tiny_model()
    from mlx_lm.models.cache import make_prompt_cache

    names = [n for n, _ in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.parameters())]
    layers = TINY["num_hidden_layers"]
    quantized = sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert fastpath.install_cpu_ops(model) == 2 * layers + 1 + (7 * layers - quantized) + layers  # norms, linears, MLPs
    assert type(model.model.layers[0].mlp).__name__ == "CpuMLP"
    assert [n for n, _ in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.parameters())] == names
    fastpath.install_table_rope(model)
    ref_cache, cache = make_prompt_cache(ref_model), make_prompt_cache(model)
    tokens = mx.array([[3, 17, 99, 5, 200, 41]])
    assert close(model(tokens, cache=cache), ref_model(tokens, cache=ref_cache))
    for tok in (5, 250):
        step = mx.array([[tok]])
        assert close(model(step, cache=cache), ref_model(step, cache=ref_cache))


_LINEAR = """
import io, json, re
from kvserve.server.models.blas import enable_fast_blas, codes_library
enable_fast_blas()
import mlx.core as mx
import numpy as np
from kvserve.cache.turbo_codec import _NORM_EPS, get_codec, pack_indices, unpack_indices
from kvserve.kernels import cpu_ops
from kvserve.server.engine import fastpath
from kvserve.server.models import weights
from kvserve.server.models.packed import packed_calls
from tests.test_weights import tiny_model

def ops(out):
    g = io.StringIO(); mx.export_to_dot(g, out); return re.findall(r'label ="([A-Za-z][^"]*)"', g.getvalue())

w, b, one = mx.random.normal((96, 64)), mx.random.normal((96,)), mx.ones((1, 64))
mx.eval(w, b, one)
res = {"errs": [], "one_op": ops(cpu_ops.linear(one, w)) == ["KvserveLinear"]}
for x in (mx.random.normal((1, 1, 64)), mx.random.normal((17, 64)), mx.random.normal((5, 3, 64)).transpose(1, 0, 2)):
    res["errs"].append(float(mx.abs(cpu_ops.linear(x, w) - x @ w.T).max()))
    res["errs"].append(float(mx.abs(cpu_ops.linear(x, w, b) - mx.addmm(b, x, w.T)).max()))
res["view"] = cpu_ops.linear(mx.ones((1, 32)), w[:, :32]) is None
res["lazy"] = cpu_ops.linear(mx.ones((1, 64)), w + 1) is None
lib = codes_library()
prompt = mx.array([[(7 * i + 3) % 256 for i in range(20)]])
ref = np.array(tiny_model()(prompt[:, :1]))
model = weights.apply_weight_format(tiny_model(), weights.DENSE_CODES)
res["installed"] = fastpath.install_cpu_ops(model)
before = packed_calls(lib)
step = model(prompt[:, :1])
res["step_ops"] = sorted(set(ops(step)))
mx.eval(step)
res["step_calls"] = packed_calls(lib) - before
res["step_err"] = float(np.abs(np.array(step) - ref).max() / np.abs(ref).max())
print(json.dumps(res))
"""


@needs_openblas
def test_linear_is_the_shims_product_and_reads_packed_codes():
    """With the BLAS shim loaded (a fresh interpreter): one operation, equal to MLX's matmul
    and addmm bit for bit for 1 and 17 rows and a transposed view; a weight that is a view
    or not evaluated is declined; a served model's decode step runs its projections as
    KvserveLinear, which still read the packed codes (2 layers x 7 and the tied head)."""
    # The user's cache folder, as the servers' (the shim and the CPU kernels built once; a
    # fresh folder compiled both again, 10-15 s, for what test_weights.py's builds check).
    res = _child(_LINEAR, PYTHONPATH=str(Path(__file__).parent.parent))
    assert res["one_op"] and res["errs"] == [0.0] * 6
    assert res["view"] and res["lazy"]
    layers = TINY["num_hidden_layers"]
    assert res["installed"] == 2 * layers + 1 + 7 * layers + layers
    assert "KvserveLinear" in res["step_ops"] and "Matmul" in res["step_ops"]  # the tied head stays
    assert res["step_calls"] == 7 * layers + 1
    assert res["step_err"] <= 1e-3
