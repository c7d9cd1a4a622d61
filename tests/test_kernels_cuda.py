"""The CUDA attention kernels: what can be checked without a GPU (launch plans, format
detection, source generation, the decoding identities the device code relies on, the
dispatch on the CPU), and a kernel-against-reference check that runs only on a CUDA GPU.
The full GPU grid is bench/gpu_attention_grid.py (docs/benchmarks/attention-gpu-grid.md).
"""

import doctest
import re

import mlx.core as mx
import numpy as np
import pytest
from kvserve.cache import parse_scheme
from kvserve.cache.affine import QuantizedFormat, quantize_parts
from kvserve.cache.turbo_codec import RawFormat, make_format
from kvserve.kernels import cuda_attention as ca
from kvserve.kernels import cuda_programs, cuda_qmv, cuda_source, dispatch
from kvserve.kernels.reference import attend_full

ON_CUDA = ca.cuda_ready()


def _formats(name, D=128, T=8, B=1, H=2):
    s = parse_scheme(name)
    k = mx.random.normal((B, H, T, D), key=mx.random.key(1))
    if name == "fp16":  # an fp16 cache's K/V: raw, in the queries' dtype
        v = mx.random.normal((B, H, T, D), key=mx.random.key(2))
        return RawFormat(D), (k.astype(mx.float16),), RawFormat(D), (v.astype(mx.float16),)
    if s.values.kind == "turbo":
        kf, vf = make_format(s.keys, D), make_format(s.values, D)
        return kf, tuple(kf.encode(k)), vf, tuple(vf.encode(k))
    kf, vf = QuantizedFormat(s.keys), QuantizedFormat(s.values)
    return kf, tuple(quantize_parts(k, s.keys)), vf, tuple(quantize_parts(k, s.values))


@pytest.mark.parametrize("name,family", [
    ("affine4", "affine"), ("affine8-g32", "affine"), ("mxfp4", "mxfp4"), ("mxfp8", None),
    ("nvfp4", None), ("turbo0v4", "turbo-raw-keys"), ("turbo8v3", "turbo-affine-keys"),
    ("turbo3", "turbo-turbo-keys")])
def test_family_by_format(name, family):
    kf, _, vf, _ = _formats(name)
    assert ca.family(kf, vf) == family


@pytest.mark.parametrize("name,key,value", [
    ("affine4-g128", ("affine", 4, 128, 3, 16), ("affine", 4, 128, 3, 16)),
    ("mxfp4", ("mx", 4, 32, 2, 16), ("mx", 4, 32, 2, 16)),
    ("turbo0v3", ("raw", 16, 0, 1, 0), ("turbo", 3, 0, 2, 12)),  # float32 keys stored as float16
    ("turbo8v2", ("affine", 8, 64, 3, 32), ("turbo", 2, 0, 2, 8))])
def test_layouts_match_the_stored_parts(name, key, value):
    kf, kp, vf, vp = _formats(name)
    kl, vl = ca.layout_of(kf, kp, 128), ca.layout_of(vf, vp, 128)
    assert (kl.kind, kl.bits, kl.group, kl.n_parts, kl.words) == key
    assert (vl.kind, vl.bits, vl.group, vl.n_parts, vl.words) == value
    assert len(kp) == kl.n_parts and len(vp) == vl.n_parts
    for layout, parts in ((kl, kp), (vl, vp)):
        if layout.words:  # the packed part's width is what the kernel indexes with
            assert parts[0].shape[-1] == layout.words and parts[0].dtype == mx.uint32
        assert 128 % layout.chunk == 0 and layout.chunk * max(layout.bits, 1) % 32 == 0


@pytest.mark.parametrize("bh,rows,T", [(64, 4, 32768), (1, 1, 1), (3, 12, 65), (2, 128, 4096),
                                       (24, 8, 1000), (1, 3, 129), (7, 32, 100000)])
