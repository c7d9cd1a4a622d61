// Per-layer chains of MLX operations as single primitives, for the CPU.
//
// On the CPU, ``mx.fast.rms_norm`` and ``mx.fast.rope`` run their fallbacks: an RMSNorm is
// eleven operations (square, mean, add, rsqrt, multiplies and the broadcasts between them)
// and a RoPE that gathers per-row positions from a cos/sin table nineteen; a linear layer is
// four (transpose, flatten, matmul, unflatten) and TurboQuant's value encoding some 25. A
// decode step of one row is bound by MLX's cost per operation, which hardly depends on its
// size (bench/step_profile.py --mlx-layer-ops). Here each chain is one operation.
//
// rms_norm(x, w, eps): x float32 (..., D), any strides with a contiguous last axis; w (D,)
//   float32. out = x * rsqrt(mean(x^2) + eps) * w, contiguous float32. A row's result depends
//   on that row only (a left-padded batch gives each row the bits it has alone).
// table_rope(x, cos, sin, offsets, dims): x float32 (B, H, L, D), any strides with a
//   contiguous last axis; cos, sin (P, dims) float32 tables laid out so that
//   rope(x) = x * cos + rotate_half(x) * sin, rotate_half(x) = [x2, x1], with the sign folded
//   into sin (fastpath.py's _Table); offsets (B,) or (1,) int32. Row b's query l takes table
//   row clamp(offsets[b] + l, 0, limit - 1), limit <= P; dimensions past ``dims`` pass through.
//   An offset below 0 is a left-padded row of a batched prefill (its padding is masked): the
//   clamp keeps those reads inside the table.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
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

// The rows (last axis) of a float32 input with any strides. Row r is read in place where
// the last axis is contiguous, else gathered into the caller's buffer (views are rare here:
// a transposed or broadcast input).
struct Rows {
  const float* data;
  int64_t width, step;
  std::vector<int64_t> offsets;

  explicit Rows(const mx::array& x)
      : data(x.data<float>()), width(x.shape(-1)), step(x.strides().back()), offsets(x.size() / x.shape(-1)) {
    for (int64_t r = 0; r < int64_t(offsets.size()); r++) offsets[r] = row_offset(x, r);
  }

  const float* row(int64_t r, float* buf) const {
    const float* p = data + offsets[r];
    if (step == 1) return p;
    for (int64_t i = 0; i < width; i++) buf[i] = p[i * step];
    return buf;
  }
};

// A primitive of this extension: CPU only; eval_cpu allocates and registers its outputs.
class CpuPrimitive : public mx::Primitive {
 public:
  explicit CpuPrimitive(mx::Stream s) : mx::Primitive(s) {}

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

 protected:
  mx::cpu::CommandEncoder& begin(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : in) encoder.set_input_array(a);
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
    }
    return encoder;
  }
};

