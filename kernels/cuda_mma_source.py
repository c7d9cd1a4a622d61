"""CUDA source of the tensor-core decode attention (f16 / bf16 queries, ``mma.sync``).

The split pass of ``kvserve.kernels.cuda_source`` does every product on the f32 pipes:
per token and query row, D FMAs for the score and D for the value, with the query read
from shared memory each time. This pass hands both products to the tensor cores
(``mma.sync.m16n8k16``, f16 or bf16 inputs, f32 accumulators); what is left on the
ordinary pipes is decoding the stored K/V, which every path must do once per element.

Shapes of one warp step (16 * TM tokens; W = D / 4 key and D / 8 value elements a thread
decodes per token):

    scores   S^T (16 tokens x 8 rows) += K (16 tokens x 16 d) . Q^T (16 d x 8 rows)
             per 16 tokens and 16 dims; A = K as decoded, B = the queries (loop-invariant
             registers), up to 16 query rows as two 8-row tiles sharing each K fragment
    softmax  online, in f32, per row; each lane holds two rows and keeps its own partial sum
    values   O^T (16 d x 8 rows) += V^T (16 d x 16 tokens) . P^T (16 tokens x 8 rows):
             P^T leaves the scores' accumulator layout and is transposed into the B layout
             by ``movmatrix`` (8x8, in registers)

Which d a fragment slot holds is free, as long as the query and the output use the same
map: lane (g, c) (g = lane / 4, c = lane % 4) decodes elements c*W .. c*W + W-1 of key
tokens g and g+8, and elements g*D/8 .. g*D/8 + D/8-1 of value tokens 2c, 2c+1, 2c+8, 2c+9,
so every load is one contiguous piece of a row. Worked example, D=128, affine4: a lane reads
16 bytes of two key rows and 8 bytes of four value rows per 16 tokens.

Warps of a block walk interleaved steps of the block's split with their own softmax state,
with no block-wide barrier until the end, where the warps' states are merged into the same
partial (acc, max, sum) per split that the f32 split pass writes, so one merge kernel serves
both. Turbo values fold each token's norm into its probability (p * norm) before the
product, so decoding a value is a centroid lookup only.
"""

from __future__ import annotations

from kvserve.kernels.cuda_source import MASK_CODE


