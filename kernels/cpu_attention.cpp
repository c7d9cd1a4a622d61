// Decode attention over stored K/V on the CPU, as an MLX primitive.
//
// MLX's CPU ``quantized_matmul`` decodes codes one element at a time (about 1.5 G
// multiply-adds/s here), so attention over an affine4 cache cost 3-4x the same attention over
// float32 K/V. This kernel reads each stored token once: its keys are scored against every
// query row of its KV head (the n_rep query heads times L queries), and, after the softmax,
// its values are weighted into the output. Affine codes are never decoded to floats: a key
// is s * code + z per group, so the codes are scored as they are and each group's scale and
// bias applied once per token and row (score_affine); values are weighted by p * s and the
// biases summed apart (accumulate_affine). Turbo tokens are decoded (32 at a time in vector
// registers) and read as floats. Component kinds (keys and values independently):
//   raw     one array (B, H_kv, T, D) in float32, float16 or bfloat16;
//   affine  mx.quantize codes (uint32), scales, biases (float32/float16/bfloat16), 4 or 8 bits;
//   turbo   packed b-bit centroid indices (uint32, little-endian bit stream) and a float32
//           norm per token: x = norm * centroid[idx] in the rotated basis. Turbo keys
//           score against rotated (and calibrated) queries, which cpu_attention.py prepares
//           as the reference does; turbo values are rotated back in here (``unrotate``).
// Inputs: q (B, H_q, L, D) float32, any strides, multiplied by ``q_scale`` as it is read (and
// prepared for the key format); the components' arrays as the cache stores them, any strides
// with a contiguous last axis (buffer views); optional additive mask (B, H_m, L, T) float32
// with H_m in {1, H_q}; optional sinks (H_q,); optional unrotate (D_v, D_v), row-contiguous.
// Output (B, H_q, L, D_v) float32. Work is split over (b, kv head) pairs between this thread
// and the BLAS shim's helper thread (``kvserve_parallel``) when the shim is loaded.
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "cpu_vec.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// 16 bytes zero-extended to 16 lanes (compilers scalarize the generic conversion).
v16u widen16(const uint8_t* c) {
  v16u u;
#if defined(__AVX512F__)
  __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  std::memcpy(&u, &w, sizeof u);
#elif defined(__AVX2__)
  __m256i w[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))),
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8)))};
  std::memcpy(&u, w, sizeof u);
#else
  for (int i = 0; i < 16; i++) u[i] = c[i];
#endif
  return u;
}

// 16 half-precision floats (IEEE float16 or bfloat16 bits) as 16 floats. float16 goes
// through the conversion instructions (AVX-512F, F16C); bfloat16 is the upper half of a
// float32, so a shift does it; elsewhere one element at a time.
v16f widen_f16(const uint16_t* h) {
  v16f f;
#if defined(__AVX512F__)
  __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  std::memcpy(&f, &w, sizeof f);
#elif defined(__F16C__)
  __m256 w[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))),
                 _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)))};
  std::memcpy(&f, w, sizeof f);
#else
  for (int i = 0; i < 16; i++) f[i] = static_cast<float>(reinterpret_cast<const mx::float16_t*>(h)[i]);
#endif
  return f;
}

