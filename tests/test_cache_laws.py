"""Laws every KV cache family obeys, parametrized over every scheme and over per-request and
batch classes. Families that are not importable yet are skipped, not failed.

Shapes are small (H_kv <= 2, D <= 256, T <= 1000) so the file runs in seconds on a CPU.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvserve.cache import (
    BatchKVCacheLayer,
    KVCacheLayer,
    SchemeUnavailable,
    batch_class_for,
    make_layer_cache,
    parse_scheme,
    single_class_for,
)
from kvserve.cache.buffer import GrowableBuffer, growths_to_reach, next_capacity
from kvserve.cache.fp16 import FP16KVCache
from kvserve.cache.registry import SCHEME_NAMES, family_of

LAW_SCHEMES = [*SCHEME_NAMES, "affine4-g32", "affine4-g128"]
KINDS = ["single", "batch"]


# --- helpers ---

def scheme_or_skip(name: str):
    scheme = parse_scheme(name)
    try:
        single_class_for(scheme)
    except SchemeUnavailable as err:
        pytest.skip(str(err))
    return scheme


def head_dim(scheme) -> int:
    return max(64, scheme.keys.group_size, scheme.values.group_size)


def rand(shape, seed: int, dtype=mx.float16) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def kv(B: int, H: int, L: int, D: int, seed: int, dtype=mx.float16):
    return rand((B, H, L, D), seed, dtype), rand((B, H, L, D), seed + 1000, dtype)


def new_cache(scheme, kind: str, B: int = 2):
    return make_layer_cache(scheme) if kind == "single" else batch_class_for(scheme)(scheme, [0] * B)


def rows(kind: str) -> int:
    return 1 if kind == "single" else 2


def assert_same_state(a, b):
    assert a.offset == b.offset if isinstance(a.offset, int) else mx.array_equal(a.offset, b.offset)
    sa, sb = a.state, b.state
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert mx.array_equal(x, y).item()


def filled(scheme, length: int, D: int, seed: int, H: int = 2, dtype=mx.float16):
    cache = make_layer_cache(scheme)
    if length:
        cache.update_and_fetch(*kv(1, H, length, D, seed, dtype))
    return cache


def reference_attention(q, k, v, scale, mask):
    """Plain f32 softmax attention with repeated K/V heads: (B, H_q, L, D) -> (B, H_q, L, D_v)."""
    _, Hq, L, _ = q.shape
    n_rep = Hq // k.shape[1]
    k, v = mx.repeat(k, n_rep, axis=1), mx.repeat(v, n_rep, axis=1)  # (B, H_q, S, D)
    scores = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)  # (B, H_q, L, S)
    if isinstance(mask, str):
        S = k.shape[2]
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ v


# --- protocol and arithmetic ---

@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_classes_implement_the_protocol(name):
    scheme = scheme_or_skip(name)
    assert isinstance(make_layer_cache(scheme), KVCacheLayer)
    assert isinstance(batch_class_for(scheme)(scheme, [0, 1]), BatchKVCacheLayer)
    assert make_layer_cache(scheme).scheme == scheme


def test_growth_arithmetic():
    assert [next_capacity(256, n) for n in (257, 600, 3000)] == [512, 768, 3072]
    assert [next_capacity(c, c + 1) for c in (2048, 4096, 16384)] == [4096, 8192, 20480]  # at most 4,096 more
    assert growths_to_reach(32768, chunk=1) == 11  # a fixed 256-slot step needs 127
    assert growths_to_reach(255, chunk=255) == 0
    assert growths_to_reach(100_000, chunk=100_000) == 0  # one prefill: one allocation


def test_growth_to_32768_one_token_at_a_time():
    cache = FP16KVCache()
    k = mx.zeros((1, 1, 1, 8), mx.float16)
    for i in range(32768):
        cache.update_and_fetch(k, k)
        if i % 1024 == 1023:
            mx.eval(cache.state)  # keep the lazy graph short
    assert (cache.offset, cache.capacity, cache.growths) == (32768, 32768, 11)


def test_buffer_appends_several_parts_together():
    buf = GrowableBuffer(granule=4)
    buf.append([mx.ones((1, 2, 3, 5)), mx.zeros((1, 2, 3, 1), mx.uint8)])
    buf.append([mx.ones((1, 2, 3, 5)), mx.zeros((1, 2, 3, 1), mx.uint8)])
    assert (buf.size, buf.capacity, buf.growths) == (6, 8, 1)
    assert [v.shape for v in buf.views()] == [(1, 2, 6, 5), (1, 2, 6, 1)]
    assert buf.nbytes == 2 * 8 * 5 * 4 + 2 * 8 * 1


@pytest.mark.parametrize("name", ["affine4", "affine8-g32", "mxfp4"])
def test_quantize_caches_store_two_records_and_show_the_scheme_s_parts(name):
    """``cache.affine``'s storage: codes of K and V in one array, scales (and biases) in
    another, so a step writes two slices; ``state`` is exactly ``mx.quantize``'s parts, and a
    cache rebuilt from it stores the same records. K and V of different head sizes (no record
    holds both) keep one array per part."""
    from kvserve.cache.affine import quantize_parts

    scheme = parse_scheme(name)
    cache = make_layer_cache(scheme)
    keys, values = kv(1, 2, 5, 64, seed=7)
    cache.update_and_fetch(keys, values)
    parts = quantize_parts(keys, scheme.keys) + quantize_parts(values, scheme.values)
    widths = [p.shape[-1] for p in parts]
    n = len(parts) // 2
    assert [(p.shape[-1], p.dtype) for p in cache._buf.parts] == [(2 * widths[0], mx.uint32),
                                                                  (2 * sum(widths[1:n]), parts[1].dtype)]
    assert all(mx.array_equal(a, b).item() for a, b in zip(cache.state, parts, strict=True))
    rebuilt = type(cache).from_state(scheme, cache.state, cache.meta_state)
    assert all(mx.array_equal(a, b).item() for a, b in zip(rebuilt._buf.parts, cache._buf.views(), strict=True))
    apart = make_layer_cache(scheme)
    apart.update_and_fetch(keys, mx.concatenate([values, values], axis=-1))  # D_v = 2 D_k
    assert len(apart._buf.parts) == len(parts) and len(apart.state) == len(parts)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_growth_counts_and_prefill_larger_than_capacity(name, kind):
    scheme = scheme_or_skip(name)
    cache, B, D = new_cache(scheme, kind), rows(kind), head_dim(scheme)
    steps = [(300, 512, 0), (213, 1024, 1), (3000, 3584, 2)]  # (chunk, capacity, growths)
    for i, (chunk, capacity, growths) in enumerate(steps):
        cache.update_and_fetch(*kv(B, 1, chunk, D, seed=i))
        assert (cache.capacity, cache.growths) == (capacity, growths)
    assert cache.size() == 3513


# --- state, trim, nbytes ---

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_state_holds_exactly_offset_tokens(name, kind):
    scheme = scheme_or_skip(name)
    B, D = rows(kind), head_dim(scheme)
    cls = type(new_cache(scheme, kind))
    for n in (1, 63, 255, 256, 257, 258, 1000):
        cache = new_cache(scheme, kind)
        keys, values = kv(B, 2, n, D, seed=n)
        cache.update_and_fetch(keys, values)
        assert cache.size() == n and all(a.shape[2] == n for a in cache.state)
        assert_same_state(cls.from_state(scheme, cache.state, cache.meta_state), cache)
        if family_of(scheme) != "turbo" and n > 1:  # chunking invariance: encoding is per token
            twice = new_cache(scheme, kind)
            twice.update_and_fetch(keys[:, :, : n - 1], values[:, :, : n - 1])
            twice.update_and_fetch(keys[:, :, n - 1 :], values[:, :, n - 1 :])
            assert_same_state(twice, cache)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_state_is_a_snapshot(name, kind):
    """Appends write into storage in place; states and rebuilt caches must not see them."""
    scheme = scheme_or_skip(name)
    B, D = rows(kind), head_dim(scheme)
    cache = new_cache(scheme, kind)
    cache.update_and_fetch(*kv(B, 2, 256, D, seed=1))  # size == capacity
    snapshot = [mx.array(a) for a in cache.state]
    held = cache.state
    copy = type(cache).from_state(scheme, held, cache.meta_state)
    cache.trim(3)
    cache.update_and_fetch(*kv(B, 2, 3, D, seed=2))
    copy.trim(1)
    copy.update_and_fetch(*kv(B, 2, 1, D, seed=3))
    assert all(mx.array_equal(a, b).item() for a, b in zip(held, snapshot))
    assert not mx.array_equal(cache.state[0], copy.state[0]).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_trim_then_append(name, kind):
    scheme = scheme_or_skip(name)
    B, D = rows(kind), head_dim(scheme)
    a, b = kv(B, 2, 20, D, seed=1), kv(B, 2, 7, D, seed=2)
    reference, cache = new_cache(scheme, kind), new_cache(scheme, kind)
    for c in (reference, cache):
        c.update_and_fetch(*a)
        c.update_and_fetch(*b)
    assert cache.is_trimmable() and cache.trim(7) == 7 and cache.size() == 20
    cache.update_and_fetch(*b)
    assert_same_state(cache, reference)
    assert cache.trim(100) == 27 and cache.size() == 0


def bytes_per_token_per_head(scheme, D: int) -> float:
    """K+V bytes per token per KV head with fp16 activations (turboquant.md section 7)."""
    def component(fmt):
        if fmt.kind == "fp16":
            return 2 * D
        scale_bytes = 2 * 2 if fmt.mode == "affine" else 1  # fp16 scale + bias, or a uint8 exponent
        return D * fmt.bits / 8 + scale_bytes * D / fmt.group_size
    return component(scheme.keys) + component(scheme.values)


def test_bytes_formula_matches_the_table():
    at128 = {n: bytes_per_token_per_head(parse_scheme(n), 128) for n in ("fp16", "affine8", "affine4")}
    assert at128 == {"fp16": 512, "affine8": 272, "affine4": 144}
    bits = {n: bytes_per_token_per_head(parse_scheme(n), 128) * 8 / 256 for n in ("mxfp4", "mxfp8", "nvfp4")}
    assert bits == {"mxfp4": 4.25, "mxfp8": 8.25, "nvfp4": 4.5}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_nbytes_per_token_equals_the_formula(name, kind):
    scheme = scheme_or_skip(name)
    if family_of(scheme) == "turbo":
        pytest.skip("turbo byte counts depend on the phase; tested with the family")
    B, H, D = rows(kind), 2, head_dim(scheme)
    cache = new_cache(scheme, kind)
    cache.update_and_fetch(*kv(B, H, 300, D, seed=3))
    per_slot = B * H * bytes_per_token_per_head(scheme, D)
    assert cache.nbytes == cache.capacity * per_slot  # the allocation, padding included
    assert cache.capacity - cache.size() < 256


# --- batch algebra ---

@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_merge_then_extract_round_trips(name):
    scheme = scheme_or_skip(name)
    D = head_dim(scheme)
    # Prefill-sized lengths (L > 1): a one-token append would start a turbo cache's decode phase.
    singles = [filled(scheme, n, D, seed=n) for n in (3, 0, 2, 5)]
    batch = batch_class_for(scheme).merge(singles)
    assert batch.left_padding == [2, 5, 3, 0] and batch.size() == 5
    assert batch.offset.tolist() == [3, 0, 2, 5]
    for i, single in enumerate(singles):
        assert_same_state(batch.extract(i), single)


@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_filter_then_extend(name):
    scheme = scheme_or_skip(name)
    D = head_dim(scheme)
    a, b, c, d, e = (filled(scheme, n, D, seed=10 + n) for n in (5, 2, 9, 3, 12))
    Batch = batch_class_for(scheme)
    batch = Batch.merge([a, b, c])
    batch.filter([2, 0])
    assert batch.left_padding == [0, 4] and batch.size() == 9
    batch.extend(Batch.merge([d, e]))
    assert batch.left_padding == [3, 7, 9, 0] and batch.size() == 12
    singles = [c, a, d, e]
    step = kv(4, 2, 1, D, seed=99)
    batch.update_and_fetch(*step)
    for i, single in enumerate(singles):
        single.update_and_fetch(step[0][i : i + 1], step[1][i : i + 1])
        assert_same_state(batch.extract(i), single)


@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_right_padding_becomes_left_padding(name):
    scheme = scheme_or_skip(name)
    D = head_dim(scheme)
    lengths = [6, 3, 5]
    keys, values = kv(3, 2, 6, D, seed=5)
    batch = batch_class_for(scheme)(scheme, [0, 0, 0])
    batch.prepare(right_padding=[6 - n for n in lengths])
    batch.update_and_fetch(keys, values)
    batch.finalize()
    assert batch.left_padding == [0, 3, 1] and batch.offset.tolist() == lengths
    for i, n in enumerate(lengths):
        single = make_layer_cache(scheme)
        single.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])
        assert_same_state(batch.extract(i), single)


# --- attention ---

def attend_step(cache, q, k, v, scale=0.125):
    mask = cache.make_mask(q.shape[2])
    keys, values = cache.update_and_fetch(k, v)
    return cache.attend(q, keys, values, scale, mask), mask


PADDED = [((5, 9, 2), 4, 2, 1), ((5, 9, 2), 4, 2, 4), ((65, 30), 8, 2, 1)]  # lengths, H_q, H_kv, L


@pytest.mark.parametrize("lengths,Hq,Hkv,L", PADDED)
@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_batched_attention_equals_each_sequence_alone(name, lengths, Hq, Hkv, L):
    scheme = scheme_or_skip(name)
    D, B = head_dim(scheme), len(lengths)
    singles = [make_layer_cache(scheme) for _ in lengths]
    for i, (n, s) in enumerate(zip(lengths, singles)):
        s.update_and_fetch(*kv(1, Hkv, n, D, seed=20 + i, dtype=mx.float32))
    batch = batch_class_for(scheme).merge(singles)
    q = rand((B, Hq, L, D), 7, mx.float32)
    k, v = kv(B, Hkv, L, D, seed=8, dtype=mx.float32)
    out, mask = attend_step(batch, q, k, v)
    assert mask.shape == (B, 1, L, max(lengths) + L)  # e.g. (2, 1, 1, 66) against (2, 2, 4, 1, 66)
    for i, single in enumerate(singles):
        alone, _ = attend_step(single, q[i : i + 1], k[i : i + 1], v[i : i + 1])
        if family_of(scheme) == "fp16":
            assert mx.array_equal(out[i : i + 1], alone).item()
        else:
            assert mx.allclose(out[i : i + 1], alone, atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_attention_matches_float_reference(name, kind, D):
    scheme = scheme_or_skip(name)
    if D % head_dim(scheme):
        pytest.skip(f"{name} needs head_dim a multiple of {head_dim(scheme)}")
    B, Hkv = rows(kind), 2
    for n_rep in (1, 2, 3):
        for L in (1, 4):
            cache = new_cache(scheme, kind)
            if kind == "batch":
                cache = batch_class_for(scheme).merge([filled(scheme, 37, D, 1, dtype=mx.float32),
                                                      filled(scheme, 30, D, 2, dtype=mx.float32)])
            else:
                cache.update_and_fetch(*kv(1, Hkv, 37, D, seed=1, dtype=mx.float32))
            q = rand((B, Hkv * n_rep, L, D), 3, mx.float32)
            k, v = kv(B, Hkv, L, D, seed=4, dtype=mx.float32)
            mask = cache.make_mask(L)
            keys, values = cache.update_and_fetch(k, v)
            out = cache.attend(q, keys, values, D ** -0.5, mask)
            expected = reference_attention(q, *cache.dequantize(), D ** -0.5, mask)
            assert out.shape == expected.shape and out.dtype == q.dtype
            assert mx.allclose(out, expected, atol=1e-4).item(), (n_rep, L)


@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_half_precision_storage_accumulates_in_f32(name):
    """fp16 keys/values (fp16 scales): f32 queries still get f32-accurate attention."""
    scheme = scheme_or_skip(name)
    D = head_dim(scheme)
    cache = make_layer_cache(scheme)
    cache.update_and_fetch(*kv(1, 2, 40, D, seed=1))
    q = rand((1, 4, 4, D), 2, mx.float32)
    mask = cache.make_mask(4)
    keys, values = cache.update_and_fetch(*kv(1, 2, 4, D, seed=3))
    out = cache.attend(q, keys, values, D ** -0.5, mask)
    expected = reference_attention(q, *cache.dequantize(), D ** -0.5, mask)
    assert out.dtype == mx.float32 and mx.allclose(out, expected, atol=1e-4).item()


@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_attention_returns_the_query_dtype(name):
    scheme = scheme_or_skip(name)
    D = head_dim(scheme)
    cache = make_layer_cache(scheme)
    keys, values = cache.update_and_fetch(*kv(1, 2, 9, D, seed=1))
    out = cache.attend(rand((1, 6, 1, D), 2), keys, values, 0.1, None)
    assert out.dtype == mx.float16 and out.shape == (1, 6, 1, D)


def test_families_refuse_foreign_schemes():
    with pytest.raises(ValueError):
        make_layer_cache("affine8").__class__(parse_scheme("fp16"))
    with pytest.raises(ValueError):
        FP16KVCache(parse_scheme("mxfp4"))
    with pytest.raises(ValueError, match="head_dim 64 is not a multiple"):
        make_layer_cache("affine4-g128").update_and_fetch(*kv(1, 1, 2, 64, seed=0))


# --- rejected speculative tokens: trim_rows ---

@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_trim_rows_equals_each_row_trimmed_alone(name):
    """Three rows of 5, 3 and 7 tokens take a 4-token verify chunk, then drop 3, 0 and 2 of
    it: each row then holds exactly what it would hold alone with only its kept tokens, in
    the same class and scheme (TurboQuant compressed, as a verify step leaves it)."""
    scheme = scheme_or_skip(name)
    D, lengths, drops = head_dim(scheme), [5, 3, 7], [3, 0, 2]
    singles = [filled(scheme, n, D, seed=10 + i) for i, n in enumerate(lengths)]
    batch = batch_class_for(scheme).merge(singles)
    batch.begin_decode()
    chunk = kv(3, 2, 4, D, seed=99)
    batch.update_and_fetch(*chunk)
    assert batch.can_trim_rows(drops)
    batch.trim_rows(drops)
    assert type(batch) is batch_class_for(scheme) and batch.scheme == scheme
    assert batch.lengths == [n + 4 - d for n, d in zip(lengths, drops)]
    for i, (single, drop) in enumerate(zip(singles, drops)):
        single.begin_decode()
        single.update_and_fetch(chunk[0][i : i + 1, :, : 4 - drop], chunk[1][i : i + 1, :, : 4 - drop])
        assert_same_state(batch.extract(i), single)
