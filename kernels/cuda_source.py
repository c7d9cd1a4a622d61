"""CUDA C++ source of the fused decode attention kernels (``mx.fast.cuda_kernel`` bodies).

Two kernels per call, flash-decoding style:

    split pass   grid (row_tiles * NT, S, B * H_kv) threads, NT = 128 per block. Block
                 (row tile, split s, (b, h)) walks its share of the context in tiles of
                 TT = 128 tokens, keeps an online softmax in f32 for RB query rows of KV
                 head h (the n_rep query heads x L positions of its group, so each KV head
                 is read once for its whole group) and writes the unnormalised partial
                 (acc (RB, D), running max m, running sum l) of its split.
    merge        one thread per output element: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.

Inside a tile (T0 = first token of the tile):

    scores   thread i owns token T0 + i: decodes its key row chunk by chunk (16 bytes of
             packed data at a time) and dots it with all RB query rows held in shared memory
    softmax  one warp per row: tile max, p = e^(s - m), rescale factor e^(m_old - m)
    values   the block is re-cut into D/8 threads per token, each owning 8 elements of the
             value row, so its accumulator is RB x 8 registers and value loads are coalesced

Stored formats (the per-token row of one KV head; ``field`` reads b-bit fields of a
little-endian bit stream, the layout of ``mx.quantize`` and of ``turbo_codec.pack_indices``):

    raw      D values in the activation dtype
    affine   b-bit codes n (b = 4, 8) + per-group scale s and bias z: x = s*n + z
    mxfp4    e2m1 codes + per-32 e8m0 exponents: x = e2m1(c) * 2^(e - 127)
    turbo    b-bit centroid indices (b = 2, 3, 4) + one f32 norm: x = norm * c[idx]
             (in the rotated basis; the caller rotates queries / un-rotates the output)

Affine codes become floats without an integer conversion (a quarter-rate instruction on
NVIDIA GPUs): the code is placed under the exponent of 1.0f, giving exactly 1 + n/2^b, and
x = (s 2^b) * (1 + n/2^b) + (z - s 2^b) is one FMA. For example with b = 4, n = 5:
bits 0x3F800000 | 5 << 19 = 1.3125 = 1 + 5/16.
"""

from __future__ import annotations

NT = 128  # threads per block of the split pass
TT = 128  # tokens per tile: one per thread while scoring

# The helpers every kvserve CUDA kernel with stored codes uses: word loads, bit fields, code
# units, mxfp4's scales. MLX hashes a kernel's whole source on every call (to find its
# compiled module), so a kernel's header holds only what it calls (``cuda_qmv`` takes this).
CORE_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace kvs {

// N words from p into w[]: 16- or 8-byte loads where the caller vouched for alignment.
template <int N, int VEC>
__device__ __forceinline__ void load_words(const uint32_t* p, uint32_t* w) {
  if constexpr (VEC == 4) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      uint4 v = *reinterpret_cast<const uint4*>(p + i);
      w[i] = v.x; w[i + 1] = v.y; w[i + 2] = v.z; w[i + 3] = v.w;
    }
  } else if constexpr (VEC == 2) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      uint2 v = *reinterpret_cast<const uint2*>(p + i);
      w[i] = v.x; w[i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = p[i];
  }
}

// Field i (BITS wide) of the little-endian bit stream w[]; i is a constant after unrolling.
template <int BITS>
__device__ __forceinline__ uint32_t field(const uint32_t* w, int i) {
  const int bit = i * BITS, wi = bit >> 5, off = bit & 31;
  uint32_t v = w[wi] >> off;
  if (off + BITS > 32) v |= w[wi + 1] << (32 - off);
  return v & ((1u << BITS) - 1u);
}

// Exactly 1 + n / 2^BITS: the code under the exponent of 1.0f (no int -> float conversion).
template <int BITS>
__device__ __forceinline__ float unit_code(uint32_t n) {
  return __uint_as_float(0x3F800000u | (n << (23 - BITS)));
}

