"""``mx.quantize``'s affine encoding of keys and values as one kernel on NVIDIA GPUs.

An affine cache stores K and V as two records (``kvserve.cache.affine``): the codes of both,
and the scales and biases of both. With MLX operations a decode step's encoding is two
``mx.quantize`` launches and two concatenations; here one launch writes both records, so a
layer's append costs the encoder plus two slice writes, where fp16's costs two slice
writes (on a GPU serving a small model the step is bound by the host launching kernels:
docs/benchmarks/gpu-serve.md). One block of D threads encodes one row of K and V:

    thread t:      u_c[t] = x_c[t]                    (c = K, V; one coordinate, as float)
    thread < 2G:   the group's min and max -> scale, bias (MLX's rule, below)
    thread < 2W:   word w of component c = OR of its PF codes, code j at bits [j*b, j*b + b)

MLX's rule for a group (``affine_quantize``): scale = max((max - min) / (2^b - 1), 1e-7),
signed and snapped so that the extreme of larger magnitude (the "edge") is exact, bias = the
edge (0 when it rounds to code 0); code = min(round((x - bias) / scale), 2^b - 1). Scales and
biases are stored in the activation dtype, codes computed with their float values, as MLX
does; a code can still differ from ``mx.quantize``'s where a quotient falls within a
rounding error of .5 (the tests bound that).

Worked example: a decode step of 8 rows over 3 KV heads, D = 64, affine4 (g64): one launch of
24 blocks x 64 threads, writing codes (8, 3, 1, 16) uint32 and side (8, 3, 1, 4) float16.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from kvserve.kernels.cuda_programs import cuda_kernel
from kvserve.kernels.cuda_attention import cuda_ready
from kvserve.kernels.cuda_layout import kernel_name

HEAD_DIMS = (64, 128, 256)
BITS = (4, 8)
GROUPS = (32, 64, 128)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

HEADER = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
ENCODE_BODY = r"""
  constexpr int D = DIM;
  constexpr int BITS_ = NBITS;
  constexpr int GS = GROUP;
  constexpr int G = D / GS;
  constexpr int W = D * BITS_ / 32;
  constexpr int PF = 32 / BITS_;
  constexpr float NB = float((1 << BITS_) - 1);
  __shared__ float u[2][D];
  __shared__ float sc[2][G];
  __shared__ float bi[2][G];
  const int t = threadIdx.x;
  const long row = blockIdx.x;
  // (B, H, L, D) inputs read through their strides: a step's keys and values are often
  // transposed views of the projections, which a contiguous copy would cost a launch each.
  const int H = k_shape[1], L = k_shape[2];
  const long b = row / (H * L), h = (row / L) % H, l = row % L;
  u[0][t] = static_cast<float>(k[b * k_strides[0] + h * k_strides[1] + l * k_strides[2] + t * k_strides[3]]);
  u[1][t] = static_cast<float>(v[b * v_strides[0] + h * v_strides[1] + l * v_strides[2] + t * v_strides[3]]);
  __syncthreads();
  if (t < 2 * G) {
    const int c = t / G, g = t % G;
    const float* x = u[c] + g * GS;
    float lo = x[0], hi = x[0];
    for (int i = 1; i < GS; ++i) { lo = fminf(lo, x[i]); hi = fmaxf(hi, x[i]); }
    float scale = fmaxf((hi - lo) / NB, 1e-7f);
    const bool low_edge = fabsf(lo) > fabsf(hi);
    scale = low_edge ? scale : -scale;
    const float edge = low_edge ? lo : hi;
    const float q0 = roundf(edge / scale);
    const bool at_zero = q0 == 0.0f;
    scale = at_zero ? scale : edge / q0;
    const float bias = at_zero ? 0.0f : edge;
    sc[c][g] = scale;
    bi[c][g] = bias;
    side[row * 4 * G + c * 2 * G + g] = static_cast<OUT_T>(scale);
    side[row * 4 * G + c * 2 * G + G + g] = static_cast<OUT_T>(bias);
  }
  __syncthreads();
  if (t < 2 * W) {
    const int c = t / W, w = t % W;
    unsigned int word = 0;
#pragma unroll
    for (int j = 0; j < PF; ++j) {
      const int i = w * PF + j;
      const int g = i / GS;
      const float q = fmaxf(fminf(roundf((u[c][i] - bi[c][g]) / sc[c][g]), NB), 0.0f);
      word |= static_cast<unsigned int>(q) << (BITS_ * j);
    }
    codes[row * 2 * W + c * W + w] = word;
  }
"""

_C_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}


_cuda = functools.cache(cuda_ready)  # asked once per layer and step: the answer does not change


def serves(keys: mx.array, values: mx.array, bits: int, group: int) -> bool:
    """Where this kernel encodes: a GPU with MLX's CUDA backend, affine 4/8-bit of a group
    in ``GROUPS``, (B, H, L, D) K and V of one shape, D in ``HEAD_DIMS``, one float dtype."""
    D = keys.shape[-1]
    return (keys.ndim == 4 and bits in BITS and group in GROUPS and D in HEAD_DIMS
            and values.shape == keys.shape and keys.dtype == values.dtype and keys.dtype in DTYPES
            and mx.default_device() == mx.gpu and _cuda())


@functools.cache
def _kernel(D: int, bits: int, group: int, dtype: mx.Dtype):
    body = (ENCODE_BODY.replace("DIM", str(D)).replace("NBITS", str(bits)).replace("GROUP", str(group))
            .replace("OUT_T", _C_TYPES[dtype]))
    return cuda_kernel(name=kernel_name(f"kvs_affine_encode_{D}_{bits}_{group}", HEADER, body),
                               input_names=["k", "v"], output_names=["codes", "side"],
                               source=body, header=HEADER, ensure_row_contiguous=False)


def encode_record(keys: mx.array, values: mx.array, bits: int, group: int) -> list[mx.array]:
    """[codes (..., 2W) uint32, side (..., 4G) in the inputs' dtype] of (..., D) keys and
    values, the records ``kvserve.cache.affine.pack_record`` makes of ``mx.quantize``'s
    parts; call only where ``serves`` says so."""
    D = keys.shape[-1]
    rows = keys.size // D
    W, G = D * bits // 32, D // group
    codes, side = _kernel(D, bits, group, keys.dtype)(
        inputs=[keys, values], grid=(rows * D, 1, 1),
        threadgroup=(D, 1, 1), output_shapes=[(rows, 2 * W), (rows, 4 * G)],
        output_dtypes=[mx.uint32, keys.dtype])
    lead = keys.shape[:-1]
    return [codes.reshape(*lead, 2 * W), side.reshape(*lead, 4 * G)]