v16f widen_bf16(const uint16_t* h) {
  typedef uint16_t v16h __attribute__((vector_size(32)));
  v16h b;
  std::memcpy(&b, h, sizeof b);
  v16u u = __builtin_convertvector(b, v16u) << 16;
  v16f f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp for x <= 0 (softmax after the max is taken off); at or below -87 it is exactly 0, so
// hidden slots get probability 0 and their V is never read.
v16f exp_neg(v16f x) { return x <= -87.0f ? splat(0.0f) : exp_clamped(x); }

enum Kind { RAW = 0, AFFINE = 1, TURBO = 2 };
enum DType { F32 = 0, F16 = 1, BF16 = 2 };

// One stored scalar as float32: float16 by the conversion instruction where there is one
// (MLX's float16_t converts in software on x86), bfloat16 as the upper half of a float32.
template <int DT>
inline float scalar_as_float(const void* p, int64_t i) {
  if constexpr (DT == F32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (DT == BF16) {
    uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  } else {
#if defined(__F16C__)
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
#else
    return static_cast<float>(static_cast<const mx::float16_t*>(p)[i]);
#endif
  }
}

float element(const void* p, int dtype, int64_t i) {
  if (dtype == F32) return scalar_as_float<F32>(p, i);
  if (dtype == F16) return scalar_as_float<F16>(p, i);
  return scalar_as_float<BF16>(p, i);
}

// One stored component (keys or values) of a call.
struct Component {
  int kind, bits, group, dim;
  const uint8_t* data;  // raw values, affine codes or turbo words
  const void* scales;  // affine scales; turbo norms (float32)
  const void* biases;  // affine biases
  int dtype;  // raw values' or affine scales' dtype
  int64_t data_stride[3];  // bytes per b, h, t
  int64_t scale_stride[3];  // elements per b, h, t
  float table[16];  // turbo centroids
  bool permuted;  // 4-bit codes come out permuted (see dequant_token)
};

// One turbo token of ``c`` (D values, float32) into ``out`` (raw tokens are read where they
// are stored: RawReader; affine codes are scored and weighted as codes: score_affine,
// accumulate_affine). 4-bit codes come out permuted within each 32: the 16 even elements,
// then the 16 odd ones (byte j holds elements 2j and 2j + 1); queries are permuted the same
// way and outputs permuted back.
void dequant_token(const Component& c, int b, int h, int t, float* out) {
  const uint8_t* p = c.data + b * c.data_stride[0] + h * c.data_stride[1] + t * c.data_stride[2];
  int64_t so = b * c.scale_stride[0] + h * c.scale_stride[1] + t * c.scale_stride[2];
  float norm = static_cast<const float*>(c.scales)[so];
  if (c.bits == 4) {
#if defined(__AVX512F__)
    // The 16 centroids fill one register: vpermps looks 16 codes up at once.
    __m512 table = _mm512_loadu_ps(c.table);
    v16f n = splat(norm);
    for (int k = 0; k < c.dim; k += 32) {
      v16u u = widen16(p + k / 2), lo = u & 15u, hi = u >> 4;
      __m512i li, hi_;
      std::memcpy(&li, &lo, sizeof li);
      std::memcpy(&hi_, &hi, sizeof hi_);
      __m512 a = _mm512_permutexvar_ps(li, table), b = _mm512_permutexvar_ps(hi_, table);
      v16f va, vb;
      std::memcpy(&va, &a, sizeof va);
      std::memcpy(&vb, &b, sizeof vb);
      store(out + k, va * n);
      store(out + k + 16, vb * n);
    }
    return;
#endif
    for (int k = 0; k < c.dim; k += 32) {
      v16u u = widen16(p + k / 2);
      for (int i = 0; i < 16; i++) {
        out[k + i] = c.table[u[i] & 15u] * norm;
        out[k + 16 + i] = c.table[u[i] >> 4] * norm;
      }
    }
    return;
  }
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
  const uint32_t mask = (1u << c.bits) - 1;
  for (int d = 0; d < c.dim; d++) {  // index d at bits [d * bits, d * bits + bits) of the stream
    int bit = d * c.bits, word = bit / 32, shift = bit % 32;
    uint32_t idx = w[word] >> shift;
    if (shift + c.bits > 32) idx |= w[word + 1] << (32 - shift);
    out[d] = c.table[idx & mask] * norm;
  }
}

int permuted(int d, bool permute) {
  if (!permute) return d;
  int base = d & ~31, i = d & 31;
  return base + (i % 2) * 16 + i / 2;
}

// Mask values at or below this hide a slot (cpu_attention.py turns boolean masks into the
// float32 minimum); additive masks above it are added to the score.
constexpr float kHidden = -1e37f;

struct Call {
  int B, Hq, Hkv, L, T, D, Dv, mask_heads;
  const float* q;
  int64_t q_strides[4];  // any layout: the queries arrive as RoPE or a projection left them
  float q_scale;  // applied as the queries are read (raw and affine keys need nothing else)
  Component keys, values;
  const float* mask;  // (B, mask_heads, L, T) or null
  const float* sinks;  // (H_q,) or null
  const float* unrotate;  // (Dv, Dv): turbo values leave rotated; out = acc @ unrotate. Or null
  float* out;
};

// Query rows (heads sharing a KV head, times queries) of one work item: a (b, KV head) pair
// split into items of at most kItemRows rows, so that a prompt chunk of one sequence (one b,
// few KV heads) still divides evenly between the two threads.
constexpr int kItemRows = 64;
// Rows scored together against a block of kTokenBlock decoded tokens: the rows' queries or
// accumulators and the block's keys or values stay in cache. The same dot products and
// accumulation order as one row at a time, so the same bits.
constexpr int kRowBlock = 16;
constexpr int kTokenBlock = 256;

// The first m of 16 scores (m < 16 at the end of the context).
inline void put(float* dst, v16f a, int m) {
  if (m == 16) {
    store(dst, a);
    return;
  }
  float x[16];
  store(x, a);
  std::memcpy(dst, x, m * sizeof(float));
}

// The scores of 16 tokens (``blk``: their keys, dimension-major) for one query row: a sum
// over d in order.
inline void score1(const float* q, int D, const float* blk, float* dst, int m) {
  v16f a = {};
  for (int d = 0; d < D; d++) a += splat(q[d]) * load(blk + d * 16);
  put(dst, a, m);
}

// Four rows at once (``qs`` floats apart), each summed exactly as score1 does: four
// independent chains of multiply-adds instead of one that waits on its own latency.
inline void score4(const float* q, int qs, int D, const float* blk, float* dst, int T, int m) {
  v16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int d = 0; d < D; d++) {
    v16f k = load(blk + d * 16);
    a0 += splat(q[d]) * k;
    a1 += splat(q[qs + d]) * k;
    a2 += splat(q[2 * qs + d]) * k;
    a3 += splat(q[3 * qs + d]) * k;
  }
  put(dst, a0, m);
  put(dst + T, a1, m);
  put(dst + 2 * T, a2, m);
  put(dst + 3 * T, a3, m);
}

// One row against N full blocks of 16 tokens (``blk``: N D x 16 blocks one after another),
// each lane summed exactly as score1 does: N independent chains instead of one (eight keep
// both FMA units busy through their latency).
template <int N>
inline void score1xN(const float* q, int D, const float* blk, float* dst) {
  v16f a[N] = {};
  for (int d = 0; d < D; d++) {
    v16f x = splat(q[d]);
    for (int i = 0; i < N; i++) a[i] += x * load(blk + size_t(i) * 16 * D + d * 16);
  }
  for (int i = 0; i < N; i++) store(dst + 16 * i, a[i]);
}

// 16 values of a token row stored as DT (F32, F16 or BF16), as float32.
template <int DT>
inline v16f load_as_float(const uint8_t* row, int d) {
  if constexpr (DT == F32) return load(reinterpret_cast<const float*>(row) + d);
  else if constexpr (DT == F16) return widen_f16(reinterpret_cast<const uint16_t*>(row) + d);
  else return widen_bf16(reinterpret_cast<const uint16_t*>(row) + d);
}

// A reader of a component's tokens from a first token on: ``at(t, d0)`` is values
// [d0, d0 + 16) of token first + t, as float32, in the order dequant_token writes them (4-bit
// codes permuted). Raw values are read where the cache stores them; affine and turbo tokens
// are decoded to a buffer first, which the F32 reader then reads. (Decoding affine codes
// inside the loops instead, 16 values per read, measured slower: each read reloads its
// group's scale and bias.)
template <int DT>
struct RawReader {
  const uint8_t* base;  // the first token
  int64_t stride;  // bytes from one token to the next
  v16f at(int t, int d0) const { return load_as_float<DT>(base + t * stride, d0); }
};

// ``f(reader)`` with the reader of component c, pair (b, h), from token t0 on; ``tokens``:
// the block decoded from t0 (affine, turbo), row length dim.
template <class F>
void with_reader(const Component& c, int b, int h, int t0, const float* tokens, int dim, F&& f) {
  const uint8_t* base = c.data + b * c.data_stride[0] + h * c.data_stride[1] + t0 * c.data_stride[2];
  const int64_t stride = c.data_stride[2];
  if (c.kind == RAW) {
    if (c.dtype == F16) f(RawReader<F16>{base, stride});
    else if (c.dtype == BF16) f(RawReader<BF16>{base, stride});
    else f(RawReader<F32>{base, stride});
    return;
  }
  f(RawReader<F32>{reinterpret_cast<const uint8_t*>(tokens), int64_t(dim) * 4});
}

// Tokens [t, t + m) of a reader, m <= 16 (D a multiple of 16), as one dimension-major block
// (``blk[d * 16 + i]`` = token t + i's d-th value), zeros for tokens past m.
template <class R>
void to_dimension_major(const R& rd, int t, int m, int D, float* blk) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    v16f r[16];
    for (int i = 0; i < 16; i++) r[i] = i < m ? rd.at(t + i, d0) : v16f{};
    transpose16(r);
    for (int d = 0; d < 16; d++) store(blk + size_t(d0 + d) * 16, r[d]);
  }
}

