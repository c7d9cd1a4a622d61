"""Load a model: resolve the source, load it with mlx-lm, pick and apply the weight format.

What the engine builds around the model (its runner, the KV caches, the prefix cache) is
not done here; ``kvserve.server.engine.model_loader`` does that with what this returns.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvserve.configs import ModelConfig
from kvserve.server.models.registry import shipped_model
from kvserve.server.models.source import ModelLoadError, resolve_model

log = logging.getLogger("kvserve.models")


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
    shard: str = ""  # split across processes: "tp2:rank0:kv_heads=2+1,mlp=768+768"; "" for one
    kv_share: float = 1.0  # this process's share of what the model's KV caches hold

    def describe(self) -> str:
        split = f", split {self.shard}" if self.shard else ""
        return (f"{self.model_id}: context {self.context_length}, {self.weight_format}, "
                f"{self.blas}, KV scheme {self.kv_scheme}{split}")


@dataclass(frozen=True)
class ModelBundle:
    """A loaded model in its chosen weight format, its tokenizer, its config.json as a
    dict, and the facts about it (``info``)."""

    model: Any  # mlx-lm nn.Module
    tokenizer: Any  # mlx-lm TokenizerWrapper
    config: dict
    info: ModelInfo


def load_bundle(config: ModelConfig, *, kv_scheme: str = "", blas: str = "",
                progress: Callable[[str], None] | None = None,
                check: Callable[[Any], None] | None = None, group=None) -> ModelBundle:
    """Resolve ``config.model``, load it with mlx-lm and convert its weights to the format
    measured fastest (or the one ``config.weight_format`` names).

    ``check(model)`` runs after loading and before the weight formats are timed, so a
    model the caller cannot use is refused before that cost. ``kv_scheme`` and ``blas``
    are only recorded in ``info``.

    Example::

        bundle = load_bundle(ModelConfig(model="gemma3-270m", weight_format="as-loaded"))
        bundle.info.model_id, bundle.info.context_length  # ('gemma3-270m', 32768)
    """
    import mlx_lm
    from mlx_lm.utils import load_model

    from kvserve.server.models.weights import apply_weight_format, choose_weight_format

    source = resolve_model(config.model, config.resolved_cache_dir(), progress)
    try:
        if Path(source).is_dir():  # what mlx_lm.load does, in two steps
            model, model_config = load_model(Path(source))
            tokenizer = load_tokenizer(Path(source), model_config.get("eos_token_id"))
        else:  # a Hugging Face repository: mlx-lm fetches it
            model, tokenizer, model_config = mlx_lm.load(str(source), return_config=True)
    except Exception as exc:  # mlx-lm raises many types; the user needs one line
        raise ModelLoadError(f"cannot load model {source}: {type(exc).__name__}: {exc}") from None
    if check is not None:
        check(model)
    choice = choose_weight_format(model, config.weight_format)
    shard, share = "", 1.0
    if group is not None:
        choice = _agree(choice, group)
    apply_weight_format(model, choice)
    if group is not None:
        from kvserve.server.models.shard import shard_model

        split, share = shard_model(model, group)
        kind, _, detail = split.partition(":")
        shard = f"{kind}:rank{group.rank()}:{detail}"
    info = ModelInfo(
        model_id=model_id_for(config.model, source),
        source=str(source),
        context_length=int(model_config.get("max_position_embeddings") or 4096),
        weight_format=choice.describe(),
        blas=blas,
        kv_scheme=kv_scheme,
        vocab_size=_vocab_size(model_config, tokenizer),
        shard=shard,
        kv_share=share,
    )
    log.info("model ready: %s", info.describe())
    return ModelBundle(model=model, tokenizer=tokenizer, config=model_config, info=info)


_TOKENIZERS: dict[tuple, Any] = {}
_TOKENIZERS_LOCK = threading.Lock()
_TOKENIZERS_KEPT = 4


def load_tokenizer(model_dir: Path, eos_token_id: Any = None) -> Any:
    """mlx-lm's ``TokenizerWrapper`` of ``model_dir``, one per process for the same files.

    Loading one takes about 0.6 s of CPU (transformers parsing its JSON in Python, the
    vocabulary listed several times); a process that starts several servers on one model
    (tests, benchmarks, an engine restarted in place) loads it once. The object is only read after loading
    (each request takes its own detokenizer copy), so sharing it changes nothing a server
    does. Known by the folder, the model's EOS ids and each non-weight file's name, size
    and modification time: a changed file loads anew.
    """
    from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

    stats = [(f.name, f.stat()) for f in model_dir.iterdir() if f.is_file() and f.suffix != ".safetensors"]
    files = tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))
    key = (str(model_dir.resolve()), repr(eos_token_id), files)
    with _TOKENIZERS_LOCK:  # servers of one process load on threads of their own
        if key not in _TOKENIZERS:
            if len(_TOKENIZERS) >= _TOKENIZERS_KEPT:
                _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
            _TOKENIZERS[key] = mlx_lm_tokenizer(model_dir, eos_token_ids=eos_token_id)
        return _TOKENIZERS[key]


def _agree(choice, group):
    """Rank 0's weight format on every rank: ranks that computed in different formats would
    round differently and sample different tokens. Codes for decode are not taken: a shard
    slices the dense weights, which leaves the codes of the whole ones unused in memory."""
    import mlx.core as mx

    from kvserve.server.models.weights import DENSE_CODES, DENSE_F32, FORMATS, WeightChoice

    if choice.name == DENSE_CODES:
        choice = WeightChoice(DENSE_F32, "split across processes: shards are dense", {}, choice.device)

    try:
        picked = mx.distributed.all_gather(mx.array([FORMATS.index(choice.name)]), group=group).tolist()[0]
    except RuntimeError as exc:  # another process failed to load and left
        raise ModelLoadError(f"rank {group.rank()}: lost the other processes while loading: {exc}") from None
    if FORMATS[picked] == choice.name:
        return choice
    return WeightChoice(FORMATS[picked], "rank 0's measurement", {}, choice.device)


def _vocab_size(model_config: dict, tokenizer) -> int:
    """Ids the model embeds and the tokenizer names: the smaller of the two counts."""
    embedded = model_config.get("vocab_size") or model_config.get("text_config", {}).get("vocab_size")
    return min(int(embedded), len(tokenizer)) if embedded else len(tokenizer)


def model_id_for(spec: str | None, source: Path | str) -> str:
    """The name clients use in ``model``: a shipped model's name, a repo id, or a folder name.

    >>> model_id_for(None, Path("/c/models/SmolLM2-135M-Instruct.Q4_1-1a2b3c"))
    'SmolLM2-135M-Instruct'
    >>> model_id_for("gemma3-270m", Path("/c/models/gemma-3-270m-q4_k_m-a5fd3b62230a"))
    'gemma3-270m'
    >>> model_id_for("mlx-community/Qwen3-0.6B-4bit", "mlx-community/Qwen3-0.6B-4bit")
    'mlx-community/Qwen3-0.6B-4bit'
    """
    path = Path(spec) if spec else None
    if path is not None and path.exists():  # a local path wins, as in resolve_model
        return path.stem if path.is_file() else path.name
    shipped = shipped_model(spec)
    return shipped.model_id if shipped is not None else spec

