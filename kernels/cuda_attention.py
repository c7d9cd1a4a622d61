"""Fused attention over stored K/V on NVIDIA GPUs (``mx.fast.cuda_kernel``), L <= 256.

``attend_cuda`` has the signature of ``kvserve.kernels.dispatch.attend`` and serves affine
4/8-bit keys and values (groups 32/64/128), mxfp4, and the TurboQuant schemes (raw,
affine-8 or turbo keys; turbo values) at head_dim 64, 128 or 256. Anything else (other
formats, L > 256, other head dims) goes to the dense reference.

One call = two kernels:

    split pass   (row tiles, S splits, B * H_kv) blocks, each over ~T / S tokens, writes
                 o_part (S, B*H_kv, R*L, D) f32 and ml_part (S, B*H_kv, R*L, 2) f32 (max, sum)
    merge        out (B, H_q, L, D): the splits' partial softmaxes combined

The split pass is the tensor-core pass (``kvserve.kernels.cuda_mma_source``) for f16 / bf16
queries over affine, mxfp4 or raw keys and affine, mxfp4 or turbo values, and the f32 pass
(``kvserve.kernels.cuda_source``) otherwise: f32 queries, turbo keys.

Worked example: B=8, 32 query heads over 8 KV heads (R=4), D=128, L=1, T=32768, f16. The 4
query rows of a KV head fit one 8-row tile; 64 (b, h) pairs x 12 splits = 768 blocks of 2
warps, each warp walking steps of 16 tokens (``mma_plan``). Each block reads its tokens' K/V
once.

Turbo keys score against rotated queries (``prepare_queries``, a small MLX matmul before
the kernel); turbo values are accumulated in their rotated basis and un-rotated once after
the merge (``finish``), exactly as the reference does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from kvserve.kernels.cuda_programs import cuda_kernel
from kvserve.kernels.cuda_source import (
    CORE_HEADER,
    HEADER,
    merge_body,
    NT,
    ROTATE_BODY,
    TT,
    split_source,
)
from kvserve.kernels.cuda_layout import (
    ROW_SPANS,
    Layout,
    kernel_name,
    layout_of,
    mask4,
    mask_kind,
    part_widths,
    row_spans,
)
from kvserve.kernels.cuda_mma_header import MMA_HEADER
from kvserve.kernels.cuda_mma_source import mma_source
from kvserve.kernels.reference import attend_dense, format_key

HEAD_DIMS = (64, 128, 256)
# Decode and verify steps, and prompt chunks up to 256 queries: a question or a new turn
# after a cached prefix, the end of a prompt. MLX's fused SDPA on CUDA (the reference's last
# step) builds a cuDNN graph for each new (L, T, strides): 57-83 ms on an H200, against
# 0.3-0.5 ms for a shape it has seen (``bench/gpu_first_calls.py --chunks``), and nearly
# every such chunk is a new shape. These kernels take L at run time: 0.3-1.5 ms from 20 to
# 256 queries over 4K-14K tokens (8B shape), new or not. Each 8-query-row tile reads the
# context again, so well past 256 queries a seen shape's cuDNN call wins by more than a
# graph costs, and long prompts' full chunks repeat their shapes.
MAX_L = 256
MAX_RB = 8  # query rows per block: the value accumulator is RB x 8 registers per thread
# Blocks to aim for: 132 SMs hold 3 blocks each (140-180 registers per thread), so this is
# ~5 waves; on an H200 at T=32K affine4 took 0.419 ms with 2048 against 0.433 with 1024.
TARGET_BLOCKS = 2048
V_BATCH = 8  # value-slice loads a thread issues before using the first (16 measured slower)
# The tensor-core pass: blocks to aim for, warps per block, 16-token tiles per warp step
# (``mma_plan``). At 160 registers per thread (affine4) an H100 SM holds 12 warps; the
# pass waits mostly on global loads, so it wants them all. Measured at T=32K (B=8, 8 KV
# heads, calls chained as in a model step), affine4 ms for blocks x warps: 256x2 0.277,
# 192x8 0.277, 512x4 0.301, 256x4 0.231, 384x4 0.231, 768x2 0.223. Two tiles per step
# need 243 registers (8 warps per SM) for no fewer instructions per token.
MMA_TARGET_BLOCKS = 768
MMA_WARPS = 2
MMA_STEP_TILES = 1
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y / gridDim.z (splits / B * H_kv)
MAX_ELEMS = (1 << 31) - 1  # MLX passes grid sizes as int: the merge launches B*H_q*L*D threads
F32 = mx.float32


@dataclass(frozen=True)
class Plan:
    """Launch shape of the split pass: RB rows per block, ``row_tiles`` x ``splits``
    x (B * H_kv) blocks of NT threads."""

    rb: int
    row_tiles: int
    splits: int

    @property
    def rbp(self) -> int:
        return -(-self.rb // 4) * 4


def plan(bh: int, rows: int, T: int, target: int = TARGET_BLOCKS) -> Plan:
    """Rows per block and the number of context splits.

    Each split takes ``per`` whole tiles of TT tokens; the kernel re-derives ``per`` as
    ceil(tiles / splits), so only split counts for which that round trip holds are used.

        >>> plan(64, 4, 32768)
        Plan(rb=4, row_tiles=1, splits=32)
        >>> plan(3, 12, 65)
        Plan(rb=6, row_tiles=2, splits=1)
    """
    row_tiles = -(-rows // MAX_RB)
    rb = 4 if rows <= 4 else -(-rows // row_tiles)  # 4 or more: one compiled kernel for 1-4
    tiles = -(-T // TT)
    want = max(1, min(tiles, -(-target // (bh * row_tiles))))
    for s in range(want, 0, -1):
        per = -(-tiles // s)
        splits = -(-tiles // per)
        if -(-tiles // splits) == per:
            return Plan(rb, row_tiles, splits)
    return Plan(rb, row_tiles, 1)


@functools.cache
def _split_kernel(key: Layout, value: Layout, mask: int):
    names = ["q", "sc"] + [f"k{i}" for i in range(key.n_parts)] + \
        [f"v{i}" for i in range(value.n_parts)]
    names += ["mask"] * (mask >= 2)
    names += ["klut_in"] * (key.kind == "turbo") + ["vlut_in"] * (value.kind == "turbo")
    # The JIT cache is keyed by name + template arguments: the name carries the formats and
    # a digest of the source and argument names; the template, shapes and dtypes.
    tag = f"{key.kind}{key.bits}g{key.group}_{value.kind}{value.bits}g{value.group}_m{mask}"
    source = split_source(key, value, mask)
    return cuda_kernel(
        name=kernel_name(f"kvs_attn_split_{tag}", HEADER, source, *names),
        input_names=names, output_names=["o_part", "ml_part"],
        source=source, header=HEADER, ensure_row_contiguous=False)


@functools.cache
def _mma_kernel(key: Layout, value: Layout, mask: int, kfast: bool, vfast: bool,
                consts: tuple[tuple[str, Any], ...]):
    """The tensor-core split pass with its compile-time constants written into the source
    (``constexpr`` / ``using`` lines) instead of passed as template arguments: the source is
    built once per shape family here, where MLX would convert and format every template
    argument again on each call of the kernel."""
    names = ["q", "sc"] + [f"k{i}" for i in range(key.n_parts)] + \
        [f"v{i}" for i in range(value.n_parts)]
    names += ["mask"] * (mask >= 2) + ["vlut_in"] * (value.kind == "turbo")
    tag = f"{key.kind}{key.bits}g{key.group}_{value.kind}{value.bits}g{value.group}_m{mask}"
    tag += f"_f{int(kfast)}{int(vfast)}"
    lines = [f"  using {k} = {_C_TYPES[v]};" if isinstance(v, mx.Dtype) else f"  constexpr int {k} = {v};"
             for k, v in consts]
    source = "\n".join(lines) + "\n" + mma_source(key, value, mask, kfast, vfast)
    # The f32 pass's chunk decoders only where the source calls one (affine codes decoded
    # through f32: scales not in the queries' dtype).
    header = (HEADER if "kvs::affine_chunk" in source else CORE_HEADER) + MMA_HEADER
    return cuda_kernel(
        name=kernel_name(f"kvs_attn_mma_{tag}", header, source, *names),
        input_names=names, output_names=["o_part", "ml_part"],
        source=source, header=header, ensure_row_contiguous=False)


_C_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
            mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.bool_: "bool", mx.int32: "int32_t"}


@functools.cache
def _merge_kernel(sinks: bool = False):
    body = merge_body(sinks)
    return cuda_kernel(name=kernel_name("kvs_attn_merge", body),
                               input_names=["o_part", "ml_part", *(["sink_rows"] if sinks else [])],
                               output_names=["out"], source=body)


@functools.cache
def _scalar(x: float) -> mx.array:
    """Softmax scale as a one-element array, built once per value (the kernel reads it
    instead of baking it into the source, so one compiled kernel serves every scale)."""
    a = mx.array([x], dtype=F32)
    mx.eval(a)
    return a


@functools.cache
def _rotate_kernel():
    return cuda_kernel(name=kernel_name("kvs_rotate", ROTATE_BODY), input_names=["x", "m"],
                               output_names=["out"], source=ROTATE_BODY)


@functools.cache
def _pi_t(codec) -> mx.array:
    """Pi transposed, contiguous: queries rotate as q @ Pi.T (one per codec)."""
    t = mx.contiguous(codec.pi.T)
    mx.eval(t)
    return t


def _rotate(x: mx.array, m: mx.array) -> mx.array:
    """x (..., D) f32 @ m (D, D) with f32 FMAs; returns (N, D), N = x.size / D."""
    D = m.shape[0]
    n = x.size // D
    (out,) = _rotate_kernel()(inputs=[x.reshape(n, D), m], grid=(n * D, 1, 1),
                              threadgroup=(256, 1, 1), output_shapes=[(n, D)],
                              output_dtypes=[F32])
    return out


def _lut(fmt) -> mx.array:
    return _centroids(fmt.codec)


@functools.cache
def _centroids(codec) -> mx.array:
    """A codec's centroids in f32, once per codec (codecs compare by dim, bits and seed)."""
    c = codec.centroids.astype(F32)
    mx.eval(c)
    return c


