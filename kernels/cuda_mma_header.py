"""Device-side helpers of the tensor-core pass (``kvserve.kernels.cuda_mma_source``), as CUDA
source: ``Act`` (pairs and ``mma.sync`` per query dtype), ``Magic`` (affine codes to f16 /
bf16 pairs without f32), and one *run* type per stored format, which loads a lane's
contiguous piece of a token row into registers (``load``, one step ahead of use) and turns
it into f16 / bf16 pairs (``decode``): ``RawRun``, ``AffineRun``, ``MxRun``, ``LutRun``.

Worked example, affine4 keys at D = 128: a lane's run is 32 elements of one row, so
``AffineRun<__half, 4, 64, 32, 4>::load`` reads 4 words (one 16-byte load) and its group's
scale and bias; ``decode`` gives 16 pairs, four per word, through ``and_or`` and one
``__hfma2`` each.
"""

MMA_HEADER = r"""
namespace kvt {

template <typename A> struct Act;
template <> struct Act<__half> {
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
template <> struct Act<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// An 8x8 matrix of 16-bit values, one row per 4 lanes (lane l: row l / 4, columns
// 2 (l % 4) and +1 in one word), transposed in place across the warp.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Affine codes straight to f16 / bf16 pairs: a code under the exponent of MAGIC (1024 in
// f16, 128 in bf16, both with a unit last place there) is MAGIC + n exactly; one exact
// subtraction and one fused s * n + z per pair follow. One word of 4-bit codes gives the
// pairs (n_s, n_s+4), s = 0..3; of 8-bit codes (n_s, n_s+2), s = 0, 1 (f16 only: 128 + 255
// is not exact in bf16). For example 4-bit w = 0x76543210, s = 1: the halves hold
// 1024 + 1 and 1024 + 5.
template <typename AT> struct Magic;
template <> struct Magic<__half> {
  static constexpr uint32_t M = 0x64006400u;
  static constexpr bool HI_NIBBLE = true;  // 1024 + 16 n (n < 16) stays in the mantissa
  static __device__ __forceinline__ uint32_t fma(uint32_t h, uint32_t s2, uint32_t z2) {
    __half2 x = __hsub2(*reinterpret_cast<__half2*>(&h), __half2half2(__ushort_as_half(0x6400)));
    x = __hfma2(x, *reinterpret_cast<__half2*>(&s2), *reinterpret_cast<__half2*>(&z2));
    return *reinterpret_cast<uint32_t*>(&x);
  }
  // (1024 + 16 n) / 16 - 64 = n exactly, then s n + z: the same single rounding as fma().
  static __device__ __forceinline__ uint32_t fma_hi(uint32_t h, uint32_t s2, uint32_t z2) {
    __half2 x = __hfma2(*reinterpret_cast<__half2*>(&h), __half2half2(__ushort_as_half(0x2c00)),
                        __half2half2(__ushort_as_half(0xd400)));  // * 1/16, - 64
    x = __hfma2(x, *reinterpret_cast<__half2*>(&s2), *reinterpret_cast<__half2*>(&z2));
    return *reinterpret_cast<uint32_t*>(&x);
  }
  static __device__ __forceinline__ uint32_t splat(__half v) {
    __half2 x = __half2half2(v);
    return *reinterpret_cast<uint32_t*>(&x);
  }
};
template <> struct Magic<__nv_bfloat16> {
  static constexpr uint32_t M = 0x43004300u;
  static constexpr bool HI_NIBBLE = false;  // bit 7 of a bf16 is the exponent's lowest
  static __device__ __forceinline__ uint32_t fma(uint32_t h, uint32_t s2, uint32_t z2) {
    __nv_bfloat162 x = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&h),
                               __bfloat162bfloat162(__ushort_as_bfloat16(0x4300)));
    x = __hfma2(x, *reinterpret_cast<__nv_bfloat162*>(&s2), *reinterpret_cast<__nv_bfloat162*>(&z2));
    return *reinterpret_cast<uint32_t*>(&x);
  }
  static __device__ __forceinline__ uint32_t splat(__nv_bfloat16 v) {
    __nv_bfloat162 x = __bfloat162bfloat162(v);
    return *reinterpret_cast<uint32_t*>(&x);
  }
};

// (a & MASK) | OR in one instruction: written as C++ the compiler emits two LOP3s, because
// one LOP3 takes one 32-bit immediate; here ptxas keeps one of the constants in a register.
template <uint32_t MASK, uint32_t OR>
__device__ __forceinline__ uint32_t and_or(uint32_t a) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(a), "n"(MASK), "n"(OR));
  return d;
}

// A lane's run of N elements of one token row, in two stages: load() issues the global
// reads into registers (a step ahead of use), decode() makes N / 2 f16 / bf16 pairs.
struct NoRun {};  // formats decoded straight from memory where they are used

template <typename AT, int N>
struct RawRun {  // stored in the queries' dtype: the pairs are the words
  uint32_t u[N / 2];
  __device__ __forceinline__ void load(const AT* row, int e0) {
    kvs::load_words<N / 2, 4>(reinterpret_cast<const uint32_t*>(row + e0), u);
  }
  __device__ __forceinline__ void decode(uint32_t* out, const float*) const {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) out[i] = u[i];
  }
};

template <typename AT, int BITS, int GS, int N, int VEC>
struct AffineRun {  // scales and biases in AT; pairs as ``Magic`` says
  static constexpr int EPW = 32 / BITS, NWD = N / EPW, PPW = EPW / 2, NGR = N > GS ? N / GS : 1;
  static constexpr uint32_t MASK = BITS == 4 ? 0x000F000Fu : 0x00FF00FFu;
  uint32_t u[NWD];
  AT s[NGR], z[NGR];
  __device__ __forceinline__ void load(const uint32_t* w, const AT* sc, const AT* bi, int e0) {
    kvs::load_words<NWD, VEC>(w + e0 / EPW, u);
#pragma unroll
    for (int i = 0; i < NGR; ++i) { s[i] = sc[e0 / GS + i]; z[i] = bi[e0 / GS + i]; }
  }
  __device__ __forceinline__ void decode(uint32_t* out, const float*) const {
#pragma unroll
    for (int m = 0; m < NWD; ++m) {
      const int gi = NGR > 1 ? (m * EPW) / GS : 0;
      const uint32_t s2 = Magic<AT>::splat(s[gi]), z2 = Magic<AT>::splat(z[gi]);
      if constexpr (BITS == 4 && Magic<AT>::HI_NIBBLE) {
        // Pairs (p, p + 4), p = 0..3: nibbles 0 and 1 of each half-word masked in place
        // (the second at 16 n), then the same for the word shifted by 8: one shift per word.
        const uint32_t u8 = u[m] >> 8;
        out[m * 4 + 0] = Magic<AT>::fma(and_or<0x000F000Fu, Magic<AT>::M>(u[m]), s2, z2);
        out[m * 4 + 1] = Magic<AT>::fma_hi(and_or<0x00F000F0u, Magic<AT>::M>(u[m]), s2, z2);
        out[m * 4 + 2] = Magic<AT>::fma(and_or<0x000F000Fu, Magic<AT>::M>(u8), s2, z2);
        out[m * 4 + 3] = Magic<AT>::fma_hi(and_or<0x00F000F0u, Magic<AT>::M>(u8), s2, z2);
      } else {
#pragma unroll
        for (int p = 0; p < PPW; ++p)
          out[m * PPW + p] = Magic<AT>::fma(and_or<MASK, Magic<AT>::M>(u[m] >> (BITS * p)), s2, z2);
      }
    }
  }
};

template <typename AT, int N, int VEC>
struct MxRun {  // mxfp4: e2m1 codes, 8 per word, and one e8m0 exponent per 32 elements
  static constexpr int NWD = N / 8, NGR = N > 32 ? N / 32 : 1;  // a run never straddles a group
  uint32_t u[NWD];
  uint8_t e[NGR];
  __device__ __forceinline__ void load(const uint32_t* w, const uint8_t* sc, int e0) {
    kvs::load_words<NWD, VEC>(w + e0 / 8, u);
#pragma unroll
    for (int i = 0; i < NGR; ++i) e[i] = sc[e0 / 32 + i];
  }
  __device__ __forceinline__ void decode(uint32_t* out, const float*) const {
    if constexpr (Magic<AT>::HI_NIBBLE) {
      // f16, pairs (p, p + 4) of each word (``pair_map``'s fast map): the two codes sit 16
      // bits apart, as the two halves of an f16 pair do, so one shift puts both magnitudes
      // (e1 e0 m) at f16 bits 9-11 and another both signs at bit 15. As an f16 that is the
      // e2m1 value times 2^-14, subnormals included (0.5 -> 2^-15); times 2^14, then times
      // the block's scale: exact, then one rounding, as the f32 path.
      const uint32_t two14 = 0x74007400u;
#pragma unroll
      for (int m = 0; m < NWD; ++m) {
        // The scale as an f16 power of two (exact from 2^-24 to 2^15; a block of f16 values
        // never needs more; clamped so that a corrupt exponent gives inf, not inf * 0).
        const uint32_t s2 = Magic<AT>::splat(__float2half_rn(
            __uint_as_float(min(uint32_t(e[(8 * m) / 32]), 142u) << 23)));
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const uint32_t t = p < 3 ? u[m] << (9 - 4 * p) : u[m] >> 3;
          const uint32_t h = (t & 0x0E000E00u) | ((t << 3) & 0x80008000u);
          __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&h), *reinterpret_cast<const __half2*>(&two14));
          x = __hmul2(x, *reinterpret_cast<const __half2*>(&s2));
          out[4 * m + p] = *reinterpret_cast<uint32_t*>(&x);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float s = kvs::e8m0_scaled(e[(2 * i) / 32]);
        out[i] = Act<AT>::pack(s * kvs::e2m1_scaled(kvs::field<4>(u, 2 * i)),
                               s * kvs::e2m1_scaled(kvs::field<4>(u, 2 * i + 1)));
      }
    }
  }
};

// BITS-wide centroid indices from element e0 (any bit offset): the words are loaded (the
// last clamped to the row), shifted so the run starts at bit 0, then read at constant
// offsets through the lookup table.
template <typename AT, int BITS, int N, int WORDS>
struct LutRun {
  static constexpr int NWD = (N * BITS + 31) / 32 + 1;
  uint32_t u[NWD];
  int off;
  __device__ __forceinline__ void load(const uint32_t* w, int e0) {
    const int bit0 = e0 * BITS, w0 = bit0 >> 5;
    off = bit0 & 31;
#pragma unroll
    for (int k = 0; k < NWD; ++k) u[k] = w[min(w0 + k, WORDS - 1)];
  }
  __device__ __forceinline__ void decode(uint32_t* out, const float* lut) const {
    uint32_t v[NWD + 1];
#pragma unroll
    for (int k = 0; k < NWD; ++k) v[k] = __funnelshift_r(u[k], k + 1 < NWD ? u[k + 1] : 0u, off);
    v[NWD] = 0u;
#pragma unroll
    for (int e = 0; e < N / 2; ++e)
      out[e] = Act<AT>::pack(lut[kvs::field<BITS>(v, 2 * e)], lut[kvs::field<BITS>(v, 2 * e + 1)]);
  }
};

}  // namespace kvt
"""
