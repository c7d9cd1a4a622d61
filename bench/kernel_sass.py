"""Registers, spills and the main loop's SASS of kvserve's tensor-core attention kernel,
compiled without a GPU exactly as MLX's ``mx.fast.cuda_kernel`` would compile it.

The kernel's source is captured from a real ``attend_cuda`` call (B=8, 32 query heads over
8 KV heads, D=128, f16 queries) with ``mx.fast.cuda_kernel`` replaced by a recorder, wrapped
in the signature MLX generates, compiled by NVRTC to PTX for sm_90, assembled by ``ptxas -v``
and disassembled by ``nvdisasm``. Reported: registers per thread, spill bytes, and for the
two largest loops (the packed-row and run-time-stride walks) the instruction count and the
opcode histogram. Registers matched what Nsight Compute reported on an H100 (168, then 160).

Tools (PyPI wheels, no GPU needed), unpacked into one directory:

    pip download --no-deps -d T nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 \\
        nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12 nvidia-cuda-nvdisasm
    for w in T/*.whl; do python -m zipfile -e $w T/x; done; chmod +x T/x/nvidia/*/bin/*
    python bench/kernel_sass.py affine4 --tools T/x/nvidia [--bf16] [--mask padded] [--out DIR]

``--mask`` gives the call a left-padded batch's mask (rows padded by 0..7 slots): ``padded``
(B, 1, 1, T), one value per token (mask kind 4); ``starts`` the same mask known by each
row's first slot, as a batch cache's decode mask is (kind 5); ``per-head`` the same values
broadcast to (B, H_q, 1, T), read through the generic array index.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import os
import re
import subprocess
import sys
from unittest import mock

C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "uint32": "uint32_t",
           "uint8": "uint8_t", "int32": "int32_t", "bool": "bool"}
# What MLX's default header provides that the kernels use.
PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
#define inf cuda::std::numeric_limits<float>::infinity()
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
"""


def c_type(dtype) -> str:
    return C_TYPES[str(dtype).split(".")[-1]]


def wrap(name, header, source, input_names, inputs, output_names, output_dtypes, template) -> str:
    """The translation unit MLX builds for a custom kernel (its ``build_kernel``)."""
    s = PRELUDE + header + "namespace mlx::core::cu {\n\n__global__ void " + name + "(\n"
    for n, a in zip(input_names, inputs):
        s += f"    const {c_type(a.dtype)}* {n},\n"
        for suffix, decl in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if a.ndim > 0 and n + suffix in source:
                s += f"    const __grid_constant__ {decl} {n}{suffix},\n"
    s += ",\n".join(f"    {c_type(d)}* {n}" for n, d in zip(output_names, output_dtypes)) + ") {\n"
    for k, v in template:
        s += f"  constexpr int {k} = {v};\n" if isinstance(v, int) else f"  using {k} = {c_type(v)};\n"
    return s + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n"


def nvrtc_ptx(tools: str, src: str) -> str:
    lib = ctypes.CDLL(glob.glob(f"{tools}/cuda_nvrtc/lib/libnvrtc.so*")[0])
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=compute_90", f"-I{tools}/cuda_runtime/include".encode(),
            f"-I{tools}/cuda_cccl/include".encode(), b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        raise RuntimeError(log.value.decode()[-4000:])
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def loops(sass: str, top: int = 2) -> list[tuple[int, collections.Counter]]:
    """Instruction count and opcode histogram of the ``top`` largest backward-branch loops."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\.(L_x_\d+):", line.strip()))}
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            spans.append((i - labels[m.group(1)], labels[m.group(1)], i))
    out = []
    for _, a, b in sorted(spans, reverse=True)[:top]:
        body = [line for line in lines[a:b + 1] if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        ops = collections.Counter(m.group(1) for line in body
                                  if (m := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)))
        out.append((len(body), ops))
    return out


def capture(scheme: str, bf16: bool, mask: str = "none") -> list[tuple]:
    """(name, header, source, input names, inputs, output names, output dtypes, template)
    of the tensor-core kernel one ``attend_cuda`` call would launch."""
    import mlx.core as mx
    from kvserve.cache.base import causal_mask
    from kvserve.kernels import bench_cases as bc
    from kvserve.kernels import cuda_attention as ca

    T = 1024
    padding = causal_mask(1, T - 1, mx.arange(8))  # (8, 1, 1, T)
    the_mask = {"none": None, "padded": padding, "starts": padding,
                "per-head": mx.broadcast_to(padding, (8, 32, 1, T))}[mask]
    if mask == "starts":  # the same mask, known by its rows' first slots (mask kind 5)
        from kvserve.kernels.cuda_layout import note_left_padding
        note_left_padding(padding, list(range(8)))
    path = bc._path
    bc._path = lambda name: (lambda *a: path(name)(*a[:6], the_mask))

    seen = []

    def recorder(name, input_names, output_names, source, header="", ensure_row_contiguous=True, **_):
        def call(inputs, template=(), output_shapes=(), output_dtypes=(), **__):
            seen.append((name, header, source, input_names, inputs, output_names, output_dtypes, template))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return call

    rand = bc._rand
    if bf16:
        bc._rand = lambda shape, seed: tuple(x.astype(mx.bfloat16) for x in rand(shape, seed))
    with mock.patch.object(mx.fast, "cuda_kernel", recorder):
        ca._mma_kernel.cache_clear(), ca._merge_kernel.cache_clear(), ca._families.clear()
        case = bc.build_case(scheme, "cuda", bc.Shape(8, 32, 8, 128, T))
        case.run(case.queries)
    bc._rand, bc._path = rand, path
    ca._mma_kernel.cache_clear(), ca._merge_kernel.cache_clear(), ca._families.clear()
    return [k for k in seen if "kvs_attn_mma" in k[0]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("scheme")
    p.add_argument("--tools", default=os.environ.get("KVSERVE_CUDA_TOOLS", ""),
                   help="the unpacked wheels' nvidia/ directory (see above)")
    p.add_argument("--bf16", action="store_true", help="bf16 queries and K/V instead of f16")
    p.add_argument("--mask", choices=("none", "padded", "starts", "per-head"), default="none")
    p.add_argument("--out", default="", help="also keep k.cu, k.ptx, k.cubin, k.sass here")
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvserve-sass")
    os.makedirs(out, exist_ok=True)
    for name, *rest in capture(args.scheme, args.bf16, args.mask):
        src = wrap(name, *rest)
        open(f"{out}/k.cu", "w").write(src)
        open(f"{out}/k.ptx", "w").write(nvrtc_ptx(args.tools, src))
        r = subprocess.run([f"{args.tools}/cuda_nvcc/bin/ptxas", "-arch=sm_90", "-v", f"{out}/k.ptx",
                            "-o", f"{out}/k.cubin"], capture_output=True, text=True, check=True)
        regs = re.findall(r"Used (\d+) registers", r.stderr)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
        nvdisasm = glob.glob(f"{args.tools}/*/bin/nvdisasm")[0]
        sass = subprocess.run([nvdisasm, "-c", f"{out}/k.cubin"], capture_output=True, text=True,
                              check=True).stdout
        open(f"{out}/k.sass", "w").write(sass)
        print(f"{name}: {regs[0] if regs else '?'} registers, spills (stores, loads) {spills}")
        for n, ops in loops(sass):
            print(f"  loop of {n} instructions: " + " ".join(f"{k}:{v}" for k, v in ops.most_common(30)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
