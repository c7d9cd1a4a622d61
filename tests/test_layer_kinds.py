"""Laws of the layer kinds besides full attention: sliding windows (in every scheme) and
recurrent state; attention sinks in every family; containers that mix kinds."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import gemma3_text, qwen3_next

from kvserve.cache import (
    BatchParallelCache,
    BatchSlidingKVCache,
    BatchStateCache,
    CacheFileError,
    ParallelCache,
    PromptCache,
    SlidingKVCache,
    StateCache,
    batch_class_for,
    load_layers,
    make_layer_cache,
    parse_scheme,
    save_layers,
)
from kvserve.cache.adapter import UnsupportedLayers, install_attention, layer_caches
from kvserve.cache.base import causal_mask
from kvserve.cache.sliding import RESERVE, slack_for
from kvserve.kernels.reference import attend_blockwise, attend_full
from test_cache_laws import LAW_SCHEMES, head_dim, kv, rand, scheme_or_skip

WINDOW = 8
LIMIT = WINDOW - 1 + RESERVE + slack_for(WINDOW)  # slots a window of 8 holds at rest at most
SLIDING_SCHEMES = ["fp16", "affine8", "affine4", "mxfp4", "turbo0v4", "turbo8v3", "turbo4"]
EXACT = ("fp16", "affine8", "affine4", "mxfp4")  # per-token codes: a window changes nothing


def sliding(name: str, tokens: int, seed: int = 1, D: int = 64, step: int = 1) -> SlidingKVCache:
    cache = SlidingKVCache(make_layer_cache(parse_scheme(name)), WINDOW)
    k, v = kv(1, 2, tokens, D, seed, mx.float32)
    for a in range(0, tokens, step):
        cache.update_and_fetch(k[:, :, a:a + step], v[:, :, a:a + step])
    return cache


# --- sliding windows ---

@pytest.mark.parametrize("name", SLIDING_SCHEMES)
def test_a_window_holds_at_most_its_limit_and_counts_every_token(name):
    cache = sliding(name, 8, seed=1)
    sizes = []
    k, v = kv(1, 2, 200, 64, 2, mx.float32)
    for t in range(200):
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        sizes.append(cache.size())
    assert max(sizes) == LIMIT and min(sizes[60:]) == WINDOW - 1 + RESERVE
    assert cache.offset == 208 and cache.dropped == 208 - cache.size()
    assert cache.scheme == parse_scheme(name) and not cache.is_trimmable()


@pytest.mark.parametrize("name", SLIDING_SCHEMES)
def test_window_attention_equals_full_attention_under_the_window_mask(name):
    """Decoding past several drops gives what a full cache of the same tokens gives with
    the window mask: the window is just a shorter context."""
    scheme = scheme_or_skip(name)
    win, full = sliding(name, 12), make_layer_cache(scheme)
    k, v = kv(1, 2, 12, 64, 1, mx.float32)
    full.update_and_fetch(k, v)
    k, v = kv(1, 2, 90, 64, 5, mx.float32)
    for t in range(90):
        q = rand((1, 4, 1, 64), 100 + t, mx.float32)
        m_win, m_full = win.make_mask(1, window_size=WINDOW), full.make_mask(1, window_size=WINDOW)
        got = win.attend(q, *win.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1]), 0.125, m_win)
        want = full.attend(q, *full.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1]), 0.125, m_full)
        if name in EXACT:
            assert mx.allclose(got, want, atol=1e-6).item(), t
        else:  # TurboQuant calibrates keys on what is stored at the first decode step
            assert mx.allclose(got, want, atol=0.3).item(), t
    assert win.dropped > 0


def test_the_mask_shows_each_query_its_last_window_tokens():
    cache = sliding("fp16", 40)
    S = cache.size()
    assert cache.make_mask(1).tolist() == [[j > S - WINDOW for j in range(S + 1)]]
    assert mx.array_equal(cache.make_mask(3), causal_mask(3, S, window_size=WINDOW)).item()
    assert sliding("fp16", 3).make_mask(1) is None and sliding("fp16", 3).make_mask(2) == "causal"


@pytest.mark.parametrize("name", SLIDING_SCHEMES)
def test_batched_windows_equal_each_row_alone(name):
    scheme = scheme_or_skip(name)
    rows = [sliding(name, n, seed=i, step=5) for i, n in enumerate((70, 6, 33))]
    alone = [sliding(name, n, seed=i, step=5) for i, n in enumerate((70, 6, 33))]
    batch = BatchSlidingKVCache.merge(rows)
    assert batch.lengths == [70, 6, 33] and batch.dropped == [r.dropped for r in rows]
    k, v = kv(3, 2, 40, 64, 9, mx.float32)
    for t in range(40):
        q = rand((3, 4, 1, 64), t, mx.float32)
        mask = batch.make_mask(1, window_size=WINDOW)
        out = batch.attend(q, *batch.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1]), 0.125, mask)
        for i, single in enumerate(alone):
            m = single.make_mask(1, window_size=WINDOW)
            one = single.attend(q[i:i + 1], *single.update_and_fetch(k[i:i + 1, :, t:t + 1],
                                                                    v[i:i + 1, :, t:t + 1]), 0.125, m)
            assert mx.allclose(out[i:i + 1], one, atol=1e-5).item(), (t, i)
    assert batch.lengths == [110, 46, 73] and batch.size() <= LIMIT
    assert type(batch.inner) is batch_class_for(scheme)


def test_batch_algebra_keeps_each_rows_position():
    a, b, c = sliding("affine4", 70, 1), sliding("affine4", 5, 2), sliding("affine4", 30, 3)
    batch = BatchSlidingKVCache.merge([a, b])
    batch.extend(BatchSlidingKVCache.merge([c]))
    assert batch.lengths == [70, 5, 30]
    batch.filter([2, 0])
    assert batch.lengths == [30, 70] and batch.offset.tolist() == [30, 70]
    row = batch.extract(1)
    assert row.offset == 70 and row.dropped == a.dropped
    assert all(mx.array_equal(x, y).item() for x, y in zip(row.state, a.state))


def test_trim_keeps_the_window_of_the_next_query():
    cache = sliding("fp16", 100)
    assert cache.can_trim(RESERVE) and cache.trim(1) == 1 and cache.offset == 99
    assert not cache.can_trim(cache.size())
    with pytest.raises(ValueError, match="cannot trim"):
        cache.trim(cache.size())
    young = sliding("fp16", 5)
    assert young.is_trimmable() and young.trim(3) == 3 and young.offset == 2


@pytest.mark.parametrize("name", ["fp16", "affine4", "turbo0v4"])
@pytest.mark.parametrize("kind", ["single", "batch"])
def test_windows_round_trip_through_a_file(tmp_path, name, kind):
    layer = sliding(name, 70)
    if kind == "batch":
        layer = BatchSlidingKVCache.merge([layer, sliding(name, 9, 4)])
    path = save_layers(tmp_path / "w", [layer])
    (back,), _ = load_layers(path)
    assert type(back) is type(layer) and back.window == WINDOW and back.dropped == layer.dropped
    assert type(back.inner) is type(layer.inner)
    assert all(mx.array_equal(x, y).item() for x, y in zip(back.state, layer.state))


def test_a_window_file_whose_store_is_not_a_store_is_refused(tmp_path):
    layer = sliding("fp16", 20)
    path = save_layers(tmp_path / "w", [layer])
    tensors, meta = mx.load(str(path), return_metadata=True)
    meta["layer.0"] = meta["layer.0"].replace('"sliding.inner": "FP16KVCache"',
                                              '"sliding.inner": "SlidingKVCache"')
    mx.save_safetensors(str(path), tensors, meta)
    with pytest.raises(CacheFileError, match="cannot hold a sliding window"):
        load_layers(path)


# --- recurrent state ---

def state(rows: int, value: float, offset: int) -> StateCache:
    cache = (StateCache if rows == 1 else BatchStateCache)(2, offsets=[offset] * rows)
    cache.cache = [mx.full((rows, 3, 4), value), mx.full((rows, 2, 2, 2), value + 0.5)]
    return cache


def test_state_rows_merge_extract_filter_extend():
    batch = BatchStateCache.merge([state(1, 1.0, 4), StateCache(2), state(1, 3.0, 9)])
    assert batch.offset.tolist() == [4, 0, 9] and batch.cache[0].shape == (3, 3, 4)
    assert batch.cache[0][1].tolist() == [[0.0] * 4] * 3  # a fresh row is a zero state
    batch.filter([2, 0])
    batch.extend(BatchStateCache.merge([state(1, 7.0, 2)]))
    assert batch.offsets == [9, 4, 2]
    assert [float(batch.extract(i)[1][0, 0, 0, 0]) for i in range(3)] == [3.5, 1.5, 7.5]


def test_left_padding_hides_padding_and_is_not_counted():
    batch = BatchStateCache.merge([StateCache(1), StateCache(1)])
    batch.prepare(left_padding=[0, 2])
    assert batch.make_mask(3).tolist() == [[True, True, True], [False, False, True]]
    batch[0] = mx.zeros((2, 3))
    batch.advance(3)
    assert batch.offsets == [3, 1] and batch.make_mask(1) is None


def test_the_last_forward_can_be_undone_once():
    batch = BatchStateCache.merge([state(1, 1.0, 4), state(1, 2.0, 6)])
    batch[0] = batch[0] + 10
    batch[1] = batch[1] + 10
    batch.advance(1)
    batch.filter([1])  # a row finished while the step was queued
    assert batch.can_trim(1) and not batch.can_trim(2) and not batch.is_trimmable()
    assert batch.trim(1) == 1 and batch.offsets == [6] and float(batch[0][0, 0, 0]) == 2.0
    with pytest.raises(ValueError, match="undo its last forward"):
        batch.trim(1)


@pytest.mark.parametrize("rows", [1, 2])
def test_state_round_trips_through_a_file_and_refuses_a_wrong_layout(tmp_path, rows):
    layer = state(rows, 1.5, 11)
    (back,), _ = load_layers(save_layers(tmp_path / "s", [layer]))
    assert type(back) is type(layer) and back.offsets == layer.offsets
    assert all(mx.array_equal(x, y).item() for x, y in zip(back.state, layer.state))
    with pytest.raises(ValueError, match="arrays for the layout"):
        StateCache.from_state(layer.scheme, layer.state[:1], layer.meta_state)


# --- attention sinks, every family ---

def sink_reference(q, k, v, scale, mask, sinks):
    """f32 softmax attention with one valueless logit per query head joining each softmax."""
    B, Hq, L, _ = q.shape
    n_rep = Hq // k.shape[1]
    k, v = mx.repeat(k, n_rep, axis=1), mx.repeat(v, n_rep, axis=1)
    s = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)  # (B, H_q, L, S)
    if mask is not None:
        s = mx.where(mask, s, -mx.inf)
    sink = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None, None], (B, Hq, L, 1))
    p = mx.softmax(mx.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return p @ v


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("name", LAW_SCHEMES)
def test_every_family_attends_with_sinks(name, L):
    scheme = scheme_or_skip(name)
    D = head_dim(scheme)
    cache = batch_class_for(scheme).merge([make_layer_cache(scheme), make_layer_cache(scheme)])
    cache.update_and_fetch(*kv(2, 2, 20, D, 1, mx.float32))
    q = rand((2, 4, L, D), 3, mx.float32)
    sinks = mx.array([0.5, -1.0, 2.0, 8.0])
    mask = cache.make_mask(L, return_array=True)
    keys, values = cache.update_and_fetch(*kv(2, 2, L, D, 4, mx.float32))
    got = cache.attend(q, keys, values, D ** -0.5, mask, sinks=sinks)
    want = sink_reference(q, *cache.dequantize(), D ** -0.5, mask, sinks)
    assert mx.allclose(got, want, atol=1e-4).item()
    plain = cache.attend(q, keys, values, D ** -0.5, mask)
    assert not mx.allclose(got, plain, atol=1e-3).item()  # the sinks took their share


def test_blockwise_and_full_paths_agree_with_sinks():
    from kvserve.cache.affine import QuantizedFormat

    fmt = parse_scheme("affine4").keys
    cache = make_layer_cache("affine4")
    keys, values = cache.update_and_fetch(*kv(1, 2, 700, 64, 2, mx.float32))
    q, sinks = rand((1, 4, 1, 64), 5, mx.float32), mx.array([9.0, 0.0, -3.0, 1.0])
    args = (q, QuantizedFormat(fmt), keys, QuantizedFormat(fmt), values, 0.125, None)
    full = attend_full(*args, sinks=sinks)
    assert mx.allclose(attend_blockwise(*args, block=128, sinks=sinks), full, atol=1e-5).item()


# --- containers of mixed kinds ---

GEMMA = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4,
                              intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64, vocab_size=64, sliding_window=WINDOW,
                              sliding_window_pattern=4)


@pytest.fixture(scope="module")
def gemma():
    mx.random.seed(0)
    return gemma3_text.Model(GEMMA)


def test_adapter_maps_each_mlx_lm_cache_to_its_kind(gemma):
    cache = PromptCache.for_model(gemma, "turbo4")
    assert cache.layout() == "window8*3,kv"
    stores = [layer.inner if isinstance(layer, SlidingKVCache) else layer for layer in cache]
    assert [s.scheme.name for s in stores] == ["affine8", "affine8", "affine8", "affine8"]  # boundary


def test_a_container_converts_the_store_inside_its_windows(gemma):
    cache = PromptCache.for_model(gemma, "affine4", quantize_after=4)
    gemma(mx.array([[1, 2, 3]]), cache=cache)
    assert not cache.maybe_convert()
    window = cache[0]
    gemma(mx.array([[4]]), cache=cache)
    assert cache.maybe_convert() and cache[0] is window  # the same object, a new store
    assert window.inner.scheme.name == "affine4" and window.offset == 4


def test_unknown_cache_kinds_are_refused_by_name():
    from mlx_lm.models.cache import ChunkedKVCache

    class Chunked:
        layers = [0]

        def make_cache(self):
            return [ChunkedKVCache(16)]

    with pytest.raises(UnsupportedLayers, match="layer 0: mlx-lm's ChunkedKVCache"):
        layer_caches(Chunked(), lambda k, n: None)


def test_hybrid_layout_names_its_state_layers():
    args = qwen3_next.ModelArgs(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4,
                                intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=64, vocab_size=64, rms_norm_eps=1e-6, linear_num_value_heads=2,
                                linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                                linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=2,
                                num_experts_per_tok=1, decoder_sparse_step=1,
                                shared_expert_intermediate_size=32, moe_intermediate_size=32,
                                rope_theta=10000, partial_rotary_factor=0.5, max_position_embeddings=512,
                                tie_word_embeddings=False, mlp_only_layers=[], norm_topk_prob=True)
    cache = PromptCache.for_model(qwen3_next.Model(args), "fp16")
    assert cache.layout() == "state2,kv,state2,kv"


def test_a_kv_shared_layer_attends_through_the_cache_it_shares(gemma):
    """Gemma 4's shared layers pass the source layer's K/V with ``cache=None``: for a
    quantized scheme those are stored parts, which only the source cache can read."""
    install_attention(gemma)
    cache = make_layer_cache("affine4")
    keys, values = cache.update_and_fetch(*kv(1, 2, 9, 64, 1, mx.float32))
    q = rand((1, 4, 1, 64), 2, mx.float32)
    own = gemma3_text.scaled_dot_product_attention(q, keys, values, cache=cache, scale=0.125, mask=None)
    shared = gemma3_text.scaled_dot_product_attention(q, keys, values, cache=None, scale=0.125, mask=None)
    assert mx.array_equal(own, shared).item()


# --- side-by-side caches (Falcon-H1's CacheList) ---

def parallel(tokens: int, seed: int) -> ParallelCache:
    layer = ParallelCache([StateCache(1), make_layer_cache("fp16")])
    layer[0][0] = mx.full((1, 3), float(seed))
    layer[0].advance(tokens)
    layer[1].update_and_fetch(*kv(1, 2, tokens, 64, seed, mx.float32))
    return layer


def test_parallel_parts_batch_row_by_row_and_round_trip(tmp_path):
    batch = BatchParallelCache.merge([parallel(5, 1), parallel(9, 2)])
    assert batch.offset.tolist() == [5, 9] and batch[1].lengths == [5, 9]
    row = batch.extract(0)
    assert row.offset == 5 and row[0][0].tolist() == [[1.0] * 3]
    (back,), _ = load_layers(save_layers(tmp_path / "p", [batch]))
    assert type(back) is BatchParallelCache and [type(p) for p in back.parts] == [BatchStateCache,
                                                                                  type(batch[1])]
    assert all(mx.array_equal(x, y).item() for x, y in zip(back.state, batch.state))
    assert not batch.is_trimmable() and not batch.can_trim(1)  # the state took no forward here


def test_a_container_converts_the_kv_part_of_a_parallel_layer():
    cache = PromptCache([parallel(6, 1)], "affine4", quantize_after=4)
    assert cache.layout() == "(state1|kv)" and cache.maybe_convert()
    assert type(cache[0][1]).__name__ == "QuantizedKVCache" and cache[0][1].offset == 6
