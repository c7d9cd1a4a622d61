// Per-layer chains of MLX operations as single primitives, for the CPU.
//
// On the CPU, ``mx.fast.rms_norm`` and ``mx.fast.rope`` run their fallbacks: an RMSNorm is
// eleven operations (square, mean, add, rsqrt, multiplies and the broadcasts between them)
// and a RoPE that gathers per-row positions from a cos/sin table nineteen; a linear layer is
// four (transpose, flatten, matmul, unflatten) and TurboQuant's value encoding some 25. A
// decode step of one row is bound by MLX's cost per operation (about 4 us for an
// elementwise one, 1 us for a view, whatever its size). Here each chain is one operation.
//
// rms_norm(x, w, eps): x float32 (..., D), any strides with a contiguous last axis; w (D,)
//   float32. out = x * rsqrt(mean(x^2) + eps) * w, contiguous float32. A row's result depends
//   on that row only (a left-padded batch gives each row the bits it has alone).
// table_rope(x, cos, sin, offsets, dims): x float32 (B, H, L, D), any strides with a
//   contiguous last axis; cos, sin (P, dims) float32 tables laid out so that
//   rope(x) = x * cos + rotate_half(x) * sin, rotate_half(x) = [x2, x1], with the sign folded
//   into sin (fastpath.py's _Table); offsets (B,) or (1,) int32. Row b's query l takes table
//   row min(offsets[b] + l, limit - 1), limit <= P; dimensions past ``dims`` pass through.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "cpu_vec.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// Offset (in elements) of row r of an array whose rows are its last axis, for any strides.
int64_t row_offset(const mx::array& a, int64_t r) {
  int64_t off = 0;
  for (int d = a.ndim() - 2; d >= 0; d--) {
    off += (r % a.shape(d)) * a.strides()[d];
    r /= a.shape(d);
  }
  return off;
}

void begin(mx::Stream s, const std::vector<mx::array>& in, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(s);
  for (const auto& a : in) encoder.set_input_array(a);
  encoder.set_output_array(out);
}