// NR rows' accumulators at once (NR <= 4), acc[r * ld : + 16 * NV] += p_r,t * v_t[d0 : d0 +
// 16 * NV] (``p``: the rows' probabilities, T apart): each token's values are read (and
// widened) once for NR rows instead of once per row. Every row adds its tokens in order, and
// a row whose p is 0 (a hidden slot, which may hold stale V, even infinite) keeps its sum by
// a vector select rather than a branch: scalar compares and jumps per token and row were most
// of a prompt chunk's time (75 rows over 16K fp16 tokens: 21.9 ms a call, 14.2 without them).
// 16 tokens that every row hides (a fresh prompt's causal half) are skipped whole, by one
// vector test per row.
template <int NR, int NV, class R>
void accumulate_rows(float* acc, int ld, const float* p, int T, int t0, int t1, const R& rd, int d0) {
  v16f a[NR][NV];
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < NV; i++) a[r][i] = load(acc + size_t(r) * ld + 16 * i);
  for (int t = t0; t < t1;) {
    int end = t + 16 < t1 ? t + 16 : t1;
    if (end - t == 16) {
      v16i seen = {};
      for (int r = 0; r < NR; r++) seen |= load(p + r * size_t(T) + t) != 0.0f;
      if (!any_lane(seen)) {
        t = end;
        continue;
      }
    }
    for (; t < end; t++) {
      v16f ws[NR];
      for (int r = 0; r < NR; r++) ws[r] = splat(p[r * size_t(T) + t]);
      for (int i = 0; i < NV; i++) {
        v16f v = rd.at(t - t0, d0 + 16 * i);
        for (int r = 0; r < NR; r++) {
          v16f sum = a[r][i] + ws[r] * v;
          a[r][i] = ws[r] != 0.0f ? sum : a[r][i];
        }
      }
    }
  }
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < NV; i++) store(acc + size_t(r) * ld + 16 * i, a[r][i]);
}