def test_plan_splits_cover_the_context_once(bh, rows, T):
    p = ca.plan(bh, rows, T)
    assert 1 <= p.rb <= ca.MAX_RB and p.rb * p.row_tiles >= rows and p.rbp % 4 == 0
    tiles = -(-T // cuda_source.TT)
    per = -(-tiles // p.splits)  # what the kernel derives from T and gridDim.y
    starts = [s * per for s in range(p.splits)]
    assert all(s < tiles for s in starts) and p.splits * per >= tiles  # none empty, none missed


def test_mask_kinds():
    assert ca.mask_kind(None, 4) == 0 and ca.mask_kind("causal", 4) == 1
    assert ca.mask_kind(mx.ones((2, 1, 4, 9), mx.bool_), 4) == 2
    assert ca.mask_kind(mx.zeros((4, 9), mx.float16), 4) == 3
    assert ca.mask4(mx.zeros((4, 9))).shape == (1, 1, 4, 9)
    with pytest.raises(ValueError):
        ca.mask_kind("sliding", 4)


def test_a_padded_batchs_decode_mask_is_known_by_its_row_spans():
    """A left-padded batch cache's decode mask hides exactly each row's padding, so the
    tensor-core pass takes the rows' first slots and the end instead (mask kind 5); a
    prefill mask, an unpadded batch's, a copy of the mask and a captured step's are not
    known (the last is read as a mask: ``cache.captured.step_mask``)."""
    from kvserve.cache import PromptCache, make_layer_cache
    from kvserve.cache.captured import step_mask
    from kvserve.kernels.cuda_layout import row_spans

    rows = []
    for n in (5, 3, 1):
        layer = make_layer_cache("affine4")
        layer.update_and_fetch(*mx.zeros((2, 1, 2, n, 64), mx.float16))
        rows.append(PromptCache([layer], "affine4"))
    batch = PromptCache.merge(rows)[0]
    mask = batch.make_mask(1)
    assert ca.mask_kind(mask, 1) == 4 and row_spans(mask, 3).tolist() == [0, 2, 4, 6]
    assert mask[:, 0, 0].tolist() == [[s <= t for t in range(6)] for s in (0, 2, 4)]
    assert row_spans(batch.make_mask(2), 3) is None and row_spans(mx.array(mask), 3) is None
    assert row_spans(mask, 2) is None  # another batch size
    assert ca.mask_kind(ca.ROW_SPANS, 1) == 5
    captured = step_mask(mx.array([3, 0]), mx.array(9), 16)  # slot 9 written, capacity 16
    assert row_spans(captured, 2) is None and ca.mask_kind(captured, 1) == 4
    assert captured[:, 0, 0].tolist() == [[s <= t <= 9 for t in range(16)] for s in (3, 0)]


@pytest.mark.parametrize("name", ["affine4", "mxfp4", "turbo0v4", "turbo8v3", "turbo2"])
@pytest.mark.parametrize("mask", [0, 1, 2, 3])
def test_generated_source_is_complete(name, mask):
    kf, kp, vf, vp = _formats(name)
    src = cuda_source.split_source(ca.layout_of(kf, kp, 128), ca.layout_of(vf, vp, 128), mask)
    assert not re.search(r"__[A-Z_]+__", src)  # every placeholder was filled
    assert ("mask[at]" in src) == (mask >= 2) and ("T - L + l" in src) == (mask == 1)
    assert src.count("{") == src.count("}")


def test_unit_code_identity_behind_the_affine_decode():
    """x = 1 + n/2^b from the bits 0x3F800000 | n << (23 - b), and s*n + z ==
    (s 2^b) x + (z - s 2^b), as the device code computes affine values."""
    for bits in (4, 8):
        n = np.arange(1 << bits, dtype=np.uint32)
        x = (np.uint32(0x3F800000) | (n << np.uint32(23 - bits))).view(np.float32)
        assert np.array_equal(x, 1 + n / (1 << bits))
        s, z = np.float32(0.0371), np.float32(-0.52)
        got = np.float32(s * (1 << bits)) * x + np.float32(z - s * (1 << bits))
        assert np.allclose(got, s * n + z, rtol=0, atol=2e-6)


def test_mxfp4_decode_matches_mlx():
    """e2m1 codes through an f16 (subnormals give 0 and 0.5) times 2^(e - 127 + 14),
    against ``mx.dequantize`` of the same packed words."""
    x = mx.random.normal((4, 64), key=mx.random.key(3)) * 3
    w, e = mx.quantize(x, group_size=32, bits=4, mode="mxfp4")
    want = np.array(mx.dequantize(w, e, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32))
    codes = (np.array(w)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # (4, 8, 8)
    codes = codes.reshape(4, 64)
    half = (((codes & 7) << 9) | ((codes & 8) << 12)).astype(np.uint16).view(np.float16)
    scale = ((np.array(e).astype(np.uint32) + 14) << 23).view(np.float32)  # (4, 2)
    got = half.astype(np.float32) * np.repeat(scale, 32, axis=1)
    assert np.array_equal(got, want)


def test_dispatch_offers_cuda_kernels_only_on_cuda():
    names = [k.name for k in dispatch._KERNELS]
    assert any(n.startswith("cuda-") for n in names) == ON_CUDA
    kf, _, vf, _ = _formats("mxfp4")  # a format the CPU kernel does not read
    assert dispatch.choose(kf, vf, 1, 4096, mx.cpu) == "blockwise"
    # No family is pre-verified: each must match the reference on its first call.
    assert not any(spec["verified"] for spec in ca.kernel_specs())


def test_specs_support_only_short_queries():
    kf, _, vf, _ = _formats("turbo8v3")
    spec = next(s for s in ca.kernel_specs() if s["name"] == "cuda-turbo-affine-keys")
    assert ca.MAX_L == 256
    assert spec["supports"](kf, vf, 1) and spec["supports"](kf, vf, 256)
    assert not spec["supports"](kf, vf, 257)


@pytest.mark.parametrize("module", [ca, cuda_source])
def test_doctests(module):
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("name", ["affine4", "affine8", "mxfp4", "turbo0v4", "turbo8v3", "turbo4"])
@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 2e-4), (mx.float16, 4e-3)])  # f32 / tensor-core pass
@pytest.mark.parametrize("sinks", [None, (-2.0, 0.0, 1.0, 3.0, 0.5, 6.0, -1.0, 2.0)])  # gpt-oss
def test_kernel_matches_the_reference_on_gpu(name, L, dtype, tol, sinks):
    _check_against_the_reference(name, L, dtype, tol, sinks, D=128)


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("name", ["affine4", "mxfp4", "turbo0v4", "turbo8v3", "fp16"])
@pytest.mark.parametrize("L", [9, 17, 27, 256])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_prompt_chunks_up_to_max_l_match_the_reference_on_gpu(name, L, dtype):
    """A question after a cached prefix: up to 256 causal queries, 8 query rows per tile
    (4 query heads per KV head: 36 to 1024 rows), over a context the chunk ends."""
    if name == "fp16" and dtype == mx.float32:
        pytest.skip("the kernels read raw K/V only in the queries' half dtype")
    kf, kp, vf, vp = _formats(name, 128, 300, 2, 2)
    q = mx.zeros((2, 8, L, 128), dtype)
    assert ca._family_plan(q, kf, kp, vf, vp, "causal", None) is not None  # the kernel, not the reference
    _check_against_the_reference(name, L, dtype, 2e-4 if dtype == mx.float32 else 4e-3, None, D=128)


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("L", [2, 27, 256, 257])
@pytest.mark.parametrize("padded", [False, True])
def test_an_fp16_prompt_chunk_takes_the_kernel_up_to_max_l_on_gpu(L, padded):
    """``attend_raw`` under a causal mask, or a left-padded batch's mask array: up to
    ``MAX_L`` queries the dispatch's kernel ("cuda-raw"; MLX's SDPA would build a cuDNN
    graph for each new shape), past it MLX's SDPA; both equal the reference."""
    from kvserve.cache.fp16 import attend_raw

    D, T, Hkv, R, B = 128, 700, 2, 4, 2 if padded else 1
    kf, (k,), vf, (v,) = _formats("fp16", D, T, B, Hkv)
    q = mx.random.normal((B, Hkv * R, L, D), key=mx.random.key(9)).astype(mx.float16)
    mask = "causal"
    if padded:  # row 1 starts 37 slots in
        t, l = mx.arange(T), mx.arange(L)[:, None] + (T - L)
        mask = (t <= l)[None, None] & (t >= mx.array([0, 37])[:, None, None, None])
    assert dispatch.choose(kf, vf, L, T, mx.gpu) == ("cuda-raw" if L <= ca.MAX_L else "dense")
    with mx.stream(mx.gpu):
        got = attend_raw(q, k, v, D ** -0.5, mask)
        mx.eval(got)
    with mx.stream(mx.cpu):
        want = attend_full(q.astype(mx.float32), kf, (k,), vf, (v,), D ** -0.5, mask)
        assert mx.max(mx.abs(got.astype(mx.float32) - want)).item() <= 4e-3


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("name", ["affine4", "turbo8v3", "turbo0v4", "fp16"])
@pytest.mark.parametrize("L", [1, 4, 17, 45, 256])
@pytest.mark.parametrize("D", [64, 256])
def test_kernel_matches_the_reference_at_other_head_dims(name, L, D):
    """The tensor-core pass merges its warps through shared memory in a layout that depends on
    D (a swizzle over D / 8-wide runs): D = 64 and 256 as well as 128."""
    _check_against_the_reference(name, L, mx.float16, 4e-3, None, D)


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("name", ["affine4", "mxfp4", "turbo0v4", "turbo8v3", "fp16"])
def test_row_spans_equal_the_mask_on_gpu(name):
    """Kind 5 against the reference over the same mask as an array: rows whose first slot is
    0, inside a step (5), past whole steps (17, 33) and inside a later step (236), over 300
    slots (18 steps of 16 and 12: a padded batch's decode mask)."""
    from kvserve.kernels.cuda_layout import note_left_padding, row_spans

    D, T, Hkv, R, starts = 128, 300, 2, 4, [0, 5, 17, 33, 236]
    B = len(starts)
    kf, kp, vf, vp = _formats(name, D, T, B, Hkv)
    q = mx.random.normal((B, Hkv * R, 1, D), key=mx.random.key(5)).astype(mx.float16)
    slots = mx.arange(T)[None, None, None, :]
    mask = note_left_padding(slots >= mx.array(starts)[:, None, None, None], starts)
    assert row_spans(mask, B).tolist() == [*starts, T]
    with mx.stream(mx.gpu):
        got = ca.attend_cuda(q, kf, kp, vf, vp, D ** -0.5, mask)
        plain = ca.attend_cuda(q, kf, kp, vf, vp, D ** -0.5, mx.array(mask))  # kind 4
        mx.eval(got, plain)
    with mx.stream(mx.cpu):
        want = attend_full(q.astype(mx.float32), kf, kp, vf, vp, D ** -0.5, mask)
        assert mx.max(mx.abs(got.astype(mx.float32) - want)).item() <= 4e-3
        assert mx.max(mx.abs(plain.astype(mx.float32) - want)).item() <= 4e-3


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("sinks", [None, (-2.0, 0.0, 1.0, 3.0, 0.5, 6.0, -1.0, 2.0)])
def test_an_fp16_padded_decode_takes_the_kernel_on_gpu(sinks):
    """An fp16 cache's padded decode step (``attend_raw`` with a mask known by its row starts)
    is served by the tensor-core kernel ("cuda-raw"), and equals the grouped path that the same
    mask as a plain array takes, and the reference."""
    from kvserve.cache.fp16 import attend_raw
    from kvserve.kernels.cuda_layout import note_left_padding

    D, T, Hkv, R, starts = 128, 700, 2, 4, [0, 3, 40, 512]
    B = len(starts)
    kf, (k,), vf, (v,) = _formats("fp16", D, T, B, Hkv)
    q = mx.random.normal((B, Hkv * R, 1, D), key=mx.random.key(9)).astype(mx.float16)
    mask = mx.arange(T)[None, None, None, :] >= mx.array(starts)[:, None, None, None]
    note_left_padding(mask, starts)
    sinks = None if sinks is None else mx.array(sinks)
    assert dispatch.choose(kf, vf, 1, T, mx.gpu) == "cuda-raw"
    with mx.stream(mx.gpu):
        got = attend_raw(q, k, v, D ** -0.5, mask, sinks)
        mx.eval(got)
        if sinks is None:
            grouped = attend_raw(q, k, v, D ** -0.5, mx.array(mask))
            mx.eval(grouped)
    with mx.stream(mx.cpu):
        want = attend_full(q.astype(mx.float32), kf, (k,), vf, (v,), D ** -0.5, mask, sinks=sinks)
        assert mx.max(mx.abs(got.astype(mx.float32) - want)).item() <= 4e-3
        if sinks is None:
            assert mx.max(mx.abs(grouped.astype(mx.float32) - want)).item() <= 4e-3


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("name", ["turbo0v4", "affine4", "fp16"])
@pytest.mark.parametrize("L", [2, 17, 45, 256])
def test_chunks_in_the_default_models_shape_match_the_reference(name, L):
    """9 query heads over 3 KV heads at D = 64 (SmolLM2-135M): 3L query rows, so 16-row tiles
    start inside a head's queries."""
    _check_against_the_reference(name, L, mx.float16, 4e-3, None, 64, B=1, Hkv=3, R=3)


