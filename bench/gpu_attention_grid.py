"""Every CUDA attention kernel against the reference, over a grid of shapes, on an NVIDIA GPU.

    python bench/gpu_attention_grid.py [--schemes affine4,turbo8v3] [--quick] [--out FILE.md]

Grid per scheme: D in {64, 128, 256} x T in {1, 63, 64, 65, 4096} x L in {1, 4} (plus L=16
at T=65), with (B, query heads, KV heads, activation dtype, left padding) cycled over
B 1/3, groups (n_rep) 1/2/3/4/8 with up to 32 query heads, f16/bf16/f32, so every value of
each appears with every scheme. The kernel runs on the GPU (``attend_cuda``, called
directly, no dispatch); the reference is ``attend_full`` on the CPU stream over the same
stored parts, in f32. Output: one line per case and a per-scheme summary (markdown).

Storage cycles too: parts as quantized (contiguous), as a cache holds them (the first T slots
of a buffer with spare room: packed rows, larger head strides), and with rows not packed
(stored token-major and viewed head-major, so the token stride is H_kv rows): the kernels take
a compile-time-stride path for packed rows and a run-time-stride path otherwise.

Tolerances (max abs difference, outputs of unit scale): the queries' dtype rounds both
results, so f16 4e-3 and bf16 3e-2 (about one ulp, as in tests/test_kernels.py); f32 2e-4
(turbo formats rotate queries and un-rotate outputs with f32 matmuls on the GPU, which
differ from the CPU's by ~1e-4 relative).
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
from kvserve.cache import parse_scheme
from kvserve.cache.affine import QuantizedFormat, quantize_parts
from kvserve.cache.base import causal_mask
from kvserve.cache.turbo_codec import make_format
from kvserve.kernels.cuda_attention import attend_cuda, family
from kvserve.kernels.reference import attend_full

SCHEMES = ("affine4", "affine4-g32", "affine4-g128", "affine8", "affine8-g32", "affine8-g128",
           "mxfp4", "turbo0v4", "turbo0v3", "turbo0v2", "turbo8v4", "turbo8v3", "turbo8v2",
           "turbo4", "turbo4v2", "turbo3", "turbo2")
TOL = {mx.float32: 2e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}
# (B, n_rep, H_kv, dtype, left-padded): query heads = n_rep * H_kv <= 32.
COMBOS = [(1, 1, 4, mx.float32, False), (3, 2, 4, mx.float16, True), (1, 3, 4, mx.bfloat16, False),
          (3, 4, 8, mx.float32, True), (1, 8, 4, mx.float16, False), (3, 8, 2, mx.bfloat16, True),
          (3, 1, 2, mx.float16, False), (1, 4, 2, mx.float32, False), (3, 3, 2, mx.float32, True),
          (1, 2, 8, mx.bfloat16, False)]


def grid(quick: bool) -> list[tuple[int, int, int]]:
    """(D, T, L) cases of one scheme."""
    if quick:
        return [(128, 4096, 1), (64, 65, 4), (256, 63, 1)]
    cases = [(D, T, L) for D in (64, 128, 256) for T in (1, 63, 64, 65, 4096) for L in (1, 4)
             if L <= T]
    return cases + [(128, 65, 16), (64, 4096, 16)]


def _rand(shape, seed, dtype):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def make_case(name: str, B: int, R: int, Hkv: int, D: int, T: int, L: int, dtype, seed: int):
    """(queries, key fmt, key parts, value fmt, value parts, key_scale) as a cache stores them."""
    scheme = parse_scheme(name)
    q = _rand((B, Hkv * R, L, D), seed, dtype)
    k, v = _rand((B, Hkv, T, D), seed + 1, dtype) * 2, _rand((B, Hkv, T, D), seed + 2, dtype)
    if scheme.values.kind != "turbo":
        kp, vp = tuple(quantize_parts(k, scheme.keys)), tuple(quantize_parts(v, scheme.values))
        return q, QuantizedFormat(scheme.keys), kp, QuantizedFormat(scheme.values), vp, None
    kf, vf = make_format(scheme.keys, D), make_format(scheme.values, D)
    key_scale = None
    if scheme.keys.kind == "turbo":  # a calibrated key basis: queries are scaled too
        key_scale = 0.5 + mx.random.uniform(shape=(B, 1, 1, D), key=mx.random.key(seed + 3))
    return q, kf, tuple(kf.encode(k, key_scale)), vf, tuple(vf.encode(v)), key_scale


STORAGE = ("contiguous", "cache view", "not packed")


def store(parts: tuple[mx.array, ...], kind: str) -> tuple[mx.array, ...]:
    """The same (B, H, T, W) values laid out as ``kind`` says (see the module docstring)."""
    if kind == "cache view":
        return tuple(mx.pad(p, [(0, 0), (0, 0), (0, 7), (0, 0)])[:, :, : p.shape[2]] for p in parts)
    if kind == "not packed":
        return tuple(mx.contiguous(p.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for p in parts)
    return parts


def mask_for(B: int, L: int, T: int, padded: bool):
    """Left padding of up to 5 slots (never a whole row) or "causal"/None unpadded."""
    if not padded:
        return "causal" if L > 1 else None
    pads = [0, min(5, T - L), min(2, T - L)][:B]
    return causal_mask(L, T - L, mx.array(pads))


def run_case(name, D, T, L, combo, seed, storage="contiguous") -> dict:
    B, R, Hkv, dtype, padded = combo
    padded = padded and B > 1
    q, kf, kp, vf, vp, ks = make_case(name, B, R, Hkv, D, T, L, dtype, seed)
    kp, vp = store(kp, storage), store(vp, storage)
    mask, scale = mask_for(B, L, T, padded), D ** -0.5
    mx.eval(q, kp, vp, ks) if ks is not None else mx.eval(q, kp, vp)
    t0 = time.perf_counter()
    got = attend_cuda(q, kf, kp, vf, vp, scale, mask, ks)
    mx.eval(got)
    gpu_s = time.perf_counter() - t0  # includes the JIT compile on a kernel's first use
    with mx.stream(mx.cpu):
        want = attend_full(q.astype(mx.float32), kf, kp, vf, vp, scale, mask, ks)
        mx.eval(want)
    diff = mx.max(mx.abs(got.astype(mx.float32) - want)).item()
    ok = got.dtype == dtype and got.shape == q.shape and diff <= TOL[dtype]
    return {"scheme": name, "B": B, "Hq": R * Hkv, "Hkv": Hkv, "D": D, "T": T, "L": L,
            "dtype": str(dtype).split(".")[-1], "mask": "padded" if padded else str(mask),
            "storage": storage, "max_abs_diff": diff, "ok": ok, "first_call_s": round(gpu_s, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--quick", action="store_true", help="3 shapes per scheme")
    p.add_argument("--out", default="", help="also write the markdown report here")
    args = p.parse_args(argv)
    mx.set_default_device(mx.gpu)
    lines, summary, i = [], {}, 0
    head = ("scheme", "B", "Hq", "Hkv", "D", "T", "L", "dtype", "mask", "storage", "max_abs_diff", "ok")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in args.schemes.split(","):
        s = parse_scheme(name)
        group = max(s.keys.group_size, s.values.group_size)
        for D, T, L in grid(args.quick):
            if group and D % group:  # e.g. affine4-g128 at D=64: no such cache exists
                continue
            combo, storage = COMBOS[i % len(COMBOS)], STORAGE[i % len(STORAGE)]
            i += 1
            try:
                r = run_case(name, D, T, L, combo, seed=i, storage=storage)
            except Exception as exc:  # noqa: BLE001 (a case that fails to run is a failed case)
                r = {"scheme": name, "B": combo[0], "Hq": combo[1] * combo[2], "Hkv": combo[2],
                     "D": D, "T": T, "L": L, "dtype": str(combo[3]).split(".")[-1], "mask": "",
                     "storage": storage,
                     "max_abs_diff": f"error: {str(exc)[:200]}", "ok": False}
            lines.append("| " + " | ".join(_fmt(r[c]) for c in head) + " |")
            print(lines[-1], flush=True)
            if args.out:  # case by case, so a run cut short still leaves its rows
                with open(args.out, "a") as fh:
                    fh.write(lines[-1] + "\n")
            fam = summary.setdefault(name, [0, 0, 0.0, family_of(s, D)])
            fam[0] += r["ok"]
            fam[1] += 1
            if isinstance(r["max_abs_diff"], float):
                fam[2] = max(fam[2], r["max_abs_diff"])
    out = ["| scheme | kernel family | passed | max abs diff |", "|---|---|---|---|"]
    out += [f"| {n} | {f} | {ok}/{n_} | {d:.2e} |" for n, (ok, n_, d, f) in summary.items()]
    report = "\n".join([f"device: {mx.default_device()}, mlx {mx.__version__}", ""] + out + [""]
                       + lines)
    print("\n".join(out))
    if args.out:  # the whole report replaces the rows written along the way
        with open(args.out, "w") as fh:
            fh.write(report + "\n")
    return 0 if all(ok == n for ok, n, _, _ in summary.values()) else 1


def family_of(scheme, D: int) -> str:
    _, kf, _, vf, _, _ = make_case(scheme.name, 1, 1, 1, D, 1, 1, mx.float16, 0)
    return family(kf, vf) or "reference"


def _fmt(x) -> str:
    return f"{x:.2e}" if isinstance(x, float) else str(x)


if __name__ == "__main__":
    sys.exit(main())