# Template constants: D, NR (8-row tiles of queries per block), TM (16-token tiles per
# step), MASK, ACT (the queries' dtype), and the formats' own (see ``mma_source``).
WALK = r"""
  if (packed == __PK__) {  // generated twice: packed rows, then run-time strides
    constexpr bool PK = __PK__;
__STRIDES__
  auto load = [&](int st, bool E, KRun (&kr)[TM][2], VRun (&vr)[TM][4], Side& sd) {
    const int t0 = st * STEP;
#pragma unroll
    for (int mt = 0; mt < TM; ++mt) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int t = E ? min(t0 + 16 * mt + g + 8 * hi, T - 1) : t0 + 16 * mt + g + 8 * hi;
__K_LOAD__
__SIDE_LOAD__
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int tk = t0 + 16 * mt + 2 * c + (k & 1) + 8 * (k >> 1);
        const int t = E ? min(tk, T - 1) : tk;
__V_LOAD__
      }
    }
  };
  auto compute = [&](int st, bool E, const KRun (&kr)[TM][2], const VRun (&vr)[TM][4], const Side& sd) {
    const int t0 = st * STEP;
    float s[TM][NR][4];
#pragma unroll
    for (int mt = 0; mt < TM; ++mt) {  // scores of tokens t0 + 16 mt + (g, g + 8)
      uint32_t kk[2][KP];  // tokens g, g + 8
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int t = E ? min(t0 + 16 * mt + g + 8 * hi, T - 1) : t0 + 16 * mt + g + 8 * hi;
__K_DECODE__
      }
#pragma unroll
      for (int nr = 0; nr < NR; ++nr)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nr][e] = 0.f;
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        const uint32_t af[4] = {kk[0][2 * j], kk[1][2 * j], kk[0][2 * j + 1], kk[1][2 * j + 1]};
#pragma unroll
        for (int nr = 0; nr < NR; ++nr) A::mma(s[mt][nr], af, qf[nr][j]);
      }
#pragma unroll
      for (int nr = 0; nr < NR; ++nr)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = t0 + 16 * mt + g + 8 * (e >> 1), row = row0 + 8 * nr + 2 * c + (e & 1);
          float sv = s[mt][nr][e] * scale;
          if (MASK == 4) sv += sd.bias[mt][e >> 1];  // one bit per token, any row
          if (MASK != 0 && MASK < 4 && row < ROWS && (!E || t < T)) {
            const int l = row % L;
__MASK__
          }
          s[mt][nr][e] = !E || (t < T && (MASK != 5 || t >= start)) ? sv : -INFINITY;
        }
    }
    // Online softmax: lanes of one c hold the same two rows; reduce over g. The running
    // max moves (and the accumulators are rescaled) only in steps where some row's max
    // grows, which after the first steps is rare: the other steps skip 2 exps and
    // D / 4 multiplies per row pair.
    float m_new[NR][2];
    bool grow = false;
#pragma unroll
    for (int nr = 0; nr < NR; ++nr)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int mt = 0; mt < TM; ++mt) mx = fmaxf(mx, fmaxf(s[mt][nr][i], s[mt][nr][2 + i]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        m_new[nr][i] = fmaxf(m_r[nr][i], mx);
        grow |= m_new[nr][i] > m_r[nr][i];
      }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int nr = 0; nr < NR; ++nr)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float alpha = __expf(m_r[nr][i] - (m_new[nr][i] == -INFINITY ? 0.f : m_new[nr][i]));
          m_r[nr][i] = m_new[nr][i];
          l_r[nr][i] *= alpha;
#pragma unroll
          for (int dm = 0; dm < D / 16; ++dm) { o[dm][nr][i] *= alpha; o[dm][nr][2 + i] *= alpha; }
        }
    }
#pragma unroll
    for (int nr = 0; nr < NR; ++nr)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float base = m_r[nr][i] == -INFINITY ? 0.f : m_r[nr][i];
        float sum = 0.f;
#pragma unroll
        for (int mt = 0; mt < TM; ++mt)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            const float p = __expf(s[mt][nr][2 * hi + i] - base);
            s[mt][nr][2 * hi + i] = p;
            sum += p;
          }
        l_r[nr][i] += sum;
      }
#pragma unroll
    for (int mt = 0; mt < TM; ++mt) {  // values of tokens t0 + 16 mt + (2c, 2c+1, 2c+8, 2c+9)
__P_SCALE__
      uint32_t vv[4][VP];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int tk = t0 + 16 * mt + 2 * c + (k & 1) + 8 * (k >> 1);
        const int t = E ? min(tk, T - 1) : tk;
__V_DECODE__
      }
      uint32_t pb[NR][2];
#pragma unroll
      for (int nr = 0; nr < NR; ++nr) {
        pb[nr][0] = kvt::transpose8x8(A::pack(s[mt][nr][0], s[mt][nr][1]));
        pb[nr][1] = kvt::transpose8x8(A::pack(s[mt][nr][2], s[mt][nr][3]));
      }
#pragma unroll
      for (int dm = 0; dm < D / 16; ++dm) {
        const uint32_t af[4] = {__byte_perm(vv[0][dm], vv[1][dm], 0x5410),
                                __byte_perm(vv[0][dm], vv[1][dm], 0x7632),
                                __byte_perm(vv[2][dm], vv[3][dm], 0x5410),
                                __byte_perm(vv[2][dm], vv[3][dm], 0x7632)};
#pragma unroll
        for (int nr = 0; nr < NR; ++nr) A::mma(o[dm][nr], af, pb[nr]);
      }
    }
  };
  constexpr bool full = false, edge = true;
  KRun ka[TM][2], kb[TM][2];
  Side sa, sb;
  VRun va[TM][4], vb[TM][4];
  // Mask kind 5 (row starts): steps wholly before this row's first slot are skipped, unread;
  // the one holding it is an edge step, whose slots before it score -inf.
  const int f_begin = MASK == 5 ? max(s_begin, (start + STEP - 1) / STEP) : s_begin;
  const int f_end = min(s_end, n_full);
  int st = f_begin + warp;
  if (st < f_end) load(st, full, ka, va, sa);
  for (; st < f_end; st += 2 * NWP) {  // two steps per trip: the buffers alternate
    if (st + NWP < f_end) load(st + NWP, full, kb, vb, sb);
    compute(st, full, ka, va, sa);
    if (st + NWP >= f_end) break;
    if (st + 2 * NWP < f_end) load(st + 2 * NWP, full, ka, va, sa);
    compute(st + NWP, full, kb, vb, sb);
  }
  if (s_end > n_full && warp == (n_full - s_begin) % NWP) {  // the last, partial step
    load(n_full, edge, ka, va, sa);
    compute(n_full, edge, ka, va, sa);
  }
  const int ps = start / STEP;  // the step holding start, unless it is the last, partial one
  if (MASK == 5 && start % STEP != 0 && ps >= s_begin && ps < s_end && ps < n_full
      && warp == (ps - s_begin) % NWP) {
    load(ps, edge, ka, va, sa);
    compute(ps, edge, ka, va, sa);
  }
  }

"""

