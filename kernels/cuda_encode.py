"""TurboQuant's encoder on NVIDIA GPUs as one kernel (``mx.fast.cuda_kernel``).

Encoding a row of K or V for a TurboQuant cache is: its norm, the unit direction rotated
by Pi, each coordinate's centroid index (how many codebook boundaries lie below it), and
the indices packed b bits apiece into uint32 words. As MLX operations that is ~22 kernels
per layer and step (casts, a reduction, a matmul, a broadcast comparison and the packing's
shifts, products and sums); on a GPU serving a small model the step is bound by the host
launching kernels (docs/benchmarks/gpu-serve.md), so the encoder was turbo0v4's largest
cost over fp16. Here one block of D threads encodes one row:

    thread t:  u_t = x_t                       (one coordinate, as float)
    block:     n = sqrt(sum u^2)               (shared-memory reduction)
    thread t:  y_t = sum_k Pi[t, k] u_k / max(n, eps)
               idx_t = #{boundaries < y_t}
    thread w < W: word w = OR of the indices whose bits fall in [32w, 32w + 32)

The layout is ``pack_indices``'s (index j at bits [j*b, j*b + b) of the word stream, a
field may spill into the next word). The rotation's sums run in another order than MLX's
matmul, so a coordinate within a rounding error of a boundary may take its neighbour's
index; the cache checks the kernel against the MLX encoder on its first call
(``TurboCodec.encode``).

Worked example: a decode step of 8 rows over 3 KV heads, D = 64, 4-bit values: one launch
of 24 blocks x 64 threads, writing (8, 3, 1, 8) words and (8, 3, 1, 1) norms.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from kvserve.kernels.cuda_programs import cuda_kernel
from kvserve.kernels.cuda_layout import kernel_name, on_cuda

HEAD_DIMS = (64, 128, 256)
BITS = (2, 3, 4)

HEADER = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
ENCODE_BODY = r"""
  constexpr int D = DIM;
  constexpr int B = NBITS;
  constexpr int W = (D * B + 31) / 32;
  constexpr int NB = (1 << B) - 1;
  __shared__ float u[D];
  __shared__ float part[D / 32];
  __shared__ unsigned int idx[D];
  const int t = threadIdx.x;
  const long row = blockIdx.x;
  const float v = static_cast<float>(x[row * D + t]);
  u[t] = v;
  float sq = v * v;
  for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffff, sq, o);
  if ((t & 31) == 0) part[t >> 5] = sq;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < D / 32; ++i) total += part[i];
  const float n = sqrtf(total);
  const float inv = n > EPS ? n : EPS;
  float y = 0.f;
  for (int k = 0; k < D; ++k) y = fmaf(u[k] / inv, pi[t * D + k], y);
  unsigned int q = 0;
  for (int b = 0; b < NB; ++b) q += y > boundaries[b] ? 1u : 0u;
  idx[t] = q;
  __syncthreads();
  if (t < W) {
    unsigned int word = 0;
    const int first = (32 * t) / B > 0 ? (32 * t) / B - 1 : 0;
    const int last = (32 * t + 31) / B < D - 1 ? (32 * t + 31) / B : D - 1;
    for (int j = first; j <= last; ++j) {
      const int s = j * B - 32 * t;
      if (s >= 32 || s + B <= 0) continue;
      word |= s >= 0 ? (idx[j] << s) : (idx[j] >> (-s));
    }
    packed[row * W + t] = word;
  }
  if (t == 0) norms[row] = n;
"""


def serves(x: mx.array, pi: mx.array, bits: int) -> bool:
    """Where this kernel encodes: a GPU with MLX's CUDA backend, D in ``HEAD_DIMS``, b in
    ``BITS``, a float32 rotation of the vectors' width."""
    D = x.shape[-1]
    return (D in HEAD_DIMS and bits in BITS and pi.shape == (D, D) and pi.dtype == mx.float32
            and x.dtype in (mx.float16, mx.bfloat16, mx.float32) and on_cuda())


@functools.cache
def _kernel(D: int, bits: int, eps: float):
    body = (ENCODE_BODY.replace("DIM", str(D)).replace("NBITS", str(bits))
            .replace("EPS", f"{eps!r}f"))
    return cuda_kernel(name=kernel_name(f"kvs_turbo_encode_{D}_{bits}", body),
                               input_names=["x", "pi", "boundaries"], output_names=["packed", "norms"],
                               source=body, header=HEADER)


def turbo_encode(x: mx.array, pi: mx.array, boundaries: mx.array, bits: int,
                 eps: float) -> tuple[mx.array, mx.array]:
    """(packed (..., ceil(D * bits / 32)) uint32, norms (..., 1) float32) of (..., D)
    vectors, as ``TurboCodec.encode`` computes them on the Walsh-Hadamard path (no key
    scale); call only where ``serves`` says so."""
    D = x.shape[-1]
    rows = x.size // D
    W = -(-D * bits // 32)
    packed, norms = _kernel(D, bits, float(eps))(
        inputs=[x.reshape(rows, D), pi, boundaries.astype(mx.float32)], grid=(rows * D, 1, 1),
        threadgroup=(D, 1, 1), output_shapes=[(rows, W), (rows,)], output_dtypes=[mx.uint32, mx.float32])
    return packed.reshape(*x.shape[:-1], W), norms.reshape(*x.shape[:-1], 1)