// Rows [0, n) of ``acc`` (Dv floats each) against tokens [t0, t1): in fours, then the 1-3
// rows left (a decode step's n_rep rows) together, 32 dimensions at a time.
template <class R>
void accumulate_all(float* acc, int n, int Dv, const float* s, int T, int t0, int t1, const R& rd) {
  auto run = [&]<int NR>(int r) {
    for (int d0 = 0; d0 < Dv; d0 += 32) {
      float* a = acc + size_t(r) * Dv + d0;
      if (Dv - d0 >= 32) accumulate_rows<NR, 2>(a, Dv, s + size_t(r) * T, T, t0, t1, rd, d0);
      else accumulate_rows<NR, 1>(a, Dv, s + size_t(r) * T, T, t0, t1, rd, d0);
    }
  };
  int r = 0;
  for (; r + 4 <= n; r += 4) run.template operator()<4>(r);
  if (n - r == 3) run.template operator()<3>(r);
  else if (n - r == 2) run.template operator()<2>(r);
  else if (n - r == 1) run.template operator()<1>(r);
}

// Scores of rows [0, n) (queries ``q``, ``qs`` floats apart, D dims each) against ``m``
// tokens laid out as dimension-major blocks of 16 (``blk``: D x 16 floats each), into
// ``dst`` + r * ld + t. Every row is summed over d in order, whichever kernel scores it.
void score_rows(const float* q, int qs, int n, int D, const float* blk, int m, float* dst, int ld) {
  for (int r0 = 0; r0 < n; r0 += kRowBlock) {
    int r1 = r0 + kRowBlock < n ? r0 + kRowBlock : n, quads = r0 + (r1 - r0) / 4 * 4;
    for (int j = 0; j < m; j += 16)
      for (int r = r0; r < quads; r += 4)
        score4(q + size_t(r) * qs, qs, D, blk + size_t(j) * D, dst + size_t(r) * ld + j, ld, m - j < 16 ? m - j : 16);
    // The rows left over (a decode step's n_rep rows, often 1-3): eight token blocks at once.
    for (int r = quads; r < r1; r++) {
      const float* qr = q + size_t(r) * qs;
      float* out = dst + size_t(r) * ld;
      int j = 0;
      for (; j + 128 <= m; j += 128) score1xN<8>(qr, D, blk + size_t(j) * D, out + j);
      for (; j + 64 <= m; j += 64) score1xN<4>(qr, D, blk + size_t(j) * D, out + j);
      for (; j < m; j += 16) score1(qr, D, blk + size_t(j) * D, out + j, m - j < 16 ? m - j : 16);
    }
  }
}

