"""PrefixCache with real MLX caches: hits, exactness of trimmed copies, tiers, eviction order."""

from __future__ import annotations

import os
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from prefix_helpers import filled, kv, prefix_state, state_bytes, step
from servers import random_llama

from kvserve.cache import PromptCache, load_layers, make_layer_cache
from kvserve.cache.prefix import Namespace, PrefixCache
from kvserve.cache.prefix.snapshot import kv_floor

MB = 1 << 20
TRIMMABLE = ["fp16", "affine8", "affine4-g32", "mxfp4", "nvfp4", "turbo0v4", "turbo8v3", "turbo4"]


def tokens(n: int, first: int = 1) -> list[int]:
    return list(range(first, first + n))


def ns_for(scheme: str, quantize_after: int = 0) -> Namespace:
    return Namespace(model="model-fp", tokenizer="tok-hash", scheme=scheme, quantize_after=quantize_after)


# --- what a hit is -----------------------------------------------------------------------

@pytest.mark.parametrize("scheme", TRIMMABLE)
def test_partial_hit_is_the_original_at_that_length(scheme):
    layers = 5  # turbo4 keeps layers 0, 1, 3, 4 at affine8: layer 2 is turbo
    original = filled(scheme, 12, seed=1, layers=layers)
    pc = PrefixCache(ns_for(scheme), ram_bytes=8 * MB)
    assert pc.insert(tokens(12), original)
    hit = pc.lookup(tokens(7) + [999, 998])
    assert (hit.num_tokens, hit.cache.offset, hit.source) == (7, 7, "ram")
    assert state_bytes(hit.cache) == prefix_state(original, 7)
    # What the original would have done next: a cache that only ever saw those 7 tokens.
    alone = PromptCache([make_layer_cache(scheme, layer_index=i, num_layers=layers) for i in range(layers)], scheme)
    for i, layer in enumerate(alone):
        layer.update_and_fetch(kv(12, 100 + i)[:, :, :7], kv(12, 150 + i)[:, :, :7])
    step(hit.cache, seed=3)  # a turbo cache compresses here, calibrating on the 7 tokens
    step(alone, seed=3)
    assert state_bytes(hit.cache) == state_bytes(alone)


def test_the_last_prompt_token_is_always_recomputed():
    pc = PrefixCache(ns_for("fp16"), ram_bytes=8 * MB)
    pc.insert(tokens(6), filled("fp16", 6))
    assert pc.lookup(tokens(6)).num_tokens == 5
    assert pc.lookup(tokens(6) + [50]).num_tokens == 6
    assert pc.lookup(tokens(1)) is None and pc.lookup([]) is None
    assert pc.lookup([2, 3]) is None  # no common first token
    s = pc.stats()
    assert (s["hits"], s["misses"], s["hit_tokens"]) == (2, 3, 11)


def test_hits_and_snapshots_are_independent_of_later_writes():
    original = filled("affine4", 8, seed=2)
    expected = state_bytes(original)
    pc = PrefixCache(ns_for("affine4"), ram_bytes=8 * MB)
    pc.insert(tokens(8), original)
    step(original, seed=1)  # the caller keeps decoding into its cache
    hit = pc.lookup(tokens(8) + [77])
    assert state_bytes(hit.cache) == expected
    for s in range(3):
        step(hit.cache, seed=s)  # the caller decodes into the hit
    again = pc.lookup(tokens(8) + [78])
    assert state_bytes(again.cache) == expected and again.cache.offset == 8
    partial = pc.lookup(tokens(5) + [0])  # a trimmed copy, then appended to in place
    step(partial.cache, seed=9)
    assert state_bytes(pc.lookup(tokens(8) + [79]).cache) == expected


def test_compressed_turbo_entries_serve_only_their_full_length():
    compressed = filled("turbo0v4", 10, seed=4)
    step(compressed, seed=0)  # the first decode step compresses: offset 11
    assert kv_floor(compressed) == 11
    pc = PrefixCache(ns_for("turbo0v4"), ram_bytes=8 * MB)
    assert pc.insert(tokens(11), compressed)
    assert pc.lookup(tokens(11) + [500]).num_tokens == 11
    assert pc.lookup(tokens(8) + [500]) is None  # would need trimming
    assert pc.insert(tokens(6), filled("turbo0v4", 6, seed=5))  # raw: not redundant next to it
    assert pc.stats()["entries"] == 2
    hit = pc.lookup(tokens(8) + [500])
    assert hit.num_tokens == 6 and hit.cache[0].phase == "raw"
    assert pc.lookup(tokens(11) + [500]).num_tokens == 11


