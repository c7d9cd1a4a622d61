// Decode attention over affine-quantized K/V on the CPU, as an MLX primitive.
//
// MLX's CPU ``quantized_matmul`` decodes codes one element at a time (about 1.5 G
// multiply-adds/s here), so attention over an affine4 cache cost 3-4x the same attention over
// float32 K/V. This kernel reads each stored token once: the token's codes are dequantized 32
// at a time in vector registers, scored against every query row of its KV head (the n_rep
// query heads times L queries), and, after the softmax, weighted into the output the same way.
// Inputs (see cpu_attention.py, which builds and registers it):
//   q (B, H_q, L, D) float32, contiguous, already multiplied by the softmax scale;
//   keys and values: codes (uint32), scales, biases (float32/float16/bfloat16) as the cache
//   stores them, (B, H_kv, T, .), any strides with a contiguous last axis (buffer views);
//   optional additive mask (B, H_m, L, T) float32 with H_m in {1, H_q}; optional sinks (H_q,).
// Output (B, H_q, L, D_v) float32. Work is split over (b, kv head) pairs between this thread
// and the BLAS shim's helper thread (``kvserve_parallel``) when the shim is loaded.
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

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

template <typename S>
float to_f32(S x) { return static_cast<float>(x); }

// One stored component (keys or values): codes, scales and biases of (b, h), token t.
struct Component {
  const uint8_t* codes;
  const void* scales;
  const void* biases;
  int64_t code_stride[3];  // bytes per b, h, t
  int64_t scale_stride[3];  // elements per b, h, t
  int bits, group, dim;
};

// Dequantize one token of ``c`` (D values) into ``out``. 4-bit values come out permuted
// within each 32: the 16 even elements, then the 16 odd ones (byte j holds elements 2j and
// 2j + 1); queries are permuted the same way, and outputs permuted back.
template <typename S>
void dequant_token(const Component& c, int b, int h, int t, float* out) {
  const uint8_t* codes = c.codes + b * c.code_stride[0] + h * c.code_stride[1] + t * c.code_stride[2];
  int64_t so = b * c.scale_stride[0] + h * c.scale_stride[1] + t * c.scale_stride[2];
  const S* sc = static_cast<const S*>(c.scales) + so;
  const S* bi = static_cast<const S*>(c.biases) + so;
  for (int k = 0; k < c.dim; k += 32) {
    v16f s = splat(to_f32(sc[k / c.group])), z = splat(to_f32(bi[k / c.group]));
    if (c.bits == 4) {
      v16u u = widen16(codes + k / 2);
      store(out + k, __builtin_convertvector(u & 15u, v16f) * s + z);
      store(out + k + 16, __builtin_convertvector(u >> 4, v16f) * s + z);
    } else {
      store(out + k, __builtin_convertvector(widen16(codes + k), v16f) * s + z);
      store(out + k + 16, __builtin_convertvector(widen16(codes + k + 16), v16f) * s + z);
    }
  }
}

// Position of element d in the permuted order of a 4-bit component.
int permuted(int d, int bits) {
  if (bits != 4) return d;
  int base = d & ~31, i = d & 31;
  return base + (i % 2) * 16 + i / 2;
}

struct Call {
  int B, Hq, Hkv, L, T, D, Dv, mask_heads;
  const float* q;
  Component keys, values;
  int key_dtype, value_dtype;  // 0 float32, 1 float16, 2 bfloat16
  const float* mask;  // (B, mask_heads, L, T) or null
  const float* sinks;  // (H_q,) or null
  float* out;
};

template <typename KS, typename VS>
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
    for (int d = 0; d < D; d++) qp[size_t(r) * D + permuted(d, c.keys.bits)] = src[d];
  }
  for (int t = 0; t < T; t++) {
    dequant_token<KS>(c.keys, b, h, t, kd);
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
      for (int t = 0; t < T; t++) sr[t] += m[t];
    }
    float top = c.sinks ? c.sinks[head] : -INFINITY;
    for (int t = 0; t < T; t++) top = sr[t] > top ? sr[t] : top;
    float sum = c.sinks ? std::exp(c.sinks[head] - top) : 0.0f;
    int t = 0;
    for (; t + 16 <= T; t += 16) {
      v16f p = exp_neg(load(sr + t) - top);
      store(sr + t, p);
      sum += hsum(p);
    }
    for (; t < T; t++) sum += (sr[t] = std::exp(sr[t] - top));
    float inv = 1.0f / sum;
    for (t = 0; t < T; t++) sr[t] *= inv;
  }
  std::fill(acc, acc + size_t(rows) * Dv, 0.0f);
  for (int t = 0; t < T; t++) {
    dequant_token<VS>(c.values, b, h, t, vd);
    for (int r = 0; r < rows; r++) {
      v16f p = splat(s[size_t(r) * T + t]);
      float* ar = acc + size_t(r) * Dv;
      for (int d = 0; d < Dv; d += 16) store(ar + d, load(ar + d) + p * load(vd + d));
    }
  }
  for (int r = 0; r < rows; r++) {
    float* dst = c.out + ((size_t(b) * c.Hq + h * R + r / c.L) * c.L + r % c.L) * Dv;
    for (int d = 0; d < Dv; d++) dst[d] = acc[size_t(r) * Dv + permuted(d, c.values.bits)];
  }
}

