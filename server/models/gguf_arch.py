"""What differs between GGUF architectures: tensor names, config.json, weight fix-ups.

One ``Arch`` per ``general.architecture`` the converter reads::

    llama   -> mlx-lm "llama"        q/k rows un-permuted (llama.cpp interleaves rotary pairs)
    gemma3  -> mlx-lm "gemma3_text"  norm weights minus 1 (llama.cpp stores Gemma's 1 + w)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ATTENTION_MLP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Arch:
    """How one GGUF architecture becomes an mlx-lm model directory.

    ``layer_names`` maps a GGUF per-layer tensor (``blk.N.<part>``) to the HF module under
    ``model.layers.N``; every part is required. ``norm_shift`` is subtracted from every
    ``*norm.weight``. ``half_scales``: the block types keep their float16 scales (the
    model then runs float16 activations where its norms are float16); False keeps every
    scale in float32, for models whose activations overflow float16.
    """

    name: str
    layer_names: dict[str, str]
    build_config: Callable[[Any], dict]  # GGUFHeader -> config.json without bos/eos/quantization
    permute_qk: bool = False
    norm_shift: float = 0.0
    half_scales: bool = True
    refuse: Callable[[Any], str | None] = field(default=lambda header: None)
    extra_stops: tuple[str, ...] = ()  # tokens that end a turn besides eos/eot ids


def hf_module(arch: Arch, gguf_base: str) -> str | None:
    """``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``; ``output`` -> ``lm_head``;
    None for a tensor the architecture has no place for."""
    if gguf_base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_base]
    parts = gguf_base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in arch.layer_names:
        return f"model.layers.{parts[1]}.{arch.layer_names[parts[2]]}"
    return None


def unpermute_rope_rows(x, n_heads: int):
    """Undo llama.cpp's row permutation of ``attn_q``/``attn_k`` (applied to every
    tensor of the module: weight, scales, biases, bias; rows are output features).

    llama.cpp stores each head's rotary pairs interleaved, HF keeps the two halves
    apart. For one head with head_dim 4 the GGUF rows are ``[r0, r2, r1, r3]`` and
    HF rows are ``[r0, r1, r2, r3]``: reshape the rows as (heads, half, 2), swap the
    last two axes and flatten back.
    """
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _common(header, model_type: str, architecture: str, eps: float, theta: float) -> dict:
    """The hyper-parameters every decoder shares, named as HF names them."""
    hidden, heads = int(header.get("embedding_length")), int(header.get("attention.head_count"))
    embed = next(t for t in header.tensors if t.name == "token_embd.weight")
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "hidden_size": hidden,
        "num_hidden_layers": int(header.get("block_count")),
        "intermediate_size": int(header.get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.get("attention.head_count_kv", heads)),
        "head_dim": int(header.get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(header.get("attention.layer_norm_rms_epsilon", eps)),
        "rope_theta": float(header.get("rope.freq_base", theta)),
        "vocab_size": embed.shape[0],
        "max_position_embeddings": int(header.get("context_length", 2048)),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in header.tensors),
    }


def _linear_rope_scaling(header) -> dict | None:
    if header.get("rope.scaling.type") != "linear":
        return None
    return {"type": "linear", "factor": float(header.get("rope.scaling.factor", 1.0))}


def _llama_config(header) -> dict:
    names = {t.name for t in header.tensors}
    config = _common(header, "llama", "LlamaForCausalLM", 1e-5, 10000.0)
    config.update(rope_traditional=False, attention_bias="blk.0.attn_q.bias" in names,
                  mlp_bias="blk.0.ffn_up.bias" in names)
    if scaling := _linear_rope_scaling(header):
        config["rope_scaling"] = scaling
    return config


def _llama_refuse(header) -> str | None:
    if any(t.name == "rope_freqs.weight" for t in header.tensors):
        return "unsupported RoPE frequency table (llama3-style rope scaling)"
    rope_type = header.get("rope.scaling.type", "none")
    if rope_type not in ("none", "linear"):
        return f"unsupported RoPE scaling {rope_type!r} (supported: none, linear)"
    return None


def _gemma3_config(header) -> dict:
    """Gemma 3 keys llama.cpp does not write take the values its runtime assumes: local
    (sliding-window) layers rotate with base 10000, every 6th layer is global, and queries
    are scaled by 1/sqrt(head_dim) except in the 62-layer 27B, which uses hidden/heads."""
    config = _common(header, "gemma3_text", "Gemma3ForCausalLM", 1e-6, 1_000_000.0)
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    config.update(
        rope_local_base_freq=float(header.get("rope.freq_base_swa", 10000.0)),
        sliding_window=int(header.get("attention.sliding_window", 512)),
        sliding_window_pattern=int(header.get("attention.sliding_window_pattern", 6)),
        query_pre_attn_scalar=(config["hidden_size"] // config["num_attention_heads"]
                               if layers == 62 else head_dim),
        rope_scaling=_linear_rope_scaling(header),
    )
    return config


def _gemma3_refuse(header) -> str | None:
    pattern = header.get("attention.sliding_window_pattern")
    if pattern is not None and not isinstance(pattern, int):  # Gemma 3n writes a per-layer list
        return "unsupported per-layer sliding-window pattern"
    return _llama_refuse(header)


LLAMA = Arch(
    name="llama",
    layer_names={"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 **_ATTENTION_MLP},
    build_config=_llama_config,
    permute_qk=True,
    refuse=_llama_refuse,
)

# llama.cpp's Gemma converter writes every RMSNorm weight as 1 + w (its runtime multiplies
# by the stored weight); mlx-lm's gemma3_text adds the 1 itself. It does not permute q/k.
GEMMA3 = Arch(
    name="gemma3",
    layer_names={"attn_norm": "input_layernorm", "attn_q_norm": "self_attn.q_norm",
                 "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                 **_ATTENTION_MLP},
    build_config=_gemma3_config,
    norm_shift=1.0,
    half_scales=False,  # Gemma's residual stream overflows float16
    refuse=_gemma3_refuse,
    extra_stops=("<end_of_turn>",),  # what llama.cpp stops Gemma chats on
)

ARCHS = {arch.name: arch for arch in (LLAMA, GEMMA3)}