MMA_BODY = r"""
  using A = kvt::Act<ACT>;
  // Pair k of a lane's decoded run holds elements (KX(k), KY(k)) of its key run and
  // (VX(k), VY(k)) of its value run (see ``pair_map``).
__PAIR_MAPS__
  constexpr int KN = D / 4, VN = D / 8, KP = KN / 2, VP = VN / 2, STEP = 16 * TM;
  constexpr float MASKED = -3.4028234663852886e38f;  // finite: a fully masked row averages
  __shared__ float o_s[8 * NR * D];
  __shared__ float m_w[NWP][8 * NR], l_w[NWP][8 * NR];
  __shared__ float vlut[16];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int split = blockIdx.y, n_split = gridDim.y, bh = blockIdx.z;
  const int Hkv = k0_shape[1], T = __T_END__, Hq = q_shape[1], L = q_shape[2];
  const int R = Hq / Hkv, ROWS = R * L, b = bh / Hkv, h = bh % Hkv;
  const int row0 = blockIdx.x * 8 * NR;
  const int n_steps = (T + STEP - 1) / STEP, per = (n_steps + n_split - 1) / n_split;
  const int s_begin = split * per, s_end = min(n_steps, s_begin + per);
  const float scale = sc[0];
__LUT_LOAD__

  // Queries as the B operand of the scores: row 8 nr + g, the d's of this lane's key chunk.
  uint32_t qf[NR][D / 16][2];
#pragma unroll
  for (int nr = 0; nr < NR; ++nr) {
    const int row = row0 + 8 * nr + g;
    const bool live = row < ROWS;
    const int hq = h * R + (live ? row : 0) / L, l = (live ? row : 0) % L;
    const ACT* qr = q + b * q_strides[0] + hq * q_strides[1] + l * q_strides[2];
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int dx = c * KN + KX(2 * j + hf), dy = c * KN + KY(2 * j + hf);
        qf[nr][j][hf] = live ? A::pack(static_cast<float>(qr[dx * q_strides[3]]),
                                       static_cast<float>(qr[dy * q_strides[3]])) : 0u;
      }
  }
__syncthreads();

__K_BASE__
__V_BASE__
  float o[D / 16][NR][4], m_r[NR][2], l_r[NR][2];
#pragma unroll
  for (int nr = 0; nr < NR; ++nr) {
#pragma unroll
    for (int i = 0; i < 2; ++i) { m_r[nr][i] = -INFINITY; l_r[nr][i] = 0.f; }
#pragma unroll
    for (int dm = 0; dm < D / 16; ++dm)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[dm][nr][e] = 0.f;
  }

  // Rows of every part are packed (token stride = row width, as in the caches' buffers):
  // token strides are then compile-time constants and a step's loads use immediate
  // offsets from one pointer per part; anything else takes the same code with run-time
  // strides. Steps whose 16 TM tokens are all below T (all but the last, when T is not a
  // multiple of STEP) skip clamping and bounds checks; step st of a warp reads its K/V
  // (load) one step before it uses them (compute).
  const bool packed = __PACKED__;
  const int n_full = T / STEP;
  using KRun = __K_RUN__;
  using VRun = __V_RUN__;
  // Per token of a step, what the scores need besides its keys, read with the step's K/V
  // (one step ahead of use, not at use, where each load's latency stalled the warp): the
  // value norms of turbo values; the mask bit of a padded batch (mask kind 4).
  struct Side { float norm[TM][2]; float bias[TM][2]; };
__MASK_ROW__
__WALK__
  // Merge the warps: each lane's rows 8 nr + 2c + i; sums over g first.
#pragma unroll
  for (int nr = 0; nr < NR; ++nr)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float l = l_r[nr][i];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (g == 0) { m_w[warp][8 * nr + 2 * c + i] = m_r[nr][i]; l_w[warp][8 * nr + 2 * c + i] = l; }
    }
  __syncthreads();
  // Then the warps' accumulators, one warp after another into o_s with plain stores (warp 0)
  // and adds (the others). Element (r, d = g VN + x) of the block's rows lives at
  // r D + g VN + (x ^ swz(g, c)): the 32 lanes of one store then hit 32 banks. Unswizzled,
  // 16 lanes shared a bank; with float atomicAdd (a compare-and-swap loop on shared memory)
  // each add took 16 trips, ~3,000 instructions per warp: a fixed ~40 us per launch.
  constexpr int GB = 32 / VN;  // g's whose VN-wide runs start in the same bank: swz separates them
#pragma unroll 1
  for (int w = 0; w < NWP; ++w) {
    if (warp == w) {
#pragma unroll
      for (int nr = 0; nr < NR; ++nr)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = 8 * nr + 2 * c + i;
          float M = -INFINITY;
#pragma unroll
          for (int v = 0; v < NWP; ++v) M = fmaxf(M, m_w[v][r]);
          const float f = __expf(m_r[nr][i] - (M == -INFINITY ? 0.f : M));
          float* os = o_s + r * D + g * VN;
          const int swz = (g / GB) * 4 + c;
#pragma unroll
          for (int dm = 0; dm < D / 16; ++dm) {
            const float ox = f * o[dm][nr][i], oy = f * o[dm][nr][2 + i];
            if (w == 0) { os[VX(dm) ^ swz] = ox; os[VY(dm) ^ swz] = oy; }
            else { os[VX(dm) ^ swz] += ox; os[VY(dm) ^ swz] += oy; }
          }
        }
    }
    __syncthreads();
  }
  const int64_t out_row = ((int64_t)split * gridDim.z + bh) * ROWS;
  for (int i = threadIdx.x; i < 8 * NR * D; i += NWP * 32) {
    const int r = i / D, d = i % D, gd = d / VN, row = row0 + r, swz = (gd / GB) * 4 + ((r >> 1) & 3);
    if (row < ROWS) o_part[(out_row + row) * D + d] = o_s[r * D + gd * VN + ((d % VN) ^ swz)];
  }
  if (threadIdx.x < 8 * NR && row0 + threadIdx.x < ROWS) {
    const int r = threadIdx.x;
    float M = -INFINITY, l = 0.f;
    for (int w = 0; w < NWP; ++w) M = fmaxf(M, m_w[w][r]);
    const float base = M == -INFINITY ? 0.f : M;
    for (int w = 0; w < NWP; ++w) l += __expf(m_w[w][r] - base) * l_w[w][r];
    ml_part[(out_row + row0 + r) * 2] = M;
    ml_part[(out_row + row0 + r) * 2 + 1] = l;
  }
"""


