"""Tiny random-weight models of many mlx-lm architectures, built with mlx-lm's own classes.

Every config: vocab 49152 (the default model's tokenizer), attention head_dim 64 (4-bit
groups of 64 and the TurboQuant rotations fit), grouped KV heads, 2-6 layers, hidden 64-128,
sliding windows of 16 tokens (so prompts of 40-80 tokens slide them), context >= 4096.
``make_tiny_model`` saves a directory that ``mlx_lm.load`` reads back bit-exactly.

Layer kinds per architecture, and the mlx-lm caches ``make_prompt_cache(model)`` gives
(``model.make_cache()`` where the model defines it; qwen3 and qwen3_moe do not, and get one
``KVCache`` per layer). ArraysCache(2) holds a conv state and a recurrent state,
ArraysCache(1) a conv state only.

    llama              full x2                                  KVCache x2
    qwen3              full x2                                  KVCache x2
    qwen3_moe          full x2 (MoE MLP, 4 experts, top 2)      KVCache x2
    ministral3         sliding16 x3, full                       RotatingKVCache(16) x3, KVCache
    gemma3_text        sliding16 x3, full                       RotatingKVCache(16) x3, KVCache
    gemma4_text        sliding16 x3, full                       RotatingKVCache(16) x3, KVCache
    gemma4_text_shared sliding16 x2, full, then 3 KV-shared     RotatingKVCache(16) x2, KVCache
                       layers (sliding, sliding, full)          (3 caches for 6 layers)
    gpt_oss            (sliding16, full) x2, attention sinks,   (RotatingKVCache(16), KVCache) x2
                       MoE MLP (4 experts, top 2)
    qwen3_5            GatedDeltaNet x3, full                   ArraysCache(2) x3, KVCache
    qwen3_next         (GatedDeltaNet, full) x2, MoE MLP        (ArraysCache(2), KVCache) x2
    lfm2               conv x2, full, conv                      ArraysCache(1) x2, KVCache, ArraysCache(1)
    nemotron_h         mamba2, full, mamba2, MLP                ArraysCache(2), KVCache, ArraysCache(2)
                                                                (MLP layers get no cache)
    granitemoehybrid   mamba2, full, mamba2 x2                  ArraysCache(2), KVCache, ArraysCache(2) x2
    falcon_h1          (mamba2 beside full attention) x2        CacheList(ArraysCache(2), KVCache) x2

Every RotatingKVCache here has keep=0. Things a server meets beyond plain attention:
- ministral3 scales queries by position (Llama 4 style: ``1 + beta * log(1 + floor(pos /
  original_max_position_embeddings))``); 32 here instead of 16384, so test prompts reach it.
- gemma4_text's forward pads the cache list itself (``cache + [None] * k``): KV-shared layers
  take ``cache=None`` and attend over the K/V the last non-shared layer of their type
  returned; its full layers use a partial ("proportional") RoPE on a quarter of head_dim.
- gpt_oss attends with per-head sinks (a learned logit in the softmax's denominator); made
  non-zero here, as trained ones are.
- qwen3_5 reads a flat config (``ModelArgs.from_dict`` wraps it in ``text_config`` itself);
  the ``text_config`` form of real checkpoints is used here, weights under
  ``language_model.``; with it ``max_position_embeddings`` and ``vocab_size`` sit inside
  ``text_config``.
- lfm2 and granitemoehybrid derive head_dim from hidden / heads, so they use hidden 128 over
  2 query heads and 1 KV head (grouped 2:1, not 4:2).
- nemotron_h returns fewer caches than layers (its MLP layers take none); falcon_h1 returns
  a ``CacheList`` per layer (a recurrent and a KV cache side by side).
- gemma3_text builds an ``lm_head`` and ties it to the embedding only when the file lacks
  ``lm_head.weight``; the file here has it, so it loads untied, as built.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

from servers import TOKENIZER_FILES

VOCAB = 49152
WINDOW = 16
CONTEXT = 4096

_BASE = {"vocab_size": VOCAB, "max_position_embeddings": CONTEXT}
_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}

ARCHS: dict[str, dict] = {
    "llama": {
        **_BASE, **_ATTN, "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        **_BASE, **_ATTN, "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        **_BASE, **_ATTN, "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 64,
        "norm_topk_prob": True,
    },
    "ministral3": {
        **_BASE, **_ATTN, "model_type": "ministral3", "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "sliding_window": WINDOW,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                            "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 32},
    },
    "gemma3_text": {
        **_BASE, **_ATTN, "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 128, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 64,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "sliding_window": WINDOW, "sliding_window_pattern": 4,
    },
    "gemma4_text": {
        **_BASE, **_ATTN, "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 128, "global_head_dim": 64, "rms_norm_eps": 1e-6,
        "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
        "sliding_window": WINDOW, "sliding_window_pattern": 4, "final_logit_softcapping": 30.0,
    },
    "gemma4_text_shared": {
        **_BASE, **_ATTN, "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 6,
        "intermediate_size": 64, "global_head_dim": 64, "rms_norm_eps": 1e-6,
        "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
        "sliding_window": WINDOW, "sliding_window_pattern": 3, "final_logit_softcapping": 30.0,
    },
    "gpt_oss": {
        **_BASE, **_ATTN, "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 150000, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": {
            **_BASE, **_ATTN, "model_type": "qwen3_5_text", "hidden_size": 64,
            "num_hidden_layers": 4, "intermediate_size": 128, "rms_norm_eps": 1e-6,
            "full_attention_interval": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
        },
    },
    "qwen3_next": {
        **_BASE, **_ATTN, "model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 128, "rms_norm_eps": 1e-6, "full_attention_interval": 2,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [], "moe_intermediate_size": 64, "norm_topk_prob": True,
        "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
    },
    "lfm2": {
        **_BASE, "model_type": "lfm2", "hidden_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "norm_eps": 1e-5,
        "conv_bias": False, "conv_L_cache": 3, "block_dim": 128, "block_ff_dim": 256,
        "block_multiple_of": 64, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False, "rope_theta": 1000000.0,
        "layer_types": ["conv", "conv", "full_attention", "conv"],
    },
    "nemotron_h": {
        **_BASE, **_ATTN, "model_type": "nemotron_h", "hidden_size": 64, "intermediate_size": 128,
        "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16,
        "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
        "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "*", "M", "-"],
    },
    "granitemoehybrid": {
        **_BASE, "model_type": "granitemoehybrid", "hidden_size": 128, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "attention_bias": False, "embedding_multiplier": 1.0, "attention_multiplier": 0.125,
        "logits_scaling": 1.0, "residual_multiplier": 1.0, "rms_norm_eps": 1e-5,
        "layer_types": ["mamba", "attention", "mamba", "mamba"], "mamba_n_heads": 4,
        "mamba_d_head": 32, "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_n_groups": 1, "mamba_conv_bias": True, "shared_intermediate_size": 128,
        "rope_theta": 10000.0,
        # transformers validates this config when mlx_lm.load reads the tokenizer:
        # mamba_expand * hidden_size must equal mamba_n_heads * mamba_d_head.
        "mamba_expand": 1,
    },
    "falcon_h1": {
        **_BASE, **_ATTN, "model_type": "falcon_h1", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1, "rope_theta": 10000.0,
        # Tied logits are scaled by lm_head / embedding multiplier (0.007 by default): ties.
        "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0,
    },
}

# Architectures the engine refuses at start-up (no kvserve cache for a layer kind they use):
# Llama 4's chunked attention (``ChunkedKVCache``: attention restarts every chunk).
UNSERVABLE: dict[str, dict] = {
    "llama4": {
        "model_type": "llama4",
        "text_config": {
            **_BASE, **_ATTN, "model_type": "llama4_text", "hidden_size": 64,
            "num_hidden_layers": 4, "intermediate_size": 64, "intermediate_size_mlp": 128,
            "attention_bias": False, "attention_chunk_size": 32, "interleave_moe_layer_step": 2,
            "num_local_experts": 2, "num_experts_per_tok": 1, "rms_norm_eps": 1e-5,
            "rope_scaling": None, "rope_theta": 500000.0, "use_qk_norm": True,
        },
    },
}


def config_of(arch: str) -> dict:
    return ARCHS[arch] if arch in ARCHS else UNSERVABLE[arch]


# Query/key gain per architecture. At mlx-lm's initialisation these models attend almost
# uniformly, so a continuation depends on the context's average only and greedy decoding
# settles on one token repeated: a broken cache would go unnoticed. Scaling queries and keys
# (their projections, or the q/k norms where those follow) by g scales the scores by g^2.
ATTENTION_GAIN: dict[str, float] = {
    "llama": 6.0, "qwen3": 6.0, "qwen3_moe": 6.0, "ministral3": 6.0, "lfm2": 6.0, "falcon_h1": 6.0,
}
_QK_WEIGHTS = ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight",
               "q_layernorm.weight", "k_layernorm.weight")


def model_classes(config: dict):
    """mlx-lm's ``Model`` and ``ModelArgs`` for a config, by its model_type module."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model, module.ModelArgs


