// Decode attention over stored K/V on the CPU, as an MLX primitive.
//
// MLX's CPU ``quantized_matmul`` decodes codes one element at a time (about 1.5 G
// multiply-adds/s here), so attention over an affine4 cache cost 3-4x the same attention over
// float32 K/V. This kernel reads each stored token once: its keys are decoded (32 at a time in
// vector registers), scored against every query row of its KV head (the n_rep query heads
// times L queries), and, after the softmax, its values are decoded and weighted into the
// output the same way. Component kinds (keys and values independently):
//   raw     one array (B, H_kv, T, D) in float32, float16 or bfloat16;
//   affine  mx.quantize codes (uint32), scales, biases (float32/float16/bfloat16), 4 or 8 bits;
//   turbo   packed b-bit centroid indices (uint32, little-endian bit stream) and a float32
//           norm per token: x = norm * centroid[idx] in the rotated basis. Queries come
//           rotated (and calibrated) and the output leaves rotated: cpu_attention.py applies
//           the format's ``prepare_queries`` / ``finish``, as the reference does.
// Inputs: q (B, H_q, L, D) float32, contiguous, scaled (and prepared for the key format); the
// components' arrays as the cache stores them, any strides with a contiguous last axis
// (buffer views); optional additive mask (B, H_m, L, T) float32 with H_m in {1, H_q}; optional
// sinks (H_q,). Output (B, H_q, L, D_v) float32. Work is split over (b, kv head) pairs between
// this thread and the BLAS shim's helper thread (``kvserve_parallel``) when the shim is loaded.
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
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

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