def _check_against_the_reference(name, L, dtype, tol, sinks, D, B=2, Hkv=2, R=4):
    T = 300
    kf, kp, vf, vp = _formats(name, D, T, B, Hkv)
    q = mx.random.normal((B, Hkv * R, L, D), key=mx.random.key(5)).astype(dtype)
    sinks = None if sinks is None else mx.array(sinks)
    with mx.stream(mx.gpu):
        got = ca.attend_cuda(q, kf, kp, vf, vp, D ** -0.5, "causal", sinks=sinks)
        mx.eval(got)
    with mx.stream(mx.cpu):
        want = attend_full(q.astype(mx.float32), kf, kp, vf, vp, D ** -0.5, "causal", sinks=sinks)
        assert mx.max(mx.abs(got.astype(mx.float32) - want)).item() <= tol


def test_kernel_names_carry_a_digest_of_the_source():
    """MLX caches compiled kernels by name (in the process and on disk): a changed source
    must get a new name, the same source the same one."""
    assert ca.kernel_name("kvs", "a", "b") == ca.kernel_name("kvs", "a", "b")
    assert ca.kernel_name("kvs", "a", "b") != ca.kernel_name("kvs", "a", "c")
    assert re.fullmatch(r"kvs_[0-9a-f]{16}", ca.kernel_name("kvs", "x"))