class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream s, float eps) : mx::Primitive(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    const auto& x = in[0];
    auto& out = outputs[0];
    begin(stream(), in, out);
    int64_t D = x.shape(-1), rows = x.size() / D;
    int64_t ls = x.strides().back();
    std::vector<int64_t> offsets(rows);
    for (int64_t r = 0; r < rows; r++) offsets[r] = row_offset(x, r);
    const float* xp = x.data<float>();
    const float* wp = in[1].data<float>();
    float* op = out.data<float>();
    float eps = eps_;
    mx::cpu::get_command_encoder(stream()).dispatch([=, offsets = std::move(offsets)]() {
      for (int64_t r = 0; r < rows; r++) {
        float* o = op + r * D;
        const float* src = xp + offsets[r];
        if (ls != 1) {  // a strided last axis (rare): gather the row first
          for (int64_t i = 0; i < D; i++) o[i] = src[i * ls];
          src = o;
        }
        float ss = 0.f;
        for (int64_t i = 0; i < D; i++) ss += src[i] * src[i];
        float scale = 1.f / std::sqrt(ss / float(D) + eps);
        for (int64_t i = 0; i < D; i++) o[i] = (src[i] * scale) * wp[i];
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvserve's RMSNorm primitive runs on the CPU only");
  }

  const char* name() const override { return "KvserveRmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class TableRope : public mx::Primitive {
 public:
  TableRope(mx::Stream s, int dims, int limit) : mx::Primitive(s), dims_(dims), limit_(limit) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    const auto& x = in[0];
    auto& out = outputs[0];
    begin(stream(), in, out);
    int64_t B = x.shape(0), H = x.shape(1), L = x.shape(2), D = x.shape(3);
    int64_t P = limit_;
    const auto& st = x.strides();
    int64_t sb = st[0], sh = st[1], sl = st[2], sd = st[3];
    const float* xp = x.data<float>();
    const float* cp = in[1].data<float>();
    const float* sp = in[2].data<float>();
    const int32_t* offp = in[3].data<int32_t>();
    int64_t n_off = in[3].size();
    float* op = out.data<float>();
    int dims = dims_, half = dims_ / 2;
    mx::cpu::get_command_encoder(stream()).dispatch([=]() {
      std::vector<float> tmp(sd != 1 ? D : 0);
      for (int64_t b = 0; b < B; b++) {
        int64_t start = offp[n_off == 1 ? 0 : b];
        for (int64_t h = 0; h < H; h++) {
          for (int64_t l = 0; l < L; l++) {
            int64_t p = start + l < P - 1 ? start + l : P - 1;
            const float* row = xp + b * sb + h * sh + l * sl;
            const float* c = cp + p * dims;
            const float* s = sp + p * dims;
            float* o = op + ((b * H + h) * L + l) * D;
            if (sd != 1) {  // a strided last axis (rare): read a contiguous copy
              for (int64_t i = 0; i < D; i++) tmp[i] = row[i * sd];
              row = tmp.data();
            }
            for (int i = 0; i < half; i++) o[i] = row[i] * c[i] + row[i + half] * s[i];
            for (int i = half; i < dims; i++) o[i] = row[i] * c[i] + row[i - half] * s[i];
            for (int64_t i = dims; i < D; i++) o[i] = row[i];
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvserve's table RoPE primitive runs on the CPU only");
  }

  const char* name() const override { return "KvserveTableRope"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const TableRope&>(other);
    return dims_ == o.dims_ && limit_ == o.limit_;
  }

 private:
  int dims_, limit_;
};

// cblas_sgemm as MLX's CPU matmul calls it: the BLAS shim's (server/models/blas_shim.c),
// which is in the global scope when it serves MLX; null otherwise, and linear() is not offered.
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                       int);
Sgemm shim_sgemm() {
  static Sgemm fn = dlsym(RTLD_DEFAULT, "kvserve_blas_product_ns")
                        ? reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"))
                        : nullptr;
  return fn;
}

class Linear : public mx::Primitive {
 public:
  Linear(mx::Stream s, bool bias) : mx::Primitive(s), bias_(bias) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    const auto& x = in[0];
    const auto& w = in[1];
    auto& out = outputs[0];
    begin(stream(), in, out);
    int64_t K = x.shape(-1), N = w.shape(0), M = x.size() / K;
    int64_t ls = x.strides().back();
    bool dense = x.flags().row_contiguous;
    std::vector<int64_t> offsets(dense ? 0 : M);
    for (int64_t r = 0; r < int64_t(offsets.size()); r++) offsets[r] = row_offset(x, r);
    const float* xp = x.data<float>();
    const float* wp = w.data<float>();
    const float* bp = bias_ ? in[2].data<float>() : nullptr;
    float* op = out.data<float>();
    mx::cpu::get_command_encoder(stream()).dispatch([=, offsets = std::move(offsets)]() {
      std::vector<float> rows(dense ? 0 : M * K);  // a strided x is gathered first, as MLX copies it
      for (int64_t r = 0; r < int64_t(offsets.size()); r++)
        for (int64_t i = 0; i < K; i++) rows[r * K + i] = xp[offsets[r] + i * ls];
      const float* a = dense ? xp : rows.data();
      for (int64_t r = 0; bp && r < M; r++) std::memcpy(op + r * N, bp, N * sizeof(float));
      // Row-major x (M, K) times w (N, K) transposed, as MLX's matmul of x @ w.T.
      shim_sgemm()(101, 111, 112, M, N, K, 1.f, a, K, wp, K, bp ? 1.f : 0.f, op, N);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvserve's linear primitive runs on the CPU only");
  }

  const char* name() const override { return "KvserveLinear"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return bias_ == static_cast<const Linear&>(other).bias_;
  }

 private:
  bool bias_;
};

// TurboQuant's encoding of vectors on the WHT path (no calibration scale): norm, unit
// direction rotated by pi, index of the nearest centroid (the number of boundaries below
// each coordinate), indices packed little-endian at ``bits`` bits. In MLX operations it is
// some 25 operations per call (turbo_codec.TurboCodec.encode), once per layer and step.
class TurboEncode : public mx::Primitive {
 public:
  TurboEncode(mx::Stream s, int bits, float eps) : mx::Primitive(s), bits_(bits), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    const auto& x = in[0];
    auto& packed = outputs[0];
    auto& norms = outputs[1];
    begin(stream(), in, packed);
    norms.set_data(mx::allocator::malloc(norms.nbytes()));
    mx::cpu::get_command_encoder(stream()).set_output_array(norms);
    int64_t D = x.shape(-1), rows = x.size() / D, W = packed.shape(-1);
    int64_t ls = x.strides().back();
    std::vector<int64_t> offsets(rows);
    for (int64_t r = 0; r < rows; r++) offsets[r] = row_offset(x, r);
    const float* xp = x.data<float>();
    const float* pi = in[1].data<float>();
    const float* bounds = in[2].data<float>();
    int n_bounds = in[2].size(), bits = bits_;
    float eps = eps_;
    uint32_t* pp = packed.data<uint32_t>();
    float* np_ = norms.data<float>();
    mx::cpu::get_command_encoder(stream()).dispatch([=, offsets = std::move(offsets)]() {
      std::vector<float> u(D);
      for (int64_t r = 0; r < rows; r++) {
        const float* src = xp + offsets[r];
        float ss = 0.f;
        for (int64_t i = 0; i < D; i++) ss += src[i * ls] * src[i * ls];
        float n = std::sqrt(ss);
        float div = n > eps ? n : eps;
        for (int64_t i = 0; i < D; i++) u[i] = src[i * ls] / div;
        uint32_t* words = pp + r * W;
        std::fill(words, words + W, 0u);
        for (int64_t j = 0; j < D; j++) {
          const float* row = pi + j * D;
          float y = 0.f;
          for (int64_t i = 0; i < D; i++) y += u[i] * row[i];
          uint32_t idx = 0;
          for (int b = 0; b < n_bounds; b++) idx += y > bounds[b];
          int64_t bit = j * bits;
          words[bit / 32] |= idx << (bit % 32);
          if (bit % 32 + bits > 32) words[bit / 32 + 1] |= idx >> (32 - bit % 32);
        }
        np_[r] = n;
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvserve's turbo encode primitive runs on the CPU only");
  }

  const char* name() const override { return "KvserveTurboEncode"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const TurboEncode&>(other);
    return bits_ == o.bits_ && eps_ == o.eps_;
  }

 private:
  int bits_;
  float eps_;
};

// silu(gate) * up = gate / (1 + exp(-gate)) * up: mlx-lm's ``swiglu``, which MLX compiles on
// the CPU into a kernel with a scalar exp and a library call per multiply-add (after the
// products and attention, the largest cost of a prompt chunk in a perf profile). Vectorized,
// 16 at a time.
class SwiGLU : public mx::Primitive {
 public:
  explicit SwiGLU(mx::Stream s) : mx::Primitive(s) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    const auto& g = in[0];
    const auto& u = in[1];
    auto& out = outputs[0];
    begin(stream(), in, out);
    int64_t D = g.shape(-1), rows = g.size() / D;
    bool dense = g.flags().row_contiguous && u.flags().row_contiguous;
    std::vector<int64_t> go(dense ? 0 : rows), uo(dense ? 0 : rows);
    for (int64_t r = 0; r < int64_t(go.size()); r++) go[r] = row_offset(g, r), uo[r] = row_offset(u, r);
    int64_t gs = g.strides().back(), us = u.strides().back();
    const float* gp = g.data<float>();
    const float* up = u.data<float>();
    float* op = out.data<float>();
    mx::cpu::get_command_encoder(stream()).dispatch([=, go = std::move(go), uo = std::move(uo)]() {
      if (dense) {
        int64_t n = rows * D, i = 0;
        for (; i + 16 <= n; i += 16) {
          v16f x = load(gp + i);
          v16f y = x / (1.0f + exp_clamped(-x)) * load(up + i);
          store(op + i, y);
        }
        for (; i < n; i++) op[i] = gp[i] / (1.0f + std::exp(-gp[i])) * up[i];
        return;
      }
      for (int64_t r = 0; r < rows; r++)  // views (rare): one element at a time
        for (int64_t i = 0; i < D; i++) {
          float x = gp[go[r] + i * gs];
          op[r * D + i] = x / (1.0f + std::exp(-x)) * up[uo[r] + i * us];
        }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvserve's SwiGLU primitive runs on the CPU only");
  }

  const char* name() const override { return "KvserveSwiGLU"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

// Each front returns nothing where it does not serve; the caller keeps the MLX path then.
std::optional<mx::array> rms_norm(const mx::array& x, const mx::array& w, float eps) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32 || w.ndim() != 1 || x.ndim() < 1 ||
      w.shape(0) != x.shape(-1))
    return std::nullopt;
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(cpu_stream(), eps), {x, w});
}

mx::array table_rope(const mx::array& x, const mx::array& cos, const mx::array& sin, const mx::array& offsets,
                     int dims, int limit) {
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<TableRope>(s, dims, limit), {x, cos, sin, offsets});
}

// x (..., K) @ w.T (+ bias) with w (N, K) an evaluated row-contiguous weight; None where the
// shim does not serve or w is a view (the caller keeps MLX's matmul).
std::optional<mx::array> linear(const mx::array& x, const mx::array& w, std::optional<mx::array> bias) {
  if (!shim_sgemm() || x.dtype() != mx::float32 || w.dtype() != mx::float32 || w.ndim() != 2 || x.ndim() < 1 ||
      x.shape(-1) != w.shape(1) || !w.is_available() || !w.flags().row_contiguous)
    return std::nullopt;
  if (bias && (bias->dtype() != mx::float32 || bias->ndim() != 1 || bias->shape(0) != w.shape(0)))
    return std::nullopt;
  auto s = cpu_stream();
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  std::vector<mx::array> inputs = {x, w};
  if (bias) inputs.push_back(*bias);
  return mx::array(shape, mx::float32, std::make_shared<Linear>(s, bias.has_value()), inputs);
}

// x (..., D) float32 -> (packed (..., ceil(D * bits / 32)) uint32, norms (..., 1) float32).
std::vector<mx::array> turbo_encode(const mx::array& x, const mx::array& pi, const mx::array& boundaries, int bits,
                                    float eps) {
  auto s = cpu_stream();
  mx::Shape words = x.shape(), norms = x.shape();
  words.back() = int((int64_t(x.shape(-1)) * bits + 31) / 32);
  norms.back() = 1;
  return mx::array::make_arrays({words, norms}, {mx::uint32, mx::float32},
                                std::make_shared<TurboEncode>(s, bits, eps), {x, pi, boundaries});
}

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(cpu_stream()), {gate, up});
}

}  // namespace

NB_MODULE(kvserve_cpu_ops, m) {
  nb::module_::import_("mlx.core");
  m.def("linear", &linear, nb::arg("x"), nb::arg("w"), nb::arg("bias").none());
  m.def("turbo_encode", &turbo_encode, nb::arg("x"), nb::arg("pi"), nb::arg("boundaries"), nb::arg("bits"),
        nb::arg("eps"));
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("up"));
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("w"), nb::arg("eps"));
  m.def("table_rope", &table_rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("offsets"),
        nb::arg("dims"), nb::arg("limit"));
}