// Rows' exponentials (``s``: n rows of T) divided by their sums; ``sums`` holds each row's
// start (a sink's term or 0). Each row is summed in token order, one add at a time: a
// left-padded row (whose hidden slots add exact zeros) then sums exactly as the same
// sequence alone, so a batch changes no bit of its rows. Eight rows' sums run side by side:
// eight chains of adds instead of one that waits on its own latency.
template <int K>
void sum_rows(const float* s, int T, float* sums) {
  float a[K];
  for (int i = 0; i < K; i++) a[i] = sums[i];
  for (int t = 0; t < T; t++)
    for (int i = 0; i < K; i++) a[i] += s[size_t(i) * T + t];
  for (int i = 0; i < K; i++) sums[i] = a[i];
}

void normalize_rows(float* s, int T, int n, float* sums) {
  int r = 0;
  for (; r + 8 <= n; r += 8) sum_rows<8>(s + size_t(r) * T, T, sums + r);
  for (; r + 4 <= n; r += 4) sum_rows<4>(s + size_t(r) * T, T, sums + r);
  if (n - r == 3) sum_rows<3>(s + size_t(r) * T, T, sums + r);  // a decode step's n_rep rows
  else if (n - r == 2) sum_rows<2>(s + size_t(r) * T, T, sums + r);
  else if (n - r == 1) sum_rows<1>(s + size_t(r) * T, T, sums + r);
  for (r = 0; r < n; r++) {
    float* sr = s + size_t(r) * T;
    float inv = 1.0f / sums[r];
    for (int t = 0; t < T; t++) sr[t] *= inv;
  }
}

#include "cpu_attention_affine.h"  // score_affine, accumulate_affine_rows, accumulate_turbo4_rows

int items_per_pair(const Call& c) {
  int rows = (c.Hq / c.Hkv) * c.L;
  return (rows + kItemRows - 1) / kItemRows;
}

