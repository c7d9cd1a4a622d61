"""The fp16 family: keys and values stored as 16-bit floats: in the model's activation dtype
where that is float16 or bfloat16 (a GPU), as float16 where the model computes in float32
(the CPU), so the scheme stores what its name says on every device.

Parts per token: ``[keys (B, H_kv, T, D), values (B, H_kv, T, D_v)]``, so K+V cost
2 * H_kv * D * 2 bytes per token (512 B per KV head at D = 128).
Attention is ``mx.fast.scaled_dot_product_attention``, which maps grouped query heads to
KV heads itself and accepts mlx-lm's masks unchanged, except for short queries on a GPU,
and every call on the CPU:
  * on a GPU, one query per row in a half dtype under a boolean mask (a left-padded batch's
    decode step, a captured step's over the cache's capacity) takes the dispatch's kernel;
    under other mask arrays ``attend_grouped`` runs: MLX's fused decode kernel on CUDA takes
    no mask array, and the unfused path MLX then takes was 3x slower than ``attend_grouped``
    on an H100 (``bench/gpu_padded_attention.py``);
  * on a GPU, 2 to 256 queries in a half dtype (a verify step, a prompt, a question after
    a cached prefix), under any mask, take the dispatch's tensor-core kernel: MLX's SDPA
    builds a cuDNN graph for every new shape there, 57-83 ms on an H200, and every such chunk is
    one (``kvserve.kernels.cuda_attention.MAX_L``);
  * on the CPU the dispatch's CPU kernel runs (``kvserve.kernels.cpu_attention``): MLX's CPU
    SDPA is unfused (a matmul per head), and the kernel, which reads each token's K/V once
    for all the query heads that share it, is faster here (``bench/step_profile.py`` and
    ``kvserve bench-attention --device cpu`` measure both).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from kvserve.cache.base import BatchStoredKVCache, StoredKVCache
from kvserve.cache.buffer import DEFAULT_GRANULE
from kvserve.cache.registry import register
from kvserve.cache.scheme import KVScheme, parse_scheme

FP16_SCHEME = parse_scheme("fp16")
# The raw prefill of a quantized scheme (``PromptCache.for_model`` with ``quantize_after``):
# K/V kept as computed, so the prompt attends to itself exactly and its conversion to the
# scheme quantizes the values a cache of that scheme would have quantized directly.
RAW_PHASE = replace(FP16_SCHEME, keys=replace(FP16_SCHEME.keys, mode="as-computed"),
                    values=replace(FP16_SCHEME.values, mode="as-computed"))
# Queries per call up to which a masked call runs ``attend_grouped``: its scores are
# (B, H_q, L, T) f32, small for decoding, not for a prefill chunk.
GROUPED_MAX_L = 16


def attend_grouped(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                   mask: mx.array) -> mx.array:
    """Attention of queries (B, H_q, L, D) over K/V (B, H_kv, T, D) under a boolean or
    additive ``mask`` ((B or 1, H_q or 1,) L, T), reading K and V once, with nothing copied
    or broadcast. Each KV head's query group (group * L rows) is one operand: scores come
    out token-major, ``keys @ q^T`` (T, group * L), and the output as ``values^T @ probs``
    (D_v, group * L): on an H100 both forms were faster for so few query rows than the
    query-major products (``bench/gpu_padded_attention.py``). Softmax in f32.

        >>> q, k = mx.ones((1, 4, 1, 8)), mx.ones((1, 2, 3, 8))
        >>> v = mx.arange(6, dtype=mx.float32).reshape(1, 2, 3, 1) * mx.ones((1, 1, 1, 8))
        >>> attend_grouped(q, k, v, 0.5, mx.array([[[[False, True, True]]]]))[0, :, 0, 0].tolist()
        [1.5, 1.5, 4.5, 4.5]
        >>> attend_grouped(q, k, v, 0.5, mx.array([[False, True, True]]))[0, :, 0, 0].tolist()  # (L, T)
        [1.5, 1.5, 4.5, 4.5]
    """
    B, Hq, L, D = queries.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    rows = Hq // Hkv * L
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # a window's (L, T) mask: every row and head
    scores = keys @ (queries * scale).reshape(B, Hkv, rows, D).swapaxes(-1, -2)  # (B, H_kv, T, rows)
    m = mask.reshape(mask.shape[0], Hkv if mask.shape[1] > 1 else 1, -1, T).swapaxes(-1, -2)
    if 1 < m.shape[-1] < rows:  # one mask for every head over several queries: each group repeats it
        m = mx.tile(m, (1, 1, 1, rows // m.shape[-1]))
    scores = scores.astype(mx.float32)
    if m.dtype == mx.bool_:
        scores = mx.where(m, scores, mx.finfo(mx.float32).min)
    else:
        scores = scores + m
    probs = mx.softmax(scores, axis=-2).astype(values.dtype)
    out = values.swapaxes(-1, -2) @ probs  # (B, H_kv, D_v, rows)
    return out.swapaxes(-1, -2).reshape(B, Hq, L, values.shape[-1])


def as_16_bit(x: mx.array) -> mx.array:
    """float32 K/V as float16; 16-bit ones as they are.

        >>> as_16_bit(mx.ones((1, 2), dtype=mx.float32)).dtype, as_16_bit(mx.ones((1,), dtype=mx.bfloat16)).dtype
        (mlx.core.float16, mlx.core.bfloat16)
    """
    return x.astype(mx.float16) if x.dtype == mx.float32 else x


class FP16Codec:
    """Identity encoding; shared by the per-request and batch classes."""

    def check_scheme(self, scheme: KVScheme) -> None:
        if scheme.keys.kind != "fp16" or scheme.values.kind != "fp16":
            raise ValueError(f"{type(self).__name__} stores fp16 keys and values, not {scheme.name}")

    def n_parts(self) -> int:
        return 2

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        if self.scheme.keys.mode == "as-computed":  # RAW_PHASE
            return [keys, values]
        return [as_16_bit(keys), as_16_bit(values)]

    def present(self, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
        return parts[0], parts[1]  # (B, H_kv, S, D), (B, H_kv, S, D_v)

    def decode(self, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
        return parts[0].astype(mx.float32), parts[1].astype(mx.float32)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               mask: Any, sinks: mx.array | None = None) -> mx.array:
        return attend_raw(queries, keys, values, scale, mask, sinks)


def attend_raw(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
               sinks: mx.array | None = None) -> mx.array:
    """Attention over unencoded K/V (the fp16 cache, and a turbo cache before it compresses):
    on the CPU the fused kernel where the dispatch picks one (MLX's SDPA falls back to a chain
    of operations there); on a GPU, in a half dtype, a decode step under a boolean mask
    (``_masked_decode``) and a short chunk under any mask by the dispatch's kernels (module
    doc); other short masked calls by the grouped path (MLX's SDPA takes no array mask in its
    fused form there), else MLX's SDPA."""
    on_cpu = mx.default_device().type == mx.cpu
    if on_cpu or (_half(queries, keys) and (_masked_decode(mask, queries) or _short_chunk(mask, queries))):
        from kvserve.kernels import dispatch  # here: kvserve.kernels imports this package
        from kvserve.cache.turbo_codec import RawFormat

        kf, vf = RawFormat(keys.shape[-1]), RawFormat(values.shape[-1])
        fused = dispatch.choose(kf, vf, queries.shape[2], keys.shape[2]) not in ("full", "blockwise")
        if fused or not on_cpu:
            return dispatch.attend(queries, kf, (keys,), vf, (values,), scale, mask, sinks=sinks)
    if (isinstance(mask, mx.array) and queries.shape[2] <= GROUPED_MAX_L and sinks is None
            and mx.default_device().type == mx.gpu):
        return attend_grouped(queries, keys, values, scale, mask)
    # MLX's SDPA takes K/V in the queries' dtype: float32 queries over 16-bit K/V (a model
    # computing in float32) read them widened.
    keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _half(queries: mx.array, keys: mx.array) -> bool:
    """The tensor-core kernel reads raw K/V in the queries' dtype, a half one; float32
    queries take the grouped path, not the kernel's fallback (MLX's unfused masked SDPA,
    3x slower than the grouped path on an H100)."""
    return queries.dtype in (mx.float16, mx.bfloat16) and keys.dtype == queries.dtype


