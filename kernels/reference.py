"""Pure-MLX attention over every KV storage format: the full path, the blockwise reference
and the dense path (decode, then MLX's SDPA) that a GPU takes where no fused kernel serves.

Both take the formats through one protocol (``kvserve.cache.turbo_codec`` states it;
``kvserve.cache.affine.QuantizedFormat`` and the turbo family's ``RawFormat`` /
``AffineFormat`` / ``TurboFormat`` implement it): ``prepare_queries`` (rotate a turbo query
once), ``scores`` and ``accumulate`` over any slice of T, ``finish`` (one inverse rotation).

Shapes, e.g. B=8 sequences, 32 query heads over 8 KV heads, D=128, T=4096, decode (L=1):

    queries (8, 32, 1, 128) -> grouped q (8, 8, 4, 1, 128): query head h reads KV head h // 4
    keys / values parts (8, 8, 4096, W)       never repeated, never dequantized as a whole
    scores of one block of 256 tokens         (8, 8, 4, 1, 256) f32
    output (8, 32, 1, 128) in the queries' dtype

``attend_full`` scores all T at once: one (B, H_kv, R, L, T) f32 score matrix and
``mx.softmax``. ``attend_blockwise`` walks T in blocks with the online softmax, all in f32;
after block j with scores s_j (masked) and values V_j:

    m_j   = max(m_{j-1}, max_t s_j)                          running max      (..., L, 1)
    l_j   = exp(m_{j-1} - m_j) * l_{j-1} + sum_t exp(s_j - m_j)   running sum
    acc_j = exp(m_{j-1} - m_j) * acc_{j-1} + exp(s_j - m_j) @ V_j  rescaled accumulator
    out   = finish(acc_last / l_last)

so it equals softmax(s) @ V up to f32 rounding. Masked slots hold a finite minimum
(``kvserve.cache.base.MASKED``), so a fully masked row (a padding query) averages its
values uniformly in both paths instead of producing NaN.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from kvserve.cache.base import apply_mask, grouped_mask

F32 = mx.float32
# Tokens per block. A turbo block decodes (B, H_kv, block, D) f32 centroids transiently:
# 16 MiB at B=8, H_kv=8, D=128, block=512, which is why the default is 256 (also faster
# on the CPU: 0.62 s against 0.86 s for turbo8v3 at T=4096).
DEFAULT_BLOCK = 256


def format_key(fmt) -> tuple:
    """A format object of the protocol by its class and parameters: callers make format
    objects afresh for every call, and what depends only on the format (which kernel serves
    it, its layout) is looked up by this. Turbo codecs compare by dim, bits and seed.

        >>> from kvserve.cache.turbo_codec import AffineFormat
        >>> format_key(AffineFormat(128, 4, 64)) == format_key(AffineFormat(128, 4, 64))
        True
    """
    return (type(fmt), getattr(fmt, "fmt", None), getattr(fmt, "codec", None),
            getattr(fmt, "dim", None), getattr(fmt, "bits", None), getattr(fmt, "group_size", None))


def group_queries(queries: mx.array, key_fmt, n_kv: int, scale: float,
                  key_scale: mx.array | None) -> mx.array:
    """(B, H_q, L, D) -> (B, H_kv, n_rep, L, D) f32, scaled and prepared for the key format.

        >>> group_queries(mx.ones((2, 6, 1, 4)), _Identity(), 3, 0.5, None).shape
        (2, 3, 2, 1, 4)
    """
    B, Hq, L, D = queries.shape
    q = queries.astype(F32).reshape(B, n_kv, Hq // n_kv, L, D) * scale
    return key_fmt.prepare_queries(q, key_scale)


def ungroup(out: mx.array, queries: mx.array) -> mx.array:
    """(B, H_kv, n_rep, L, D_v) f32 -> (B, H_q, L, D_v) in the queries' dtype."""
    B, Hq, L, _ = queries.shape
    return out.reshape(B, Hq, L, out.shape[-1]).astype(queries.dtype)


def grouped_sinks(sinks: mx.array, n_kv: int) -> mx.array:
    """One sink logit per query head (H_q,) -> (1, H_kv, n_rep, 1, 1) f32, against scores."""
    return sinks.astype(F32).reshape(1, n_kv, -1, 1, 1)


def attend_full(queries: mx.array, key_fmt, keys: tuple[mx.array, ...], value_fmt,
                values: tuple[mx.array, ...], scale: float, mask: Any,
                key_scale: mx.array | None = None, sinks: mx.array | None = None) -> mx.array:
    """One (B, H_kv, n_rep, L, T) f32 score matrix over the whole context; the same ops as
    ``attend_quantized`` / ``attend_encoded``. Fastest for short contexts on the CPU.

    ``sinks`` (H_q,): a logit per query head that joins each softmax as one more column
    and carries no value (gpt-oss), as in ``mx.fast.scaled_dot_product_attention``."""
    Hkv, T = keys[0].shape[1], keys[0].shape[2]
    q = group_queries(queries, key_fmt, Hkv, scale, key_scale)
    s = key_fmt.scores(q, keys)  # (B, H_kv, R, L, T)
    s = apply_mask(s, grouped_mask(mask, Hkv, q.shape[2], q.shape[3], T))
    if sinks is not None:
        sink = mx.broadcast_to(grouped_sinks(sinks, Hkv), (*s.shape[:-1], 1))
        p = mx.softmax(mx.concatenate([s, sink], axis=-1), axis=-1, precise=True)[..., :T]
    else:
        p = mx.softmax(s, axis=-1, precise=True)
    return ungroup(value_fmt.finish(value_fmt.accumulate(p, values)), queries)