// e2m1 code -> value * 2^-14: the code's exponent and mantissa bits placed in an f16,
// whose subnormals then give 0 and 0.5 exactly; the 2^14 goes into the block scale.
__device__ __forceinline__ float e2m1_scaled(uint32_t c) {
  const unsigned short h = (unsigned short)(((c & 7u) << 9) | ((c & 8u) << 12));
  return __half2float(__ushort_as_half(h));
}

// e8m0 exponent e -> 2^(e - 127) * 2^14 (finite for e <= 240).
__device__ __forceinline__ float e8m0_scaled(uint8_t e) {
  return __uint_as_float((uint32_t(e) + 14u) << 23);
}

}  // namespace kvs
"""

# The f32 split pass's chunk decoders and value readers, on top of the core.
HEADER = CORE_HEADER + r"""
namespace kvs {

__device__ __forceinline__ void widen4(const uint4& v, const float*, float* x) {
  x[0] = __uint_as_float(v.x); x[1] = __uint_as_float(v.y);
  x[2] = __uint_as_float(v.z); x[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ void widen8(const uint4& v, const __half*, float* x) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __half22float2(h[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
}
__device__ __forceinline__ void widen8(const uint4& v, const __nv_bfloat16*, float* x) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
}

// ---- key chunks: EC elements starting at element c * EC of one token row -------------
template <int EC, typename T>
__device__ __forceinline__ void raw_chunk(const T* row, int c, float* x) {
  const uint4 v = *reinterpret_cast<const uint4*>(row + c * EC);
  if constexpr (EC == 4) widen4(v, (const float*)nullptr, x); else widen8(v, (const T*)nullptr, x);
}

template <int BITS, int GS, int EC, int VEC, typename S>
__device__ __forceinline__ void affine_chunk(const uint32_t* w, const S* sc, const S* bi, int c, float* x) {
  constexpr int WC = EC * BITS / 32;
  uint32_t u[WC];
  load_words<WC, VEC>(w + c * WC, u);
  const int g = (c * EC) / GS;
  const float s = static_cast<float>(sc[g]) * float(1 << BITS);
  const float z = static_cast<float>(bi[g]) - s;
#pragma unroll
  for (int i = 0; i < EC; ++i) x[i] = fmaf(s, unit_code<BITS>(field<BITS>(u, i)), z);
}

template <int EC, int VEC>
__device__ __forceinline__ void mx4_chunk(const uint32_t* w, const uint8_t* sc, int c, float* x) {
  constexpr int WC = EC / 8;
  uint32_t u[WC];
  load_words<WC, VEC>(w + c * WC, u);
  const float s = e8m0_scaled(sc[(c * EC) / 32]);
#pragma unroll
  for (int i = 0; i < EC; ++i) x[i] = s * e2m1_scaled(field<4>(u, i));
}

template <int BITS, int EC, int VEC>
__device__ __forceinline__ void turbo_chunk(const uint32_t* w, const float* lut, int c, float* x) {
  constexpr int WC = EC * BITS / 32;
  uint32_t u[WC];
  load_words<WC, VEC>(w + c * WC, u);
#pragma unroll
  for (int i = 0; i < EC; ++i) x[i] = lut[field<BITS>(u, i)];  // times the norm, per score
}

// ---- value slices: the 8 elements 8j .. 8j + 7 of one token row -----------------------
// Split into load() and decode() so the value pass can issue a batch of loads before
// using any of them (one memory round trip per batch, not per token).
template <typename T>
struct RawV {
  uint4 a, b;
  __device__ __forceinline__ void load(const T* row, int j) {
    a = *reinterpret_cast<const uint4*>(row + 8 * j);
    if constexpr (sizeof(T) == 4) b = *reinterpret_cast<const uint4*>(row + 8 * j + 4);
  }
  __device__ __forceinline__ void decode(float* x) const {
    if constexpr (sizeof(T) == 4) {
      widen4(a, (const float*)nullptr, x); widen4(b, (const float*)nullptr, x + 4);
    } else {
      widen8(a, (const T*)nullptr, x);
    }
  }
};

template <int BITS, int GS, typename S>
struct AffineV {
  uint32_t u[2]; S s, z;
  __device__ __forceinline__ void load(const uint32_t* w, const S* sc, const S* bi, int j) {
    if constexpr (BITS == 4) { u[0] = w[j]; } else { load_words<2, 2>(w + 2 * j, u); }
    s = sc[(8 * j) / GS]; z = bi[(8 * j) / GS];
  }
  __device__ __forceinline__ void decode(float* x) const {
    const float s2 = static_cast<float>(s) * float(1 << BITS);
    const float z2 = static_cast<float>(z) - s2;
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = fmaf(s2, unit_code<BITS>(field<BITS>(u, i)), z2);
  }
};

struct Mx4V {
  uint32_t u; uint8_t e;
  __device__ __forceinline__ void load(const uint32_t* w, const uint8_t* sc, int j) {
    u = w[j]; e = sc[(8 * j) / 32];
  }
  __device__ __forceinline__ void decode(float* x) const {
    const float s = e8m0_scaled(e);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = s * e2m1_scaled(field<4>(&u, i));
  }
};

// W = words per row: a 3-bit slice may straddle two words; the second is clamped to the row.
template <int BITS, int W>
struct TurboV {
  uint32_t u; float norm; const float* lut;
  __device__ __forceinline__ void load(const uint32_t* w, const float* norms, const float* lut_, int j) {
    const int bit = 8 * BITS * j, wi = bit >> 5, off = bit & 31;
    if constexpr (BITS == 3) {
      const unsigned long long both = (unsigned long long)w[wi] |
          ((unsigned long long)w[wi + 1 < W ? wi + 1 : W - 1] << 32);
      u = (uint32_t)(both >> off);
    } else {
      u = w[wi] >> off;
    }
    norm = norms[0]; lut = lut_;
  }
  __device__ __forceinline__ void decode(float* x) const {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = norm * lut[field<BITS>(&u, i)];
  }
};

}  // namespace kvs
"""

# The split pass. Template constants: D, RB (query rows per block), RBP (RB rounded up to
# 4), MASK (0 none, 1 causal, 2 boolean array, 3 additive array) and the format's own; the
# body is completed by the K_* / V_* snippets of ``component_code``.
SPLIT_BODY = r"""
  constexpr int NT = __NT__, TT = __TT__, NW = NT / 32;
  constexpr int NG = NT / (D / 8);  // token groups of the value pass
  constexpr float MASKED = -3.4028234663852886e38f;  // finite: a fully masked row averages
  __shared__ __align__(16) float q_s[RB * D];
  __shared__ float s_s[RB * TT];
  __shared__ __align__(16) float p_s[TT * RBP];
  __shared__ float m_s[RB], l_s[RB], a_s[RB];
  __shared__ float klut[16], vlut[16];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row0 = blockIdx.x * RB, split = blockIdx.y, n_split = gridDim.y, bh = blockIdx.z;
  const int Hkv = k0_shape[1], T = k0_shape[2];
  const int Hq = q_shape[1], L = q_shape[2];
  const int R = Hq / Hkv, ROWS = R * L;
  const int b = bh / Hkv, h = bh % Hkv;
  const int n_tiles = (T + TT - 1) / TT, per = (n_tiles + n_split - 1) / n_split;
  const int t_begin = split * per * TT, t_end = min(T, t_begin + per * TT);
  const float scale = sc[0];

  for (int i = tid; i < RB * D; i += NT) {
    const int row = row0 + i / D, d = i % D;
    float v = 0.f;
    if (row < ROWS) {
      const int hq = h * R + row / L, l = row % L;
      v = static_cast<float>(q[b * q_strides[0] + hq * q_strides[1] + l * q_strides[2] + d * q_strides[3]]) * scale;
    }
    q_s[i] = v;
  }
  if (tid < RB) { m_s[tid] = -INFINITY; l_s[tid] = 0.f; }
__LUT_LOAD__
  __syncthreads();

__K_BASE__
__V_BASE__
__V_DECL__
  const int vj = tid % (D / 8), grp = tid / (D / 8);
  float acc[RB][8];
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;

  for (int t0 = t_begin; t0 < t_end; t0 += TT) {
    const int n = min(TT, t_end - t0);
    {  // scores: thread tid owns token t0 + tid
      float s[RB];
#pragma unroll
      for (int r = 0; r < RB; ++r) s[r] = 0.f;
      const int t = t0 + tid;
      if (tid < n) {
__K_ROW__
#pragma unroll
        for (int c = 0; c < D / KEC; ++c) {
          float x[KEC];
__K_CHUNK__
#pragma unroll
          for (int r = 0; r < RB; ++r) {
            const float4* qv = reinterpret_cast<const float4*>(q_s + r * D + c * KEC);
            float part = 0.f;
#pragma unroll
            for (int e = 0; e < KEC / 4; ++e) {
              const float4 qq = qv[e];
              part = fmaf(qq.x, x[4 * e], part); part = fmaf(qq.y, x[4 * e + 1], part);
              part = fmaf(qq.z, x[4 * e + 2], part); part = fmaf(qq.w, x[4 * e + 3], part);
            }
            s[r] += part;
          }
        }
__K_POST__
#pragma unroll
        for (int r = 0; r < RB; ++r) {
          const int row = row0 + r, l = row % L;
__MASK__
        }
      }
#pragma unroll
      for (int r = 0; r < RB; ++r) s_s[r * TT + tid] = tid < n ? s[r] : -INFINITY;
    }
    __syncthreads();
    for (int r = warp; r < RB; r += NW) {  // online softmax, one warp per row
      float v[TT / 32], mx = -INFINITY;
#pragma unroll
      for (int k = 0; k < TT / 32; ++k) { v[k] = s_s[r * TT + lane + 32 * k]; mx = fmaxf(mx, v[k]); }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = m_s[r], m_new = fmaxf(m_old, mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;  // all -inf so far: no NaN
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < TT / 32; ++k) {
        const float p = __expf(v[k] - base);
        p_s[(lane + 32 * k) * RBP + r] = p;
        sum += p;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0) {
        const float a = __expf(m_old - base);
        a_s[r] = a; l_s[r] = l_s[r] * a + sum; m_s[r] = m_new;
      }
    }
    __syncthreads();
    {  // values: thread owns elements 8*vj .. 8*vj+7 of every NG-th token of the tile
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const float a = a_s[r];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i] *= a;
      }
      constexpr int VB = TT / NG < VBATCH ? TT / NG : VBATCH;  // loads in flight per thread
      for (int tb = grp; tb < n; tb += VB * NG) {
        VSlice raw[VB];
#pragma unroll
        for (int k = 0; k < VB; ++k) {
          const int t = t0 + tb + k * NG;
          if (tb + k * NG < n) { __V_LOAD__ }
        }
#pragma unroll
        for (int k = 0; k < VB; ++k) {
          const int tl = tb + k * NG;
          if (tl < n) {
            float x[8];
            raw[k].decode(x);
            float p[RBP];
#pragma unroll
            for (int r = 0; r < RBP; r += 4) {
              const float4 pp = *reinterpret_cast<const float4*>(p_s + tl * RBP + r);
              p[r] = pp.x; p[r + 1] = pp.y; p[r + 2] = pp.z; p[r + 3] = pp.w;
            }
#pragma unroll
            for (int r = 0; r < RB; ++r)
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(p[r], x[i], acc[r][i]);
          }
        }
      }
    }
    __syncthreads();
  }

  // Sum the token groups' accumulators (they share the block's running max).
  for (int i = tid; i < RB * D; i += NT) q_s[i] = 0.f;
  __syncthreads();
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int i = 0; i < 8; ++i) atomicAdd(&q_s[r * D + 8 * vj + i], acc[r][i]);
  __syncthreads();
  const int64_t out_row = ((int64_t)split * gridDim.z + bh) * ROWS;
  for (int i = tid; i < RB * D; i += NT) {
    const int row = row0 + i / D;
    if (row < ROWS) o_part[(out_row + row) * D + i % D] = q_s[i];
  }
  if (tid < RB && row0 + tid < ROWS) {
    ml_part[(out_row + row0 + tid) * 2] = m_s[tid];
    ml_part[(out_row + row0 + tid) * 2 + 1] = l_s[tid];
  }