def _short_chunk(mask: Any, queries: mx.array) -> bool:
    """2 to ``MAX_L`` queries, under any mask: a shape MLX's CUDA SDPA would build a cuDNN
    graph for (module doc). Lone and batched prompts take the same kernel, so a prompt's
    attention does not change with the batch it is prefilled in (a left-padded batch's mask
    is an array).

        >>> q = mx.zeros((1, 4, 20, 64), mx.float16)
        >>> _short_chunk("causal", q), _short_chunk(mx.ones((20, 20), mx.bool_), q)
        (True, True)
        >>> _short_chunk("causal", q[:, :, :1]), _short_chunk("causal", mx.zeros((1, 4, 257, 64)))
        (False, False)
    """
    from kvserve.kernels.cuda_attention import MAX_L

    return 1 < queries.shape[2] <= MAX_L


def _masked_decode(mask: Any, queries: mx.array) -> bool:
    """One query per row under a boolean mask array: a padded batch's decode step (the kernel
    starts each row at its first slot where ``note_left_padding`` saw the mask), a window's,
    or a captured step's over its cache's capacity (``kvserve.cache.captured``), where the
    kernel reading the mask took 4.33 ms a step against the grouped path's 5.56 (default
    model, 8 rows of ~300 tokens, H200)."""
    return queries.shape[2] == 1 and isinstance(mask, mx.array) and mask.dtype == mx.bool_


class FP16KVCache(FP16Codec, StoredKVCache):
    def __init__(self, scheme: KVScheme = FP16_SCHEME, granule: int = DEFAULT_GRANULE):
        super().__init__(scheme, granule)


class BatchFP16KVCache(FP16Codec, BatchStoredKVCache):
    single_cls = FP16KVCache


register("fp16", FP16KVCache, BatchFP16KVCache)