def build_model(arch: str, seed: int = 0):
    """The model of ``ARCHS[arch]`` with mlx-lm's random initialisation under ``seed``."""
    import mlx.core as mx

    model_class, args_class = model_classes(config_of(arch))
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(json.loads(json.dumps(config_of(arch)))))
    _randomize_zero_inits(model, seed)
    _scale_queries_and_keys(model, ATTENTION_GAIN.get(arch, 1.0))
    mx.eval(model.parameters())
    return model


def _scale_queries_and_keys(model, gain: float) -> None:
    from mlx.utils import tree_flatten, tree_unflatten

    if gain != 1.0:
        scaled = [(k, v * gain) for k, v in tree_flatten(model.parameters()) if k.endswith(_QK_WEIGHTS)]
        model.update(tree_unflatten(scaled))


def _randomize_zero_inits(model, seed: int) -> None:
    """gpt-oss sinks start at zero, which only adds 1 to every softmax denominator; trained
    sinks differ per head, so give them spread (a sink of 0 would hide a missed sink)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    sinks = [(k, mx.random.normal(v.shape, key=mx.random.key(seed + i)).astype(v.dtype))
             for i, (k, v) in enumerate(tree_flatten(model.parameters())) if k.endswith(".sinks")]
    if sinks:
        model.update(tree_unflatten(sinks))


def make_tiny_model(arch: str, dst: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save ``ARCHS[arch]`` with random weights and the tokenizer of ``tokenizer_dir`` into
    ``dst``; checked to load back with ``mlx_lm`` to the same logits."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model = build_model(arch, seed)
    weights = dict(tree_flatten(model.parameters()))
    _check_sanitize_keeps(model, weights)
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    (dst / "config.json").write_text(json.dumps(config_of(arch), indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dst / name)
    _check_loads_back(model, dst)
    return dst


def make_padded_model(arch: str, extra: int, dst: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """``make_tiny_model(arch, seed)`` with ``extra`` more layers that add nothing (their
    attention and MLP output projections are zero, so the residual stream passes through
    them unchanged): it computes exactly what the tiny model does, at more cost per token.
    A target for which the tiny model is an exact, cheap draft model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    config = {**config_of(arch), "num_hidden_layers": config_of(arch)["num_hidden_layers"] + extra}
    weights = dict(tree_flatten(build_model(arch, seed).parameters()))
    first = config_of(arch)["num_hidden_layers"]
    for i in range(first, config["num_hidden_layers"]):
        for key, value in list(weights.items()):
            if key.startswith("model.layers.0."):
                zero = key.endswith(("o_proj.weight", "down_proj.weight"))
                weights[key.replace("layers.0.", f"layers.{i}.")] = mx.zeros_like(value) if zero else value
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dst / name)
    return dst


