"""The prefix cache's pure-Python parts: radix index, LRU by bytes, namespaces, fingerprints."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from kvserve.cache.prefix.fingerprint import model_fingerprint, tokenizer_hash
from kvserve.cache.prefix.index import RadixIndex
from kvserve.cache.prefix.lru import LRUBytes
from kvserve.cache.prefix.namespace import Namespace, as_tokens
from kvserve.cache.scheme import parse_scheme


# --- radix index -----------------------------------------------------------------------

def build(entries: dict[str, list[int]]) -> RadixIndex:
    ix = RadixIndex()
    for key, tokens in entries.items():
        ix.add(key, tokens)
    return ix


def test_matches_groups_by_common_prefix_longest_first():
    ix = build({"a": [1, 2, 3, 4], "b": [1, 2, 3, 9, 9], "c": [1, 7], "d": [5]})
    assert list(ix.matches([1, 2, 3, 9, 5])) == [(4, ["b"]), (3, ["a"]), (1, ["c"])]
    assert list(ix.matches([1, 2, 3, 4, 5])) == [(4, ["a"]), (3, ["b"]), (1, ["c"])]
    assert [(n, sorted(keys)) for n, keys in ix.matches([1, 2])] == [(2, ["a", "b"]), (1, ["c"])]
    assert list(ix.matches([6, 1])) == []
    assert list(ix.matches([5, 5])) == [(1, ["d"])]


def test_split_and_merge_keep_the_tree_compressed():
    ix = build({"long": [1, 2, 3, 4, 5, 6]})
    ix.add("mid", [1, 2, 3])  # splits the edge at 3
    ix.add("fork", [1, 2, 3, 7])
    root = ix._root
    (n1,) = root.children.values()
    assert n1.edge == (1, 2, 3) and n1.key == "mid"
    assert sorted(c.edge for c in n1.children.values()) == [(4, 5, 6), (7,)]
    ix.remove("mid")  # still a branch point: stays, without a key
    assert n1.key is None and len(n1.children) == 2
    ix.remove("fork")  # one child left: folded back into one edge
    (only,) = root.children.values()
    assert only.edge == (1, 2, 3, 4, 5, 6) and only.key == "long"
    ix.remove("long")
    assert root.children == {} and len(ix) == 0


def test_prefixes_and_extensions():
    ix = build({"a": [1], "b": [1, 2, 3], "c": [1, 2, 3, 4], "d": [1, 2, 5], "e": [2]})
    assert ix.prefixes_of([1, 2, 3, 4, 8]) == ["a", "b", "c"]  # shortest first
    assert ix.prefixes_of([1, 2, 3]) == ["a", "b"]
    assert sorted(ix.extensions_of([1, 2])) == ["b", "c", "d"]
    assert sorted(ix.extensions_of([1, 2, 3])) == ["b", "c"]
    assert ix.extensions_of([1, 2, 3, 4, 5]) == []
    assert ix.key_of([1, 2, 3]) == "b" and ix.key_of([1, 2]) is None


def test_duplicates_are_refused():
    ix = build({"a": [1, 2]})
    with pytest.raises(ValueError, match="already stored as a"):
        ix.add("b", [1, 2])
    with pytest.raises(ValueError, match="already stored"):
        ix.add("a", [3])


def brute_groups(stored: dict[str, tuple[int, ...]], prompt: list[int]) -> list[tuple[int, list[str]]]:
    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    groups: dict[int, list[str]] = {}
    for key, seq in stored.items():
        c = common(seq, prompt)
        if c:
            groups.setdefault(c, []).append(key)
    return [(c, sorted(groups[c])) for c in sorted(groups, reverse=True)]


def test_random_operations_agree_with_brute_force():
    rng = random.Random(7)
    ix, stored = RadixIndex(), {}
    for step in range(3000):  # vocabulary of 3 so that sequences share prefixes often
        seq = tuple(rng.randrange(3) for _ in range(rng.randint(1, 8)))
        if stored and rng.random() < 0.4:
            key = rng.choice(sorted(stored))
            ix.remove(key)
            del stored[key]
        elif seq not in stored.values():
            key = f"k{step}"
            ix.add(key, seq)
            stored[key] = seq
        prompt = [rng.randrange(3) for _ in range(rng.randint(0, 9))]
        got = [(c, sorted(keys)) for c, keys in ix.matches(prompt)]
        assert got == brute_groups(stored, prompt)
        assert sorted(ix.prefixes_of(prompt)) == sorted(k for k, s in stored.items()
                                                       if list(s) == prompt[:len(s)])
        assert sorted(ix.extensions_of(prompt)) == sorted(
            k for k, s in stored.items() if prompt and list(s[:len(prompt)]) == prompt)
    assert len(ix) == len(stored)


# --- LRU by bytes ----------------------------------------------------------------------

def test_lru_evicts_least_recently_used_in_exact_order():
    lru = LRUBytes(100)
    for key in "abcd":
        assert lru.add(key, 25) == []
    lru.touch("a")
    lru.touch("c")
    assert lru.order() == ["b", "d", "a", "c"]
    assert lru.add("e", 60) == ["b", "d", "a"]  # 3 x 25 must go for 60 to fit next to c
    assert lru.order() == ["c", "e"] and lru.total == 85
    assert lru.add("c", 40) == []  # re-adding resizes and refreshes
    assert lru.order() == ["e", "c"] and lru.total == 100
    assert lru.add("g", 10) == ["e"]
    assert lru.order() == ["c", "g"] and lru.total == 50
    assert lru.add("f", 101) == ["f"] and lru.order() == ["c", "g"]  # larger than the budget
    assert lru.remove("c") and not lru.remove("c") and lru.total == 10


# --- namespaces ------------------------------------------------------------------------

def test_every_field_changes_the_namespace():
    base = Namespace("m", "t", parse_scheme("turbo4"))
    seeded = replace(base.scheme, values=replace(base.scheme.values, seed=99))
    variants = [Namespace("m2", "t", base.scheme), Namespace("m", "t2", base.scheme),
                Namespace("m", "t", parse_scheme("turbo3")), Namespace("m", "t", seeded),
                Namespace("m", "t", base.scheme, quantize_after=256)]
    keys = {base.key} | {v.key for v in variants}
    assert len(keys) == 6
    assert json.loads(Namespace("m", "t", seeded).identity()["scheme_params"])["values.seed"] == "99"
    assert Namespace("m", "t", "affine4-g32").scheme == parse_scheme("affine4-g32")


def test_entry_names_are_hashes_only():
    ns = Namespace("m", "t", "fp16")
    name = ns.entry_name([1, 2, 3])
    assert name == ns.entry_key([1, 2, 3]) + ".safetensors"
    assert all(c in "0123456789abcdef-." for c in name.removesuffix(".safetensors"))
    assert Namespace("other", "t", "fp16").entry_name([1, 2, 3]) != name
    with pytest.raises(ValueError):
        as_tokens([1, -1])
    with pytest.raises(ValueError):
        as_tokens([1 << 32])


# --- fingerprints ----------------------------------------------------------------------

def test_model_fingerprint_reads_samples_not_mtimes(tmp_path):
    (tmp_path / "config.json").write_text('{"b": 1, "a": 2}')
    weights = tmp_path / "model.safetensors"
    header = b'{"w":{"dtype":"U8","shape":[1048576],"data_offsets":[0,1048576]}}'
    data = bytearray(os.urandom(1 << 20))
    weights.write_bytes(len(header).to_bytes(8, "little") + header + data)
    first = model_fingerprint(tmp_path)
    os.utime(weights, (1, 1))  # a copy with another mtime is the same model
    assert model_fingerprint(tmp_path) == first
    (tmp_path / "config.json").write_text('{"a": 2, "b": 1}')  # same JSON, other order
    assert model_fingerprint(tmp_path) == first
    data[-1] ^= 1  # inside the last sampled block
    weights.write_bytes(len(header).to_bytes(8, "little") + header + data)
    assert model_fingerprint(tmp_path) != first
    assert model_fingerprint(weights) != model_fingerprint(tmp_path)  # one file: no config
    (tmp_path / "config.json").write_text('{"a": 3}')
    assert model_fingerprint(tmp_path, extra="x") != model_fingerprint(tmp_path)


TOKENIZER_SCRIPT = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from kvserve.cache.prefix.fingerprint import tokenizer_hash

def build():
    vocab = {f"t{i}": i for i in range(300)}
    vocab.update({"a": 300, "b": 301, "ab": 302})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok

print(tokenizer_hash(build()))
"""


def test_tokenizer_hash_is_stable_across_processes_and_wrappers():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    scope: dict = {}
    exec(TOKENIZER_SCRIPT.replace("print(tokenizer_hash(build()))", ""), scope)
    tok = scope["build"]()
    here = tokenizer_hash(tok)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another process, another str hash seed
    there = subprocess.run([sys.executable, "-c", TOKENIZER_SCRIPT], capture_output=True, text=True,
                           env=env, check=True).stdout.strip()
    assert here == there
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1")
    before = tokenizer_hash(TokenizerWrapper(hf))
    assert before == tokenizer_hash(hf)
    hf.chat_template = "{{ messages }}"  # the chat template is part of the identity
    assert tokenizer_hash(TokenizerWrapper(hf)) != before
    tok.add_tokens(["<new>"])
    assert tokenizer_hash(tok) != here
