// Attention over affine K/V without decoding the codes to floats (cpu_attention.cpp includes
// this inside its namespace, after the float scoring kernels it reuses).
//
// A stored element is s * code + z, with one scale and bias per group of 32-128 dimensions.
// Keys: q . k = sum over groups of s * (q . codes) + z * sum(q), so the codes are scored
// unscaled by the float kernels and each group's scale and bias applied once per token and
// row. Values: sum_t p_t v_t = sum_t (p_t s_t) codes_t + sum_t p_t z_t. Decoding every
// element first (one multiply-add each, written out and read back, then transposed for the
// scores) cost more than the attention itself.
#pragma once

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

// Scores of rows [0, n) (queries ``q``, D each) against affine keys [t0, t1), into ``dst``
// + r * ld + (t - t0). A key is s * code + z in each group, so q . k = sum over groups of
// s * (q . codes) + z * sum(q): the codes are scored unscaled (the float kernels above, per
// group) and each group's scale and bias applied once per token and row, where decoding
// them first applied them to every element. ``blk``: kTokenBlock x D floats; ``tmp``:
// n x kTokenBlock scores of one group, then kTokenBlock scales and biases.
void score_affine(const Component& c, int b, int h, int n, int t0, int t1, const float* q, float* dst, int ld,
                  float* blk, float* tmp) {
  const int D = c.dim, g = c.group, m = t1 - t0;
  const size_t g_stride = size_t(kTokenBlock) * g;
  for (int j = 0; j < m; j += 16) {
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
    score_rows(q + grp * g, D, n, g, blk + grp * g_stride, m, raw, kTokenBlock);
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
// sum_t p_t z_t: a token's codes are widened once for every row of the block and scaled by
// one multiply-add each, and the biases are summed apart (``zs``, per row and group) and added
// at the end. Each row sums over t in order whatever block it is in, so decode, verify and
// prompt chunks agree bit for bit. A hidden slot (p == 0) adds nothing: its stale scales may
// not be finite. Dims [d0, d0 + 16 * NV) (4-bit codes permuted within each 32, as
// dequant_token writes them); ``p[r]`` row r's probabilities, ``acc[r]`` its accumulators
// from d0, ``zs[r]`` its bias sums per group.
template <int DT, int BITS, int NR, int NV>
void accumulate_affine(const Component& c, int b, int h, int t0, int t1, int d0, const float* const* p,
                       float* const* acc, float* const* zs) {
  const uint8_t* base = c.data + b * c.data_stride[0] + h * c.data_stride[1];
  const int64_t so0 = b * c.scale_stride[0] + h * c.scale_stride[1];
  v16f a[NR][NV];
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < NV; i++) a[r][i] = load(acc[r] + 16 * i);
  for (int t = t0; t < t1; t++) {
    const uint8_t* codes = base + t * c.data_stride[2];
    const int64_t so = so0 + t * c.scale_stride[2];
    v16f x[NV];
    for (int k = 0; k < NV / 2; k++) {
      int d = d0 + 32 * k;
      if constexpr (BITS == 4) {
        v16u u = widen16(codes + d / 2);
        x[2 * k] = __builtin_convertvector(u & 15u, v16f);
        x[2 * k + 1] = __builtin_convertvector(u >> 4, v16f);
      } else {
        x[2 * k] = __builtin_convertvector(widen16(codes + d), v16f);
        x[2 * k + 1] = __builtin_convertvector(widen16(codes + d + 16), v16f);
      }
    }
    for (int r = 0; r < NR; r++) {
      float pr = p[r][t];
      if (pr == 0.0f) continue;
      for (int k = 0; k < NV / 2; k++) {
        int d = d0 + 32 * k, g = d / c.group;
        v16f w = splat(pr * scalar_as_float<DT>(c.scales, so + g));
        a[r][2 * k] += w * x[2 * k];
        a[r][2 * k + 1] += w * x[2 * k + 1];
        if (d % c.group == 0) zs[r][g] += pr * scalar_as_float<DT>(c.biases, so + g);
      }
    }
  }
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < NV; i++) store(acc[r] + 16 * i, a[r][i]);
}

template <int DT, int BITS, int NR>
void accumulate_affine(const Component& c, int b, int h, int t0, int t1, int Dv, const float* const* p,
                       float* const* acc, float* const* zs) {
  for (int d0 = 0; d0 < Dv; d0 += 64) {
    float* at[NR];
    for (int r = 0; r < NR; r++) at[r] = acc[r] + d0;
    if (Dv - d0 >= 64) accumulate_affine<DT, BITS, NR, 4>(c, b, h, t0, t1, d0, p, at, zs);
    else accumulate_affine<DT, BITS, NR, 2>(c, b, h, t0, t1, d0, p, at, zs);
  }
}

// Rows [0, n) of a pair over affine values, four rows at a time: ``s`` the rows'
// probabilities (n x T), ``acc`` their accumulators (n x Dv), ``zs`` their bias sums (n x
// Dv / group). Token blocks outermost, so a block's codes stay in cache for every row.
template <int DT, int BITS>
void accumulate_affine_rows(const Component& c, int b, int h, int n, int T, int Dv, const float* s,
                            float* acc, float* zs) {
  const int groups = Dv / c.group;
  for (int t0 = 0; t0 < T; t0 += kTokenBlock) {
    int t1 = t0 + kTokenBlock < T ? t0 + kTokenBlock : T;
    for (int r0 = 0; r0 < n; r0 += 4) {
      const float* p[4];
      float *ac[4], *z[4];
      int nr = n - r0 < 4 ? n - r0 : 4;
      for (int r = 0; r < nr; r++) {
        p[r] = s + size_t(r0 + r) * T;
        ac[r] = acc + size_t(r0 + r) * Dv;
        z[r] = zs + size_t(r0 + r) * groups;
      }
      if (nr == 4) accumulate_affine<DT, BITS, 4>(c, b, h, t0, t1, Dv, p, ac, z);
      else if (nr == 3) accumulate_affine<DT, BITS, 3>(c, b, h, t0, t1, Dv, p, ac, z);
      else if (nr == 2) accumulate_affine<DT, BITS, 2>(c, b, h, t0, t1, Dv, p, ac, z);
      else accumulate_affine<DT, BITS, 1>(c, b, h, t0, t1, Dv, p, ac, z);
    }
  }
}

void accumulate_affine_rows(const Component& c, int b, int h, int n, int T, int Dv, const float* s,
                            float* acc, float* zs) {
  auto run = [&](auto dt) {
    constexpr int DT = decltype(dt)::value;
    if (c.bits == 4) accumulate_affine_rows<DT, 4>(c, b, h, n, T, Dv, s, acc, zs);
    else accumulate_affine_rows<DT, 8>(c, b, h, n, T, Dv, s, acc, zs);
  };
  if (c.dtype == F16) run(std::integral_constant<int, F16>{});
  else if (c.dtype == BF16) run(std::integral_constant<int, BF16>{});
  else run(std::integral_constant<int, F32>{});
}