v16f load(const float* p) { v16f v; std::memcpy(&v, p, sizeof v); return v; }
void store(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
v16f splat(float x) { return v16f{} + x; }

float hsum(v16f v) {
#if defined(__AVX512F__)
  __m512 w;
  std::memcpy(&w, &v, sizeof w);
  return _mm512_reduce_add_ps(w);
#else
  float s = 0;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
#endif
}

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

// exp for x <= 0 (softmax after the max is taken off), to about 2 ulp: 2^n * p(r) with
// |r| <= ln2/2 and a degree-6 polynomial; below -87 it is 0.
v16f exp_neg(v16f x) {
  x = x < -87.0f ? splat(-87.0f) : x;
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
  v16f out = p * two_n;
  return x <= -87.0f ? splat(0.0f) : out;
}

enum Kind { RAW = 0, AFFINE = 1, TURBO = 2 };
enum DType { F32 = 0, F16 = 1, BF16 = 2 };

float element(const void* p, int dtype, int64_t i) {
  if (dtype == F32) return static_cast<const float*>(p)[i];
  if (dtype == F16) return static_cast<float>(static_cast<const mx::float16_t*>(p)[i]);
  return static_cast<float>(static_cast<const mx::bfloat16_t*>(p)[i]);
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

// One token of ``c`` (D values, float32) into ``out``. 4-bit codes come out permuted within
// each 32: the 16 even elements, then the 16 odd ones (byte j holds elements 2j and 2j + 1);
// queries are permuted the same way and outputs permuted back.
void dequant_token(const Component& c, int b, int h, int t, float* out) {
  const uint8_t* p = c.data + b * c.data_stride[0] + h * c.data_stride[1] + t * c.data_stride[2];
  int64_t so = b * c.scale_stride[0] + h * c.scale_stride[1] + t * c.scale_stride[2];
  if (c.kind == RAW) {
    if (c.dtype == F32) std::memcpy(out, p, c.dim * sizeof(float));
    else for (int d = 0; d < c.dim; d++) out[d] = element(p, c.dtype, d);
    return;
  }
  if (c.kind == AFFINE) {
    for (int k = 0; k < c.dim; k += 32) {
      v16f s = splat(element(c.scales, c.dtype, so + k / c.group));
      v16f z = splat(element(c.biases, c.dtype, so + k / c.group));
      if (c.bits == 4) {
        v16u u = widen16(p + k / 2);
        store(out + k, __builtin_convertvector(u & 15u, v16f) * s + z);
        store(out + k + 16, __builtin_convertvector(u >> 4, v16f) * s + z);
      } else {
        store(out + k, __builtin_convertvector(widen16(p + k), v16f) * s + z);
        store(out + k + 16, __builtin_convertvector(widen16(p + k + 16), v16f) * s + z);
      }
    }
    return;
  }
  float norm = static_cast<const float*>(c.scales)[so];
  if (c.bits == 4) {
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
  Component keys, values;
  const float* mask;  // (B, mask_heads, L, T) or null
  const float* sinks;  // (H_q,) or null
  float* out;
};

void attend_pair(const Call& c, int b, int h, std::vector<float>& scratch) {
  const int R = c.Hq / c.Hkv, rows = R * c.L, T = c.T, D = c.D, Dv = c.Dv;
  scratch.resize(size_t(rows) * (T + D + Dv) + D + Dv);
  float* s = scratch.data();  // rows x T scores, then probabilities
  float* qp = s + size_t(rows) * T;  // rows x D permuted queries
  float* acc = qp + size_t(rows) * D;  // rows x Dv accumulators (permuted)
  float* kd = acc + size_t(rows) * Dv;
  float* vd = kd + D;
  for (int r = 0; r < rows; r++) {
    const float* src = c.q + ((size_t(b) * c.Hq + h * R + r / c.L) * c.L + r % c.L) * D;
    for (int d = 0; d < D; d++) qp[size_t(r) * D + permuted(d, c.keys.permuted)] = src[d];
  }
  for (int t = 0; t < T; t++) {
    dequant_token(c.keys, b, h, t, kd);
    for (int r = 0; r < rows; r++) {
      v16f a = {};
      for (int d = 0; d < D; d += 16) a += load(qp + size_t(r) * D + d) * load(kd + d);
      s[size_t(r) * T + t] = hsum(a);
    }
  }
  for (int r = 0; r < rows; r++) {
    float* sr = s + size_t(r) * T;
    int head = h * R + r / c.L, l = r % c.L;
    if (c.mask) {
      const float* m = c.mask + ((size_t(b) * c.mask_heads + (c.mask_heads > 1 ? head : 0)) * c.L + l) * T;
      // A hidden slot (the float32 minimum, from a boolean mask) takes that value whatever
      // its score: a slot outside a window or in padding may hold stale K, even infinite.
      for (int t = 0; t < T; t++) sr[t] = m[t] <= kHidden ? m[t] : sr[t] + m[t];
    }
    float top = c.sinks ? c.sinks[head] : -INFINITY;
    for (int t = 0; t < T; t++) top = sr[t] > top ? sr[t] : top;
    for (int t = 0; t < T; t += 16) {  // the tail through the same exp, padded
      int n = T - t < 16 ? T - t : 16;
      float x[16];
      std::fill(x, x + 16, top);
      std::memcpy(x, sr + t, n * sizeof(float));
      store(x, exp_neg(load(x) - top));
      std::memcpy(sr + t, x, n * sizeof(float));
    }
    // In token order, one at a time: a left-padded row (whose hidden slots add exact zeros)
    // then sums exactly as the same sequence alone, so a batch changes no bit of its rows.
    float sum = c.sinks ? std::exp(c.sinks[head] - top) : 0.0f;
    for (int t = 0; t < T; t++) sum += sr[t];
    float inv = 1.0f / sum;
    for (int t = 0; t < T; t++) sr[t] *= inv;
  }
  std::fill(acc, acc + size_t(rows) * Dv, 0.0f);
  for (int t = 0; t < T; t++) {
    dequant_token(c.values, b, h, t, vd);
    for (int r = 0; r < rows; r++) {
      if (s[size_t(r) * T + t] == 0.0f) continue;  // a hidden slot: its V is never read
      v16f p = splat(s[size_t(r) * T + t]);
      float* ar = acc + size_t(r) * Dv;
      for (int d = 0; d < Dv; d += 16) store(ar + d, load(ar + d) + p * load(vd + d));
    }
  }
  for (int r = 0; r < rows; r++) {
    float* dst = c.out + ((size_t(b) * c.Hq + h * R + r / c.L) * c.L + r % c.L) * Dv;
    for (int d = 0; d < Dv; d++) dst[d] = acc[size_t(r) * Dv + permuted(d, c.values.permuted)];
  }
}

void attend_range(void* ctx, int i0, int i1) {
  const Call& c = *static_cast<const Call*>(ctx);
  std::vector<float> scratch;
  for (int i = i0; i < i1; i++) attend_pair(c, i / c.Hkv, i % c.Hkv, scratch);
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

Component component(const Spec& spec, const mx::array* a, int dim) {
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
  c.permuted = spec.kind != RAW && spec.bits == 4;
  return c;
}

class StoredAttention : public mx::Primitive {
 public:
  StoredAttention(mx::Stream s, Spec keys, Spec values, bool mask, bool sinks)
      : mx::Primitive(s), keys_(std::move(keys)), values_(std::move(values)), mask_(mask), sinks_(sinks) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const auto& q = in[0];
    Call c{};
    c.B = q.shape(0); c.Hq = q.shape(1); c.L = q.shape(2); c.D = q.shape(3); c.Dv = out.shape(3);
    c.Hkv = in[1].shape(1); c.T = in[1].shape(2);
    c.q = q.data<float>();
    size_t next = 1;
    c.keys = component(keys_, &in[next], c.D);
    next += keys_.arrays();
    c.values = component(values_, &in[next], c.Dv);
    next += values_.arrays();
    if (mask_) {
      c.mask = in[next].data<float>();
      c.mask_heads = in[next].shape(1);
      next++;
    }
    if (sinks_) c.sinks = in[next].data<float>();
    c.out = out.data<float>();
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : in) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([c]() mutable {
      static ParallelFn parallel = reinterpret_cast<ParallelFn>(dlsym(RTLD_DEFAULT, "kvserve_parallel"));
      int pairs = c.B * c.Hkv;
      long work = long(pairs) * (c.Hq / c.Hkv) * c.L * c.T * (c.D + c.Dv);
      if (parallel) parallel(attend_range, &c, pairs, work);
      else attend_range(&c, 0, pairs);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvserve's stored-K/V attention runs on the CPU only");
  }

  const char* name() const override { return "KvserveStoredAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const StoredAttention&>(other);
    return keys_ == o.keys_ && values_ == o.values_ && mask_ == o.mask_ && sinks_ == o.sinks_;
  }

 private:
  Spec keys_, values_;
  bool mask_, sinks_;
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
                           std::optional<mx::array> sinks) {
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  Spec ks = spec(k_kind, k_bits, k_group, k_table, keys.size());
  Spec vs = spec(v_kind, v_bits, v_group, v_table, values.size());
  std::vector<mx::array> inputs = {mx::contiguous(mx::astype(q, mx::float32, s), false, s)};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  if (mask) inputs.push_back(mx::contiguous(mx::astype(*mask, mx::float32, s), false, s));
  if (sinks) inputs.push_back(mx::contiguous(mx::astype(*sinks, mx::float32, s), false, s));
  mx::Shape shape = {q.shape(0), q.shape(1), q.shape(2), v_dim};
  auto prim = std::make_shared<StoredAttention>(s, ks, vs, mask.has_value(), sinks.has_value());
  return mx::array(shape, mx::float32, prim, inputs);
}

}  // namespace

NB_MODULE(kvserve_cpu_attention, m) {
  nb::module_::import_("mlx.core");
  m.def("stored_attention", &stored_attention, nb::arg("q"), nb::arg("k_kind"), nb::arg("k_bits"),
        nb::arg("k_group"), nb::arg("k_table"), nb::arg("keys"), nb::arg("v_kind"), nb::arg("v_bits"),
        nb::arg("v_group"), nb::arg("v_table"), nb::arg("values"), nb::arg("v_dim"), nb::arg("mask").none(),
        nb::arg("sinks").none());
}
