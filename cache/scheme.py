"""KV cache schemes: a name parsed once into a frozen ``KVScheme``.

A scheme says how keys and values are stored. Every cache file and every metric carries
``scheme.name`` and ``scheme.params()``, so nothing is ever loaded under the wrong scheme.

Grammar (anything else is refused with the list of valid names):
    fp16                          keys and values in the model's activation dtype
    affine8 | affine4 [-gN]       mx.quantize affine, group N in {32, 64, 128} (default 64)
    mxfp4 | mxfp8 | nvfp4         MLX block formats (groups of 32, 32, 16)
    turbo<K>v<V> | turbo<N>       TurboQuant: K in {0 raw, 8 affine8, 2-4 turbo}, V in {2, 3, 4};
                                  turbo<N> is turbo<N>v<N>. Accepted: turbo0v4 turbo0v3 turbo0v2
                                  turbo8v4 turbo8v3 turbo8v2 turbo4 turbo4v2 turbo3 turbo2

Example:
    >>> s = parse_scheme("turbo8v3")
    >>> (s.keys.kind, s.keys.bits, s.values.kind, s.values.bits, s.values.seed)
    ('affine', 8, 'turbo', 3, 43)
    >>> parse_scheme("affine4-g32").keys.group_size
    32
    >>> parse_scheme("turbo4").protect_boundary_layers
    True
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

KEY_SEED = 42  # TurboQuant rotation seeds: keys 42, values 43 (as in mlx-swift-lm)
VALUE_SEED = 43
AFFINE_GROUPS = (32, 64, 128)
MX_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}
TURBO_NAMES = ("turbo0v4", "turbo0v3", "turbo0v2", "turbo8v4", "turbo8v3", "turbo8v2",
               "turbo4", "turbo4v2", "turbo3", "turbo2")
SCHEME_NAMES = ("fp16", "affine8", "affine4", *MX_MODES, *TURBO_NAMES)


class UnknownScheme(ValueError):
    """A scheme name that does not parse; the message lists the valid names."""


@dataclass(frozen=True)
class ComponentFormat:
    """How one of keys or values is stored.

    ``kind``: "fp16" (activation dtype), "affine" / "mx" (``mx.quantize`` with ``mode``),
    or "turbo" (per-vector norm + rotated Lloyd-Max indices, rotation seeded by ``seed``).
    """

    kind: str
    bits: int
    group_size: int = 0
    mode: str = ""
    seed: int = 0


@dataclass(frozen=True)
class KVScheme:
    name: str
    keys: ComponentFormat
    values: ComponentFormat
    # Symmetric TurboQuant: per-dimension key calibration, first/last 2 layers kept at affine8.
    calibrate_keys: bool = False
    protect_boundary_layers: bool = False

    @property
    def quantized(self) -> bool:
        return self.name != "fp16"

    def params(self) -> dict[str, str]:
        """Every parameter as flat strings, for safetensors metadata and metric labels."""
        out = {"scheme": self.name, "calibrate_keys": str(self.calibrate_keys),
               "protect_boundary_layers": str(self.protect_boundary_layers)}
        for part, fmt in (("keys", self.keys), ("values", self.values)):
            out.update({f"{part}.{k}": str(v) for k, v in asdict(fmt).items()})
        return out


FP16 = ComponentFormat("fp16", 16)


def _affine(bits: int, group: int) -> ComponentFormat:
    return ComponentFormat("affine", bits, group, "affine")


def _turbo_part(bits: int, seed: int) -> ComponentFormat:
    if bits == 0:
        return FP16
    if bits == 8:
        return _affine(8, 64)
    return ComponentFormat("turbo", bits, 0, "", seed)


def _parse_turbo(name: str) -> KVScheme:
    k, v = re.fullmatch(r"turbo(\d)(?:v(\d))?", name).groups()
    kb, vb = int(k), int(v or k)
    fragile = 0 < kb < 8 or vb <= 2
    symmetric = 2 <= kb <= 4
    return KVScheme(name, _turbo_part(kb, KEY_SEED), _turbo_part(vb, VALUE_SEED),
                    calibrate_keys=symmetric, protect_boundary_layers=fragile)


def parse_scheme(name: str) -> KVScheme:
    """Parse a scheme name; raises ``UnknownScheme`` listing the valid names."""
    text = name.strip().lower()
    if text == "fp16":
        return KVScheme("fp16", FP16, FP16)
    if text in MX_MODES:
        bits, group = MX_MODES[text]
        fmt = ComponentFormat("mx", bits, group, text)
        return KVScheme(text, fmt, fmt)
    m = re.fullmatch(r"affine(4|8)(?:-g(\d+))?", text)
    if m and int(m.group(2) or 64) in AFFINE_GROUPS:
        bits, group = int(m.group(1)), int(m.group(2) or 64)
        canonical = f"affine{bits}" if group == 64 else f"affine{bits}-g{group}"
        return KVScheme(canonical, _affine(bits, group), _affine(bits, group))
    if text in TURBO_NAMES:
        return _parse_turbo(text)
    raise UnknownScheme(f"unknown KV scheme '{name}'; valid schemes: {', '.join(SCHEME_NAMES)} "
                        f"(affine schemes take -g32, -g64 or -g128)")
