"""Do kvserve's CUDA kernels compile to the same PTX in two trees? Answered without a GPU.

Every program the kernels' wrappers would launch over a grid (7 schemes, head dims 64 and
128, f16 and f32 queries, every mask kind, sinks; f16 scales, which take the fast pair
decode; the few-rows matmul at 4 and 8 bits, groups 32-128, 1-64 rows; the affine encoder)
is captured with ``mx.fast.cuda_kernel`` replaced by a recorder, wrapped as MLX builds it
and compiled by NVRTC (``kernel_sass.wrap`` and ``nvrtc_ptx``; tools as ``kernel_sass.py``
says). Each program's PTX is hashed with the kernel's name and the unit's hash in internal
names taken out, keyed by the kernel's name without its source digest, its input dtypes,
template and compile-time constants, so the same program matches across trees.

    python bench/kernel_ptx.py --tools T/x/nvidia --out new.json
    PYTHONPATH=OLD_SRC python bench/kernel_ptx.py --tools T/x/nvidia --out old.json
    python bench/kernel_ptx.py --compare old.json new.json

(``OLD_SRC``: a folder whose ``kvserve`` holds links to an older checkout's ``configs``,
``server``, ``cache``, ``kernels`` and ``bench``.)
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
from kernel_sass import nvrtc_ptx, wrap  # noqa: E402


def capture() -> dict[str, tuple[str, str, int]]:
    """key -> (name, translation unit, bytes of header and source as MLX receives them)."""
    import mlx.core as mx

    programs: dict[str, tuple[str, str, int]] = {}

    def recorder(name, input_names, output_names, source, header="", **_):
        def call(inputs, template=(), output_shapes=(), output_dtypes=(), **__):
            base = re.sub(r"_[0-9a-f]{16}$", "", name)
            consts = [re.sub(r"//.*", "", line).strip() for line in source.splitlines()
                      if re.match(r"\s*(constexpr int|using) \w+ = ", line)]
            key = json.dumps([base, [str(a.dtype) for a in inputs], [(k, str(v)) for k, v in template or ()],
                              [str(d) for d in output_dtypes], consts])
            unit = wrap(name, header, source, input_names, inputs, output_names, output_dtypes, template or ())
            programs.setdefault(key, (name, unit, len(header) + len(source)))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return call

    with mock.patch.object(mx.fast, "cuda_kernel", recorder):
        _drive()
    return programs


def _drive() -> None:
    import mlx.core as mx
    from kvserve.cache import parse_scheme
    from kvserve.cache.affine import QuantizedFormat, quantize_parts
    from kvserve.cache.turbo_codec import RawFormat, make_format
    from kvserve.kernels import cuda_attention as ca, cuda_layout, cuda_qmv, cuda_quantize

    cuda_layout.on_cuda = lambda: True
    masks = {"none": lambda B, L, T: None, "causal": lambda B, L, T: "causal",
             "array": lambda B, L, T: mx.ones((B, 1, L, T), mx.bool_),
             "padded": lambda B, L, T: mx.ones((B, 1, 1, T), mx.bool_) if L == 1 else None}

    def formats(name, k):
        s = parse_scheme(name)
        if name == "fp16":
            return RawFormat(k.shape[-1]), (k.astype(mx.float16),), RawFormat(k.shape[-1]), (k.astype(mx.float16),)
        if s.values.kind == "turbo":
            kf, vf = make_format(s.keys, k.shape[-1]), make_format(s.values, k.shape[-1])
            return kf, tuple(kf.encode(k)), vf, tuple(vf.encode(k))
        kf, vf = QuantizedFormat(s.keys), QuantizedFormat(s.values)
        return kf, tuple(quantize_parts(k, s.keys)), vf, tuple(quantize_parts(k, s.values))

    B, Hkv, R, T = 2, 2, 4, 300
    grid = itertools.product(["affine4", "affine8", "mxfp4", "turbo0v4", "turbo8v3", "turbo4", "fp16"],
                             [64, 128], [1, 4, 17], [mx.float16, mx.float32], masks, [mx.float32, mx.float16])
    for name, D, L, dt, mask, kdt in grid:
        if kdt == mx.float16 and not name.startswith(("affine", "mx")):
            continue  # f16 scales: the affine and mxfp4 pair decode
        kf, kp, vf, vp = formats(name, mx.random.normal((B, Hkv, T, D)).astype(kdt))
        q = mx.random.normal((B, Hkv * R, L, D)).astype(dt)
        for sinks in (None, mx.zeros((Hkv * R,))):
            ca.attend_cuda(q, kf, kp, vf, vp, D ** -0.5, masks[mask](B, L, T), sinks=sinks)
    for bits, group, rows in itertools.product([4, 8], [32, 64, 128], [1, 2, 8, 24, 64]):
        wq, s, b = mx.quantize(mx.random.normal((512, 2048)).astype(mx.float16), group_size=group, bits=bits)
        cuda_qmv.quantized_matmul(mx.random.normal((rows, 2048)).astype(mx.float16), wq, s, b, group, bits)
    for bits, group, D in itertools.product([4, 8], [32, 64, 128], [64, 128]):
        if group <= D:  # a group never spans heads
            k = mx.random.normal((2, 2, 3, D)).astype(mx.float16)
            cuda_quantize.encode_record(k, k, bits, group)


def digest(job: tuple[str, str, str, str]) -> tuple[str, str]:
    key, name, unit, tools = job
    try:
        ptx = nvrtc_ptx(tools, unit)
    except RuntimeError as exc:
        return key, "error: " + " / ".join(line for line in str(exc).splitlines() if "error" in line)[:300]
    ptx = "\n".join(line for line in ptx.splitlines() if not line.startswith("//")).replace(name, "KERNEL")
    ptx = re.sub(r"k_cu_[0-9a-f]{8}", "k_cu_H", ptx)  # internal names carry a hash of the unit
    return key, hashlib.sha256(ptx.encode()).hexdigest()


def compare(old: dict, new: dict) -> int:
    keys = sorted(set(old) & set(new))
    same = [k for k in keys if old[k]["ptx"] == new[k]["ptx"] and not old[k]["ptx"].startswith("error")]
    errors = [k for k in keys if old[k]["ptx"].startswith("error") or new[k]["ptx"].startswith("error")]
    print(f"{len(old)} programs before, {len(new)} after, {len(keys)} in both: {len(same)} the same PTX, "
          f"{len(errors)} failing to compile, {len(keys) - len(same) - len(errors)} different; source bytes "
          f"{sum(old[k]['bytes'] for k in keys)} -> {sum(new[k]['bytes'] for k in keys)}")
    for k in keys:
        if k not in same:
            print(f"  {k[:160]}: {old[k]['ptx'][:80]} | {new[k]['ptx'][:80]}")
    sizes: dict[str, list[int]] = {}
    for k in keys:  # bytes per call of each kernel, before -> after (the largest program of a name)
        was, now = sizes.setdefault(json.loads(k)[0], [0, 0])
        sizes[json.loads(k)[0]] = [max(was, old[k]["bytes"]), max(now, new[k]["bytes"])]
    for name, (was, now) in sorted(sizes.items()):
        print(f"  {name}: {was} -> {now} bytes")
    return 0 if len(same) == len(keys) == len(old) == len(new) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tools", help="the unpacked wheels' nvidia/ directory (kernel_sass.py)")
    p.add_argument("--out", help="write {program: PTX digest, source bytes} here")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(Path(f).read_text()) for f in args.compare))
    programs = capture()
    jobs = [(key, name, unit, args.tools) for key, (name, unit, _) in programs.items()]
    with ProcessPoolExecutor(args.jobs) as pool:
        digests = dict(pool.map(digest, jobs))
    Path(args.out).write_text(json.dumps({k: {"ptx": digests[k], "bytes": programs[k][2]} for k in programs},
                                         indent=0))
    print(f"{len(programs)} programs, {sum(d.startswith('error') for d in digests.values())} failing to compile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
