"""PromptCache, the attention adapter and cache files, on a tiny random-weight llama.

The model: hidden 64, 2 layers, 4 query heads, 2 KV heads (GQA 2), head_dim 64, vocab 256.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from servers import random_llama
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from kvserve.cache import (
    BatchFP16KVCache,
    BatchQuantizedKVCache,
    CacheFileError,
    FP16KVCache,
    PromptCache,
    QuantizedKVCache,
    SchemeUnavailable,
    install_attention,
    load_layers,
    make_layer_cache,
    parse_scheme,
    save_layers,
    single_class_for,
)
from kvserve.cache.adapter import from_mlx_lm, uninstall_attention

PROMPT = [3, 17, 99, 4, 250, 31, 8, 77, 120, 5, 64, 200]


@pytest.fixture(scope="module")
def model():
    return random_llama(1234)


def step(model, cache, tokens: list[list[int]]) -> mx.array:
    """One forward; converts inside the container afterwards, as the runner does."""
    logits = model(mx.array(tokens), cache=cache)[:, -1]  # (B, V)
    if isinstance(cache, PromptCache):
        cache.maybe_convert()
    mx.eval(logits)
    return logits


def greedy(model, cache, prompt: list[int], n: int) -> tuple[list[int], mx.array]:
    logits, tokens, seen = step(model, cache, [prompt]), [], []
    for _ in range(n):
        seen.append(logits[0])
        tokens.append(int(mx.argmax(logits[0]).item()))
        logits = step(model, cache, [[tokens[-1]]])
    return tokens, mx.stack(seen)  # (n, V)


# --- the container against mlx-lm ---

def test_fp16_container_decodes_like_mlx_lm(model):
    """The same tokens; logits equal to float16 rounding: the fp16 cache stores K/V as 16-bit
    floats where mlx-lm's keeps the model's float32 (and on the CPU attention runs in
    kvserve's kernel, which sums in another order than MLX's SDPA)."""
    ours = PromptCache.for_model(model, "fp16")
    theirs = make_prompt_cache(model)
    a, la = greedy(model, ours, PROMPT, 16)
    b, lb = greedy(model, theirs, PROMPT, 16)
    assert a == b
    assert mx.allclose(la, lb, atol=2e-3, rtol=2e-3).item()
    assert all(type(layer) is FP16KVCache for layer in ours) and ours.offset == len(PROMPT) + 16


@pytest.mark.parametrize("name,atol", [("affine8", 0.05), ("mxfp8", 0.2)])
def test_quantized_container_stays_close(model, name, atol):
    reference, ref_logits = greedy(model, PromptCache.for_model(model, "fp16"), PROMPT, 12)
    cache = PromptCache.for_model(model, name)
    tokens, logits = greedy(model, cache, PROMPT, 12)
    assert all(type(layer) is QuantizedKVCache for layer in cache)
    assert mx.abs(logits - ref_logits).max().item() < atol
    assert tokens == reference


def test_holders_see_the_converted_layers(model):
    """mlx-swift-examples kept its own fp16 layer list and lost the quantized cache."""
    cache = PromptCache.for_model(model, "affine4", quantize_after=16)
    held_by_scheduler = cache  # another holder of the same request
    stale_layer = cache[0]  # what nobody should keep across steps
    step(model, cache, [PROMPT])
    assert cache.offset == 12 and type(held_by_scheduler[0]) is FP16KVCache
    fp16_bytes = held_by_scheduler.nbytes
    converted = []
    for t in range(6):
        step(model, cache, [[t]])
        converted.append(type(held_by_scheduler[0]) is QuantizedKVCache)
    assert converted == [False, False, False, True, True, True]  # offset 16 reached at the 4th token
    assert all(type(layer) is QuantizedKVCache for layer in held_by_scheduler)
    assert held_by_scheduler.nbytes == sum(layer.nbytes for layer in held_by_scheduler.layers)
    # affine4 g64 at D = 64 with f32 activations: 32 B packed + 2 * 4 B scale/bias per component.
    per_token = 2 * 2 * (32 + 8)  # H_kv * (K + V)
    assert held_by_scheduler.nbytes == 2 * 256 * per_token < fp16_bytes
    assert type(stale_layer) is FP16KVCache and not held_by_scheduler.pending_conversion


def test_conversion_keeps_decoding_close(model):
    reference, ref_logits = greedy(model, PromptCache.for_model(model, "fp16"), PROMPT, 10)
    tokens, logits = greedy(model, PromptCache.for_model(model, "affine8", quantize_after=14), PROMPT, 10)
    _, raw_logits = greedy(model, PromptCache.for_model(model, "affine8", quantize_after=1 << 20), PROMPT, 10)
    assert mx.array_equal(logits[:2], raw_logits[:2]).item()  # the raw prefill until offset 14
    assert mx.abs(logits - ref_logits).max().item() < 0.05 and tokens == reference


def test_quantize_after_zero_starts_quantized(model):
    cache = PromptCache.for_model(model, "mxfp4")
    assert all(type(layer) is QuantizedKVCache for layer in cache) and not cache.maybe_convert()


# --- batches of containers ---

@pytest.mark.parametrize("name", ["fp16", "affine8"])
def test_batched_decode_equals_each_request_alone(model, name):
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:9]]
    alone = [greedy(model, PromptCache.for_model(model, name), p, 6) for p in prompts]
    singles = [PromptCache.for_model(model, name) for _ in prompts]
    logits = mx.concatenate([step(model, c, [p]) for c, p in zip(singles, prompts)])
    batch = PromptCache.merge(singles)
    assert batch.is_batch and batch.offset.tolist() == [12, 5, 7]
    seen = []
    for _ in range(6):
        seen.append(logits)
        tokens = mx.argmax(logits, axis=-1).tolist()
        logits = step(model, batch, [[t] for t in tokens])
    seen = mx.stack(seen, axis=1)  # (B, n, V)
    for i, (tokens, ref_logits) in enumerate(alone):
        assert mx.argmax(seen[i], axis=-1).tolist() == tokens
        assert mx.allclose(seen[i], ref_logits, atol=1e-4).item()
    request = batch.extract(1)
    assert request.offset == 5 + 6 and not request.is_batch


def test_batch_container_converts_in_place(model):
    singles = [PromptCache.for_model(model, "affine8", quantize_after=14) for _ in range(2)]
    for c, p in zip(singles, (PROMPT, PROMPT[:6])):
        step(model, c, [p])
    batch = PromptCache.merge(singles)
    assert type(batch[0]) is BatchFP16KVCache
    step(model, batch, [[1], [2]])
    assert type(batch[0]) is BatchFP16KVCache  # longest is 13
    step(model, batch, [[1], [2]])
    assert type(batch[0]) is BatchQuantizedKVCache and batch.offset.tolist() == [14, 8]
    assert type(batch.extract(1)[1]) is QuantizedKVCache


# --- the adapter ---

def test_install_attention_is_idempotent_and_reversible(model):
    install_attention(model)
    assert install_attention(model) == 0
    assert llama.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"
    uninstall_attention(model)
    assert not hasattr(llama.scaled_dot_product_attention, "__kvserve_original__")
    assert install_attention(model) == 1


def test_dispatcher_hands_attention_sinks_to_the_cache(model):
    install_attention(model)
    cache = make_layer_cache("fp16")
    k = mx.zeros((1, 2, 3, 64))
    keys, values = cache.update_and_fetch(k, k + 1)  # sinks scale the output down: 1 -> 0.03
    q, sinks = mx.zeros((1, 4, 3, 64)), mx.full((4,), 5.0)
    got = llama.scaled_dot_product_attention(q, keys, values, cache=cache, scale=1.0, mask=None,
                                             sinks=sinks)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=None, sinks=sinks)
    assert mx.array_equal(got, want).item() and 0 < got.max().item() < 0.05


def test_from_mlx_lm_keeps_the_tokens(model):
    theirs = make_prompt_cache(model)
    step(model, theirs, [PROMPT])
    ours = from_mlx_lm(theirs[0])
    assert ours.offset == 12 and mx.array_equal(ours.state[0], theirs[0].keys[..., :12, :]).item()


# --- files ---

def scheme_or_skip(name: str):
    try:
        single_class_for(name)
    except SchemeUnavailable as err:
        pytest.skip(str(err))
    return parse_scheme(name)


@pytest.mark.parametrize("name", ["fp16", "affine4", "affine8-g32", "mxfp4", "nvfp4", "turbo8v3"])
def test_round_trip_then_decoding_continues_identically(model, tmp_path, name):
    scheme_or_skip(name)
    cache = PromptCache.for_model(model, name)
    first, _ = greedy(model, cache, PROMPT, 3)
    path = save_layers(tmp_path / "c", cache, {"model": "tiny"})
    layers, meta = load_layers(path)
    assert meta == {"model": "tiny"} and path.suffix == ".safetensors"
    loaded = PromptCache(layers, name)
    for a, b in zip(cache, loaded):
        assert type(a) is type(b) and a.offset == b.offset == 15
        assert all(mx.array_equal(x, y).item() and x.dtype == y.dtype for x, y in zip(a.state, b.state))
    last = [[first[-1]]]
    n1, l1 = greedy(model, cache, last[0], 8)
    n2, l2 = greedy(model, loaded, last[0], 8)
    assert n1 == n2 and mx.array_equal(l1, l2).item()


def test_files_hold_offset_tokens_and_describe_them(model, tmp_path):
    cache = PromptCache.for_model(model, "affine4")
    step(model, cache, [PROMPT])
    path = save_layers(tmp_path / "c.safetensors", cache)
    tensors, header = mx.load(str(path), return_metadata=True)
    assert all(a.shape[2] == 12 for a in tensors.values()) and cache[0].capacity == 256
    info = json.loads(header["layer.1"])
    assert header["format_version"] == "1" and info["class"] == "QuantizedKVCache"
    assert info["params"] == parse_scheme("affine4").params() and info["offset"] == 12
    assert info["meta"] == {"offset": "12"} and info["tensors"] == 6


def rewrite(path, out, tensors=None, header=None):
    t, h = mx.load(str(path), return_metadata=True)
    t, h = tensors(t) if tensors else t, header(h) if header else h
    mx.save_safetensors(str(out), t, h)
    return out


@pytest.fixture
def saved(model, tmp_path):
    cache = PromptCache.for_model(model, "affine8")
    step(model, cache, [PROMPT])
    return save_layers(tmp_path / "ok.safetensors", cache)


def edit_layer(h, **changes):
    info = json.loads(h["layer.0"])
    info.update(changes)
    return {**h, "layer.0": json.dumps(info)}


@pytest.mark.parametrize("what,edit,message", [
    ("version", {"header": lambda h: {**h, "format_version": "2"}}, "unsupported format version '2'"),
    ("format", {"header": lambda h: {k: v for k, v in h.items() if k != "format"}}, "not a kvserve"),
    ("class", {"header": lambda h: edit_layer(h, **{"class": "FP16KVCache"})}, "does not store scheme"),
    ("unknown class", {"header": lambda h: edit_layer(h, **{"class": "Nope"})}, "unusable"),
    ("params", {"header": lambda h: edit_layer(h, params={**json.loads(h["layer.0"])["params"],
                                                           "keys.bits": "4"})}, "differ"),
    ("missing", {"tensors": lambda t: {k: v for k, v in t.items() if k != "layer.0.4"}}, "missing"),
    ("offset", {"header": lambda h: edit_layer(h, meta={"offset": "11"})}, "does not match"),
])
def test_loading_refuses_files_it_cannot_rebuild(saved, tmp_path, what, edit, message):
    bad = rewrite(saved, tmp_path / f"bad-{what.replace(' ', '-')}.safetensors", **edit)
    with pytest.raises(CacheFileError, match=message):
        load_layers(bad)


def test_saving_refuses_foreign_layers(model, tmp_path):
    with pytest.raises(TypeError):
        save_layers(tmp_path / "x", make_prompt_cache(model))
    with pytest.raises(CacheFileError):
        load_layers(tmp_path / "absent.safetensors")


def test_batch_containers_round_trip_too(model, tmp_path):
    singles = [PromptCache.for_model(model, "mxfp8") for _ in range(2)]
    for c, p in zip(singles, (PROMPT, PROMPT[:4])):
        step(model, c, [p])
    batch = PromptCache.merge(singles)
    layers, _ = load_layers(save_layers(tmp_path / "batch", batch))
    loaded = PromptCache(layers, "mxfp8")
    assert loaded[0].left_padding == [0, 8] and loaded.offset.tolist() == [12, 4]
    a = step(model, batch, [[7], [9]])
    b = step(model, loaded, [[7], [9]])
    assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("dtype,atol", [(mx.float32, 1e-6), (mx.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads,L,mask_heads", [(8, 2, 1, 1), (6, 3, 4, 6), (4, 4, 3, 1), (8, 2, 5, 1)])
def test_grouped_attention_under_a_mask_equals_mlx_sdpa(dtype, atol, heads, kv_heads, L, mask_heads):
    """The fp16 family's masked decode path (a GPU's left-padded batches and verify steps):
    boolean and additive masks, one or every query head, any query group, one query or
    several (a verify step: one mask for every head over 5 queries of 4-query groups),
    against MLX's own SDPA."""
    from kvserve.cache.fp16 import attend_grouped

    keys = mx.random.split(mx.random.key(5), 5)
    q = mx.random.normal((3, heads, L, 64), key=keys[0]).astype(dtype)
    k = mx.random.normal((3, kv_heads, 50, 64), key=keys[1]).astype(dtype)
    v = mx.random.normal((3, kv_heads, 50, 32), key=keys[2]).astype(dtype)
    visible = (mx.random.uniform(shape=(3, mask_heads, L, 50), key=keys[3]) > 0.4) | (mx.arange(50) == 49)
    for mask in (visible, mx.where(visible, 0.0, -1e4).astype(dtype)):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        got = attend_grouped(q, k, v, 0.125, mask)
        assert got.shape == want.shape and got.dtype == dtype
        assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() <= atol