def test_kernels_reach_mlx_compacted_with_only_the_helpers_they_call(monkeypatch):
    """MLX hashes a kernel's whole source on every call of it: kvserve's kernels reach
    ``mx.fast.cuda_kernel`` without comments or blank lines, the few-rows matmul without the
    f32 pass's chunk decoders, and the tensor-core attention with them only where affine codes
    decode through f32 (scales not in the queries' dtype)."""
    specs = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda name, **spec: specs.append(spec))
    affine = ca.Layout("affine", 4, 64, 3, 16)
    cuda_qmv._kernel.__wrapped__(4, 64, 8, 1)
    ca._mma_kernel.__wrapped__(affine, affine, 4, True, True, ())
    ca._mma_kernel.__wrapped__(affine, affine, 4, False, True, ())
    ca._mma_kernel.__wrapped__(ca.Layout("raw", 16, 0, 1, 0), ca.Layout("raw", 16, 0, 1, 0), 4, False, False, ())
    ca._merge_kernel.__wrapped__(False)
    for spec in specs:
        code = spec["source"] + spec.get("header", "")
        assert "//" not in code and "\n\n" not in code and code == cuda_programs.compact(code)
    qmv, fast, through_f32, raw = (spec.get("header", "") for spec in specs[:4])
    assert "AffineRun" in qmv and "load_words" in qmv and "affine_chunk" not in qmv
    assert "affine_chunk" not in fast and "affine_chunk" in through_f32 and "affine_chunk" not in raw


