"""Split a loaded model across the processes of an ``mx.distributed`` group.

Tensor parallel, where the model allows: every rank keeps the whole embedding and head, and
a slice of each attention and MLP layer: its query heads with their KV heads, its part of
the MLP's hidden width. A layer's output is the ``all_sum`` of the ranks' parts, so every
rank ends each layer with the same hidden state and the same logits, and each rank's KV
cache holds only its own KV heads. Otherwise a pipeline (mlx-lm's ``pipeline()``): each rank
keeps a run of whole layers and their caches, and hands its hidden state to the next.

The model's own ``shard()`` (mlx-lm's tensor-parallel split) is used when the heads divide
evenly. Heads that do not divide (the default model has 9 query heads over 3 KV heads) are
split here by whole KV-head groups, as evenly as they go, for models laid out as Llama's
(``q/k/v/o_proj`` and ``gate/up/down_proj``); mlx-lm would cut a head in two. Models
with neither split are refused with the reason.

    >>> even_bounds(3, 2), even_bounds(1536, 2, unit=64), even_bounds(4, 4)
    ([0, 2, 3], [0, 768, 1536], [0, 1, 2, 3, 4])
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kvserve.server.models.errors import ModelLoadError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def even_bounds(total: int, parts: int, unit: int = 1) -> list[int]:
    """Cut ``total`` (a multiple of ``unit``) into ``parts`` runs of whole units, the first
    ones longer by one unit where it does not divide; returns the ``parts + 1`` boundaries."""
    units, extra = divmod(total // unit, parts)
    out = [0]
    for r in range(parts):
        out.append(out[-1] + (units + (r < extra)) * unit)
    return out


def shard_model(model: nn.Module, group) -> tuple[str, float]:
    """Keep this rank's part of ``model`` (in place). Returns the split, the same on every
    rank (``tp2:even``, ``tp2:kv_heads=2+1,mlp=768+768``, ``pp2:layers=2+2``), and this
    rank's share of what the KV caches hold (heads, or layers for a pipeline). Raises
    ``ModelLoadError``."""
    n = group.size()
    name = type(model).__module__.rsplit(".", 1)[-1]
    if not hasattr(model, "shard"):
        if hasattr(getattr(model, "model", None), "pipeline"):
            return _pipeline(model, group)
        raise ModelLoadError(f"{name} cannot be split across {n} processes: mlx-lm gives it neither a "
                             f"tensor-parallel shard() nor a pipeline split")
    attentions = [layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")]
    heads = {(getattr(a, "n_heads", n), getattr(a, "n_kv_heads", n)) for a in attentions}
    if all(q % n == 0 and kv % n == 0 for q, kv in heads):
        try:
            model.shard(group)
        except ValueError as exc:
            raise ModelLoadError(f"{name} cannot be split across {n} processes: {exc}") from None
        return f"tp{n}:even", 1 / n
    if not _llama_layout(model) or min(kv for _, kv in heads) < n:
        raise ModelLoadError(f"{name} cannot be split across {n} processes: its heads {sorted(heads)} "
                             f"(query, KV) do not divide by {n}")
    return _shard_by_head_groups(model, group)


def _pipeline(model: nn.Module, group) -> tuple[str, float]:
    """mlx-lm's pipeline split: rank r keeps a run of whole layers (rank 0 the last ones)
    and sends its hidden state on; the forward ends with every rank holding the same one."""
    total = len(model.model.layers)
    model.model.pipeline(group)
    mine = len(model.model.pipeline_layers)
    mx.eval(model.parameters())
    counts = mx.distributed.all_gather(mx.array([mine]), group=group).tolist()
    return f"pp{group.size()}:layers=" + "+".join(map(str, counts)), mine / total


def _llama_layout(model: nn.Module) -> bool:
    def linear(m) -> bool:
        return isinstance(m, (nn.Linear, nn.QuantizedLinear)) and getattr(m, "mode", "affine") == "affine"

    for layer in model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not hasattr(attn, "n_kv_heads"):
            return False
        if not all(linear(getattr(attn, p, None)) for p in ATTENTION):
            return False
        if not all(linear(getattr(mlp, p, None)) for p in MLP):
            return False
    return True


def _shard_by_head_groups(model: nn.Module, group) -> tuple[str, float]:
    """Rank r takes KV heads ``kv[r]:kv[r+1]``, the query heads that read them, and a run of
    the MLP's hidden width; ``o_proj`` and ``down_proj`` sum the ranks' parts."""
    n, r = group.size(), group.rank()
    splits, heads, mine = set(), 0, 0
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        per_kv = attn.n_heads // attn.n_kv_heads
        head_dim = _out_dims(attn.k_proj) // attn.n_kv_heads
        kv = even_bounds(attn.n_kv_heads, n)
        a, b = kv[r], kv[r + 1]
        heads, mine = heads + attn.n_kv_heads, mine + b - a
        attn.q_proj = _rows(attn.q_proj, a * per_kv * head_dim, b * per_kv * head_dim)
        attn.k_proj = _rows(attn.k_proj, a * head_dim, b * head_dim)
        attn.v_proj = _rows(attn.v_proj, a * head_dim, b * head_dim)
        attn.o_proj = SummedLinear(attn.o_proj, a * per_kv * head_dim, b * per_kv * head_dim, group)
        attn.n_heads, attn.n_kv_heads = (b - a) * per_kv, b - a
        width = _out_dims(mlp.gate_proj)
        hidden = even_bounds(width, n, unit=getattr(mlp.down_proj, "group_size", 1))
        h0, h1 = hidden[r], hidden[r + 1]
        mlp.gate_proj, mlp.up_proj = _rows(mlp.gate_proj, h0, h1), _rows(mlp.up_proj, h0, h1)
        mlp.down_proj = SummedLinear(mlp.down_proj, h0, h1, group)
        splits.add(("+".join(str(kv[i + 1] - kv[i]) for i in range(n)),
                    "+".join(str(hidden[i + 1] - hidden[i]) for i in range(n))))
    mx.eval(model.parameters())
    return f"tp{n}:" + ";".join(f"kv_heads={k},mlp={m}" for k, m in sorted(splits)), mine / heads


class SummedLinear(nn.Module):
    """Input features ``lo:hi`` of a linear layer on this rank; the ranks' products are
    summed (``all_sum``) and the bias added once: mlx's ``ShardedToAllLinear``, unevenly cut."""

    def __init__(self, linear: nn.Module, lo: int, hi: int, group):
        super().__init__()
        self.part = _cols(linear, lo, hi)
        if "bias" in linear:
            self.bias = linear.bias
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(self.part(x), group=self.group)
        return y + self.bias if "bias" in self else y


