"""Rebuild a Hugging Face ``tokenizers`` tokenizer from GGUF tokenizer metadata.

A GGUF file carries its vocabulary under ``tokenizer.ggml.*``::

    tokenizer.ggml.model       "gpt2" (byte-level BPE) | "llama" (SentencePiece BPE)
    tokenizer.ggml.pre         "smollm" | "llama-bpe" | "gpt2" | "default" (how text is split)
    tokenizer.ggml.tokens      ["<|endoftext|>", "<|im_start|>", ..., "Ġt", ...]  index = id
    tokenizer.ggml.token_type  [3, 3, ..., 1, ...]  1 normal, 3 control, 4 user-defined, 6 byte
    tokenizer.ggml.merges      ["Ġ t", "Ġ a", ...]  in rank order (byte-level BPE only)
    tokenizer.ggml.scores      [-1000.0, ..., -0.0, -1.0, ...]  (SentencePiece; not read)
    tokenizer.ggml.bos_token_id / eos_token_id / unknown_token_id / padding_token_id
    tokenizer.chat_template    Jinja template

Byte-level BPE: the pre-tokenizer follows the name llama.cpp records, because it decides
how digits and punctuation are split and therefore which ids a prompt gets.

SentencePiece (Gemma): no merges are stored, so they are implied by the vocabulary (see
``_implied_merges``); spaces become "▁" before merging, and a piece missing from the
vocabulary falls back to its ``<0xNN>`` byte tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvserve.server.models.errors import ModelLoadError

# llama.cpp token types (llama_token_type).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# The split pattern of llama-3 style BPE (llama.cpp's "llama-bpe"): numbers in runs
# of up to three digits, case-insensitive contractions, newlines kept together.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE = ("smollm", "llama-bpe", "gpt2", "default")


def _pre_tokenizer(pre: str, add_prefix_space: bool):
    """The ``tokenizers`` pre-tokenizer for a llama.cpp pre-tokenizer name.

    ``gpt2``/``default``: the GPT-2 regex inside ByteLevel. ``smollm``: digits are
    split one by one first ("2024" -> "2","0","2","4"), then the GPT-2 regex.
    ``llama-bpe``: the llama-3 regex, then the byte mapping alone.
    """
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in ("gpt2", "default"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "llama-bpe":
        split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
    raise ModelLoadError(
        f"unsupported tokenizer pre-processing {pre!r} (supported: {', '.join(SUPPORTED_PRE)})")


def _merges(raw: list[str]) -> list[tuple[str, str]]:
    """``"Ġ t"`` -> ``("Ġ", "t")``. The separator is searched from the second
    character on, as llama.cpp does, so a merge whose left part is itself a space
    still splits correctly."""
    out = []
    for merge in raw:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ModelLoadError(f"malformed BPE merge {merge!r} in the GGUF vocabulary")
        out.append((merge[:cut], merge[cut + 1:]))
    return out


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a duplicated string keeps its first id
    return vocab


def _token_id(meta: dict, key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)


def _special_tokens(meta: dict) -> tuple[list[str], list[str]]:
    """Control tokens (matched whole, skipped by skip_special_tokens) and
    user-defined tokens (matched whole, decoded as text)."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    control = [tokens[i] for i, kind in enumerate(types) if int(kind) == TOKEN_CONTROL]
    user = [tokens[i] for i, kind in enumerate(types) if int(kind) == TOKEN_USER_DEFINED]
    # bos/eos are special even when a file does not mark them as control tokens.
    for key in ("bos_token_id", "eos_token_id"):
        index = _token_id(meta, key)
        if index is not None and index < len(tokens) and tokens[index] not in control:
            control.append(tokens[index])
    return control, user