def supported(queries: mx.array, key: Layout | None, value: Layout | None) -> bool:
    _, _, L, D = queries.shape
    return (key is not None and value is not None and D in HEAD_DIMS and 1 <= L <= MAX_L
            and queries.dtype in (mx.float16, mx.bfloat16, F32))


_PART_DTYPES = {"affine": (mx.uint32, None, None), "mx": (mx.uint32, mx.uint8),
                "turbo": (mx.uint32, F32), "raw": (None,)}


def launchable(queries: mx.array, kl: Layout, vl: Layout, keys: tuple[mx.array, ...],
               values: tuple[mx.array, ...], mask: Any, key_fmt=None, value_fmt=None) -> bool:
    """Whether every global read and write of the kernels stays inside the arrays passed.

    The device code takes B, H_q, L and D from the queries and H_kv and T from the first
    key part, and indexes every other part, the mask and the outputs with them. So: all
    parts (B, H_kv, T, width) with the widths ``part_widths`` expects and 32-bit packed
    words; a mask whose dims are each 1 or the full (B, H_q, L, T); turbo codecs of
    dimension D with 2^bits centroids; grid sizes within CUDA's and MLX's int limits.
    Anything else goes to the reference instead of reading past an array's end.
    """
    B, Hq, L, D = queries.shape
    parts = (*keys, *values)
    if any(a.ndim != 4 for a in parts):
        return False
    Hkv, T = keys[0].shape[1], keys[0].shape[2]
    if any(tuple(a.shape[:3]) != (B, Hkv, T) for a in parts):
        return False
    for layout, arrays in ((kl, keys), (vl, values)):
        if len(arrays) != layout.n_parts:
            return False
        if [a.shape[3] for a in arrays] != part_widths(layout, D):
            return False
        if layout.kind in ("affine", "turbo") and layout.words != part_widths(layout, D)[0]:
            return False
        for a, dt in zip(arrays, _PART_DTYPES[layout.kind]):
            if dt is not None and a.dtype != dt:
                return False
    for layout, fmt in ((kl, key_fmt), (vl, value_fmt)):
        codec = getattr(fmt, "codec", None)
        if layout.kind == "turbo" and codec is not None and (
                codec.dim != D or codec.centroids.size != 1 << layout.bits):
            return False
    if B * Hkv > MAX_GRID_YZ or B * Hq * L * D > MAX_ELEMS or T > MAX_ELEMS - TT:
        return False
    return mask is None or isinstance(mask, str) or (mask.ndim <= 4 and _mask_fits(mask, queries.shape, T))