def _mask(kind: int) -> str:
    """The f32 split pass's masking of ``s[r]``, as masking of ``sv`` here. Kind 4 is applied
    before, from the bit ``load`` fetched with the step's keys (score e of a lane is token
    g + 8 (e >> 1)); kind 5 by the walk, which starts at each row's first slot."""
    if kind >= 4:
        return ""
    return MASK_CODE[kind].replace("s[r]", "sv")


def pair_map(layout, fast: bool) -> tuple[str, str]:
    """C++ expressions of k: the two elements of a run that decoded pair k holds.

        >>> from kvserve.kernels.cuda_layout import Layout
        >>> pair_map(Layout("affine", 4, 64, 3, 16), True)
        ('(8 * ((k) / 4) + (k) % 4)', '(8 * ((k) / 4) + (k) % 4 + 4)')
        >>> pair_map(Layout("mx", 4, 32, 2, 16), False)
        ('(2 * (k))', '(2 * (k) + 1)')
    """
    if not fast:
        return "(2 * (k))", "(2 * (k) + 1)"
    epw = 32 // layout.bits
    x = f"({epw} * ((k) / {epw // 2}) + (k) % {epw // 2})"
    return x, x[:-1] + f" + {epw // 2})"


def _decode(layout, role: str, out: str, n: str, first: str) -> str:
    """Decode ``n`` affine elements (scales not in the queries' dtype) from element
    ``first`` of token t's row straight from memory, through f32, into pairs ``out[e]`` = (elements 2e, 2e + 1)."""
    U = role.upper()
    rows = ", ".join(f"{role}{i}b + t * {role}{i}s" for i in range(layout.n_parts))
    EC, V = f"{U}EC", f"{U}VEC"
    call = f"kvs::affine_chunk<{U}BITS, {U}GS, {EC}, {V}>({rows}, ({first}) / {EC} + p, x + p * {EC});"
    return (f"        float x[{n}];\n"
            f"#pragma unroll\n        for (int p = 0; p < ({n}) / {EC}; ++p) {{ {call} }}\n"
            f"#pragma unroll\n        for (int e = 0; e < ({n}) / 2; ++e) {out}[e] = A::pack(x[2 * e], x[2 * e + 1]);")