template <typename KS, typename VS>
void attend_range(void* ctx, int i0, int i1) {
  const Call& c = *static_cast<const Call*>(ctx);
  std::vector<float> scratch;
  for (int i = i0; i < i1; i++) attend_pair<KS, VS>(c, i / c.Hkv, i % c.Hkv, scratch);
}

using RangeFn = void (*)(void*, int, int);
using ParallelFn = void (*)(RangeFn, void*, int, long);

template <typename KS>
RangeFn range_for(int value_dtype) {
  if (value_dtype == 1) return attend_range<KS, mx::float16_t>;
  if (value_dtype == 2) return attend_range<KS, mx::bfloat16_t>;
  return attend_range<KS, float>;
}

RangeFn range_for(int key_dtype, int value_dtype) {
  if (key_dtype == 1) return range_for<mx::float16_t>(value_dtype);
  if (key_dtype == 2) return range_for<mx::bfloat16_t>(value_dtype);
  return range_for<float>(value_dtype);
}

int dtype_code(mx::Dtype t) {
  if (t == mx::float32) return 0;
  if (t == mx::float16) return 1;
  if (t == mx::bfloat16) return 2;
  throw std::invalid_argument("scales must be float32, float16 or bfloat16");
}

Component component(const mx::array& codes, const mx::array& scales, const mx::array& biases, int bits,
                    int group, int dim) {
  Component c;
  c.codes = codes.data<uint8_t>();
  c.scales = scales.data<void>();
  c.biases = biases.data<void>();
  for (int i = 0; i < 3; i++) {
    c.code_stride[i] = codes.strides()[i] * 4;  // uint32 words, addressed in bytes
    c.scale_stride[i] = scales.strides()[i];
  }
  c.bits = bits;
  c.group = group;
  c.dim = dim;
  return c;
}

class AffineAttention : public mx::Primitive {
 public:
  AffineAttention(mx::Stream s, int kbits, int kgroup, int vbits, int vgroup, bool mask, bool sinks)
      : mx::Primitive(s), kbits_(kbits), kgroup_(kgroup), vbits_(vbits), vgroup_(vgroup), mask_(mask),
        sinks_(sinks) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const auto& q = in[0];
    int D = q.shape(3), Dv = out.shape(3);
    Call c{};
    c.B = q.shape(0); c.Hq = q.shape(1); c.L = q.shape(2); c.D = D; c.Dv = Dv;
    c.Hkv = in[1].shape(1); c.T = in[1].shape(2);
    c.q = q.data<float>();
    c.keys = component(in[1], in[2], in[3], kbits_, kgroup_, D);
    c.values = component(in[4], in[5], in[6], vbits_, vgroup_, Dv);
    c.key_dtype = dtype_code(in[2].dtype());
    c.value_dtype = dtype_code(in[5].dtype());
    size_t next = 7;
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
    encoder.dispatch([c, fn = range_for(c.key_dtype, c.value_dtype)]() mutable {
      static ParallelFn parallel = reinterpret_cast<ParallelFn>(dlsym(RTLD_DEFAULT, "kvserve_parallel"));
      int pairs = c.B * c.Hkv;
      long work = long(pairs) * (c.Hq / c.Hkv) * c.L * c.T * (c.D + c.Dv);
      if (parallel) parallel(fn, &c, pairs, work);
      else fn(&c, 0, pairs);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvserve affine attention runs on the CPU only");
  }

  const char* name() const override { return "KvserveAffineAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AffineAttention&>(other);
    return kbits_ == o.kbits_ && kgroup_ == o.kgroup_ && vbits_ == o.vbits_ && vgroup_ == o.vgroup_ &&
           mask_ == o.mask_ && sinks_ == o.sinks_;
  }

 private:
  int kbits_, kgroup_, vbits_, vgroup_;
  bool mask_, sinks_;
};

// The array arguments as the primitive expects them; shapes are checked in Python.
mx::array affine_attention(const mx::array& q, const mx::array& kc, const mx::array& ks, const mx::array& kb,
                           int kbits, int kgroup, const mx::array& vc, const mx::array& vs,
                           const mx::array& vb, int vbits, int vgroup, std::optional<mx::array> mask,
                           std::optional<mx::array> sinks) {
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  std::vector<mx::array> inputs = {mx::contiguous(mx::astype(q, mx::float32, s), false, s), kc, ks, kb, vc, vs, vb};
  if (mask) inputs.push_back(mx::contiguous(mx::astype(*mask, mx::float32, s), false, s));
  if (sinks) inputs.push_back(mx::contiguous(mx::astype(*sinks, mx::float32, s), false, s));
  int Dv = vc.shape(3) * 32 / vbits;
  mx::Shape shape = {q.shape(0), q.shape(1), q.shape(2), Dv};
  auto prim = std::make_shared<AffineAttention>(s, kbits, kgroup, vbits, vgroup, mask.has_value(), sinks.has_value());
  return mx::array(shape, mx::float32, prim, inputs);
}

}  // namespace

NB_MODULE(kvserve_cpu_attention, m) {
  nb::module_::import_("mlx.core");
  m.def("affine_attention", &affine_attention, nb::arg("q"), nb::arg("kc"), nb::arg("ks"), nb::arg("kb"),
        nb::arg("kbits"), nb::arg("kgroup"), nb::arg("vc"), nb::arg("vs"), nb::arg("vb"), nb::arg("vbits"),
        nb::arg("vgroup"), nb::arg("mask").none(), nb::arg("sinks").none());
}