def _check_sanitize_keeps(model, weights: dict) -> None:
    """``load`` passes the file through ``sanitize`` (renames, transposes, adds 1 to norms of
    unconverted checkpoints): the saved form must be the one it leaves alone."""
    import mlx.core as mx

    fresh = type(model)(model.args)
    after = fresh.sanitize(dict(weights))
    renamed = set(after) ^ set(weights)
    assert not renamed, f"sanitize renames {sorted(renamed)[:4]}"
    changed = [k for k in weights if not mx.array_equal(after[k], weights[k]).item()]
    assert not changed, f"sanitize changes {changed[:4]}"


def _check_loads_back(model, dst: Path) -> None:
    """``mlx_lm.load`` gives the same logits as the model in memory. (The whole ``load``: its
    tokenizer step has transformers parse config.json, which validates some model types.)"""
    import mlx.core as mx
    import mlx_lm

    loaded, _ = mlx_lm.load(str(dst))
    tokens = mx.array([[11, 2000, 345, 17, 40000, 9, 123]])
    want, got = model(tokens), loaded(tokens)
    assert mx.array_equal(want, got).item(), f"{dst.name}: loaded logits differ"


def prompt_tokens(seed: int, n: int) -> list[int]:
    """``n`` ids drawn from the ordinary vocabulary (no special tokens: ids below 17 are
    the chat template's markers and end-of-text)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens with mlx-lm's own caches (``make_prompt_cache``)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out