@pytest.mark.parametrize("name", ["affine4", "affine8-g32", "mxfp4", "turbo0v4", "turbo8v3", "turbo3"])
def test_launchable_only_when_every_index_stays_in_bounds(name):
    D, T, B, H = 128, 8, 2, 2
    kf, kp, vf, vp = _formats(name, D, T, B, H)
    kl, vl = ca.layout_of(kf, kp, D), ca.layout_of(vf, vp, D)
    q = mx.zeros((B, 2 * H, 4, D))
    ok = lambda q=q, kp=kp, vp=vp, mask=None: ca.launchable(q, kl, vl, kp, vp, mask, kf, vf)  # noqa: E731
    assert ok() and ok(mask="causal")
    assert ok(mask=mx.ones((B, 1, 4, T), mx.bool_)) and ok(mask=mx.zeros((4, T)))
    assert ok(mask=mx.zeros((1, 1, 1, 1)))  # size-1 dims are never indexed
    assert not ok(mask=mx.ones((B, 1, 4, T + 1), mx.bool_))  # a mask over other slots
    assert not ok(mask=mx.ones((B + 1, 1, 4, T), mx.bool_))
    assert not ok(q=mx.zeros((B + 1, 2 * H, 4, D)))  # queries of a batch the cache lacks
    assert not ok(q=mx.zeros((B, 2 * H, 4, 64)))  # parts narrower than D
    assert not ok(vp=tuple(a[:, :, : T - 1] for a in vp))  # values shorter than keys
    assert not ok(kp=tuple(a[:1] for a in kp))