def attend_cuda(queries: mx.array, key_fmt, keys: tuple[mx.array, ...], value_fmt,
                values: tuple[mx.array, ...], scale: float, mask: Any,
                key_scale: mx.array | None = None, sinks: mx.array | None = None) -> mx.array:
    """Attention of (B, H_q, L, D) queries over stored K/V parts (B, H_kv, T, W): the
    fused kernels where they apply, else the dense reference (``attend_dense``). Returns
    the queries' dtype, (B, H_q, L, D). ``sinks`` (H_q,) join the merge's softmax (``merge_body``).

    A decode step calls this once per layer with the same shapes but T, so what does not
    depend on T (formats, layouts, which pass, its compiled kernel and constants) is
    worked out once per shape family (``_family_plan``); per call remain the checks and
    the launch shape that involve T."""
    T = keys[0].shape[2]
    # A decode mask known by its rows' spans (a padded eager batch's): the
    # tensor-core pass reads one start per row and the end (mask kind 5); other passes, and
    # other masks, read the mask itself.
    spans = row_spans(mask, queries.shape[0]) if queries.shape[2] == 1 else None
    fam = None if spans is None else _family_plan(queries, key_fmt, keys, value_fmt, values,
                                                  ROW_SPANS, key_scale)
    if fam is None:
        fam = _family_plan(queries, key_fmt, keys, value_fmt, values, mask, key_scale)
    if fam is None or T == 0 or T > MAX_ELEMS - TT or any(a.shape[2] != T for a in (*keys, *values)) \
            or not _mask_fits(mask, queries.shape, T):
        # The GPU's reference path: the blockwise walk evaluates between blocks, which would
        # stall a decode step queued ahead on every layer.
        return attend_dense(queries, key_fmt, keys, value_fmt, values, scale, mask, key_scale, sinks=sinks)
    kl, vl, kind = fam.kl, fam.vl, fam.mask_kind
    mask_in = [spans] if kind == 5 else [mask4(mask)] if kind >= 2 else []
    if fam.mma is not None:
        o_part, ml_part = _mma_pass(queries, fam, keys, values, scale, mask_in, value_fmt)
    else:
        o_part, ml_part = _f32_pass(queries, kl, vl, keys, values, scale, kind, mask_in,
                                    key_fmt, value_fmt, key_scale)
    B, Hq, L, D = queries.shape
    turbo_v = vl.kind == "turbo"
    out_dtype = F32 if turbo_v else queries.dtype
    sink_in = [] if sinks is None else [mx.contiguous(mx.broadcast_to(
        sinks.astype(F32)[None, :, None], (B, Hq, L)))]  # (B, H_q, L): one per merged row
    (out,) = _merge_kernel(sinks is not None)(
        inputs=[o_part, ml_part, *sink_in], template=[("OT", out_dtype)], grid=(B * Hq * L * D, 1, 1),
        threadgroup=(256, 1, 1), output_shapes=[(B, Hq, L, D)], output_dtypes=[out_dtype])
    if turbo_v:  # one inverse rotation of the merged accumulator (``value_fmt.finish``)
        out = _rotate(out, value_fmt.codec.pi).reshape(B, Hq, L, D).astype(queries.dtype)
    return out