def block_mask(mask: Any, n_kv: int, n_rep: int, L: int, T: int, start: int,
               stop: int) -> mx.array | None:
    """The mask restricted to key slots [start, stop), broadcasting against the block's
    (B, H_kv, n_rep, L, stop - start) scores. "causal" is built for the block only: query
    i sits at position T - L + i.

        >>> block_mask("causal", 1, 1, 2, 5, 3, 5).tolist()
        [[True, False], [True, True]]
    """
    if isinstance(mask, str) and mask == "causal":
        if L == 1:
            return None
        return mx.arange(T - L, T)[:, None] >= mx.arange(start, stop)[None]  # (L, stop - start)
    g = grouped_mask(mask, n_kv, n_rep, L, T)  # a reshape of the caller's mask, no copy
    if g is None or g.shape[-1] == 1:
        return g
    return g[..., start:stop]


def _block(arrays: tuple[mx.array, ...], start: int, stop: int) -> tuple[mx.array, ...]:
    return tuple(a[:, :, start:stop] for a in arrays)  # (B, H_kv, stop - start, W)


def online_step(state: tuple[mx.array, mx.array, mx.array] | None, s: mx.array, value_fmt,
                values: tuple[mx.array, ...]) -> tuple[mx.array, mx.array, mx.array]:
    """One block of the online softmax: (m, l, acc) and masked scores s (..., L, t) ->
    the new (m, l, acc). ``state`` None starts the recurrence (no rescaling)."""
    block_max = s.max(axis=-1, keepdims=True)  # (B, H_kv, R, L, 1)
    m = block_max if state is None else mx.maximum(state[0], block_max)
    p = mx.exp(s - m)
    pv = value_fmt.accumulate(p, values)  # (B, H_kv, R, L, D_v), the format's basis
    if state is None:
        return m, p.sum(axis=-1, keepdims=True), pv
    alpha = mx.exp(state[0] - m)  # rescales what earlier blocks summed under a smaller max
    return m, alpha * state[1] + p.sum(axis=-1, keepdims=True), alpha * state[2] + pv


def attend_blockwise(queries: mx.array, key_fmt, keys: tuple[mx.array, ...], value_fmt,
                     values: tuple[mx.array, ...], scale: float, mask: Any,
                     key_scale: mx.array | None = None, block: int = DEFAULT_BLOCK,
                     sinks: mx.array | None = None) -> mx.array:
    """Attention of (B, H_q, L, D) queries over T stored tokens, ``block`` tokens at a time.

    At most one block's scores (B, H_kv, n_rep, L, block) and one block's transient
    decode (the format's) exist at once, besides the (B, H_q, L, D_v) accumulator. With
    T = 1100 and block = 512 the blocks are [0, 512), [512, 1024), [1024, 1100).
    """
    Hkv, T = keys[0].shape[1], keys[0].shape[2]
    if T == 0:
        raise ValueError("attention over an empty context")
    q = group_queries(queries, key_fmt, Hkv, scale, key_scale)
    R, L = q.shape[2], q.shape[3]
    state = None
    for start in range(0, T, block):
        stop = min(start + block, T)
        s = key_fmt.scores(q, _block(keys, start, stop))  # (B, H_kv, R, L, stop - start)
        s = apply_mask(s, block_mask(mask, Hkv, R, L, T, start, stop))
        state = online_step(state, s, value_fmt, _block(values, start, stop))
        if stop < T:
            # Without this, MLX schedules every block's transient decode before the first
            # one is consumed and the peak is that of the full path (297 MiB against 100
            # for turbo8v3 at T=4096, block 512).
            mx.eval(state)
    m, l, acc = state
    if sinks is not None:  # the sink joins the softmax's sum as a block of one valueless slot
        sink = grouped_sinks(sinks, Hkv)
        top = mx.maximum(m, sink)
        alpha = mx.exp(m - top)
        l, acc = alpha * l + mx.exp(sink - top), alpha * acc
    return ungroup(value_fmt.finish(acc / l), queries)


def attend_dense(queries: mx.array, key_fmt, keys: tuple[mx.array, ...], value_fmt,
                 values: tuple[mx.array, ...], scale: float, mask: Any,
                 key_scale: mx.array | None = None, sinks: mx.array | None = None) -> mx.array:
    """Decode the whole context to the queries' dtype, then MLX's fused SDPA: a GPU's path
    for calls no fused kernel serves (prompt chunks of more than 256 queries over stored
    codes). It holds one dense copy of the layer's K/V at a time, as an fp16 cache
    would, and the attention is then what a model of that dtype computes over such a cache.
    (The blockwise walk would keep memory bounded, but on a GPU it runs on the CPU stream:
    MLX's CUDA ``quantized_matmul`` takes no f32 activations.)

        >>> from kvserve.cache.turbo_codec import AffineFormat
        >>> fmt, x = AffineFormat(64, 8, 64), mx.random.normal((1, 2, 40, 64))
        >>> q = mx.random.normal((1, 4, 20, 64))
        >>> out = attend_dense(q, fmt, fmt.encode(x), fmt, fmt.encode(x), 0.125, "causal")
        >>> want = attend_blockwise(q, fmt, fmt.encode(x), fmt, fmt.encode(x), 0.125, "causal")
        >>> out.shape, bool(mx.abs(out - want).max() < 1e-4)
        ((1, 4, 20, 64), True)
    """
    k = key_fmt.decode(keys, key_scale).astype(queries.dtype)
    v = value_fmt.decode(values).astype(queries.dtype)
    if sinks is not None:  # MLX's SDPA takes sinks only in a type that promotes to the output's
        sinks = sinks.astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


class _Identity:
    """A key format that leaves queries as they are (for the examples above)."""

    def prepare_queries(self, q: mx.array, scale: mx.array | None = None) -> mx.array:
        return q