"""

# Masking of score s[r] (row0 + r, token t); a boolean array hides slots, an additive one is
# added. Array masks are read through their strides, broadcast dims of size 1 included (the
# wrapper only passes masks whose every dim is 1 or the full B, H_q, L, T: see
# ``cuda_attention.launchable``); a size-1 dim is never indexed, whatever its stride.
_ARRAY_MASK = """
          const int hq = h * R + min(row, ROWS - 1) / L;
          const int64_t at = (mask_shape[0] == 1 ? 0 : b) * mask_strides[0] +
              (mask_shape[1] == 1 ? 0 : hq) * mask_strides[1] +
              (mask_shape[2] == 1 ? 0 : l) * mask_strides[2] +
              (mask_shape[3] == 1 ? 0 : t) * mask_strides[3];
"""
MASK_CODE = {
    0: "",
    1: "          if (t > T - L + l) s[r] = MASKED;  // query l sits at position T - L + l",
    2: _ARRAY_MASK + "          if (!mask[at]) s[r] = MASKED;",
    3: _ARRAY_MASK + "          s[r] += static_cast<float>(mask[at]);",
    # The value depends on (b, t) only: the row-independent load is shared by every row.
    # 64-bit index: the mask may be a view into a larger buffer, whose strides nothing bounds.
    4: "          if (!mask[(mask_shape[0] == 1 ? 0 : b) * mask_strides[0] + (int64_t)t * mask_strides[3]])"
       " s[r] = MASKED;",
}

MERGE_BODY = r"""
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int S = ml_part_shape[0];
  const int64_t n_rows = (int64_t)ml_part_shape[1] * ml_part_shape[2];
  const int D = o_part_shape[3];
  if (idx >= n_rows * D) return;
  const int64_t row = idx / D;
  float M = SINK_M;
  for (int s = 0; s < S; ++s) M = fmaxf(M, ml_part[(s * n_rows + row) * 2]);
  const float base = M == -INFINITY ? 0.f : M;
  float l = SINK_L, o = 0.f;
  for (int s = 0; s < S; ++s) {
    const float w = __expf(ml_part[(s * n_rows + row) * 2] - base);
    l = fmaf(w, ml_part[(s * n_rows + row) * 2 + 1], l);
    o = fmaf(w, o_part[s * n_rows * D + idx], o);
  }
  out[idx] = static_cast<OT>(o / l);
