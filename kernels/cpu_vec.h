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
inline v16f splat(float x) { return v16f{} + x; }

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