def run(layout, role: str, fast: bool) -> dict[str, str]:
    """The run type of one component and its load / decode statements (token t, buffer
    slot ``R``), or direct decoding for affine codes whose scales are not in the queries'
    dtype (through f32, ``_decode``).

        >>> from kvserve.kernels.cuda_layout import Layout
        >>> run(Layout("turbo", 4, 0, 2, 16), "v", False)["type"]
        'kvt::LutRun<ACT, VBITS, VN, VWORDS>'
    """
    U = role.upper()
    n, first = ("KN", "c * KN") if role == "k" else ("VN", "g * VN")
    slot, out = ("kr[mt][hi]", "kk[hi]") if role == "k" else ("vr[mt][k]", "vv[k]")
    rows = ", ".join(f"{role}{i}b + t * {role}{i}s" for i in range(layout.n_parts))
    if layout.kind == "raw":
        kind = f"kvt::RawRun<ACT, {n}>"
    elif layout.kind == "turbo":
        kind, rows = f"kvt::LutRun<ACT, {U}BITS, {n}, {U}WORDS>", f"{role}0b + t * {role}0s"
    elif layout.kind == "mx":
        kind = f"kvt::MxRun<ACT, {n}, {U}VEC>"
    elif fast:
        kind = f"kvt::AffineRun<ACT, {U}BITS, {U}GS, {n}, {U}VEC>"
    else:
        return {"type": "kvt::NoRun", "load": "        (void)t;",
                "decode": _decode(layout, role, out, n, first)}
    lut = f"{role}lut" if layout.kind == "turbo" else "nullptr"
    return {"type": kind, "load": f"        {slot}.load({rows}, {first});",
            "decode": f"        {slot}.decode({out}, {lut});"}