// Rows [g0, g0 + n) of pair (b, h). Scratch: n x T scores, then n x D queries, n x Dv
// accumulators, kTokenBlock decoded tokens, and their keys dimension-major.
void attend_rows(const Call& c, int b, int h, int g0, int n, std::vector<float>& scratch) {
  const int R = c.Hq / c.Hkv, T = c.T, D = c.D, Dv = c.Dv, W = D > Dv ? D : Dv;
  const int groups = c.values.kind == AFFINE ? Dv / c.values.group : 0;
  scratch.resize(size_t(n) * (T + D + Dv + groups + 1) + size_t(kTokenBlock) * (W + D) + size_t(n + 2) * kTokenBlock);
  float* s = scratch.data();  // n x T scores, then probabilities
  float* qp = s + size_t(n) * T;  // n x D permuted queries
  float* acc = qp + size_t(n) * D;  // n x Dv accumulators (permuted)
  float* tokens = acc + size_t(n) * Dv;  // decoded keys or values of one token block
  auto head_of = [&](int r) { return h * R + (g0 + r) / c.L; };
  auto query_of = [&](int r) { return (g0 + r) % c.L; };
  for (int r = 0; r < n; r++) {
    const float* src = c.q + b * c.q_strides[0] + head_of(r) * c.q_strides[1] + query_of(r) * c.q_strides[2];
    for (int d = 0; d < D; d++)
      qp[size_t(r) * D + permuted(d, c.keys.permuted)] = src[d * c.q_strides[3]] * c.q_scale;
  }
  // Scores 16 tokens at a time: keys decoded, then laid out dimension-major (D x 16), so a
  // row's 16 scores are D multiply-adds into one register, summed over d in order (the same
  // order for every L and batch, so decode, verify and prompt chunks agree bit for bit).
  float* kt = tokens + size_t(kTokenBlock) * W;
  float* zs = kt + size_t(kTokenBlock) * D;  // n x groups: affine values' bias sums
  float* affine_tmp = zs + size_t(n) * groups;  // score_affine's scratch
  float* sums = affine_tmp + size_t(n + 2) * kTokenBlock;  // n softmax denominators
  for (int t0 = 0; t0 < T; t0 += kTokenBlock) {
    int t1 = t0 + kTokenBlock < T ? t0 + kTokenBlock : T;
    if (c.keys.kind == AFFINE) {
      score_affine(c.keys, b, h, n, t0, t1, qp, s + t0, T, kt, affine_tmp);
      continue;
    }
    if (c.keys.kind != RAW)
      for (int t = t0; t < t1; t++) dequant_token(c.keys, b, h, t, tokens + size_t(t - t0) * D);
    with_reader(c.keys, b, h, t0, tokens, D, [&](const auto& rd) {
      for (int j = t0; j < t1; j += 16)
        to_dimension_major(rd, j - t0, t1 - j < 16 ? t1 - j : 16, D, kt + size_t(j - t0) * D);
    });
    score_rows(qp, D, n, D, kt, t1 - t0, s + t0, T);
  }
  for (int r = 0; r < n; r++) {
    float* sr = s + size_t(r) * T;
    int head = head_of(r), l = query_of(r);
    if (c.mask) {
      const float* m = c.mask + ((size_t(b) * c.mask_heads + (c.mask_heads > 1 ? head : 0)) * c.L + l) * T;
      // A hidden slot (the float32 minimum, from a boolean mask) takes that value whatever
      // its score: a slot outside a window or in padding may hold stale K, even infinite.
      for (int t = 0; t < T; t++) sr[t] = m[t] <= kHidden ? m[t] : sr[t] + m[t];
    }
    float top = c.sinks ? c.sinks[head] : -INFINITY;
    v16f tops = splat(top);  // the maximum is the same in any order
    int t = 0;
    for (; t + 16 <= T; t += 16) {
      v16f x = load(sr + t);
      tops = x > tops ? x : tops;
    }
    for (int i = 0; i < 16; i++) top = tops[i] > top ? tops[i] : top;
    for (; t < T; t++) top = sr[t] > top ? sr[t] : top;
    v16f tops16 = splat(top);
    int full = T / 16 * 16;
    for (int t = 0; t < full; t += 16) store(sr + t, exp_neg(load(sr + t) - tops16));
    for (int t = full; t < T; t += 16) {  // the tail through the same exp, padded
      int m = T - t;
      float x[16];
      std::fill(x, x + 16, top);
      std::memcpy(x, sr + t, m * sizeof(float));
      store(x, exp_neg(load(x) - top));
      std::memcpy(sr + t, x, m * sizeof(float));
    }
    sums[r] = c.sinks ? std::exp(c.sinks[head] - top) : 0.0f;
  }
  normalize_rows(s, T, n, sums);
  std::fill(acc, acc + size_t(n) * Dv, 0.0f);
  std::fill(zs, zs + size_t(n) * groups, 0.0f);
  const bool as_codes = c.values.kind == AFFINE || (c.values.kind == TURBO && c.values.bits == 4);
  // Weighting values as codes needs (4 * Dv / group + 2) x kTokenBlock floats of scratch, at
  // most (Dv / 8 + 2) x kTokenBlock: the token and key blocks, free once the keys are scored.
  if (c.values.kind == AFFINE) accumulate_affine_rows(c.values, b, h, n, T, Dv, s, acc, zs, tokens);
  else if (as_codes) accumulate_turbo4_rows(c.values, b, h, n, T, Dv, s, acc, tokens);
  for (int t0 = 0; !as_codes && t0 < T; t0 += kTokenBlock) {
    int t1 = t0 + kTokenBlock < T ? t0 + kTokenBlock : T;
    if (c.values.kind != RAW)
      for (int t = t0; t < t1; t++) dequant_token(c.values, b, h, t, tokens + size_t(t - t0) * Dv);
    with_reader(c.values, b, h, t0, tokens, Dv, [&](const auto& rd) { accumulate_all(acc, n, Dv, s, T, t0, t1, rd); });
  }
  for (int r = 0; r < n; r++) {
    float* dst = c.out + ((size_t(b) * c.Hq + head_of(r)) * c.L + query_of(r)) * Dv;
    if (!c.unrotate) {
      for (int d = 0; d < Dv; d++) dst[d] = acc[size_t(r) * Dv + permuted(d, c.values.permuted)];
      for (int d = 0; groups && d < Dv; d++) dst[d] += zs[size_t(r) * groups + d / c.values.group];
      continue;
    }
    std::fill(dst, dst + Dv, 0.0f);  // one inverse rotation per output row, not per token
    for (int i = 0; i < Dv; i++) {
      v16f y = splat(acc[size_t(r) * Dv + permuted(i, c.values.permuted)]);
      const float* row = c.unrotate + size_t(i) * Dv;
      for (int d = 0; d < Dv; d += 16) store(dst + d, load(dst + d) + y * load(row + d));
    }
  }
}