def test_converted_containers_are_not_trimmed_below_quantize_after():
    cache = filled("fp16", 12, seed=6)
    cache = PromptCache(list(cache), "affine8", quantize_after=8)
    assert cache.maybe_convert() and kv_floor(cache) == 8
    pc = PrefixCache(ns_for("affine8", quantize_after=8), ram_bytes=8 * MB)
    assert pc.insert(tokens(12), cache)
    assert pc.lookup(tokens(10) + [0]).num_tokens == 10
    assert pc.lookup(tokens(6) + [0]) is None  # the original held fp16 at 6 tokens
    young = PromptCache(list(filled("fp16", 5, seed=7)), "affine8", quantize_after=8)
    assert kv_floor(young) == 0 and pc.insert([40, 41, 42, 43, 44], young)
    assert pc.lookup([40, 41, 42, 0]).num_tokens == 3


def test_longer_entries_replace_the_prefixes_they_extend(tmp_path):
    pc = PrefixCache(ns_for("fp16"), ram_bytes=8 * MB, disk_dir=tmp_path, disk_bytes=8 * MB)
    assert pc.insert(tokens(5), filled("fp16", 5))
    pc.flush()
    short_file = tmp_path / pc.ns.entry_name(tokens(5))
    assert short_file.exists()
    assert pc.insert(tokens(9), filled("fp16", 9))
    pc.flush()
    assert pc.stats()["entries"] == 1 and not short_file.exists()
    assert not pc.insert(tokens(5), filled("fp16", 5))  # served by the longer entry already
    assert not pc.insert(tokens(9), filled("fp16", 9))
    assert sorted(p.name for p in tmp_path.iterdir()) == [pc.ns.entry_name(tokens(9))]
    pc.close()


# --- tiers and their eviction order ---------------------------------------------------

def entry_bytes(scheme: str = "affine8", n: int = 8) -> int:
    pc = PrefixCache(ns_for(scheme), ram_bytes=64 * MB)
    pc.insert(tokens(n), filled(scheme, n))
    return pc.stats()["ram_bytes"]


def test_ram_tier_evicts_least_recently_used_bytes():
    size = entry_bytes()
    pc = PrefixCache(ns_for("affine8"), ram_bytes=3 * size)
    for first in (100, 200, 300):
        assert pc.insert(tokens(8, first), filled("affine8", 8, seed=first))
    assert pc.lookup(tokens(8, 100) + [0]).num_tokens == 8  # 100 is now the most recent
    assert pc.insert(tokens(8, 400), filled("affine8", 8, seed=400))  # evicts 200
    assert pc.lookup(tokens(8, 200)) is None
    assert pc.insert(tokens(8, 500), filled("affine8", 8, seed=500))  # evicts 300
    assert [pc.lookup(tokens(8, f) + [0]) is not None for f in (100, 300, 400, 500)] == [True, False, True, True]
    s = pc.stats()
    assert (s["ram_entries"], s["ram_bytes"], s["ram_evictions"], s["entries"]) == (3, 3 * size, 2, 3)
    assert not PrefixCache(ns_for("affine8"), ram_bytes=size - 1).insert(tokens(8), filled("affine8", 8))


def file_bytes(tmp_path, scheme: str = "affine8", n: int = 8) -> int:
    d = tmp_path / "measure"
    pc = PrefixCache(ns_for(scheme), ram_bytes=64 * MB, disk_dir=d, disk_bytes=64 * MB)
    pc.insert(tokens(n, 900), filled(scheme, n))
    pc.close()
    size = pc.stats()["disk_bytes"]
    shutil.rmtree(d)
    return size


def names(pc: PrefixCache, *firsts: int) -> list[str]:
    return sorted(pc.ns.entry_name(tokens(8, f)) for f in firsts)