"""


def merge_body(sinks: bool) -> str:
    """The merge of the splits' partial softmaxes. With attention sinks (gpt-oss) the row's
    sink logit (``sink_rows``, one per (b, h, query)) is one more split holding no value:
    it raises the running max and adds exp(sink - max) to the sum, never to the output.

        >>> "sink_rows[row]" in merge_body(True), "sink_rows" in merge_body(False)
        (True, False)
    """
    if sinks:
        return MERGE_BODY.replace("SINK_M", "sink_rows[row]").replace(
            "float l = SINK_L", "float l = __expf(sink_rows[row] - base)")
    return MERGE_BODY.replace("SINK_M", "-INFINITY").replace("SINK_L", "0.f")


def _base(prefix: str, n_parts: int) -> str:
    """Per-(b, h) base pointers and token strides of a component's parts."""
    lines = []
    for i in range(n_parts):
        p = f"{prefix}{i}"
        lines.append(f"  const auto* {p}b = {p} + b * {p}_strides[0] + h * {p}_strides[1];"
                     f" const int64_t {p}t = {p}_strides[2];")
    return "\n".join(lines)


def component_code(layout, role: str) -> dict[str, str]:
    """The snippets that read one stored component: role "k" (scores) or "v" (values).

        >>> from kvserve.kernels.cuda_layout import Layout
        >>> component_code(Layout("affine", 4, 64, 3, 16), "v")["V_LOAD"]
        'raw[k].load(v0b + t * v0t, v1b + t * v1t, v2b + t * v2t, vj);'
    """
    P, U = role, role.upper()
    rows = ", ".join(f"{P}{i}b + t * {P}{i}t" for i in range(layout.n_parts))
    code = {f"{U}_BASE": _base(P, layout.n_parts)}
    if role == "k":
        call = {"raw": f"kvs::raw_chunk<KEC>({rows}, c, x);",
                "affine": f"kvs::affine_chunk<KBITS, KGS, KEC, KVEC>({rows}, c, x);",
                "mx": f"kvs::mx4_chunk<KEC, KVEC>({rows}, c, x);",
                "turbo": "kvs::turbo_chunk<KBITS, KEC, KVEC>(k0b + t * k0t, klut, c, x);"}
        code["K_ROW"] = ""
        code["K_CHUNK"] = "          " + call[layout.kind]
        code["K_POST"] = ("        { const float nk = k1b[t * k1t];\n#pragma unroll\n"
                          "          for (int r = 0; r < RB; ++r) s[r] *= nk; }"
                          if layout.kind == "turbo" else "")
    else:
        decl = {"raw": "kvs::RawV<DT_V0>", "affine": "kvs::AffineV<VBITS, VGS, DT_V1>",
                "mx": "kvs::Mx4V", "turbo": "kvs::TurboV<VBITS, VW>"}
        args = {"turbo": "v0b + t * v0t, v1b + t * v1t, vlut"}.get(layout.kind, rows)
        code["V_DECL"] = f"  using VSlice = {decl[layout.kind]};"
        code["V_LOAD"] = f"raw[k].load({args}, vj);"
    return code