@dataclass(frozen=True)
class FamilyPlan:
    """What ``attend_cuda`` decides once per shape family (everything but T): the layouts,
    the mask kind and, for the tensor-core pass, its kernel and constants."""

    kl: Layout
    vl: Layout
    mask_kind: int
    mma: Any = None  # the compiled tensor-core kernel, or None for the f32 pass


def _parts_key(parts: tuple[mx.array, ...]) -> tuple:
    """Shapes without T (axis 2) and dtypes of stored parts."""
    return tuple((a.ndim, a.shape[:2], a.shape[3:], a.dtype) for a in parts)


def _mask_key(mask: Any) -> Any:
    return mask if mask is None or isinstance(mask, str) else (mask.ndim, mask.dtype)


def _mask_fits(mask: Any, q_shape: tuple, T: int) -> bool:
    """An array mask's dims are each 1 or the full (B, H_q, L, T) (see ``launchable``)."""
    if mask is None or isinstance(mask, str):
        return True
    B, Hq, L, _ = q_shape
    return all(n in (1, full) for n, full in zip(mask4(mask).shape, (B, Hq, L, T)))


_FAMILIES_MAX = 256  # shape families kept (a server sees a handful: one per batch shape)
_families: dict[tuple, FamilyPlan | None] = {}


def _family_plan(queries, key_fmt, keys, value_fmt, values, mask, key_scale) -> FamilyPlan | None:
    """The ``FamilyPlan`` of this call's shape family, or None when the kernels do not
    serve it (the reference does); computed on the family's first call."""
    key = (queries.shape, queries.dtype, _parts_key(keys), _parts_key(values), format_key(key_fmt),
           format_key(value_fmt), _mask_key(mask), key_scale is None)
    if key in _families:
        return _families[key]
    plan_ = _new_family_plan(queries, key_fmt, keys, value_fmt, values, mask)
    if len(_families) >= _FAMILIES_MAX:
        _families.clear()
    _families[key] = plan_
    return plan_