// Work items [i0, i1): item i is rows [k * kItemRows, ...) of pair i / per, k = i % per.
void attend_range(void* ctx, int i0, int i1) {
  const Call& c = *static_cast<const Call*>(ctx);
  const int per = items_per_pair(c), rows = (c.Hq / c.Hkv) * c.L;
  std::vector<float> scratch;
  for (int i = i0; i < i1; i++) {
    int pair = i / per, g0 = (i % per) * kItemRows;
    attend_rows(c, pair / c.Hkv, pair % c.Hkv, g0, rows - g0 < kItemRows ? rows - g0 : kItemRows, scratch);
  }
}

using RangeFn = void (*)(void*, int, int);
using ParallelFn = void (*)(RangeFn, void*, int, long);

int dtype_code(mx::Dtype t) {
  if (t == mx::float32) return F32;
  if (t == mx::float16) return F16;
  if (t == mx::bfloat16) return BF16;
  throw std::invalid_argument("stored values and scales must be float32, float16 or bfloat16");
}

// What a component is, apart from its arrays (the primitive keeps it between calls).
struct Spec {
  int kind, bits, group;
  std::vector<float> table;  // turbo centroids
  size_t arrays() const { return kind == RAW ? 1 : kind == AFFINE ? 3 : 2; }
  bool operator==(const Spec& o) const {
    return kind == o.kind && bits == o.bits && group == o.group && table == o.table;
  }
};

Component component(const Spec& spec, const mx::array* a, int dim, bool values) {
  Component c{};
  c.kind = spec.kind;
  c.bits = spec.bits;
  c.group = spec.group;
  c.dim = dim;
  c.data = a[0].data<uint8_t>();
  for (int i = 0; i < 3; i++) c.data_stride[i] = a[0].strides()[i] * int64_t(a[0].itemsize());
  c.dtype = F32;
  if (spec.kind == RAW) c.dtype = dtype_code(a[0].dtype());
  if (spec.kind != RAW) {
    c.scales = a[1].data<void>();
    for (int i = 0; i < 3; i++) c.scale_stride[i] = a[1].strides()[i];
  }
  if (spec.kind == AFFINE) {
    c.biases = a[2].data<void>();
    c.dtype = dtype_code(a[1].dtype());
  }
  std::copy(spec.table.begin(), spec.table.end(), c.table);
  // 4-bit values (accumulate_affine, dequant_token) and turbo keys come permuted; affine keys
  // are scored in dimension order (codes_dimension_major).
  c.permuted = spec.bits == 4 && (spec.kind == TURBO || (spec.kind == AFFINE && values));
  return c;
}

