"""What the CUDA attention kernels know about a call at compile time: the layout of each
stored component, the mask kind, and the names kernels are compiled under.

Shared by the f32 split pass (``kvserve.kernels.cuda_source``), the tensor-core pass
(``kvserve.kernels.cuda_mma_source``) and their launcher (``kvserve.kernels.cuda_attention``).

    >>> from kvserve.cache.affine import QuantizedFormat
    >>> from kvserve.cache.scheme import parse_scheme
    >>> k = mx.zeros((1, 8, 4, 16), mx.uint32)
    >>> layout_of(QuantizedFormat(parse_scheme("affine4").keys), (k,), 128)
    Layout(kind='affine', bits=4, group=64, n_parts=3, words=16)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

F32 = mx.float32


@dataclass(frozen=True)
class Layout:
    """What the kernel must know, at compile time, about one stored component.

    kind "raw" / "affine" / "mx" (mxfp4) / "turbo"; ``bits``; ``group`` (affine group,
    32 for mxfp4, 0 otherwise); ``n_parts`` stored arrays; ``words`` uint32 per token row
    (0 for raw).

        >>> Layout("affine", 4, 64, 3, 16).chunk, Layout("turbo", 3, 0, 2, 12).chunk
        (32, 32)
    """

    kind: str
    bits: int
    group: int
    n_parts: int
    words: int

    @property
    def chunk(self) -> int:
        """Elements decoded per step of the scoring loop: 16 bytes of packed data (32
        elements for 3-bit turbo: 3 words, the period of the 3-bit stream)."""
        if self.kind == "raw":
            return 16 * 8 // self.bits
        return 32 if self.kind in ("mx", "turbo") or self.bits == 4 else 16

    @property
    def vec(self) -> int:
        """Words per load in the scoring loop (4: 16-byte loads), as alignment allows."""
        if self.kind == "raw":
            return 4
        per_chunk = self.chunk * self.bits // 32
        for v in (4, 2):
            if per_chunk % v == 0 and self.words % v == 0:
                return v
        return 1


def layout_of(fmt, parts: tuple[mx.array, ...], dim: int) -> Layout | None:
    """The ``Layout`` of a format object of the attention protocol, or None when the
    kernels do not read it (mxfp8, nvfp4, other bit widths)."""
    from kvserve.cache.affine import QuantizedFormat
    from kvserve.cache.turbo_codec import AffineFormat, RawFormat, TurboFormat

    if isinstance(fmt, QuantizedFormat):
        f = fmt.fmt
        if f.mode == "affine" and f.bits in (4, 8) and f.group_size in (32, 64, 128):
            return Layout("affine", f.bits, f.group_size, 3, dim * f.bits // 32)
        if f.mode == "mxfp4":
            return Layout("mx", 4, 32, 2, dim // 8)
        return None
    if isinstance(fmt, AffineFormat) and fmt.bits in (4, 8):
        return Layout("affine", fmt.bits, fmt.group_size, 3, dim * fmt.bits // 32)
    if isinstance(fmt, RawFormat) and parts[0].dtype in (mx.float16, mx.bfloat16, F32):
        return Layout("raw", 8 * parts[0].dtype.size, 0, 1, 0)
    if isinstance(fmt, TurboFormat) and fmt.codec.bits in (2, 3, 4):
        return Layout("turbo", fmt.codec.bits, 0, 2, fmt.codec.words)
    return None


def part_widths(layout: Layout, dim: int) -> list[int]:
    """Last-dim widths of the stored parts that the device code indexes up to, for head
    dimension ``dim`` (the kernels take D from the queries and read every part up to it).

        >>> part_widths(Layout("affine", 4, 64, 3, 16), 128), part_widths(Layout("turbo", 3, 0, 2, 12), 128)
        ([16, 2, 2], [12, 1])
    """
    if layout.kind == "raw":
        return [dim]
    if layout.kind == "affine":
        return [dim * layout.bits // 32, dim // layout.group, dim // layout.group]
    if layout.kind == "mx":
        return [dim // 8, dim // 32]
    return [-(-dim * layout.bits // 32), 1]


ROW_SPANS = "row spans"  # the family plan's marker for mask kind 5
_PADDED_MAX = 16  # masks remembered: one per decode step and batch, a handful live at once
_padded: dict[int, list] = {}


def note_left_padding(mask: mx.array, padding: list[int]) -> mx.array:
    """Remember that ``mask`` (B, 1, 1, T) hides exactly row b's first ``padding[b]`` slots,
    as a left-padded batch's decode mask does, so the kernels can read each row's span
    instead of the mask (``row_spans``). Returns ``mask``.

        >>> m = note_left_padding(mx.array([[[[False, True]]], [[[True, True]]]]), [1, 0])
        >>> row_spans(m, 2).tolist(), row_spans(mx.array(m), 2)
        ([1, 0, 2], None)
    """
    if len(_padded) >= _PADDED_MAX:
        _padded.pop(next(iter(_padded)))
    # The spans are built on first use (``row_spans``); the mask itself keeps its id unique.
    _padded[id(mask)] = [mask, len(padding), lambda: mx.array([*padding, mask.shape[-1]], dtype=mx.int32)]
    return mask


def row_spans(mask: Any, batch: int) -> mx.array | None:
    """(B + 1,) int32 for a mask ``note_left_padding`` saw: each row's first slot, then the
    slot every row ends before; else None. Built once per mask."""
    entry = _padded.get(id(mask)) if isinstance(mask, mx.array) else None
    if entry is None or entry[0] is not mask or entry[1] != batch:
        return None
    if callable(entry[2]):
        entry[2] = entry[2]()
    return entry[2]


def mask_kind(mask: Any, L: int) -> int:
    """0 none, 1 causal (computed in the kernel), 2 boolean array, 3 additive array,
    4 boolean array shared by every head and query: (B or 1, 1, 1, T), the mask of a
    left-padded batch's decode step. Kind 4 reads one value per token instead of one per
    score (the generic index costs more than the load; padding doubled affine4's time).
    5 (``ROW_SPANS``): such a mask known to show each row one span of slots, its first
    ones hidden by padding (``row_spans``); the kernel then reads row b's span only, from
    one int per row and one for the end.

        >>> mask_kind(None, 1), mask_kind("causal", 1), mask_kind("causal", 4)
        (0, 0, 1)
        >>> mask_kind(mx.ones((3, 1, 1, 9), mx.bool_), 1), mask_kind(mx.ones((3, 1, 4, 9), mx.bool_), 4)
        (4, 2)
        >>> mask_kind(ROW_SPANS, 1)
        5
    """
    if isinstance(mask, str) and mask == ROW_SPANS:
        return 5
    if mask is None or (isinstance(mask, str) and L == 1):
        return 0
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask '{mask}'")
        return 1
    if mask.dtype != mx.bool_:
        return 3
    shape = mask4(mask).shape
    return 4 if shape[1] == shape[2] == 1 else 2


def mask4(mask: mx.array) -> mx.array:
    """Any mlx-lm mask array as (B or 1, H_q or 1, L or 1, T), without a copy."""
    while mask.ndim < 4:
        mask = mask[None]
    return mask


def on_cuda() -> bool:
    """MLX computes on a CUDA GPU here (its default device is the GPU of the CUDA backend)."""
    try:
        return mx.default_device() == mx.gpu and bool(mx.cuda.is_available())
    except AttributeError:  # an MLX without the cuda module
        return False


def kernel_name(base: str, *texts: str) -> str:
    """``base`` plus a digest of the kernel's source text.

    MLX has known a compiled kernel by its name and template arguments only: earlier
    releases kept custom kernels in an on-disk PTX cache shared by every process of one MLX
    version and never invalidated (0.32 keeps them in memory, ``cuda_programs``). A name
    without the digest would load whatever binary an earlier process built under it, from
    whatever source that process had: different argument lists and indexing, hence
    out-of-bounds accesses. With the digest a changed source is a new name.

        >>> kernel_name("k", "a") != kernel_name("k", "b")
        True
    """
    return f"{base}_{hashlib.sha1(chr(0).join(texts).encode()).hexdigest()[:16]}"
