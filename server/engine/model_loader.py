"""Build what the engine serves: the model (loaded by ``kvserve.server.models``), its runner,
the prefix cache, and a start-up check that the KV scheme fits the model.

Runs on the engine thread (``Engine`` calls the function returned by ``make_loader``), so
every array the model owns is created by the thread that will use it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

from kvserve.cache.scheme import KVScheme
from kvserve.configs import CacheConfig, ModelConfig
from kvserve.server.engine.device import DeviceProfile, choose_profile
from kvserve.server.engine.loop import LoadedModel
from kvserve.server.models.errors import ModelLoadError
from kvserve.server.models.load import load_bundle, model_id_for

log = logging.getLogger("kvserve.engine")


def make_loader(config: ModelConfig, scheme: KVScheme, blas: str,
                progress: Callable[[str], None] | None = None, cache: CacheConfig | None = None,
                speculative: str = "off", group=None, draft_model: str | None = None,
                device: DeviceProfile | None = None, draft_cost: float | None = None):
    """Returns a zero-argument loader for ``Engine``; ``blas`` describes the active BLAS;
    ``cache`` sizes the prefix cache (None: no prefix cache); ``speculative`` the proposer
    ("off", "ngram", or "draft" with ``draft_model``, whose
    step costs ``draft_cost`` of the served model's: None, measured); ``group``: rank 0 of a model split
    across processes (its runner leads the others); ``device``: the device profile (None:
    chosen for MLX's default device)."""

    def load() -> LoadedModel:
        loaded = load_model(config, scheme, blas, progress, cache, speculative, group, draft_model, device,
                            draft_cost)
        if group is None:
            return loaded
        from kvserve.server.engine.distributed import Channel, LeaderRunner

        return replace(loaded, runner=LeaderRunner(loaded.runner, Channel(group)))

    return load


def load_model(config: ModelConfig, scheme: KVScheme, blas: str,
               progress: Callable[[str], None] | None = None,
               cache: CacheConfig | None = None, speculative: str = "off", group=None,
               draft_model: str | None = None, device: DeviceProfile | None = None,
               draft_cost: float | None = None) -> LoadedModel:
    """The model (this rank's shard of it with ``group``), its runner and prefix cache, with
    the rewrites of the ``device`` profile (None: chosen for MLX's default device)."""
    from kvserve.server.engine.fastpath import apply_rewrites
    from kvserve.server.engine.kv_memory import token_bytes
    from kvserve.server.engine.grammar import Grammars
    from kvserve.server.engine.runner import ModelRunner
    from kvserve.server.engine.speculation import NgramProposer

    bundle = load_bundle(config, kv_scheme=scheme.name, blas=blas, progress=progress,
                         check=lambda model: _check_servable(model, scheme, model_id_for(config.model, config.model)),
                         group=group)
    device = device or choose_profile(config.resolved_cache_dir())
    apply_rewrites(bundle.model, device.rewrites, bundle.info.context_length)
    layout = _layout(bundle.model, scheme)
    if speculative != "off" and _state_beside_attention(layout):
        raise ModelLoadError(f"speculative decoding needs layers that can drop rejected tokens row by row; "
                             f"this model has recurrent-state layers beside attention in one layer ({layout})")
    swap_dir = config.resolved_cache_dir() / "swap"  # on disk: /tmp may be RAM-backed
    swap_dir.mkdir(parents=True, exist_ok=True)
    prefix = None
    if cache is not None and cache.prefix_enabled:
        prefix = open_prefix_cache(cache, config, bundle.info.source, bundle.tokenizer, scheme, layout,
                                   bundle.info.shard, bundle.info.kv_share)
        if group is not None:
            from kvserve.server.engine.distributed import AgreedPrefix

            prefix = AgreedPrefix(prefix, group)
    grammars = Grammars(bundle.tokenizer, bundle.info.vocab_size)
    proposer = NgramProposer() if speculative == "ngram" else None
    if speculative == "draft":
        proposer = load_draft(replace(config, model=draft_model), bundle, scheme, blas, progress, device,
                              draft_cost)
    runner = ModelRunner(bundle.model, scheme, swap_dir, prefix, grammars, proposer,
                         cache.prompt_cache_checkpoint_tokens if cache is not None else 0,
                         captured=device.captured)
    return LoadedModel(runner=runner, tokenizer=bundle.tokenizer, info=bundle.info, grammars=grammars,
                       kv_token_bytes=token_bytes(bundle.model, scheme), device=device,
                       message_ends=prefix is not None and ("window" in layout or "state" in layout))


def load_draft(config: ModelConfig, target, scheme: KVScheme, blas: str,
               progress: Callable[[str], None] | None = None, device: DeviceProfile | None = None,
               cost: float | None = None):
    """The draft model of ``--speculative draft`` as a ``DraftProposer``: loaded like the
    served model (``target``, a ``ModelBundle``), refused in one line when its tokenizer
    maps tokens to other ids than the served one's, or when its layers cannot drop the
    proposals the served model rejects. ``cost``: its decode step's share of the served
    model's (None: measured here)."""
    from kvserve.server.engine.draft import DraftProposer, relative_cost
    from kvserve.server.engine.fastpath import apply_rewrites

    name = model_id_for(config.model, config.model)
    draft = load_bundle(config, kv_scheme=scheme.name, blas=blas, progress=progress,
                        check=lambda model: _check_servable(model, scheme, f"draft model {name}"))
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ModelLoadError(f"draft model {name} has another tokenizer than the served model "
                             f"{target.info.model_id}: its proposals would be other tokens")
    layout = _layout(draft.model, scheme)
    if "state" in layout:
        raise ModelLoadError(f"draft model {name} has recurrent-state layers ({layout}): they cannot "
                             f"drop the proposals the served model rejects")
    device = device or choose_profile(config.resolved_cache_dir())
    apply_rewrites(draft.model, device.rewrites, draft.info.context_length)
    source = "measured" if cost is None else "engine.draft_cost"
    cost = relative_cost(draft.model, target.model, scheme) if cost is None else cost
    log.info("draft model %s: a decode step costs %.2f of the served model's (%s)", draft.info.describe(), cost,
             source)
    return DraftProposer(draft.model, scheme, cost, vocab=target.info.vocab_size or None)


def prefix_ram_gb(configured: float | None, memory: int | None = None) -> float:
    """The prefix cache's RAM tier in GiB: as configured, else an eighth of the machine's
    ``memory`` (bytes; this machine's when None) and at least 1 GiB.

    >>> prefix_ram_gb(0.5), prefix_ram_gb(None, 24 << 30), prefix_ram_gb(None, 128 << 30)
    (0.5, 3.0, 16.0)
    >>> prefix_ram_gb(None, 4 << 30)
    1.0
    """
    if configured is not None:
        return configured
    from kvserve.server.engine.kv_memory import machine_memory

    return max(1.0, (memory or machine_memory()) / 8 / 2**30)


def open_prefix_cache(cache: CacheConfig, config: ModelConfig, source, tokenizer, scheme: KVScheme,
                      layout: str = "", shard: str = "", share: float = 1.0):
    """The prefix cache of this model, tokenizer and scheme, its files in one directory per
    namespace. The weight format measured at start-up is no part of the namespace: every
    format computes with the same weight values (dense f32 is the exact dequantization of the
    stored ones), so K/V computed under one differ from another's by float rounding only, as
    a batched row's do from a lone one's; and the measurement may pick another format after
    a restart.

    Each rank of a split model (``shard``) keeps its part of every entry in its own directory
    (``rank<r>`` under a ``prompt_cache_dir``): ranks never evict each other's files as
    foreign. The budgets are the whole model's: each rank takes its ``share`` (of the KV
    heads, or of the layers), so ranks with unequal parts still evict the same entries."""
    from kvserve.cache.prefix import Namespace, PrefixCache, model_fingerprint, tokenizer_hash

    ns = Namespace(model=model_fingerprint(source), tokenizer=tokenizer_hash(tokenizer),
                   scheme=scheme, layout=layout, shard=shard)
    disk_dir = None
    if cache.prompt_cache_disk_gb > 0:
        disk_dir = Path(cache.prompt_cache_dir).expanduser() if cache.prompt_cache_dir \
            else config.resolved_cache_dir() / "prompt-cache" / ns.key
        if shard and cache.prompt_cache_dir:
            disk_dir = disk_dir / shard.split(":")[1]
    ram_gb = prefix_ram_gb(cache.prompt_cache_ram_gb)
    prefix = PrefixCache(ns, ram_bytes=int(ram_gb * share * 2**30), disk_dir=disk_dir,
                         disk_bytes=int(cache.prompt_cache_disk_gb * share * 2**30))
    stats = prefix.stats()
    log.info("prefix cache: %.1f GiB RAM, %s; %d entries found on disk",
             ram_gb, f"{cache.prompt_cache_disk_gb:.1f} GiB in {disk_dir}"
             if disk_dir else "no SSD tier", stats["disk_entries"])
    return prefix


def _check_servable(model, scheme: KVScheme, name: str) -> None:
    """The start-up probe (``servable.py``): a model the engine cannot serve, or a scheme its
    head size cannot take, is refused here in one line, not by a 500 on every request."""
    from kvserve.server.engine.servable import NotServable, check_servable

    try:
        check_servable(model, scheme, name)
    except NotServable as exc:
        raise ModelLoadError(str(exc)) from None


def _state_beside_attention(layout: str) -> bool:
    """A recurrent state inside a parallel layer (a Mamba beside attention in one layer):
    such a layer verifies its chunk at once, so its state cannot roll back row by row.

        >>> _state_beside_attention("(state2|kv)*2"), _state_beside_attention("state2*3,kv")
        (True, False)
    """
    return any("state" in group for group in re.findall(r"\(([^)]*)\)", layout))


def _layout(model, scheme: KVScheme) -> str:
    """The layer kinds a request's cache holds (``kv,window512*5,...``): prefix files of
    another layout are refused with that reason."""
    from kvserve.cache import PromptCache

    return PromptCache.for_model(model, scheme).layout()