def _new_family_plan(queries, key_fmt, keys, value_fmt, values, mask) -> FamilyPlan | None:
    B, Hq, L, D = queries.shape
    q_dtype, Hkv = queries.dtype, keys[0].shape[1]
    kl, vl = layout_of(key_fmt, keys, D), layout_of(value_fmt, values, D)
    if not supported(queries, kl, vl) or Hq % Hkv \
            or not launchable(queries, kl, vl, keys, values, mask, key_fmt, value_fmt):
        return None
    kind = mask_kind(mask, L)
    if not tensor_cores(queries, kl, vl, keys):  # the f32 pass reads no raw values, no row starts
        return None if vl.kind == "raw" or kind == 5 else FamilyPlan(kl, vl, kind)
    rows = (Hq // Hkv) * L
    p = mma_plan(B * Hkv, rows, 1 << 20, D)  # T-independent fields only (nr, tm, warps)
    (kec, kvec), (vec, vvec) = chunking(kl, D // 4), chunking(vl, D // 8)
    kfast, vfast = fast_pairs(kl, keys, q_dtype), fast_pairs(vl, values, q_dtype)
    consts = [("D", D), ("NR", p.nr), ("TM", p.tm), ("NWP", p.warps), ("MASK", kind), ("ACT", q_dtype),
              ("KEC", kec), ("KVEC", kvec), ("KBITS", kl.bits), ("KGS", kl.group or 32),
              ("VEC", vec), ("VVEC", vvec), ("VBITS", vl.bits), ("VGS", vl.group or 32),
              ("VWORDS", max(vl.words, 1))]
    # Row widths of the parts: a part whose token stride equals its width is packed.
    consts += [(f"{role.upper()}{i}W", w) for role, layout in (("k", kl), ("v", vl))
               for i, w in enumerate(part_widths(layout, D))]
    inputs = [q_dtype, F32, *(a.dtype for a in keys), *(a.dtype for a in values)]
    inputs += ([mx.int32] if kind == 5 else [mask.dtype] if kind >= 2 else []) + [F32] * (vl.kind == "turbo")
    consts += [(f"DT{i}", dt) for i, dt in enumerate(inputs)]
    return FamilyPlan(kl, vl, kind, _mma_kernel(kl, vl, kind, kfast, vfast, tuple(consts)))


def _f32_pass(queries, kl, vl, keys, values, scale, kind, mask_in, key_fmt, value_fmt, key_scale):
    """The f32 split pass (``cuda_source``): any query dtype, turbo keys included."""
    B, Hq, L, D = queries.shape
    Hkv, T = keys[0].shape[1], keys[0].shape[2]
    R = Hq // Hkv
    q = queries
    if kl.kind == "turbo":  # rotate once (and fold in the key calibration), f32
        q = _rotate(queries.astype(F32), _pi_t(key_fmt.codec)).reshape(B, Hkv, R, L, D)
        q = (q if key_scale is None else q * key_scale[:, :, None]).reshape(B, Hq, L, D)
    inputs = [q, _scalar(float(scale)), *keys, *values, *mask_in]
    if kl.kind == "turbo":
        inputs.append(_lut(key_fmt))
    if vl.kind == "turbo":
        inputs.append(_lut(value_fmt))
    p = plan(B * Hkv, R * L, T)
    template = _template(kl, vl, D, p, kind, inputs)
    return _split_kernel(kl, vl, kind)(
        inputs=inputs, template=template, grid=(p.row_tiles * NT, p.splits, B * Hkv),
        threadgroup=(NT, 1, 1),
        output_shapes=[(p.splits, B * Hkv, R * L, D), (p.splits, B * Hkv, R * L, 2)],
        output_dtypes=[F32, F32])


def tensor_cores(queries: mx.array, kl: Layout, vl: Layout, keys: tuple[mx.array, ...]) -> bool:
    """Whether the tensor-core pass serves this call: f16/bf16 queries; keys affine, mxfp4
    or raw in the queries' dtype; values affine, mxfp4, turbo, or raw beside raw keys (an
    fp16 cache: K and V in one dtype)."""
    raw_keys = kl.kind == "raw" and keys[0].dtype == queries.dtype
    return (queries.dtype in (mx.float16, mx.bfloat16) and (kl.kind in ("affine", "mx") or raw_keys)
            and (vl.kind in ("affine", "mx", "turbo") or (vl.kind == "raw" and raw_keys)))


@dataclass(frozen=True)
class MmaPlan:
    """Launch shape of the tensor-core pass: ``nr`` 8-row query tiles and ``tm`` 16-token
    tiles per warp step; ``row_tiles`` x ``splits`` x (B * H_kv) blocks of ``warps`` warps."""

    nr: int
    tm: int
    row_tiles: int
    splits: int
    warps: int


def mma_plan(bh: int, rows: int, T: int, D: int, target: int = 0) -> MmaPlan:
    """Query tiles, tokens per step and context splits (each split a whole number of steps,
    at least one per warp where the context allows).

        >>> mma_plan(64, 4, 32768, 128)
        MmaPlan(nr=1, tm=1, row_tiles=1, splits=12, warps=2)
        >>> mma_plan(3, 12, 65, 256)
        MmaPlan(nr=1, tm=1, row_tiles=2, splits=3, warps=2)
    """
    target = target or MMA_TARGET_BLOCKS
    nr = 1 if rows <= 8 or D == 256 else 2  # D=256: two row tiles would not fit in registers
    tm, warps = 1 if D == 256 else MMA_STEP_TILES, MMA_WARPS
    row_tiles = -(-rows // (8 * nr))
    steps = -(-T // (16 * tm))
    want = max(1, min(-(-steps // warps), -(-target // (bh * row_tiles))))
    for s in range(want, 0, -1):
        per = -(-steps // s)
        splits = -(-steps // per)
        if -(-steps // splits) == per:
            return MmaPlan(nr, tm, row_tiles, splits, warps)
    return MmaPlan(nr, tm, row_tiles, 1, warps)


def chunking(layout: Layout, n: int) -> tuple[int, int]:
    """(elements per decode call, words per load) for a lane's run of ``n`` elements.

        >>> chunking(Layout("affine", 4, 64, 3, 16), 32), chunking(Layout("affine", 4, 32, 3, 8), 8)
        ((32, 4), (8, 1))
    """
    if layout.kind in ("raw", "turbo"):
        return n, 4
    ec = min(n, 32, layout.group or 32)
    wc = ec * layout.bits // 32
    for v in (4, 2):
        if wc % v == 0 and layout.words % v == 0:
            return ec, v
    return ec, 1


def fast_pairs(layout: Layout, parts: tuple[mx.array, ...], act: mx.Dtype) -> bool:
    """Whether codes become ``act`` pairs without f32, as pairs (p, p + 4) of each word
    (``pair_map``'s fast map): affine codes whose scales are in the queries' dtype, 4-bit, or
    8-bit into f16 (1024 + 255 is exact in f16 only) (``AffineRun``); mxfp4 codes into f16
    (``MxRun``)."""
    if layout.kind == "mx":
        return act == mx.float16
    return (layout.kind == "affine" and parts[1].dtype == act
            and (layout.bits == 4 or act == mx.float16))


def _mma_pass(queries, fam: FamilyPlan, keys, values, scale, mask_in, value_fmt):
    B, Hq, L, D = queries.shape
    Hkv, T = keys[0].shape[1], keys[0].shape[2]
    rows = (Hq // Hkv) * L
    inputs = [queries, _scalar(float(scale)), *keys, *values, *mask_in]
    if fam.vl.kind == "turbo":
        inputs.append(_lut(value_fmt))
    p = mma_plan(B * Hkv, rows, T, D)
    return fam.mma(
        inputs=inputs, grid=(p.row_tiles * p.warps * 32, p.splits, B * Hkv),
        threadgroup=(p.warps * 32, 1, 1),
        output_shapes=[(p.splits, B * Hkv, rows, D), (p.splits, B * Hkv, rows, 2)],
        output_dtypes=[F32, F32])


def _template(kl: Layout, vl: Layout, D: int, p: Plan, kind: int, inputs) -> list:
    """Compile-time constants; the input dtypes are listed too, because the JIT cache
    knows a kernel by name and template arguments only, and the signature's pointer
    types follow the dtypes."""
    consts = [("D", D), ("RB", p.rb), ("RBP", p.rbp), ("MASK", kind),
              ("KEC", kl.chunk), ("KBITS", kl.bits), ("KGS", kl.group or 32), ("KVEC", kl.vec),
              ("VBITS", vl.bits), ("VGS", vl.group or 32), ("VW", max(vl.words, 1)), ("VBATCH", V_BATCH)]
    first_value = 2 + kl.n_parts  # inputs: q, scale, key parts, value parts, ...
    names = [("DT_V0", inputs[first_value].dtype)]
    if vl.n_parts > 1:
        names.append(("DT_V1", inputs[first_value + 1].dtype))
    return consts + names + [(f"DT{i}", a.dtype) for i, a in enumerate(inputs)]


def cuda_ready() -> bool:
    """True where MLX has its CUDA backend and a device."""
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:  # an MLX without the cuda module
        return False


def family(key_fmt, value_fmt) -> str | None:
    """Which kernel family serves this pair of formats (None: the reference does), by
    the format objects alone, as ``FusedKernel.supports`` sees them.

        >>> from kvserve.cache.affine import QuantizedFormat
        >>> from kvserve.cache.scheme import parse_scheme
        >>> s = parse_scheme("affine4-g32")
        >>> family(QuantizedFormat(s.keys), QuantizedFormat(s.values))
        'affine'
    """
    from kvserve.cache.affine import QuantizedFormat
    from kvserve.cache.turbo_codec import AffineFormat, RawFormat, TurboFormat

    if isinstance(key_fmt, RawFormat) and isinstance(value_fmt, RawFormat):
        return "raw"
    if isinstance(key_fmt, QuantizedFormat) and isinstance(value_fmt, QuantizedFormat):
        k, v = key_fmt.fmt, value_fmt.fmt
        if k.mode == v.mode == "affine" and {k.bits, v.bits} <= {4, 8}:
            return "affine"
        return "mxfp4" if k.mode == v.mode == "mxfp4" else None
    if not isinstance(value_fmt, TurboFormat) or value_fmt.codec.bits not in (2, 3, 4):
        return None
    if isinstance(key_fmt, RawFormat):
        return "turbo-raw-keys"
    if isinstance(key_fmt, AffineFormat) and key_fmt.bits in (4, 8):
        return "turbo-affine-keys"
    if isinstance(key_fmt, TurboFormat) and key_fmt.codec.bits in (2, 3, 4):
        return "turbo-turbo-keys"
    return None


# "raw": an fp16 cache's K/V, served only where ``cache.fp16.attend_raw`` asks (a padded
# batch's decode, whose mask MLX's fused SDPA does not take on a GPU).
FAMILIES = ("affine", "mxfp4", "turbo-raw-keys", "turbo-affine-keys", "turbo-turbo-keys", "raw")
# Families the dispatch runs on an NVIDIA GPU without a first-call self-check. None: all
# first five passed the GPU grid on an H200 (mlx 0.32.4, 473 cases over 17 schemes) and
# compute-sanitizer's memcheck (0 errors), but one process that ran the grid later hit "an
# illegal memory access" whose cause was not isolated (docs/benchmarks/attention-gpu.md,
# "Memory safety"), so each family must match the reference on its first call first.
VERIFIED_ON_GPU: frozenset[str] = frozenset()


def kernel_specs() -> list[dict]:
    """One ``FusedKernel`` description per family (the dispatch builds and registers them).

        >>> [s["name"] for s in kernel_specs()][:2]
        ['cuda-affine', 'cuda-mxfp4']
    """
    def supports_for(name):
        return lambda kf, vf, L: L <= MAX_L and family(kf, vf) == name
    return [{"name": f"cuda-{name}", "supports": supports_for(name), "fn": attend_cuda,
             "verified": name in VERIFIED_ON_GPU} for name in FAMILIES]
