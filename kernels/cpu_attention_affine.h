// Attention over affine K/V without decoding the codes to floats (cpu_attention.cpp includes
// this inside its namespace, after the float scoring kernels it reuses).
//
// A stored element is s * code + z, with one scale and bias per group of 32-128 dimensions.
// Keys: q . k = sum over groups of s * (q . codes) + z * sum(q), so the codes are scored
// unscaled by the float kernels and each group's scale and bias applied once per token and
// row. Values: sum_t p_t v_t = sum_t (p_t s_t) codes_t + sum_t p_t z_t. Decoding every
// element first (one multiply-add each, written out and read back, then transposed for the
// scores) cost more than the attention itself. Turbo's 4-bit values are weighted the same
// way (accumulate_turbo4_rows): a norm per token for the scale, centroids for the codes.
#pragma once

#if defined(__AVX512F__)
// ``table`` at each lane's low 4 bits, the bits above ignored (vpermps reads only those).
inline v16f lookup16(v16u u, v16f table) {
  __m512 t;
  __m512i i;
  std::memcpy(&t, &table, sizeof t);
  std::memcpy(&i, &u, sizeof i);
  __m512 f = _mm512_permutexvar_ps(i, t);
  v16f x;
  std::memcpy(&x, &f, sizeof x);
  return x;
}
#endif