def test_disk_tier_spills_promotes_and_evicts_in_lru_order(tmp_path):
    size, ram = file_bytes(tmp_path), entry_bytes()
    d = tmp_path / "cache"
    pc = PrefixCache(ns_for("affine8"), ram_bytes=ram, disk_dir=d, disk_bytes=2 * size + size // 2)
    for first in (100, 200, 300):
        pc.insert(tokens(8, first), filled("affine8", 8, seed=first))
        pc.flush()
    assert sorted(os.listdir(d)) == names(pc, 200, 300)  # 100 was the oldest file
    hit = pc.lookup(tokens(8, 200) + [0])  # from disk, promoted to RAM; 300 leaves RAM
    assert hit.source == "disk" and state_bytes(hit.cache) == state_bytes(filled("affine8", 8, seed=200))
    assert pc.lookup(tokens(8, 200) + [1]).source == "ram"
    pc.insert(tokens(8, 400), filled("affine8", 8, seed=400))
    pc.flush()
    assert sorted(os.listdir(d)) == names(pc, 200, 400)  # 300 was least recently used
    assert pc.lookup(tokens(8, 300) + [0]) is None and pc.lookup(tokens(8, 100) + [0]) is None
    s = pc.stats()
    assert (s["disk_entries"], s["disk_bytes"], s["disk_evictions"], s["disk_hits"]) == (2, 2 * size, 2, 1)
    pc.close()


def test_restart_rebuilds_the_index_and_orders_it_by_mtime(tmp_path):
    size = file_bytes(tmp_path)
    d = tmp_path / "cache"
    pc = PrefixCache(ns_for("affine8"), ram_bytes=64 * MB, disk_dir=d, disk_bytes=64 * MB)
    for first in (100, 200, 300):
        pc.insert(tokens(8, first), filled("affine8", 8, seed=first))
    pc.close()
    other = PrefixCache(Namespace("another-model", "tok-hash", "affine8"), 64 * MB, d, 64 * MB)
    other.insert(tokens(8, 100), filled("affine8", 8, seed=1))
    other.close()
    mtimes = {100: 3000, 200: 1000, 300: 2000}
    for first, t in mtimes.items():
        os.utime(d / pc.ns.entry_name(tokens(8, first)), (t, t))
    os.utime(d / other.ns.entry_name(tokens(8, 100)), (9000, 9000))  # newest, but never loadable
    pc = PrefixCache(ns_for("affine8"), ram_bytes=64 * MB, disk_dir=d, disk_bytes=2 * size + size // 2)
    pc.flush()
    assert sorted(os.listdir(d)) == names(pc, 100, 300)  # the foreign file, then the oldest (200)
    s = pc.stats()
    assert s["refused"]["model"] == 1 and (s["disk_entries"], s["ram_entries"], s["foreign_files"]) == (2, 0, 0)
    hit = pc.lookup(tokens(8, 300) + [5])
    assert hit.source == "disk" and state_bytes(hit.cache) == state_bytes(filled("affine8", 8, seed=300))
    pc.close()


@pytest.mark.parametrize("scheme,dtype,compress", [
    ("fp16", mx.float16, False), ("fp16", mx.bfloat16, False), ("fp16", mx.float32, False),
    ("affine4-g32", mx.float16, False), ("affine8", mx.bfloat16, False), ("mxfp4", mx.float16, False),
    ("nvfp4", mx.float16, False), ("turbo4", mx.float16, False), ("turbo4", mx.float16, True),
    ("turbo8v3", mx.bfloat16, True), ("turbo0v2", mx.float16, True)])
def test_disk_round_trip_is_bit_identical(tmp_path, scheme, dtype, compress):
    original = filled(scheme, 9, seed=11, layers=5, dtype=dtype)
    if compress:
        step(original, seed=2)
    n = original.offset
    pc = PrefixCache(ns_for(scheme), ram_bytes=64 * MB, disk_dir=tmp_path, disk_bytes=64 * MB)
    assert pc.insert(tokens(n), original)
    pc.close()
    pc = PrefixCache(ns_for(scheme), ram_bytes=64 * MB, disk_dir=tmp_path, disk_bytes=64 * MB)
    hit = pc.lookup(tokens(n) + [0])
    assert (hit.source, hit.num_tokens) == ("disk", n)
    assert state_bytes(hit.cache) == state_bytes(original)
    assert [layer.meta_state for layer in hit.cache] == [layer.meta_state for layer in original]
    layers, user = load_layers(tmp_path / pc.ns.entry_name(tokens(n)))  # the layer format reads it too
    assert state_bytes(PromptCache(layers, scheme)) == state_bytes(original)
    assert user["model"] == "model-fp" and user["num_tokens"] == str(n)
    pc.close()


# --- what is not stored ----------------------------------------------------------------

def test_a_full_queue_drops_the_spill_and_counts_it(tmp_path):
    pc = PrefixCache(ns_for("fp16"), ram_bytes=8 * MB, disk_dir=tmp_path, disk_bytes=8 * MB,
                     max_pending_writes=0)
    assert pc.insert(tokens(4), filled("fp16", 4))  # kept in RAM, not written
    pc.flush()
    assert pc.stats()["dropped_spills"] == 1 and os.listdir(tmp_path) == []
    tiny = PrefixCache(ns_for("fp16"), ram_bytes=10, disk_dir=tmp_path, disk_bytes=8 * MB,
                       max_pending_writes=0)
    assert not tiny.insert(tokens(4), filled("fp16", 4))  # fits nowhere
    assert tiny.stats()["entries"] == 0


def test_write_errors_are_counted_never_fatal(tmp_path):
    d = tmp_path / "gone"
    pc = PrefixCache(ns_for("fp16"), ram_bytes=8 * MB, disk_dir=d, disk_bytes=8 * MB)
    shutil.rmtree(d)
    assert pc.insert(tokens(4), filled("fp16", 4))
    assert pc.flush()
    s = pc.stats()
    assert (s["write_errors"], s["disk_entries"], s["ram_entries"]) == (1, 0, 1)
    assert pc.lookup(tokens(4) + [9]).num_tokens == 4
    pc.close()


def test_unsupported_and_mismatched_caches():
    pc = PrefixCache(ns_for("fp16"), ram_bytes=8 * MB)
    theirs = KVCache()
    theirs.update_and_fetch(kv(3, 0), kv(3, 1))
    assert not pc.insert(tokens(3), PromptCache([theirs], "fp16"))
    assert pc.stats()["unsupported"] == 1
    with pytest.raises(ValueError, match="holds 4 tokens, 3 were given"):
        pc.insert(tokens(3), filled("fp16", 4))
    with pytest.raises(ValueError, match="affine8 cache"):
        pc.insert(tokens(4), filled("affine8", 4))
    pc.close()
    with pytest.raises(RuntimeError, match="closed"):
        pc.lookup(tokens(3))


# --- on a model: greedy output with a hit equals the cold run -----------------------------

def greedy(model, cache: PromptCache, todo: list[int], n: int) -> list[int]:
    out = []
    logits = model(mx.array([todo]), cache=cache)[:, -1]
    for _ in range(n):
        out.append(int(mx.argmax(logits[0]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1]
    return out


@pytest.mark.parametrize("scheme", ["fp16", "affine8"])
def test_greedy_output_with_a_hit_equals_the_cold_run(tmp_path, scheme):
    model = random_llama(5)
    first = [3, 17, 99, 4, 250, 31, 8, 77, 120, 5]
    second = first[:7] + [64, 200, 11, 12]
    cold = greedy(model, PromptCache.for_model(model, scheme), second, 8)
    pc = PrefixCache(ns_for(scheme), ram_bytes=8 * MB, disk_dir=tmp_path, disk_bytes=8 * MB)
    cache = PromptCache.for_model(model, scheme)
    mx.eval(model(mx.array([first]), cache=cache))
    pc.insert(first, cache)
    hit = pc.lookup(second)
    assert hit.num_tokens == 7
    assert greedy(model, hit.cache, second[7:], 8) == cold
    pc.close()
    restarted = PrefixCache(ns_for(scheme), ram_bytes=8 * MB, disk_dir=tmp_path, disk_bytes=8 * MB)
    hit = restarted.lookup(second)
    assert hit.source == "disk" and greedy(model, hit.cache, second[7:], 8) == cold
    restarted.close()
