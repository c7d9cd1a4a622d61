// 16-lane float vectors for the CPU primitives (cpu_attention.cpp, cpu_ops.cpp): GCC/Clang
// vector extensions, which the compiler maps to AVX-512, AVX2 or NEON as the machine has.
#pragma once

#include <cstdint>
#include <cstring>

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16f load(const float* p) { v16f v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
// A broadcast. (``v16f{} + x`` reads the same except for -0.0, and so cost an add per
// broadcast in every hot loop: the compiler may not drop 0 + x.)
inline v16f splat(float x) { return v16f{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
// Whether any lane of a comparison's mask is set.
inline bool any_lane(v16i m) {
  uint64_t w[8];
  std::memcpy(w, &m, sizeof w);
  return (w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7]) != 0;
}

// exp(x) for x clamped to [-87, 88], to about 2 ulp: 2^n * p(r) with |r| <= ln2/2 and a
// degree-6 polynomial.
inline v16f exp_clamped(v16f x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  v16f n = x * 1.44269504088896341f;
  v16i ni = __builtin_convertvector(n + (n < 0 ? splat(-0.5f) : splat(0.5f)), v16i);
  n = __builtin_convertvector(ni, v16f);
  v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  v16i bits = (ni + 127) << 23;
  v16f two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// [a0, b0, a1, b1, ..., a7, b7] and [a8, b8, ..., a15, b15]: one two-source permute each.
inline v16f interleave_lo(v16f a, v16f b) {
  return __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}
inline v16f interleave_hi(v16f a, v16f b) {
  return __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}

// A 16 x 16 block transposed in registers: four rounds of the perfect shuffle (row 2i takes
// the interleaved first halves of rows i and i + 8, row 2i + 1 the second halves), 64
// permutes where element-by-element copies take 256 loads and 256 stores.
//   rows r (row i = [16i, ..., 16i + 15])  ->  r[j] = [j, 16 + j, ..., 240 + j]
inline void transpose16(v16f r[16]) {
  for (int round = 0; round < 4; round++) {
    v16f t[16];
    for (int i = 0; i < 8; i++) {
      t[2 * i] = interleave_lo(r[i], r[i + 8]);
      t[2 * i + 1] = interleave_hi(r[i], r[i + 8]);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
  }
}
