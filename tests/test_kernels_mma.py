"""The tensor-core attention pass, as far as it can be checked without a GPU: which calls
take it, its launch plan, the generated source, the fragment maps it relies on (simulated
in numpy from the PTX fragment layouts), and the dispatch's reference and self-check rules.
On a CUDA GPU, tests/test_kernels_cuda.py and bench/gpu_attention_grid.py run it."""

import doctest
import re

import mlx.core as mx
import numpy as np
import pytest
from kvserve.cache import parse_scheme
from kvserve.cache.affine import QuantizedFormat, quantize_parts
from kvserve.cache.turbo_codec import make_format
from kvserve.kernels import cuda_attention as ca
from kvserve.kernels import cuda_mma_source as ms
from kvserve.kernels import dispatch
from kvserve.kernels.reference import attend_blockwise


def _parts(name, dtype=mx.float16, D=128, T=8):
    s = parse_scheme(name)
    k = mx.random.normal((1, 2, T, D), key=mx.random.key(3)).astype(dtype)
    if s.values.kind == "turbo":
        kf, vf = make_format(s.keys, D), make_format(s.values, D)
        kp, vp = tuple(kf.encode(k)), tuple(vf.encode(k))
    else:
        kf, vf = QuantizedFormat(s.keys), QuantizedFormat(s.values)
        kp, vp = tuple(quantize_parts(k, s.keys)), tuple(quantize_parts(k, s.values))
    return kf, kp, vf, vp, ca.layout_of(kf, kp, D), ca.layout_of(vf, vp, D)


@pytest.mark.parametrize("name,dtype,mma,kfast,vfast", [
    ("affine4", mx.float16, True, True, True), ("affine4", mx.bfloat16, True, True, True),
    ("affine8", mx.float16, True, True, True), ("affine8", mx.bfloat16, True, False, False),
    ("mxfp4", mx.float16, True, True, True), ("mxfp4", mx.bfloat16, True, False, False),
    ("turbo0v4", mx.float16, True, False, False),
    ("turbo8v3", mx.bfloat16, True, False, False), ("turbo8v3", mx.float16, True, True, False),
    ("turbo4", mx.float16, False, False, False), ("affine4", mx.float32, False, True, True)])
def test_which_calls_take_the_tensor_cores(name, dtype, mma, kfast, vfast):
    kf, kp, vf, vp, kl, vl = _parts(name, dtype)
    q = mx.zeros((1, 4, 1, 128), dtype)
    assert ca.tensor_cores(q, kl, vl, kp) == mma
    assert (ca.fast_pairs(kl, kp, dtype), ca.fast_pairs(vl, vp, dtype)) == (kfast, vfast)


def test_raw_keys_in_another_dtype_take_the_f32_pass():
    kf, kp, vf, vp, kl, vl = _parts("turbo0v4", mx.bfloat16)  # (float32 keys are stored as float16)
    assert kp[0].dtype == mx.bfloat16 and not ca.tensor_cores(mx.zeros((1, 4, 1, 128), mx.float16), kl, vl, kp)


@pytest.mark.parametrize("bh,rows,T,D", [(64, 4, 32768, 128), (1, 1, 1, 64), (3, 12, 65, 256),
                                         (2, 16, 4096, 128), (24, 9, 1000, 64), (7, 32, 100000, 128)])