// 4-bit codes (each lane's low 4 bits; the bits above are ignored) as float32: one lookup in a
// register of 0..15, where masking and converting took two instructions on the ports the
// multiply-adds need.
inline v16f nibbles_as_float(v16u u) {
#if defined(__AVX512F__)
  return lookup16(u, v16f{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
#else
  return __builtin_convertvector(u & 15u, v16f);
#endif
}

// Code i of each lane's word (BITS-bit codes) as float32.
template <int BITS>
inline v16f code_as_float(v16u u, int i) {
  if constexpr (BITS == 4) return nibbles_as_float(i ? u >> (4 * i) : u);
  else return __builtin_convertvector((u >> (BITS * i)) & ((1u << BITS) - 1), v16f);
}

// What a 4-bit value code stands for, 16 lanes at a time: affine codes are their own value
// (scaled per group later), turbo codes index the 16 centroids of the rotated basis.
struct Nibbles {
  v16f operator()(v16u u) const { return nibbles_as_float(u); }
};

struct Centroids {
  v16f table;
  v16f operator()(v16u u) const {
#if defined(__AVX512F__)
    return lookup16(u, table);
#else
    v16f x;
    for (int l = 0; l < 16; l++) x[l] = table[u[l] & 15u];
    return x;
#endif
  }
};

// Affine keys [t, t + m) (m <= 16) as their codes, unscaled, in float32, group-major and
// dimension-major: code d of token t + i at ``blk[(d / g) * g_stride + (d % g) * 16 + i]``
// (zeros past m). The codes are moved as 32-bit words: 16 tokens' words transposed in
// registers, then each word's 8 (4-bit) or 4 (8-bit) codes shifted out in dimension order.
template <int BITS, int NW>
void codes_dimension_major(const Component& c, const uint8_t* base, int m, int w0, int nw, float* blk,
                           size_t g_stride) {
  constexpr int per_word = 32 / BITS;
  v16f r[16];
  for (int i = 0; i < 16; i++) {
    r[i] = v16f{};
    if (NW && m == 16) std::memcpy(&r[i], base + i * c.data_stride[2] + w0 * 4, NW * 4);  // whole rows
    else if (i < m) std::memcpy(&r[i], base + i * c.data_stride[2] + w0 * 4, nw * 4);
  }
  transpose16(r);  // r[k]: word w0 + k of the 16 tokens
  for (int k = 0; k < nw; k++) {
    int d = (w0 + k) * per_word;  // a word's codes share a group (groups are multiples of 32)
    float* out = blk + (d / c.group) * g_stride + (d % c.group) * 16;
    v16u u;
    std::memcpy(&u, &r[k], sizeof u);
    for (int i = 0; i < per_word; i++)
      store(out + i * 16, __builtin_convertvector((u >> (BITS * i)) & ((1u << BITS) - 1), v16f));
  }
}

template <int BITS>
void codes_dimension_major(const Component& c, int b, int h, int t, int m, int D, float* blk, size_t g_stride) {
  const int words = D / (32 / BITS);
  const uint8_t* base = c.data + b * c.data_stride[0] + h * c.data_stride[1] + t * c.data_stride[2];
  for (int w0 = 0; w0 < words; w0 += 16) {
    int nw = words - w0 < 16 ? words - w0 : 16;
    if (nw == 16) codes_dimension_major<BITS, 16>(c, base, m, w0, nw, blk, g_stride);
    else if (nw == 8) codes_dimension_major<BITS, 8>(c, base, m, w0, nw, blk, g_stride);
    else codes_dimension_major<BITS, 0>(c, base, m, w0, nw, blk, g_stride);
  }
}

// Words [first, first + nw) (nw <= 16) of tokens [0, mj) from ``base`` (mj <= 16), word-major:
// out[k * 16 + i] = word first + k of token i (0 past mj), by one transpose in registers.
template <int NW>
void words_word_major(const uint8_t* base, int64_t stride, int mj, int first, int nw, uint32_t* out) {
  v16f r[16];
  for (int i = 0; i < 16; i++) {
    r[i] = v16f{};
    if (NW && mj == 16) std::memcpy(&r[i], base + i * stride + first * 4, NW * 4);  // whole rows
    else if (i < mj) std::memcpy(&r[i], base + i * stride + first * 4, nw * 4);
  }
  transpose16(r);
  for (int k = 0; k < nw; k++) std::memcpy(out + k * 16, &r[k], sizeof r[k]);
}

// Scores of NR rows against NC chunks of 16 tokens (``words``: each chunk's ``nw`` words of one
// group, word-major), unscaled, into raw + r * kTokenBlock + 16 * chunk (the first m). Each
// lane is summed over d in order from zero, as score_rows sums a dimension-major block, and a
// query value multiplies NC chunks at once: NR * NC independent chains of multiply-adds (one
// chunk's NR chains waited on their own latency).
template <int BITS, int NR, int NC>
void score_word_chunks(const uint32_t* words, int nw, const float* q, int qs, float* raw, int m) {
  constexpr int per_word = 32 / BITS;
  v16f a[NR][NC] = {};
  for (int k = 0; k < nw; k++) {
    v16u u[NC];
    for (int j = 0; j < NC; j++) std::memcpy(&u[j], words + (size_t(j) * nw + k) * 16, sizeof u[j]);
    for (int i = 0; i < per_word; i++) {
      v16f x[NC];
      for (int j = 0; j < NC; j++) x[j] = code_as_float<BITS>(u[j], i);
      for (int r = 0; r < NR; r++) {
        v16f qv = splat(q[size_t(r) * qs + k * per_word + i]);
        for (int j = 0; j < NC; j++) a[r][j] += qv * x[j];
      }
    }
  }
  for (int r = 0; r < NR; r++)
    for (int j = 0; j < NC && 16 * j < m; j++)
      put(raw + size_t(r) * kTokenBlock + 16 * j, a[r][j], m - 16 * j < 16 ? m - 16 * j : 16);
}

// Scores of NR rows (a decode step's n_rep: NR <= 4) against affine keys [t0, t0 + m) in group
// ``grp``, unscaled, into raw + r * kTokenBlock, straight from the codes: the same sums as
// codes_dimension_major then score_rows, without widening every code to a float in memory
// and reading it back for every row. ``wbuf``: 4 x 16 x (group's words) uint32 of scratch.
template <int BITS, int NR>
void score_codes(const Component& c, int b, int h, int t0, int m, int grp, const float* q, int qs, float* raw,
                 uint32_t* wbuf) {
  constexpr int per_word = 32 / BITS, NC = 4;
  const int words = c.group / per_word, first = grp * words;
  const uint8_t* base = c.data + b * c.data_stride[0] + h * c.data_stride[1] + t0 * c.data_stride[2];
  const int64_t stride = c.data_stride[2];
  const float* qg = q + grp * c.group;
  for (int j0 = 0; j0 < m; j0 += 16 * NC) {
    const int chunks = (m - j0 + 15) / 16 < NC ? (m - j0 + 15) / 16 : NC;
    for (int j = 0; j < chunks; j++) {
      const int t = j0 + 16 * j, mj = m - t < 16 ? m - t : 16;
      for (int w0 = 0; w0 < words; w0 += 16) {
        const int nw = words - w0 < 16 ? words - w0 : 16;
        uint32_t* out = wbuf + (size_t(j) * words + w0) * 16;
        if (nw == 16) words_word_major<16>(base + t * stride, stride, mj, first + w0, nw, out);
        else if (nw == 8) words_word_major<8>(base + t * stride, stride, mj, first + w0, nw, out);
        else words_word_major<0>(base + t * stride, stride, mj, first + w0, nw, out);
      }
    }
    float* dst = raw + j0;
    if (chunks == NC) score_word_chunks<BITS, NR, NC>(wbuf, words, qg, qs, dst, m - j0);
    else
      for (int j = 0; j < chunks; j++)
        score_word_chunks<BITS, NR, 1>(wbuf + size_t(j) * words * 16, words, qg, qs, dst + 16 * j, m - j0 - 16 * j);
  }
}

template <int BITS>
void score_codes(const Component& c, int b, int h, int n, int t0, int m, int grp, const float* q, int qs, float* raw) {
  uint32_t wbuf[4 * 16 * 32];  // 4 chunks of 16 tokens, up to 32 words a group (a group of 256 4-bit codes)
  if (n == 4) score_codes<BITS, 4>(c, b, h, t0, m, grp, q, qs, raw, wbuf);
  else if (n == 3) score_codes<BITS, 3>(c, b, h, t0, m, grp, q, qs, raw, wbuf);
  else if (n == 2) score_codes<BITS, 2>(c, b, h, t0, m, grp, q, qs, raw, wbuf);
  else score_codes<BITS, 1>(c, b, h, t0, m, grp, q, qs, raw, wbuf);
}

// Scores of rows [0, n) (queries ``q``, D each) against affine keys [t0, t1), into ``dst``
// + r * ld + (t - t0). A key is s * code + z in each group, so q . k = sum over groups of
// s * (q . codes) + z * sum(q): the codes are scored unscaled, per group, and each group's
// scale and bias applied once per token and row, where decoding them first applied them to
// every element. Up to 4 rows (a decode step's n_rep) are scored from the codes in registers
// (score_codes); more (prompt chunks, verify steps) widen a block of codes to floats once,
// dimension-major, for the float kernels above to read for every row. Both sum each lane over
// d in order, so a row gets the same bits either way. ``blk``: kTokenBlock x D floats;
// ``tmp``: n x kTokenBlock scores of one group, then kTokenBlock scales and biases.
void score_affine(const Component& c, int b, int h, int n, int t0, int t1, const float* q, float* dst, int ld,
                  float* blk, float* tmp) {
  const int D = c.dim, g = c.group, m = t1 - t0;
  const size_t g_stride = size_t(kTokenBlock) * g;
  const bool few = n <= 4;
  for (int j = 0; !few && j < m; j += 16) {
    if (c.bits == 4) codes_dimension_major<4>(c, b, h, t0 + j, m - j < 16 ? m - j : 16, D, blk + size_t(j) * g, g_stride);
    else codes_dimension_major<8>(c, b, h, t0 + j, m - j < 16 ? m - j : 16, D, blk + size_t(j) * g, g_stride);
  }
  float* raw = tmp;  // n x kTokenBlock
  float* sc = tmp + size_t(n) * kTokenBlock;  // kTokenBlock scales, then kTokenBlock biases
  float* z = sc + kTokenBlock;
  const int64_t so = b * c.scale_stride[0] + h * c.scale_stride[1];
  for (int grp = 0; grp < D / g; grp++) {
    for (int t = 0; t < m; t++) {
      int64_t i = so + (t0 + t) * c.scale_stride[2] + grp;
      sc[t] = element(c.scales, c.dtype, i);
      z[t] = element(c.biases, c.dtype, i);
    }
    if (!few) score_rows(q + grp * g, D, n, g, blk + grp * g_stride, m, raw, kTokenBlock);
    else if (c.bits == 4) score_codes<4>(c, b, h, n, t0, m, grp, q, D, raw);
    else score_codes<8>(c, b, h, n, t0, m, grp, q, D, raw);
    for (int r = 0; r < n; r++) {
      const float* qr = q + size_t(r) * D + grp * g;
      float qsum = 0.0f;
      for (int d = 0; d < g; d++) qsum += qr[d];
      float* out = dst + size_t(r) * ld;
      const float* rr = raw + size_t(r) * kTokenBlock;
      if (grp == 0)
        for (int t = 0; t < m; t++) out[t] = sc[t] * rr[t] + z[t] * qsum;
      else
        for (int t = 0; t < m; t++) out[t] += sc[t] * rr[t] + z[t] * qsum;
    }
  }
}

// Affine values weighted into NR rows' accumulators without decoding them to floats first.
// A token's value is s * code + z in each group, so sum_t p_t v_t = sum_t (p_t s_t) code_t +
// sum_t p_t z_t. A token block's weights p_t s_t come first, for every row and group at once
// (``block_weights``: a multiply each, vectorized over tokens, where computing them inside the
// loop below reloaded and converted the scale once per row and token); then a token's codes
// are widened once for every row of the block and weighted by one multiply-add each. The
// biases are summed apart (``zs``, per row and group) and added at the end. Each row sums over
// t in order whatever block it is in, so decode, verify and prompt chunks agree bit for bit.
// A hidden slot (p == 0) weighs 0 and adds no bias: its stale scales may not be finite.

// a * b + c, rounded once where the machine has the instruction: spelled out, since whether
// the compiler fuses ``c += a * b`` differed between the instantiations of bias_sums (and
// then a row's bits with the rows beside it).
inline float mul_add(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// zs[r][g] += p_r,t * zb[t - t0] for tokens [t0, t0 + m) of NR rows, in token order, the rows'
// chains side by side in registers (through memory, each add waited on a store).
template <int NR>
void bias_sums(const float* const* p, int t0, int m, const float* zb, float* const* zs, int g) {
  float z[NR];
  for (int r = 0; r < NR; r++) z[r] = zs[r][g];
  for (int t = 0; t < m; t++)
    for (int r = 0; r < NR; r++)
      if (p[r][t0 + t] != 0.0f) z[r] = mul_add(p[r][t0 + t], zb[t], z[r]);
  for (int r = 0; r < NR; r++) zs[r][g] = z[r];
}

// ws[(r * groups + g) * kTokenBlock + t - t0] = p_r,t * s_t,g (0 where p_r,t is 0) and zs[r][g]
// += p_r,t * z_t,g in token order, for tokens [t0, t1) and rows [0, nr). ``sz``: 2 x
// kTokenBlock floats of scratch (one group's scales, then its biases).
template <int DT>
void block_weights(const Component& c, int b, int h, int t0, int t1, int nr, const float* const* p, float* ws,
                   float* const* zs, float* sz) {
  const int groups = c.dim / c.group, m = t1 - t0;
  const int64_t so0 = b * c.scale_stride[0] + h * c.scale_stride[1] + t0 * c.scale_stride[2];
  float *sc = sz, *zb = sz + kTokenBlock;
  for (int g = 0; g < groups; g++) {
    for (int t = 0; t < m; t++) sc[t] = scalar_as_float<DT>(c.scales, so0 + t * c.scale_stride[2] + g);
    for (int r = 0; r < nr; r++) {
      const float* pr = p[r] + t0;
      float* w = ws + (size_t(r) * groups + g) * kTokenBlock;
      for (int t = 0; t < m; t++) w[t] = pr[t] == 0.0f ? 0.0f : pr[t] * sc[t];
    }
    if (!c.biases) continue;  // turbo values: norms, no bias
    for (int t = 0; t < m; t++) zb[t] = scalar_as_float<DT>(c.biases, so0 + t * c.scale_stride[2] + g);
    if (nr == 4) bias_sums<4>(p, t0, m, zb, zs, g);
    else if (nr == 3) bias_sums<3>(p, t0, m, zb, zs, g);
    else if (nr == 2) bias_sums<2>(p, t0, m, zb, zs, g);
    else bias_sums<1>(p, t0, m, zb, zs, g);
  }
}

// acc[r][0 : 16 * NV] += sum over t in [t0, t1) of w_r,t * codes_t[d0 : d0 + 16 * NV] (4-bit
// codes permuted within each 32, as dequant_token writes them), ``ws`` from block_weights.
// A weight of 0 adds +0: the codes are finite.
template <int BITS, int NR, int NV, class Codes>
void accumulate_affine(const Component& c, int b, int h, int t0, int t1, int d0, const float* ws,
                       float* const* acc, const Codes& codes4) {
  const uint8_t* base = c.data + b * c.data_stride[0] + h * c.data_stride[1];
  const int groups = c.dim / c.group;
  const float* w[NR][NV / 2];
  for (int r = 0; r < NR; r++)
    for (int k = 0; k < NV / 2; k++) w[r][k] = ws + (size_t(r) * groups + (d0 + 32 * k) / c.group) * kTokenBlock - t0;
  v16f a[NR][NV];
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < NV; i++) a[r][i] = load(acc[r] + 16 * i);
  for (int t = t0; t < t1; t++) {
    const uint8_t* codes = base + t * c.data_stride[2];
    __builtin_prefetch(codes + 32 * c.data_stride[2]);  // 30% faster on a 2-core x86 VM
    v16f x[NV];
    for (int k = 0; k < NV / 2; k++) {
      int d = d0 + 32 * k;
      if constexpr (BITS == 4) {
        v16u u = widen16(codes + d / 2);
        x[2 * k] = codes4(u);
        x[2 * k + 1] = codes4(u >> 4);
      } else {
        x[2 * k] = __builtin_convertvector(widen16(codes + d), v16f);
        x[2 * k + 1] = __builtin_convertvector(widen16(codes + d + 16), v16f);
      }
    }
    for (int r = 0; r < NR; r++)
      for (int k = 0; k < NV / 2; k++) {
        v16f wt = splat(w[r][k][t]);
        a[r][2 * k] += wt * x[2 * k];
        a[r][2 * k + 1] += wt * x[2 * k + 1];
      }
  }
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < NV; i++) store(acc[r] + 16 * i, a[r][i]);
}

template <int BITS, int NR, class Codes>
void accumulate_affine(const Component& c, int b, int h, int t0, int t1, int Dv, const float* ws, float* const* acc,
                       const Codes& codes4) {
  for (int d0 = 0; d0 < Dv; d0 += 64) {
    float* at[NR];
    for (int r = 0; r < NR; r++) at[r] = acc[r] + d0;
    if (Dv - d0 >= 64) accumulate_affine<BITS, NR, 4>(c, b, h, t0, t1, d0, ws, at, codes4);
    else accumulate_affine<BITS, NR, 2>(c, b, h, t0, t1, d0, ws, at, codes4);
  }
}

// Rows [0, n) of a pair over affine values, four rows at a time: ``s`` the rows'
// probabilities (n x T), ``acc`` their accumulators (n x Dv), ``zs`` their bias sums (n x
// Dv / group), ``work`` (4 * Dv / group + 2) x kTokenBlock floats of scratch. Token blocks
// outermost, so a block's codes stay in cache for every row.
template <int DT, int BITS, class Codes = Nibbles>
void accumulate_affine_rows(const Component& c, int b, int h, int n, int T, int Dv, const float* s,
                            float* acc, float* zs, float* work, const Codes& codes4 = {}) {
  const int groups = Dv / c.group;
  float *ws = work, *sz = ws + size_t(4 * groups) * kTokenBlock;
  for (int t0 = 0; t0 < T; t0 += kTokenBlock) {
    int t1 = t0 + kTokenBlock < T ? t0 + kTokenBlock : T;
    for (int r0 = 0; r0 < n; r0 += 4) {
      const float* p[4];
      float *ac[4], *z[4];
      int nr = n - r0 < 4 ? n - r0 : 4;
      for (int r = 0; r < nr; r++) {
        p[r] = s + size_t(r0 + r) * T;
        ac[r] = acc + size_t(r0 + r) * Dv;
        z[r] = zs ? zs + size_t(r0 + r) * groups : nullptr;
      }
      block_weights<DT>(c, b, h, t0, t1, nr, p, ws, z, sz);
      if (nr == 4) accumulate_affine<BITS, 4>(c, b, h, t0, t1, Dv, ws, ac, codes4);
      else if (nr == 3) accumulate_affine<BITS, 3>(c, b, h, t0, t1, Dv, ws, ac, codes4);
      else if (nr == 2) accumulate_affine<BITS, 2>(c, b, h, t0, t1, Dv, ws, ac, codes4);
      else accumulate_affine<BITS, 1>(c, b, h, t0, t1, Dv, ws, ac, codes4);
    }
  }
}

void accumulate_affine_rows(const Component& c, int b, int h, int n, int T, int Dv, const float* s,
                            float* acc, float* zs, float* work) {
  auto run = [&](auto dt) {
    constexpr int DT = decltype(dt)::value;
    if (c.bits == 4) accumulate_affine_rows<DT, 4>(c, b, h, n, T, Dv, s, acc, zs, work);
    else accumulate_affine_rows<DT, 8>(c, b, h, n, T, Dv, s, acc, zs, work);
  };
  if (c.dtype == F16) run(std::integral_constant<int, F16>{});
  else if (c.dtype == BF16) run(std::integral_constant<int, BF16>{});
  else run(std::integral_constant<int, F32>{});
}

// Rows [0, n) of a pair over turbo 4-bit values, as affine values are weighted: a token's
// value is norm_t * centroid[code] (rotated basis), so sum_t p_t v_t = sum_t (p_t norm_t)
// centroid[code_t], the weights a multiply each per token block and the codes looked up in a
// register, where decoding every token to floats first (norm times centroid, written out and
// read back for every row) cost more than the weighting. ``work``: 6 x kTokenBlock floats.
void accumulate_turbo4_rows(const Component& c, int b, int h, int n, int T, int Dv, const float* s, float* acc,
                            float* work) {
  Component v = c;  // one group spanning the row, scaled by the token's norm (float32), no bias
  v.group = Dv;
  v.dtype = F32;
  v.biases = nullptr;
  accumulate_affine_rows<F32, 4>(v, b, h, n, T, Dv, s, acc, nullptr, work, Centroids{load(c.table)});
}
