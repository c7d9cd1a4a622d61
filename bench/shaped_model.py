"""A served model of a real model's shape: random weights, the default model's tokenizer.

The default model (135M parameters) is too small to show what a GPU's decode step costs
for the models people serve: its step is bound by kernel launches, not by bytes. This
script writes an mlx-lm model directory of a real model's shape, with random weights
built from mlx-lm's own classes and the default model's tokenizer, so ``kvserve bench``
can serve it beside ``mlx_lm.server`` over HTTP like any other model:

  * ``llama3-8b``: Llama-3-8B (32 layers, hidden 4096, 32 query heads over 8 KV heads,
    head_dim 128, MLP 14336, rope theta 500000), full attention;
  * ``gemma3-4b``: Gemma 3 4B's text model (34 layers, hidden 2560, 8 query heads over 4
    KV heads, head_dim 256, MLP 10240), five sliding-window layers (1024 tokens) to each
    full one;
  * ``smollm2-135m-32k``: the default model's own shape (30 layers, hidden 576, 9 query
    heads over 3 KV heads, head_dim 64) with a 32,768-token context where the default model
    has 8,192, for CPU benchmarks over documents of 16K and 32K tokens;
  * ``smollm2-thin``: the default model's depth and head_dim (30 layers, head_dim 64) with
    the widths cut (hidden 192, 3 query heads over 1 KV head, MLP 128): a step does every
    operation the default model's does on a tenth of its products, so on a CPU it shows the
    host's work per step, which is what a GPU's short steps wait on.

The vocabulary is the tokenizer's (49152 rows where Llama 3 has 128256 and Gemma 3
262144), so every sampled id decodes; the embedding and output head are smaller than the
real models' by that much. ``--bits 4`` quantizes every projection as mlx-lm's
converter does (affine, groups of 64); ``--bits 16`` keeps float16 (bfloat16 for Gemma).

    python bench/shaped_model.py --shape llama3-8b --bits 4 --out /root/models/llama3-8b-q4
    kvserve bench --model /root/models/llama3-8b-q4 --target kvserve: \\
        --target 'kvserve:--kv-scheme affine4' --target mlx_lm: \\
        --concurrency 8 --requests 8 --document-tokens 16000 --max-tokens 64

(``mlx_lm:--kv-bits 4`` serves short prompts only on CUDA: with a 16K-token document MLX's
CUDA backend has no quantized matmul for its attention, docs/benchmarks/gpu-serve.md.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

VOCAB = 49152  # the default model's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

SHAPES: dict[str, dict] = {
    "llama3-8b": {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "max_position_embeddings": 131072, "torch_dtype": "float16",
    },
    "smollm2-135m-32k": {  # the default model's shape with a 32K context (its own: 8K)
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
        "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "max_position_embeddings": 32768, "torch_dtype": "float16",
    },
    "smollm2-thin": {  # the default model's depth and head_dim, its widths cut
        "model_type": "llama", "hidden_size": 192, "num_hidden_layers": 30,
        "intermediate_size": 128, "num_attention_heads": 3, "num_key_value_heads": 1,
        "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "max_position_embeddings": 8192, "torch_dtype": "float16",
    },
    "gemma3-4b": {
        "model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34,
        "intermediate_size": 10240, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 1024, "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    },
}


def write_shaped_model(config: dict, bits: int, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write ``config``'s model with random weights (``bits`` 16 or 4) and the tokenizer of
    ``tokenizer_dir`` into ``out``, as mlx-lm saves a converted model (shards and an index
    above 5 GB). Returns ``out``.

    >>> import tempfile, mlx_lm
    >>> tiny = {**SHAPES["llama3-8b"], "hidden_size": 64, "num_hidden_layers": 2,
    ...         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...         "head_dim": 64, "vocab_size": 256}
    >>> out = write_shaped_model(tiny, 4, Path(tempfile.mkdtemp()) / "m", Path("/nonexistent"))
    [INFO] Quantized model with ... bits per weight.
    >>> model, config = mlx_lm.utils.load_model(out)
    >>> config["quantization"], model.model.layers[0].mlp.up_proj.bits
    ({'group_size': 64, 'bits': 4, 'mode': 'affine'}, 4)
    """
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16 if config.get("torch_dtype") == "bfloat16" else mx.float16)
    mx.eval(model.parameters())
    config = dict(config)
    if bits != 16:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def _default_tokenizer_dir() -> Path:
    from kvserve.configs import ModelConfig
    from kvserve.server.models.source import resolve_model

    return Path(resolve_model(None, ModelConfig().resolved_cache_dir()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--bits", type=int, choices=(16, 4), default=16)
    p.add_argument("--layers", type=int, help="fewer layers than the shape's (a quicker model)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    t0 = time.perf_counter()
    write_shaped_model(config, args.bits, args.out, _default_tokenizer_dir())
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"{args.shape}, {config['num_hidden_layers']} layers, {args.bits}-bit weights: "
          f"{size / 2**30:.2f} GiB in {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