def test_array_masks_never_index_a_broadcast_dim():
    src = cuda_source.MASK_CODE[2]
    for dim in range(4):
        assert f"mask_shape[{dim}] == 1 ? 0" in src


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_the_turbo_encoder_kernel_matches_the_mlx_encoder_on_gpu(D, bits, dtype):
    """One kernel (``kernels/cuda_encode``) encodes as the MLX operations do: equal norms, and
    equal indices but for coordinates within a rounding error of a boundary (one level, at
    most one in a thousand); rows of zeros (padding) encode to zeros."""
    from kvserve.cache.turbo_codec import _NORM_EPS, get_codec, unpack_indices
    from kvserve.kernels import cuda_encode

    codec = get_codec(D, bits, 43)
    x = mx.random.normal((8, 3, 5, D), key=mx.random.key(D + bits)).astype(dtype)
    x = mx.concatenate([x, mx.zeros((8, 3, 1, D), dtype=dtype)], axis=2)
    assert cuda_encode.serves(x, codec.pi, bits)
    packed, norms = cuda_encode.turbo_encode(x, codec.pi, codec.boundaries, bits, _NORM_EPS)
    ref_packed, ref_norms = codec.encode_unit(*codec.unit_rotated(x))
    assert packed.shape == ref_packed.shape and packed.dtype == mx.uint32 and norms.shape == ref_norms.shape
    assert mx.allclose(norms, ref_norms, rtol=1e-5, atol=1e-6).item()
    apart = mx.abs(unpack_indices(packed, bits, D).astype(mx.int32) - unpack_indices(ref_packed, bits, D).astype(mx.int32))
    assert mx.max(apart).item() <= 1 and mx.sum(apart).item() <= max(1, apart.size // 1000)
    assert mx.array_equal(packed[:, :, -1], ref_packed[:, :, -1]).item()


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("scheme", ["affine4", "affine8", "affine4-g32", "affine8-g128"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_the_affine_encoder_kernel_matches_mx_quantize_on_gpu(D, scheme, dtype):
    """One kernel (``kernels/cuda_quantize``) writes the records that ``pack_record`` makes of
    ``mx.quantize``'s parts: equal scales and biases, and equal codes but where a quotient
    lies within a rounding error of .5 (one level, at most one in a thousand); rows of zeros
    (padding) encode as MLX encodes them."""
    from kvserve.cache.affine import code_levels, pack_record
    from kvserve.kernels import cuda_quantize

    fmt = parse_scheme(scheme).keys
    if D % fmt.group_size:
        pytest.skip("group larger than the head")
    k, v = (mx.random.normal((8, 3, 5, D), key=mx.random.key(D + i)).astype(dtype) * 3 for i in (0, 1))
    k, v = (mx.concatenate([x, mx.zeros((8, 3, 1, D), dtype=dtype)], axis=2) for x in (k, v))
    v = mx.contiguous(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # a strided view, as models give
    assert cuda_quantize.serves(k, v, fmt.bits, fmt.group_size)
    codes, side = cuda_quantize.encode_record(k, v, fmt.bits, fmt.group_size)
    ref_codes, ref_side = pack_record(quantize_parts(k, fmt), quantize_parts(v, fmt))
    assert (codes.shape, codes.dtype, side.shape, side.dtype) == (ref_codes.shape, mx.uint32, ref_side.shape, dtype)
    assert mx.allclose(side.astype(mx.float32), ref_side.astype(mx.float32), rtol=1e-3, atol=1e-6).item()
    apart = mx.abs(code_levels(codes, fmt.bits) - code_levels(ref_codes, fmt.bits))
    assert mx.max(apart).item() <= 1 and mx.sum(apart).item() <= max(1, apart.size // 1000)
    assert mx.array_equal(codes[:, :, -1], ref_codes[:, :, -1]).item()


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend and an NVIDIA GPU")
@pytest.mark.parametrize("scheme", ["affine4", "affine8-g32"])
def test_attention_over_an_affine_cache_s_records_matches_the_reference_on_gpu(scheme):
    """The cache's stored parts are views of its two records (strided, at offsets); the
    fused kernels read them where they are and agree with the reference over copies."""
    from kvserve.cache import BatchQuantizedKVCache

    s = parse_scheme(scheme)
    cache = BatchQuantizedKVCache(s, [0, 2, 1])
    k, v = (mx.random.normal((3, 2, 40, 128), key=mx.random.key(i)).astype(mx.float16) for i in (3, 4))
    cache.update_and_fetch(k, v)
    mask = cache.make_mask(1)  # before the step's append, as the models ask for it
    keys, values = cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert len(cache._buf.parts) == 2 and keys[0].shape[2] == 41
    q = mx.random.normal((3, 4, 1, 128), key=mx.random.key(5)).astype(mx.float16)
    got = dispatch.attend(q, QuantizedFormat(s.keys), keys, QuantizedFormat(s.values), values, 0.1, mask)
    copies = tuple(mx.contiguous(a) for a in keys), tuple(mx.contiguous(a) for a in values)
    want = dispatch.reference(q, QuantizedFormat(s.keys), copies[0], QuantizedFormat(s.values), copies[1], 0.1, mask)
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=4e-3, rtol=1e-2).item()


def test_the_affine_encoder_kernel_serves_only_a_cuda_gpu_and_its_shapes():
    from kvserve.kernels import cuda_quantize

    x = mx.zeros((2, 3, 1, 64), dtype=mx.float16)
    assert cuda_quantize.serves(x, x, 4, 64) is ON_CUDA
    assert not cuda_quantize.serves(mx.zeros((2, 1, 1, 96)), mx.zeros((2, 1, 1, 96)), 4, 32)  # D not 64/128/256
    assert not cuda_quantize.serves(x, mx.zeros((2, 3, 1, 128), dtype=mx.float16), 4, 64)  # K and V differ
    assert not cuda_quantize.serves(x, x, 2, 64) and not cuda_quantize.serves(x, x, 4, 16)


def test_the_turbo_encoder_kernel_serves_only_a_cuda_gpu_and_its_shapes():
    from kvserve.cache.turbo_codec import get_codec
    from kvserve.kernels import cuda_encode

    codec = get_codec(64, 4, 43)
    x = mx.zeros((2, 64), dtype=mx.float16)
    assert cuda_encode.serves(x, codec.pi, 4) is ON_CUDA
    assert not cuda_encode.serves(mx.zeros((2, 96)), get_codec(96, 4, 43).pi, 4)  # D not 64/128/256
    assert not cuda_encode.serves(x, codec.pi, 8)


def _dequantized_product(x, wq, s, b, group, bits):
    """x times the quantized weights, in float32 (the products the kernel must match)."""
    return x.astype(mx.float32) @ mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32).T


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("split", cuda_qmv.SPLITS)
def test_every_few_rows_split_gives_the_same_product(split):
    """Each count of warps per block the benchmark may choose, at each count of column
    tiles it allows, on a width that leaves the last superblock part-empty (1152 = 9 superblocks of 128 values: some warps take one
    more than others, or none) and an output count that leaves the last block part-empty
    (390 = 24 x 16 + 6)."""
    K, N = 1152, 390
    wq, s, b = mx.quantize((mx.random.normal((N, K), key=mx.random.key(5)) * 0.05).astype(mx.float16),
                           group_size=64, bits=4)
    for M in (1, 5, 8, 13, 29, 64):  # 1, 2, 4 and 8 column tiles, the last ones part-empty
        if split * cuda_qmv.tiles_for(M) > cuda_qmv.MAX_SPLIT_TILES:
            continue
        x = mx.random.normal((M, K), key=mx.random.key(M)).astype(mx.float16)
        want = _dequantized_product(x, wq, s, b, 64, 4)
        got = cuda_qmv.quantized_matmul(x, wq, s, b, 64, 4, split=split)
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), rtol=0.02, atol=0.02)


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_few_rows_qmv_equals_mlx_quantized_matmul(bits, group, dtype):
    """1 to 9 rows and each count of column tiles (up to 64 rows), a width that leaves the
    kernel's last superblock part-empty (1152 = 9 x 128) and an output count that leaves a
    block part-empty (390); through the rewrite's module, which hands 1 row of this small
    matrix and 65 rows back to MLX, and multiplies ``DENSE_ROWS`` rows by the dequantized weights. 8-bit weights with bfloat16 scales
    stay with MLX (``serves`` is false there)."""
    import mlx.nn as nn
    from kvserve.kernels import cuda_qmv
    from kvserve.server.engine.few_rows import DENSE_ROWS, FewRowsQuantizedLinear, install_few_rows

    K, N = 1152, 390
    w = (mx.random.normal((N, K), key=mx.random.key(3)) * 0.05).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    for M in (*range(1, 10), 16, 17, 33, 64, 65):
        x = mx.random.normal((1, M, K), key=mx.random.key(M)).astype(dtype)
        ref = _dequantized_product(x, wq, s, b, group, bits)
        taken = 2 <= M <= cuda_qmv.MAX_ROWS and not (bits == 8 and dtype == mx.bfloat16)  # a small matrix
        assert cuda_qmv.serves(x, wq, s, group, bits, "affine") is taken
        if taken:
            got = cuda_qmv.quantized_matmul(x, wq, s, b, group, bits)
            assert got.shape == (1, M, N) and got.dtype == dtype
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref), rtol=0.02, atol=0.02)
    linear = nn.QuantizedLinear(K, N, bias=True, group_size=group, bits=bits)
    linear.set_dtype(dtype)
    plain = {n: linear(mx.ones((1, n, K), dtype)) for n in (1, 8, 9, 64, 65, DENSE_ROWS)}
    mlx_keeps = bits == 8 and dtype == mx.bfloat16
    assert install_few_rows(linear) == (0 if mlx_keeps else 1)
    assert (type(linear) is FewRowsQuantizedLinear) is not mlx_keeps
    for n, before in plain.items():
        np.testing.assert_allclose(np.array(linear(mx.ones((1, n, K), dtype)).astype(mx.float32)),
                                   np.array(before.astype(mx.float32)), rtol=0.02, atol=0.05)
    # The default device is process-wide: another thread's ``with mx.stream(mx.cpu)`` (a
    # kernel's self-check) moves it under a forward, which must then stay off the GPU kernel.
    # There it is MLX's own CPU product (bfloat16's CPU sums are 0.13 off the GPU's here).
    with mx.stream(mx.cpu):
        x8 = mx.ones((1, 8, K), dtype)
        on_cpu, mlx_on_cpu = linear(x8), nn.QuantizedLinear.__call__(linear, x8)
        mx.eval(on_cpu, mlx_on_cpu)
    assert mx.array_equal(on_cpu, mlx_on_cpu).item()
