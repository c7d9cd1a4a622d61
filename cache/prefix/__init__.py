"""Prefix cache: reuse the KV cache of the longest cached prefix of a prompt, from RAM or SSD.

    from kvserve.cache.prefix import PrefixCache, Namespace, Hit, model_fingerprint, tokenizer_hash

    ns = Namespace(model=model_fingerprint(model_dir, extra=weight_format),
                   tokenizer=tokenizer_hash(tokenizer), scheme=kv_scheme, quantize_after=0)
    pc = PrefixCache(ns, ram_bytes=2 << 30, disk_dir=Path("~/.cache/kvserve/prompts").expanduser(),
                     disk_bytes=20 << 30)   # start-up: removes temp files, rebuilds the index from headers

    hit = pc.lookup(prompt)                 # Hit | None
    if hit:                                 # hit.cache holds prompt[:hit.num_tokens], hit.num_tokens < len(prompt)
        cache, todo = hit.cache, prompt[hit.num_tokens:]
    else:
        cache, todo = PromptCache.for_model(model, kv_scheme), prompt
    ...prefill ``todo`` into ``cache``...
    pc.insert(prompt, cache)                # snapshot; the disk write happens in the background
    ...decode into ``cache``; at the end, maybe pc.insert(prompt + output, cache)...
    pc.stats()                              # hits, misses, hit_tokens, ram/disk bytes and entries, refused, ...
    pc.flush(); pc.close()                  # at shutdown

All calls belong to the engine thread. A worked example with a real (tiny) cache:

    >>> import tempfile
    >>> import mlx.core as mx
    >>> from kvserve.cache import PromptCache, make_layer_cache
    >>> def filled(tokens):                  # a 2-layer affine4 cache holding len(tokens) tokens
    ...     layers = [make_layer_cache("affine4") for _ in range(2)]
    ...     for layer in layers:
    ...         kv = mx.ones((1, 2, len(tokens), 64))          # (B, H_kv, T, D)
    ...         _ = layer.update_and_fetch(kv, kv)
    ...     return PromptCache(layers, "affine4")
    >>> ns = Namespace(model="m", tokenizer="t", scheme="affine4")
    >>> d = tempfile.mkdtemp()
    >>> pc = PrefixCache(ns, ram_bytes=1 << 20, disk_dir=d, disk_bytes=1 << 20)
    >>> pc.insert([1, 2, 3, 4, 5], filled([1, 2, 3, 4, 5]))
    True
    >>> hit = pc.lookup([1, 2, 3, 9])        # shares 3 tokens: a trimmed copy of the entry
    >>> hit.num_tokens, hit.cache.offset, hit.source
    (3, 3, 'ram')
    >>> pc.lookup([1, 2, 3, 4, 5]).num_tokens  # the last prompt token is always recomputed
    4
    >>> pc.lookup([7, 8]) is None
    True
    >>> pc.flush()
    True
    >>> s = pc.stats(); (s["hits"], s["misses"], s["hit_tokens"], s["ram_entries"], s["disk_entries"])
    (2, 1, 7, 1, 1)
    >>> pc.close()
    True

A restarted server finds the entry on disk (headers only at start-up; tensors on a hit):

    >>> pc = PrefixCache(ns, ram_bytes=1 << 20, disk_dir=d, disk_bytes=1 << 20)
    >>> hit = pc.lookup([1, 2, 3, 4, 5, 6])
    >>> hit.num_tokens, hit.source
    (5, 'disk')
    >>> PrefixCache(Namespace("other-model", "t", "affine4"), 1 << 20, d, 1 << 20).stats()["refused"]["model"]
    1
    >>> pc.close()
    True

File format and guarantees: docs/prefix-cache.md.
"""

from kvserve.cache.prefix.fingerprint import model_fingerprint, tokenizer_hash
from kvserve.cache.prefix.namespace import Namespace
from kvserve.cache.prefix.store import Hit, PrefixCache

__all__ = ["Hit", "Namespace", "PrefixCache", "model_fingerprint", "tokenizer_hash"]