def _out_dims(m: nn.Module) -> int:
    return m.weight.shape[0]


def _rows(m: nn.Module, lo: int, hi: int) -> nn.Module:
    """Output features ``lo:hi`` of a Linear or QuantizedLinear (bias rows too)."""
    out = _like(m)
    out.weight = m.weight[lo:hi]
    if isinstance(m, nn.QuantizedLinear):
        out.scales = m.scales[lo:hi]
        if m.get("biases") is not None:
            out.biases = m.biases[lo:hi]
    if "bias" in m:
        out.bias = m.bias[lo:hi]
    return out


def _cols(m: nn.Module, lo: int, hi: int) -> nn.Module:
    """Input features ``lo:hi`` (no bias: ``SummedLinear`` adds it once)."""
    out = _like(m)
    if isinstance(m, nn.QuantizedLinear):
        if lo % m.group_size or hi % m.group_size:
            raise ModelLoadError(f"cannot cut a {m.group_size}-wide quantization group at {lo}:{hi}")
        per_word = 32 // m.bits
        out.weight = mx.contiguous(m.weight[:, lo // per_word : hi // per_word])
        out.scales = mx.contiguous(m.scales[:, lo // m.group_size : hi // m.group_size])
        if m.get("biases") is not None:
            out.biases = mx.contiguous(m.biases[:, lo // m.group_size : hi // m.group_size])
    else:  # a column slice is strided: copied once here, not by every matmul
        out.weight = mx.contiguous(m.weight[:, lo:hi])
    return out


def _like(m: nn.Module) -> nn.Module:
    """An empty module of ``m``'s kind (its weights are set by the caller)."""
    if isinstance(m, nn.QuantizedLinear):
        q = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(q)
        q.group_size, q.bits, q.mode = m.group_size, m.bits, getattr(m, "mode", "affine")
        q.freeze()
        return q
    lin = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(lin)
    return lin