def split_source(key_layout, value_layout, mask: int) -> str:
    """The split-pass body for one pair of stored formats and a mask kind (0 none, 1 causal,
    2 boolean array, 3 additive array)."""
    body = SPLIT_BODY.replace("__NT__", str(NT)).replace("__TT__", str(TT))
    lut = []
    if key_layout.kind == "turbo":
        lut.append(f"  if (tid < {1 << key_layout.bits}) klut[tid] = klut_in[tid];")
    if value_layout.kind == "turbo":
        lut.append(f"  if (tid < {1 << value_layout.bits}) vlut[tid] = vlut_in[tid];")
    body = body.replace("__LUT_LOAD__", "\n".join(lut)).replace("__MASK__", MASK_CODE[mask])
    snippets = {**component_code(key_layout, "k"), **component_code(value_layout, "v")}
    for name, text in snippets.items():
        body = body.replace(f"__{name}__", text)
    return body

# x (N, D) @ m (D, D) in f32 FMAs, one thread per output element: the TurboQuant rotation
# of queries and inverse rotation of outputs. MLX's f32 matmul on CUDA differed from the
# CPU's by up to 1e-3 here (reduced-precision tensor-core math), which is the whole error
# budget of an f32 attention; this product is D FMAs per element and costs microseconds.
ROTATE_BODY = r"""
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int D = m_shape[0];
  if (idx >= (int64_t)x_shape[0] * D) return;
  const int64_t n = idx / D;
  const int d = idx % D;
  float acc = 0.f;
  for (int e = 0; e < D; ++e) acc = fmaf(x[n * D + e], m[e * D + d], acc);
  out[idx] = acc;
"""