def test_mma_plan_covers_the_context_and_the_rows_once(bh, rows, T, D):
    p = ca.mma_plan(bh, rows, T, D)
    steps = -(-T // (16 * p.tm))
    per = -(-steps // p.splits)
    assert (p.splits - 1) * per < steps <= p.splits * per  # no split empty, none past the end
    assert p.row_tiles * 8 * p.nr >= rows > (p.row_tiles - 1) * 8 * p.nr
    assert p.nr == (1 if rows <= 8 or D == 256 else 2) and p.tm == (1 if D == 256 else ca.MMA_STEP_TILES)


@pytest.mark.parametrize("name", ["affine4", "affine8-g32", "mxfp4", "turbo0v4", "turbo8v3",
                                  "turbo0v2", "affine4-g128"])
@pytest.mark.parametrize("mask", [0, 1, 2, 3, 4, 5])
def test_generated_source_is_complete(name, mask):
    _, kp, _, vp, kl, vl = _parts(name)
    kfast, vfast = ca.fast_pairs(kl, kp, mx.float16), ca.fast_pairs(vl, vp, mx.float16)
    src = ms.mma_source(kl, vl, mask, kfast, vfast)
    assert not re.findall(r"__[A-Z_]+__", src)  # every placeholder filled
    assert src.count("{") == src.count("}")
    assert ("AffineRun" in src) == ((kfast and kl.kind == "affine") or (vfast and vl.kind == "affine"))
    assert ("LutRun" in src) == (vl.kind == "turbo")


def _run(expr: str, k: int) -> int:
    return eval(expr.replace("/", "//"), {"k": k})  # noqa: S307 (our own generated expression)


@pytest.mark.parametrize("bits,fast,n", [(4, True, 32), (8, True, 32), (4, False, 16), (4, True, 16)])
def test_pair_maps_cover_a_run_once(bits, fast, n):
    kx, ky = ms.pair_map(ca.Layout("affine", bits, 64, 3, 128 * bits // 32), fast)
    got = sorted([_run(kx, k) for k in range(n // 2)] + [_run(ky, k) for k in range(n // 2)])
    assert got == list(range(n))


@pytest.mark.parametrize("bits", [4, 8])
def test_affine_run_pairs_are_the_elements_the_map_names(bits):
    """The device code's word split ((w >> BITS*p) & MASK) gives pair m*PPW + p; the map
    must name the same two elements."""
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=32)
    words = [sum(int(codes[w * (32 // bits) + i]) << (bits * i) for i in range(32 // bits))
             for w in range(bits)]
    mask = 0x000F000F if bits == 4 else 0x00FF00FF
    ppw = 16 // bits
    kx, ky = ms.pair_map(ca.Layout("affine", bits, 64, 3, 4 * bits), True)
    for m, w in enumerate(words):
        for p in range(ppw):
            u = (w >> (bits * p)) & mask
            k = m * ppw + p
            assert (u & 0xFFFF, u >> 16) == (codes[_run(kx, k)], codes[_run(ky, k)])


def _frag_mma(c, a, b):
    """One m16n8k16 MMA over per-lane fragments, as the PTX ISA lays them out."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[lane][0], a[lane][1]
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[lane][2], a[lane][3]
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b[lane][0], b[lane][1]
        C[g, 2 * t:2 * t + 2], C[g + 8, 2 * t:2 * t + 2] = c[lane][:2], c[lane][2:]
    C = C + A @ B
    return [np.r_[C[lane >> 2, 2 * (lane & 3):2 * (lane & 3) + 2],
                  C[(lane >> 2) + 8, 2 * (lane & 3):2 * (lane & 3) + 2]] for lane in range(32)]


def _transpose8x8(frag):
    M = np.zeros((8, 8))
    for lane in range(32):
        M[lane >> 2, 2 * (lane & 3):2 * (lane & 3) + 2] = frag[lane]
    return [M.T[lane >> 2, 2 * (lane & 3):2 * (lane & 3) + 2] for lane in range(32)]


def test_fragment_maps_of_one_warp_step_give_softmax_attention():
    """16 tokens, 8 query rows, D=64, the lane maps of MMA_BODY (natural pair order): the
    scores' accumulator transposed by movmatrix is the values' B operand, and the output
    lands at d = g*D/8 + 2*dm (+1)."""
    rng = np.random.default_rng(0)
    D, KN, VN = 64, 16, 8
    K, V, Q = rng.normal(size=(16, D)), rng.normal(size=(16, D)), rng.normal(size=(8, D))
    s = [np.zeros(4) for _ in range(32)]
    for j in range(D // 16):
        a = [[K[(lane >> 2) + 8 * h, (lane & 3) * KN + 4 * j + 2 * hf:(lane & 3) * KN + 4 * j + 2 * hf + 2]
              for hf, h in ((0, 0), (0, 1), (1, 0), (1, 1))] for lane in range(32)]
        b = [[Q[lane >> 2, (lane & 3) * KN + 4 * j + 2 * hf:(lane & 3) * KN + 4 * j + 2 * hf + 2]
              for hf in (0, 1)] for lane in range(32)]
        s = _frag_mma(s, a, b)
    p = [np.exp(x) for x in s]  # unnormalised: the check divides at the end
    pb = list(zip(_transpose8x8([x[:2] for x in p]), _transpose8x8([x[2:] for x in p])))
    out = np.zeros((8, D))
    for dm in range(D // 16):
        def vpair(lane, k):  # token 2c + (k & 1) + 8 (k >> 1), elements 2 dm, 2 dm + 1 of run g
            t, g = 2 * (lane & 3) + (k & 1) + 8 * (k >> 1), lane >> 2
            return V[t, g * VN + 2 * dm:g * VN + 2 * dm + 2]
        a = [[np.array([vpair(ln, 0)[0], vpair(ln, 1)[0]]), np.array([vpair(ln, 0)[1], vpair(ln, 1)[1]]),
              np.array([vpair(ln, 2)[0], vpair(ln, 3)[0]]), np.array([vpair(ln, 2)[1], vpair(ln, 3)[1]])]
             for ln in range(32)]
        o = _frag_mma([np.zeros(4) for _ in range(32)], a, pb)
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            for i in range(2):
                out[2 * c + i, g * VN + 2 * dm] += o[lane][i]
                out[2 * c + i, g * VN + 2 * dm + 1] += o[lane][2 + i]
    l = np.zeros(8)
    for lane in range(32):
        l[2 * (lane & 3):2 * (lane & 3) + 2] += p[lane][[0, 1]] + p[lane][[2, 3]]
    S = Q @ K.T
    want = np.exp(S) @ V / np.exp(S).sum(1, keepdims=True)
    np.testing.assert_allclose(out / l[:, None], want, rtol=1e-10)


def test_reference_runs_on_the_cpu_stream_whatever_the_default_device():
    kf, kp, vf, vp, _, _ = _parts("affine4", mx.float32)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(5))
    got = dispatch.reference(q, kf, kp, vf, vp, 128 ** -0.5, None)
    with mx.stream(mx.cpu):  # on a GPU the default stream rounds differently (1 ulp seen)
        want = attend_blockwise(q, kf, kp, vf, vp, 128 ** -0.5, None)
    assert mx.array_equal(got, want)


@pytest.mark.parametrize("dtype,err,ok", [(mx.float16, 3e-3, True), (mx.float16, 6e-3, False),
                                          (mx.bfloat16, 2e-2, True), (mx.float32, 3e-3, False),
                                          (mx.float32, 1e-4, True)])
def test_self_check_tolerance_follows_the_output_dtype(dtype, err, ok):
    kf, kp, vf, vp, _, _ = _parts("affine4", mx.float32)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(6)).astype(dtype)

    def off_by(*args, **kwargs):
        out = attend_blockwise(*args, **kwargs).astype(mx.float32)
        return (out + err * mx.sign(out)).astype(dtype)

    want = attend_blockwise(q, kf, kp, vf, vp, 128 ** -0.5, None).astype(mx.float32)
    if mx.max(mx.abs(want)).item() > 1:  # the bound scales with the outputs' size
        err *= mx.max(mx.abs(want)).item()
    kernel = dispatch.FusedKernel("off-by", mx.cpu, lambda *a: True, off_by)
    assert dispatch.self_check(kernel, (q, kf, kp, vf, vp, 128 ** -0.5, None), {}) == ok


@pytest.mark.parametrize("module", [ca, ms])
def test_doctests(module):
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