def _adds_bos(meta: dict) -> bool:
    """Whether encoding starts with bos. A SentencePiece file that does not say gets one,
    as llama.cpp gives it."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _post_processor(meta: dict, plain=None):
    """Adds bos/eos around an encoded text when the file asks for it; else ``plain``."""
    from tokenizers import processors

    tokens = meta["tokenizer.ggml.tokens"]
    add_bos = _adds_bos(meta)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = _token_id(meta, "bos_token_id"), _token_id(meta, "eos_token_id")
    if not ((add_bos and bos is not None) or (add_eos and eos is not None)):
        return plain
    front = [tokens[bos]] if add_bos and bos is not None else []
    back = [tokens[eos]] if add_eos and eos is not None else []
    specials = [(t, tokens.index(t)) for t in dict.fromkeys(front + back)]
    return processors.TemplateProcessing(
        single=" ".join(front + ["$A"] + back),
        pair=" ".join(front + ["$A"] + back + front + ["$B"] + back),
        special_tokens=specials,
    )


def build_tokenizer(meta: dict):
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF vocabulary.

    Examples: SmolLM2 (byte-level BPE) ``build_tokenizer(meta).encode("The capital of France
    is").ids == [504, 3575, 282, 4649, 314]``; Gemma 3 (SentencePiece) gives
    ``[2, 818, 5279, 529, 7001, 563]``, bos first.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(f"unsupported tokenizer model {kind!r} "
                             "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    if not meta.get("tokenizer.ggml.tokens"):
        raise ModelLoadError("the GGUF file has no tokenizer vocabulary")
    return _byte_level(meta) if kind == "gpt2" else _sentencepiece(meta)


def _byte_level(meta: dict):
    from tokenizers import Tokenizer, decoders, models, processors

    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tokenizer = Tokenizer(models.BPE(
        vocab=_vocab(meta["tokenizer.ggml.tokens"]),
        merges=_merges(meta.get("tokenizer.ggml.merges") or []),
        fuse_unk=False, byte_fallback=False,
        # llama-3 vocabularies contain whole words that merges cannot reach.
        ignore_merges=(pre == "llama-bpe"),
    ))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre, add_prefix)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(meta, processors.ByteLevel(trim_offsets=False))
    _add_special_tokens(tokenizer, meta, set(meta["tokenizer.ggml.tokens"]))
    return tokenizer


def _sentencepiece(meta: dict):
    """SentencePiece BPE over "▁"-for-space text with byte fallback (Gemma's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    # Llama 2 style vocabularies prepend "▁" to the text and strip it when decoding;
    # only files that add no such prefix (Gemma's) have been checked.
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        raise ModelLoadError("unsupported tokenizer: SentencePiece ('llama') with a space prefix")
    tokens = _respelled(meta["tokenizer.ggml.tokens"])
    vocab = _vocab(tokens)
    unk = _token_id(meta, "unknown_token_id")
    tokenizer = Tokenizer(models.BPE(
        vocab=vocab, merges=_implied_merges(tokens, vocab), fuse_unk=True, byte_fallback=True,
        unk_token=tokens[unk] if unk is not None and unk < len(tokens) else None,
    ))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    if (processor := _post_processor(meta)) is not None:
        tokenizer.post_processor = processor
    _add_special_tokens(tokenizer, meta, set(vocab))
    return tokenizer


def _respelled(tokens: list[str]) -> list[str]:
    """Gemma's files store the tokens made of 2..31 spaces with real spaces, while the
    text they must match has "▁" for every space by then.

    >>> _respelled(["  ", "▁a", " x"])
    ['▁▁', '▁a', ' x']
    """
    return ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]


def _implied_merges(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges that rebuild every token from two tokens, ranked by the position of the
    token they make (longer left piece first within one token).

    SentencePiece merges the pair whose result scores best; normal tokens are stored
    best-first (Gemma 3: score = -rank), so position is that order, and it also places the
    user-defined space runs (all scored -1000) where the original model merges them.

    >>> _implied_merges(["a", "b", "ab", "abb"], {"a": 0, "b": 1, "ab": 2, "abb": 3})
    [('a', 'b'), ('ab', 'b')]
    """
    merges = []
    for index, token in enumerate(tokens):
        if vocab.get(token) != index:  # a repeated string: its first id stands
            continue
        merges += [(token[:cut], token[cut:]) for cut in range(len(token) - 1, 0, -1)
                   if token[:cut] in vocab and token[cut:] in vocab]
    return merges


def _add_special_tokens(tokenizer, meta: dict, known: set[str]) -> None:
    """Control tokens become special added tokens; user-defined ones plain added tokens
    (matched whole), those the model's vocabulary spells the same way."""
    from tokenizers import AddedToken

    control, user = _special_tokens(meta)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user if t in known])


def special_token_map(meta: dict) -> dict[str, str]:
    """``{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", ...}`` for the ids
    the file names."""
    tokens = meta["tokenizer.ggml.tokens"]
    out = {}
    for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        index = _token_id(meta, key)
        if index is not None and 0 <= index < len(tokens):
            out[role] = tokens[index]
    return out


def tokenizer_config(meta: dict, context_length: int | None = None) -> dict[str, Any]:
    """tokenizer_config.json for ``transformers.AutoTokenizer`` (a plain fast
    tokenizer over tokenizer.json) with the chat template of the file."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        **special_token_map(meta),
    }
    if context_length:
        config["model_max_length"] = int(context_length)
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def write_tokenizer_files(meta: dict, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    arch = meta.get("general.architecture", "")
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out / "tokenizer.json"))
    config = tokenizer_config(meta, meta.get(f"{arch}.context_length"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    specials = special_token_map(meta)
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")