class StoredAttention : public mx::Primitive {
 public:
  StoredAttention(mx::Stream s, Spec keys, Spec values, bool mask, bool sinks, bool unrotate, float q_scale)
      : mx::Primitive(s),
        keys_(std::move(keys)),
        values_(std::move(values)),
        mask_(mask),
        sinks_(sinks),
        unrotate_(unrotate),
        q_scale_(q_scale) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const auto& q = in[0];
    Call c{};
    c.B = q.shape(0); c.Hq = q.shape(1); c.L = q.shape(2); c.D = q.shape(3); c.Dv = out.shape(3);
    c.Hkv = in[1].shape(1); c.T = in[1].shape(2);
    c.q = q.data<float>();
    for (int i = 0; i < 4; i++) c.q_strides[i] = q.strides()[i];
    c.q_scale = q_scale_;
    size_t next = 1;
    c.keys = component(keys_, &in[next], c.D, false);
    next += keys_.arrays();
    c.values = component(values_, &in[next], c.Dv, true);
    next += values_.arrays();
    if (mask_) {
      c.mask = in[next].data<float>();
      c.mask_heads = in[next].shape(1);
      next++;
    }
    if (sinks_) c.sinks = in[next++].data<float>();
    if (unrotate_) c.unrotate = in[next].data<float>();
    c.out = out.data<float>();
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : in) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([c]() mutable {
      static ParallelFn parallel = reinterpret_cast<ParallelFn>(dlsym(RTLD_DEFAULT, "kvserve_parallel"));
      int items = c.B * c.Hkv * items_per_pair(c);
      long work = long(c.B) * c.Hq * c.L * c.T * (c.D + c.Dv);
      if (parallel) parallel(attend_range, &c, items, work);
      else attend_range(&c, 0, items);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvserve's stored-K/V attention runs on the CPU only");
  }

  const char* name() const override { return "KvserveStoredAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const StoredAttention&>(other);
    return keys_ == o.keys_ && values_ == o.values_ && mask_ == o.mask_ && sinks_ == o.sinks_ &&
           unrotate_ == o.unrotate_ && q_scale_ == o.q_scale_;
  }

 private:
  Spec keys_, values_;
  bool mask_, sinks_, unrotate_;
  float q_scale_;
};

Spec spec(int kind, int bits, int group, const std::vector<float>& table, size_t n_arrays) {
  Spec s{kind, bits, group, table};
  if (kind < RAW || kind > TURBO || s.arrays() != n_arrays)
    throw std::invalid_argument("component arrays do not match its kind");
  if (kind == AFFINE && ((bits != 4 && bits != 8) || group % 32))
    throw std::invalid_argument("affine components: 4 or 8 bits, groups a multiple of 32");
  if (kind == TURBO && (bits < 1 || bits > 4 || table.size() != (size_t(1) << bits)))
    throw std::invalid_argument("turbo components: 1 to 4 bits and 2^bits centroids");
  return s;
}

// Keys and values as (kind, bits, group, centroids, arrays); shapes are checked in Python.
mx::array stored_attention(const mx::array& q, int k_kind, int k_bits, int k_group,
                           const std::vector<float>& k_table, const std::vector<mx::array>& keys, int v_kind,
                           int v_bits, int v_group, const std::vector<float>& v_table,
                           const std::vector<mx::array>& values, int v_dim, std::optional<mx::array> mask,
                           std::optional<mx::array> sinks, std::optional<mx::array> unrotate, float q_scale) {
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  Spec ks = spec(k_kind, k_bits, k_group, k_table, keys.size());
  Spec vs = spec(v_kind, v_bits, v_group, v_table, values.size());
  std::vector<mx::array> inputs = {mx::astype(q, mx::float32, s)};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  if (mask) inputs.push_back(mx::contiguous(mx::astype(*mask, mx::float32, s), false, s));
  if (sinks) inputs.push_back(mx::contiguous(mx::astype(*sinks, mx::float32, s), false, s));
  if (unrotate) inputs.push_back(*unrotate);
  mx::Shape shape = {q.shape(0), q.shape(1), q.shape(2), v_dim};
  auto prim = std::make_shared<StoredAttention>(s, ks, vs, mask.has_value(), sinks.has_value(),
                                                unrotate.has_value(), q_scale);
  return mx::array(shape, mx::float32, prim, inputs);
}

}  // namespace

NB_MODULE(kvserve_cpu_attention, m) {
  nb::module_::import_("mlx.core");
  m.def("stored_attention", &stored_attention, nb::arg("q"), nb::arg("k_kind"), nb::arg("k_bits"),
        nb::arg("k_group"), nb::arg("k_table"), nb::arg("keys"), nb::arg("v_kind"), nb::arg("v_bits"),
        nb::arg("v_group"), nb::arg("v_table"), nb::arg("values"), nb::arg("v_dim"), nb::arg("mask").none(),
        nb::arg("sinks").none(), nb::arg("unrotate").none(), nb::arg("q_scale"));
}
