"""Load a model for serving: resolve the source, load it with mlx-lm, pick the weight format.

Runs on the engine thread (``Engine`` calls the function returned by ``make_loader``), so
every array the model owns is created by the thread that will use it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvserve.cache.scheme import KVScheme
from kvserve.configs import CacheConfig, ModelConfig
from kvserve.server.engine.loop import LoadedModel
from kvserve.server.engine.model_source import ModelLoadError, resolve_model

log = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the served model that clients and logs see (``/v1/models``)."""

    model_id: str
    source: str
    context_length: int
    weight_format: str
    blas: str
    kv_scheme: str
    vocab_size: int = 0  # rows of the embedding: token ids (prompt, logit_bias) stay below

    def describe(self) -> str:
        return (f"{self.model_id}: context {self.context_length}, {self.weight_format}, "
                f"{self.blas}, KV scheme {self.kv_scheme}")


def make_loader(config: ModelConfig, scheme: KVScheme, blas: str,
                progress: Callable[[str], None] | None = None, cache: CacheConfig | None = None):
    """Returns a zero-argument loader for ``Engine``; ``blas`` describes the active BLAS;
    ``cache`` sizes the prefix cache (None: no prefix cache)."""

    def load() -> LoadedModel:
        return load_model(config, scheme, blas, progress, cache)

    return load


def load_model(config: ModelConfig, scheme: KVScheme, blas: str,
               progress: Callable[[str], None] | None = None,
               cache: CacheConfig | None = None) -> LoadedModel:
    import mlx_lm

    from kvserve.server.engine.fastpath import install_table_rope
    from kvserve.server.engine.runner import ModelRunner
    from kvserve.server.engine.weights import apply_weight_format, choose_weight_format

    source = resolve_model(config.model, config.resolved_cache_dir(), progress)
    try:
        model, tokenizer, model_config = mlx_lm.load(str(source), return_config=True)
    except Exception as exc:  # mlx-lm raises many types; the user needs one line
        raise ModelLoadError(f"cannot load model {source}: {type(exc).__name__}: {exc}") from None
    _check_scheme_fits(model, scheme)
    choice = choose_weight_format(model, config.weight_format)
    apply_weight_format(model, choice)
    install_table_rope(model)
    info = ModelInfo(
        model_id=model_id_for(config.model, source),
        source=str(source),
        context_length=int(model_config.get("max_position_embeddings") or 4096),
        weight_format=choice.describe(),
        blas=blas,
        kv_scheme=scheme.name,
        vocab_size=_vocab_size(model_config, tokenizer),
    )
    log.info("model ready: %s", info.describe())
    swap_dir = config.resolved_cache_dir() / "swap"  # on disk: /tmp may be RAM-backed
    swap_dir.mkdir(parents=True, exist_ok=True)
    prefix = None
    if cache is not None and cache.prefix_enabled:
        prefix = open_prefix_cache(cache, config, source, tokenizer, scheme)
    runner = ModelRunner(model, scheme, swap_dir, prefix)
    return LoadedModel(runner=runner, tokenizer=tokenizer, info=info)


def open_prefix_cache(cache: CacheConfig, config: ModelConfig, source, tokenizer, scheme: KVScheme):
    """The prefix cache of this model, tokenizer and scheme, its files in one directory per
    namespace. The weight format measured at start-up is no part of the namespace: every
    format computes with the same weight values (dense f32 is the exact dequantization of the
    stored ones), so K/V computed under one differ from another's by float rounding only, as
    a batched row's do from a lone one's; and the measurement may pick another format after
    a restart."""
    from kvserve.cache.prefix import Namespace, PrefixCache, model_fingerprint, tokenizer_hash

    ns = Namespace(model=model_fingerprint(source), tokenizer=tokenizer_hash(tokenizer),
                   scheme=scheme)
    disk_dir = None
    if cache.prompt_cache_disk_gb > 0:
        disk_dir = Path(cache.prompt_cache_dir).expanduser() if cache.prompt_cache_dir \
            else config.resolved_cache_dir() / "prompt-cache" / ns.key
    prefix = PrefixCache(ns, ram_bytes=int(cache.prompt_cache_ram_gb * 2**30), disk_dir=disk_dir,
                         disk_bytes=int(cache.prompt_cache_disk_gb * 2**30))
    stats = prefix.stats()
    log.info("prefix cache: %.1f GiB RAM, %s; %d entries found on disk",
             cache.prompt_cache_ram_gb, f"{cache.prompt_cache_disk_gb:.1f} GiB in {disk_dir}"
             if disk_dir else "no SSD tier", stats["disk_entries"])
    return prefix


def _check_scheme_fits(model, scheme: KVScheme) -> None:
    """One token through a fresh cache of ``scheme``: a scheme the model's head size cannot
    take (a group larger than head_dim) fails here, at start-up, not on every request."""
    import mlx.core as mx

    from kvserve.cache import PromptCache

    try:
        cache = PromptCache.for_model(model, scheme)
        model(mx.array([[0]]), cache=cache)
        cache.maybe_convert()
        model(mx.array([[0]]), cache=cache)  # a decode step: TurboQuant compresses here
        mx.eval(cache.state)
    except ValueError as exc:
        raise ModelLoadError(f"KV scheme {scheme.name} does not fit this model: {exc}") from None


def _vocab_size(model_config: dict, tokenizer) -> int:
    """Ids the model embeds and the tokenizer names: the smaller of the two counts."""
    embedded = model_config.get("vocab_size") or model_config.get("text_config", {}).get("vocab_size")
    return min(int(embedded), len(tokenizer)) if embedded else len(tokenizer)


def model_id_for(spec: str | None, source: Path | str) -> str:
    """The name clients use in ``model``: the default model's name, a repo id, or a folder name.

    >>> model_id_for(None, Path("/c/models/SmolLM2-135M-Instruct.Q4_1-1a2b3c"))
    'SmolLM2-135M-Instruct'
    >>> model_id_for("mlx-community/Qwen3-0.6B-4bit", "mlx-community/Qwen3-0.6B-4bit")
    'mlx-community/Qwen3-0.6B-4bit'
    """
    if spec in (None, "default"):
        return "SmolLM2-135M-Instruct"
    path = Path(spec)
    if path.exists():
        return path.stem if path.is_file() else path.name
    return spec
