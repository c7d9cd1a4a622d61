"""Quantized weights times a few rows of activations on NVIDIA GPUs (``mx.fast.cuda_kernel``).

A decode step multiplies every weight matrix by one row of activations per running
request: M = 1 to 8 rows. MLX's CUDA backend serves M > 1 with its tiled tensor-core
GEMM (``qmm_sm80``), whose 64-row tiles are mostly empty at M = 8: a Llama-3-8B shape with
4-bit weights spent 26.2 of its 33.6 ms decode step there on an H200 (3.87 GB of weights
at 150 GB/s, 3% of the card's bandwidth; docs/benchmarks/gpu-serve.md, ninth round). The
product is bound by the bytes of the weights, which this kernel reads once for all M rows:

    warp w of block b:  output column n = 4 b + w (one row of W)
    lane l:             the packed words l, l + 32, l + 64, ... of that row (coalesced),
                        each word's 32 / bits values dequantized once (s q + b) and
                        multiplied with the M activations' values at those positions
                        (read 8 or 4 at a time, 16 or 8 bytes per load)
    warp:               M sums reduced by shuffles; lane 0 writes y[m, n]

Worked example: a 4-bit ``nn.QuantizedLinear`` of 4096 -> 14336 (group 64), 8 rows: one
launch of 3584 blocks x 128 threads; each lane reads 16 words (128 values) of its row.

Affine modes only (MLX's default), 4 or 8 bits, groups of 32, 64 or 128, float16 or
bfloat16 activations, 2 <= M <= ``MAX_ROWS``: ``serves`` says where; elsewhere the caller keeps
``mx.quantized_matmul``. The sums run in float32 in another order than MLX's kernels, so
results agree to rounding (``tests/test_kernels_cuda.py`` checks them on a GPU).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kvserve.kernels.cuda_layout import kernel_name, on_cuda

MAX_ROWS = 8
BITS = (4, 8)
GROUPS = (32, 64, 128)
WARPS = 4  # output columns (rows of W) per block

HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename P> struct Pointee;                // the activations' type, from x's pointer
template <typename E> struct Pointee<const E*> { using type = E; };
template <int P> struct XVec;                        // P activations in one load
template <> struct XVec<8> { using type = uint4; };
template <> struct XVec<4> { using type = uint2; };
template <typename T> struct XPair;
template <> struct XPair<__half> { using type = __half2; };
template <> struct XPair<__nv_bfloat16> { using type = __nv_bfloat162; };
__device__ inline float2 pair_to_float2(__half2 h) { return __half22float2(h); }
__device__ inline float2 pair_to_float2(__nv_bfloat162 h) { return __bfloat1622float2(h); }
"""
BODY = r"""
  constexpr int B = NBITS;
  constexpr int PER = 32 / B;            // values per packed word
  constexpr int GS = GROUP;
  constexpr int U = 4;                   // words in flight per lane
  using T = typename Pointee<decltype(x)>::type;
  using V = typename XVec<PER>::type;
  using P2 = typename XPair<T>::type;
  const int M = x_shape[0], K = x_shape[1], N = w_shape[0];
  const int KW = K / PER, G = K / GS;
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
  if (n >= N) return;
  const uint32_t* wr = w + (size_t)n * KW;
  const T* sr = scales + (size_t)n * G;
  const T* br = biases + (size_t)n * G;
  float acc[MAXM];
  #pragma unroll
  for (int m = 0; m < MAXM; ++m) acc[m] = 0.f;
  for (int base = 0; base < KW; base += 32 * U) {
    uint32_t q[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * 32 + lane;
      q[u] = c < KW ? wr[c] : 0u;
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * 32 + lane;
      if (c >= KW) break;
      const int k0 = c * PER;
      const float s = static_cast<float>(sr[k0 / GS]), bias = static_cast<float>(br[k0 / GS]);
      float wv[PER];                     // this word's weights, dequantized once for all rows
      #pragma unroll
      for (int j = 0; j < PER; ++j)
        wv[j] = fmaf(s, static_cast<float>((q[u] >> (B * j)) & ((1u << B) - 1u)), bias);
      #pragma unroll
      for (int m = 0; m < MAXM; ++m) {
        if (m >= M) break;
        const V raw = *reinterpret_cast<const V*>(x + (size_t)m * K + k0);
        const P2* xp = reinterpret_cast<const P2*>(&raw);
        float d = 0.f;
        #pragma unroll
        for (int j = 0; j < PER / 2; ++j) {
          const float2 f = pair_to_float2(xp[j]);
          d = fmaf(f.x, wv[2 * j], fmaf(f.y, wv[2 * j + 1], d));
        }
        acc[m] += d;
      }
    }
  }
  #pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    if (m >= M) break;
    float v = acc[m];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    if (lane == 0) y[(size_t)m * N + n] = static_cast<T>(v);
  }
"""


def serves(x: mx.array, w: mx.array, scales: mx.array, group_size: int, bits: int, mode: str,
           transpose: bool = True) -> bool:
    """Where ``quantized_matmul`` runs here: a CUDA GPU, weights ``serves_weights`` takes,
    and 2 to ``MAX_ROWS`` rows of ``x`` in the scales' dtype."""
    return (transpose and serves_weights(w, scales, group_size, bits, mode) and serves_rows(x, scales)
            and on_cuda())


def serves_weights(w: mx.array, scales: mx.array, group_size: int, bits: int, mode: str) -> bool:
    """Output-major affine weights of ``BITS`` bits in groups of ``GROUPS``, float16 or
    bfloat16 scales: what a layer can check once, when it is loaded."""
    return (mode == "affine" and bits in BITS and group_size in GROUPS and w.ndim == 2
            and w.dtype == mx.uint32 and scales.dtype in (mx.float16, mx.bfloat16)
            and (w.shape[1] * 32 // bits) % group_size == 0)


def serves_rows(x: mx.array, scales: mx.array) -> bool:
    """2 to ``MAX_ROWS`` rows of activations in the scales' dtype. One row stays with MLX's
    own matrix-vector kernel, which reads the weights as fast as this one (and the default
    model's one-stream step was 7.3 ms with it against 9.1 with this kernel, H200)."""
    return x.dtype == scales.dtype and 2 <= x.size // max(x.shape[-1], 1) <= MAX_ROWS


@functools.cache
def _kernel(bits: int, group_size: int):
    body = (BODY.replace("NBITS", str(bits)).replace("GROUP", str(group_size))
            .replace("MAXM", str(MAX_ROWS)).replace("WARPS_PER_BLOCK", str(WARPS)))
    return mx.fast.cuda_kernel(name=kernel_name(f"kvs_qmv_{bits}_{group_size}", HEADER, body),
                               input_names=["x", "w", "scales", "biases"], output_names=["y"],
                               source=body, header=HEADER)


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, bits: int) -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)`` for
    the few rows ``serves`` allows: (..., K) -> (..., N)."""
    K, N = x.shape[-1], w.shape[0]
    rows = x.size // K
    (y,) = _kernel(bits, group_size)(
        inputs=[x.reshape(rows, K), w, scales, biases],
        grid=(-(-N // WARPS) * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, N)], output_dtypes=[x.dtype])
    return y.reshape(*x.shape[:-1], N)