def mma_source(key_layout, value_layout, mask: int, kfast: bool = False, vfast: bool = False) -> str:
    """The tensor-core split pass for one pair of stored formats and a mask kind.

    Keys: raw (in the queries' dtype), affine or mxfp4; values: affine, mxfp4 or turbo.
    ``kfast`` / ``vfast``: affine codes decoded straight to pairs (``AffineRun``; the
    scales must be in the queries' dtype), else through f32.

        >>> from kvserve.kernels.cuda_layout import Layout
        >>> src = mma_source(Layout("affine", 4, 64, 3, 16), Layout("turbo", 3, 0, 2, 12), 0)
        >>> import re
        >>> re.findall(r"__[A-Z_]+__", src)   # every placeholder filled
        []
    """
    from kvserve.kernels.cuda_source import component_code

    walk = WALK.replace("__PK__", "true") + WALK.replace("__PK__", "false")
    body = MMA_BODY.replace("__WALK__", walk).replace("__MASK__", _mask(mask))
    lut = ""
    if value_layout.kind == "turbo":
        lut = f"  if (threadIdx.x < {1 << value_layout.bits}) vlut[threadIdx.x] = vlut_in[threadIdx.x];"
        side = "        sd.norm[mt][hi] = v1b[t * v1s];"
        scale = ("#pragma unroll\n      for (int nr = 0; nr < NR; ++nr) {\n"
                 "        s[mt][nr][0] *= sd.norm[mt][0]; s[mt][nr][1] *= sd.norm[mt][0];\n"
                 "        s[mt][nr][2] *= sd.norm[mt][1]; s[mt][nr][3] *= sd.norm[mt][1]; }")
    else:
        side = scale = ""
    if mask == 4:
        side += "\n        sd.bias[mt][hi] = mrow[t * mts] ? 0.f : MASKED;"
    row = {4: "  const bool* mrow = mask + (mask_shape[0] == 1 ? 0 : b) * mask_strides[0];\n"
              "  const int64_t mts = mask_strides[3];\n  constexpr int start = 0;",
           5: "  const int start = min(mask[b], T - 1);  // this row's first slot: at least one is read"
           }.get(mask, "  constexpr int start = 0;")
    # Kind 5's rows end at mask[B] (a captured step's storage runs past its rows): every
    # bound below (steps, splits, edge clamps) is then the rows', and steps past it are not read.
    body = body.replace("__T_END__", "max(1, min(mask[q_shape[0]], k0_shape[2]))" if mask == 5 else "k0_shape[2]")
    body = body.replace("__MASK_ROW__", row)
    body = body.replace("__LUT_LOAD__", lut).replace("__P_SCALE__", scale).replace("__SIDE_LOAD__", side)
    body = body.replace("__K_BASE__", component_code(key_layout, "k")["K_BASE"])
    body = body.replace("__V_BASE__", component_code(value_layout, "v")["V_BASE"])
    for role, layout, fast in (("k", key_layout, kfast), ("v", value_layout, vfast)):
        r, U = run(layout, role, fast), role.upper()
        body = body.replace(f"__{U}_RUN__", r["type"]).replace(f"__{U}_LOAD__", r["load"])
        body = body.replace(f"__{U}_DECODE__", r["decode"])
    (kx, ky), (vx, vy) = pair_map(key_layout, kfast), pair_map(value_layout, vfast)
    maps = [f"  auto {name} = [](int k) {{ return {expr}; }};"
            for name, expr in (("KX", kx), ("KY", ky), ("VX", vx), ("VY", vy))]
    body = body.replace("__PAIR_MAPS__", "\n".join(maps))
    parts = [f"{role}{i}" for role, layout in (("k", key_layout), ("v", value_layout))
             for i in range(layout.n_parts)]
    body = body.replace("__PACKED__", " && ".join(f"{x}t == {x.upper()}W" for x in parts))
    strides = [f"    const int64_t {x}s = PK ? int64_t({x.upper()}W) : {x}t;" for x in parts]
    return body.replace("__STRIDES__", "\n".join(strides))