class RmsNorm : public CpuPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : CpuPrimitive(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& encoder = begin(in, outputs);
    Rows x(in[0]);
    const float* wp = in[1].data<float>();
    float* op = outputs[0].data<float>();
    float eps = eps_;
    encoder.dispatch([=, x = std::move(x)]() {
      int64_t D = x.width;
      for (int64_t r = 0; r < int64_t(x.offsets.size()); r++) {
        float* o = op + r * D;
        const float* src = x.row(r, o);  // a strided row is gathered into its output first
        float ss = 0.f;
        for (int64_t i = 0; i < D; i++) ss += src[i] * src[i];
        float scale = 1.f / std::sqrt(ss / float(D) + eps);
        for (int64_t i = 0; i < D; i++) o[i] = (src[i] * scale) * wp[i];
      }
    });
  }

  const char* name() const override { return "KvserveRmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class TableRope : public CpuPrimitive {
 public:
  TableRope(mx::Stream s, int dims, int limit) : CpuPrimitive(s), dims_(dims), limit_(limit) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    const auto& x = in[0];
    auto& out = outputs[0];
    auto& encoder = begin(in, outputs);
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
    encoder.dispatch([=]() {
      std::vector<float> tmp(sd != 1 ? D : 0);
      for (int64_t b = 0; b < B; b++) {
        int64_t start = offp[n_off == 1 ? 0 : b];
        for (int64_t h = 0; h < H; h++) {
          for (int64_t l = 0; l < L; l++) {
            int64_t p = std::clamp<int64_t>(start + l, 0, P - 1);
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

class Linear : public CpuPrimitive {
 public:
  Linear(mx::Stream s, bool bias) : CpuPrimitive(s), bias_(bias) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& encoder = begin(in, outputs);
    bool dense = in[0].flags().row_contiguous;
    Rows x(in[0]);
    int64_t K = x.width, N = in[1].shape(0), M = x.offsets.size();
    const float* wp = in[1].data<float>();
    const float* bp = bias_ ? in[2].data<float>() : nullptr;
    float* op = outputs[0].data<float>();
    encoder.dispatch([=, x = std::move(x)]() {
      std::vector<float> rows(dense ? 0 : M * K);  // a view is gathered first, as MLX copies it
      if (!dense)
        for (int64_t r = 0; r < M; r++) {
          float* dst = rows.data() + r * K;
          const float* p = x.row(r, dst);
          if (p != dst) std::memcpy(dst, p, K * sizeof(float));
        }
      const float* a = dense ? x.data : rows.data();
      for (int64_t r = 0; bp && r < M; r++) std::memcpy(op + r * N, bp, N * sizeof(float));
      // Row-major x (M, K) times w (N, K) transposed, as MLX's matmul of x @ w.T.
      shim_sgemm()(101, 111, 112, M, N, K, 1.f, a, K, wp, K, bp ? 1.f : 0.f, op, N);
    });
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
class TurboEncode : public CpuPrimitive {
 public:
  TurboEncode(mx::Stream s, int bits, float eps) : CpuPrimitive(s), bits_(bits), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& encoder = begin(in, outputs);
    Rows x(in[0]);
    int64_t D = x.width, rows = x.offsets.size(), W = outputs[0].shape(-1);
    const float* pi = in[1].data<float>();
    const float* bounds = in[2].data<float>();
    int n_bounds = in[2].size(), bits = bits_;
    float eps = eps_;
    uint32_t* pp = outputs[0].data<uint32_t>();
    float* np_ = outputs[1].data<float>();
    encoder.dispatch([=, x = std::move(x)]() {
      std::vector<float> u(D), gathered(D), y(D), pi_t(D * D);
      std::vector<uint32_t> idx(D);
      // pi transposed: rotated[j] = sum_i u[i] pi[j][i] takes 16 outputs per FMA, with u[i]
      // broadcast, reading pi_t's row i (a scalar dot product per output, one dependent chain
      // of D multiply-adds, took 61 ms a layer for a 4,000-token prompt of the default model,
      // nearly all of a request's join; this loop, 5 ms).
      for (int64_t j = 0; j < D; j++)
        for (int64_t i = 0; i < D; i++) pi_t[i * D + j] = pi[j * D + i];
      for (int64_t r = 0; r < rows; r++) {
        const float* src = x.row(r, gathered.data());
        float ss = 0.f;
        for (int64_t i = 0; i < D; i++) ss += src[i] * src[i];
        float n = std::sqrt(ss);
        float div = n > eps ? n : eps;
        for (int64_t i = 0; i < D; i++) u[i] = src[i] / div;
        rotate(u.data(), pi_t.data(), pi, D, y.data());
        count_below(y.data(), bounds, n_bounds, D, idx.data());
        uint32_t* words = pp + r * W;
        std::fill(words, words + W, 0u);
        for (int64_t j = 0; j < D; j++) {
          int64_t bit = j * bits;
          words[bit / 32] |= idx[j] << (bit % 32);
          if (bit % 32 + bits > 32) words[bit / 32 + 1] |= idx[j] >> (32 - bit % 32);
        }
        np_[r] = n;
      }
    });
  }

  // y = pi u for one unit row: 16 outputs at a time where D allows it (each output's sum
  // still runs in i order), else one dot product per output.
  static void rotate(const float* u, const float* pi_t, const float* pi, int64_t D, float* y) {
    int64_t j = 0;
    for (; j + 64 <= D; j += 64) {
      v16f a0{}, a1{}, a2{}, a3{};
      for (int64_t i = 0; i < D; i++) {
        v16f ui = splat(u[i]);
        const float* row = pi_t + i * D + j;
        a0 += ui * load(row); a1 += ui * load(row + 16); a2 += ui * load(row + 32); a3 += ui * load(row + 48);
      }
      store(y + j, a0); store(y + j + 16, a1); store(y + j + 32, a2); store(y + j + 48, a3);
    }
    for (; j + 16 <= D; j += 16) {
      v16f a{};
      for (int64_t i = 0; i < D; i++) a += splat(u[i]) * load(pi_t + i * D + j);
      store(y + j, a);
    }
    for (; j < D; j++) {
      float a = 0.f;
      for (int64_t i = 0; i < D; i++) a += u[i] * pi[j * D + i];
      y[j] = a;
    }
  }

  // idx[j] = how many boundaries lie below y[j]: the nearest centroid's index.
  static void count_below(const float* y, const float* bounds, int n_bounds, int64_t D, uint32_t* idx) {
    int64_t j = 0;
    for (; j + 16 <= D; j += 16) {
      v16f v = load(y + j);
      v16i c{};
      for (int b = 0; b < n_bounds; b++) c -= v > splat(bounds[b]);  // true is -1
      std::memcpy(idx + j, &c, sizeof c);
    }
    for (; j < D; j++) {
      uint32_t c = 0;
      for (int b = 0; b < n_bounds; b++) c += y[j] > bounds[b];
      idx[j] = c;
    }
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
class SwiGLU : public CpuPrimitive {
 public:
  explicit SwiGLU(mx::Stream s) : CpuPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& encoder = begin(in, outputs);
    bool dense = in[0].flags().row_contiguous && in[1].flags().row_contiguous;
    Rows g(in[0]), u(in[1]);
    float* op = outputs[0].data<float>();
    encoder.dispatch([=, g = std::move(g), u = std::move(u)]() {
      int64_t D = g.width, n = D * g.offsets.size(), i = 0;
      if (dense) {
        for (; i + 16 <= n; i += 16) {
          v16f x = load(g.data + i);
          store(op + i, x / (1.0f + exp_clamped(-x)) * load(u.data + i));
        }
        for (; i < n; i++) op[i] = g.data[i] / (1.0f + std::exp(-g.data[i])) * u.data[i];
        return;
      }
      std::vector<float> gb(D), ub(D);
      for (int64_t r = 0; r < int64_t(g.offsets.size()); r++) {  // views (rare): one element at a time
        const float* gr = g.row(r, gb.data());
        const float* ur = u.row(r, ub.data());
        for (int64_t j = 0; j < D; j++) op[r * D + j] = gr[j] / (1.0f + std::exp(-gr[j])) * ur[j];
      }
    });
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

std::optional<mx::array> table_rope(const mx::array& x, const mx::array& cos, const mx::array& sin,
                                    const mx::array& offsets, int dims, int limit) {
  if (x.dtype() != mx::float32 || x.ndim() != 4 || cos.dtype() != mx::float32 || sin.dtype() != mx::float32 ||
      cos.ndim() != 2 || cos.shape() != sin.shape() || dims % 2 || cos.shape(1) != dims || dims > x.shape(3) ||
      (offsets.size() != 1 && offsets.size() != size_t(x.shape(0))) || limit <= 0 || limit > cos.shape(0))
    return std::nullopt;
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<TableRope>(s, dims, limit),
                   {x, cos, sin, mx::astype(offsets, mx::int32, s)});
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

std::optional<mx::array> swiglu(const mx::array& gate, const mx::array& up) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.shape() != up.shape()) return std::nullopt;
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
