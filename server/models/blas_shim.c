/* Exports the CBLAS gemm symbols libmlx.so imports and forwards them to the
   prefixed OpenBLAS from the scipy-openblas32 wheel. */
#include <pthread.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
enum { RowMajor = 101, ColMajor = 102, NoTrans = 111, Trans = 112 };
typedef float f32;
void scipy_cblas_sgemm(int, int, int, int, int, int, f32, const f32 *, int,
                       const f32 *, int, f32, f32 *, int);
void scipy_cblas_sgemv(int, int, int, int, f32, const f32 *, int, const f32 *,
                       int, f32, f32 *, int);
void scipy_cblas_dgemm(int, int, int, int, int, int, double, const double *,
                       int, const double *, int, double, double *, int);
void scipy_cblas_cgemm(int, int, int, int, int, int, const void *, const void *,
                       int, const void *, int, const void *, void *, int);

static unsigned long long sgemm_calls, sgemv_calls;
unsigned long long kvserve_blas_sgemm_calls(void) { return sgemm_calls; }
unsigned long long kvserve_blas_sgemv_calls(void) { return sgemv_calls; }

/* Row-major C = alpha*op(A)*op(B) + beta*C with M == 1 or N == 1 is a gemv.
   K == 0 is left to gemm: gemv returns early there without applying beta. */
static int as_gemv(int ta, int tb, int M, int N, int K, f32 alpha,
                   const f32 *A, int lda, const f32 *B, int ldb, f32 beta,
                   f32 *C, int ldc) {
  if (K <= 0 || M <= 0 || N <= 0) return 0;
  if (M == 1) {                      /* C row = op(B)^T a */
    int inca = (ta == NoTrans) ? 1 : lda;
    scipy_cblas_sgemv(RowMajor, tb == NoTrans ? Trans : NoTrans,
                      tb == NoTrans ? K : N, tb == NoTrans ? N : K,
                      alpha, B, ldb, A, inca, beta, C, 1);
    return 1;
  }
  if (N == 1) {                      /* C column = op(A) b */
    int incb = (tb == NoTrans) ? ldb : 1;
    scipy_cblas_sgemv(RowMajor, ta == NoTrans ? NoTrans : Trans,
                      ta == NoTrans ? M : K, ta == NoTrans ? K : M,
                      alpha, A, lda, B, incb, beta, C, ldc);
    return 1;
  }
  return 0;
}

/* Few rows times a transposed weight (a batched decode step: C = A B^T with A (M, K)
   activations, B (N, K) weights, 2 <= M <= SMALL_M). OpenBLAS packs B on every gemm call,
   which makes M == 8 about 3x slower than M == 1; here blocks of 4 weight rows are read
   once from memory and used against every pair of activation rows (from L1), with
   vector accumulators the compiler maps onto the machine's vector registers. */
#define SMALL_M 16
#define VW 8
typedef float vf __attribute__((vector_size(VW * 4)));
static f32 hsum(vf v) { f32 s = 0; for (int i = 0; i < VW; i++) s += v[i]; return s; }
static vf ld(const f32 *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }

static f32 dot(const f32 *a, const f32 *b, int K) {
  int KW = K - K % VW; vf c = {0};
  for (int k = 0; k < KW; k += VW) c += ld(a + k) * ld(b + k);
  f32 s = hsum(c);
  for (int k = KW; k < K; k++) s += a[k] * b[k];
  return s;
}

static void put(f32 *c, f32 alpha, f32 v, f32 beta) { *c = alpha * v + (beta == 0.0f ? 0.0f : beta * *c); }

static void block_4x2(int K, f32 alpha, const f32 *a0, int lda, const f32 *b0, int ldb,
                      f32 beta, f32 *c0, int ldc) {
  const f32 *a1 = a0 + lda, *b1 = b0 + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb;
  int KW = K - K % VW;
  vf c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0}, c10 = {0}, c11 = {0}, c12 = {0}, c13 = {0};
  for (int k = 0; k < KW; k += VW) {
    vf x0 = ld(a0 + k), x1 = ld(a1 + k), w;
    w = ld(b0 + k); c00 += x0 * w; c10 += x1 * w;
    w = ld(b1 + k); c01 += x0 * w; c11 += x1 * w;
    w = ld(b2 + k); c02 += x0 * w; c12 += x1 * w;
    w = ld(b3 + k); c03 += x0 * w; c13 += x1 * w;
  }
  f32 s[8] = {hsum(c00), hsum(c01), hsum(c02), hsum(c03), hsum(c10), hsum(c11), hsum(c12), hsum(c13)};
  for (int k = KW; k < K; k++) {
    s[0] += a0[k] * b0[k]; s[1] += a0[k] * b1[k]; s[2] += a0[k] * b2[k]; s[3] += a0[k] * b3[k];
    s[4] += a1[k] * b0[k]; s[5] += a1[k] * b1[k]; s[6] += a1[k] * b2[k]; s[7] += a1[k] * b3[k];
  }
  for (int j = 0; j < 4; j++) { put(c0 + j, alpha, s[j], beta); put(c0 + ldc + j, alpha, s[4 + j], beta); }
}

/* One activation row against 4 weight rows: ``dot``'s arithmetic for each of the four (the
   same lanes summed in the same order), with independent accumulators. */
static void block_4x1(int K, f32 alpha, const f32 *a0, const f32 *b0, int ldb, f32 beta, f32 *c0) {
  const f32 *b1 = b0 + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb;
  int KW = K - K % VW;
  vf c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0};
  for (int k = 0; k < KW; k += VW) {
    vf x0 = ld(a0 + k);
    c00 += x0 * ld(b0 + k); c01 += x0 * ld(b1 + k); c02 += x0 * ld(b2 + k); c03 += x0 * ld(b3 + k);
  }
  f32 s[4] = {hsum(c00), hsum(c01), hsum(c02), hsum(c03)};
  for (int k = KW; k < K; k++) { s[0] += a0[k] * b0[k]; s[1] += a0[k] * b1[k]; s[2] += a0[k] * b2[k]; s[3] += a0[k] * b3[k]; }
  for (int j = 0; j < 4; j++) put(c0 + j, alpha, s[j], beta);
}

/* The same for 8 weight rows: enough independent sums to keep the multiply-adds busy where
   one row has no second activation row to share its weight loads with. */
static void block_8x1(int K, f32 alpha, const f32 *a0, const f32 *b0, int ldb, f32 beta, f32 *c0) {
  int KW = K - K % VW;
  vf c[8] = {{0}};
  for (int k = 0; k < KW; k += VW) {
    vf x0 = ld(a0 + k);
    for (int j = 0; j < 8; j++) c[j] += x0 * ld(b0 + (long)j * ldb + k);
  }
  for (int j = 0; j < 8; j++) {
    const f32 *bj = b0 + (long)j * ldb;
    f32 s = hsum(c[j]);
    for (int k = KW; k < K; k++) s += a0[k] * bj[k];
    put(c0 + j, alpha, s, beta);
  }
}

/* Every output is ``dot``'s sum whichever block computes it, so a row's result does not
   depend on how many rows share the product (1 to SMALL_M): a decode row gives the same
   logits alone and batched. */
static void small_m_nt(int M, int N, int K, f32 alpha, const f32 *A, int lda,
                       const f32 *B, int ldb, f32 beta, f32 *C, int ldc) {
  int n = 0;
  if (M == 1)
    for (; n + 7 < N; n += 8) block_8x1(K, alpha, A, B + (long)n * ldb, ldb, beta, C + n);
  for (; n + 3 < N; n += 4) {
    int m = 0;
    for (; m + 1 < M; m += 2)
      block_4x2(K, alpha, A + (long)m * lda, lda, B + (long)n * ldb, ldb, beta, C + (long)m * ldc + n, ldc);
    for (; m < M; m++)
      block_4x1(K, alpha, A + (long)m * lda, B + (long)n * ldb, ldb, beta, C + (long)m * ldc + n);
  }
  for (; n < N; n++)
    for (int m = 0; m < M; m++)
      put(C + (long)m * ldc + n, alpha, dot(A + (long)m * lda, B + (long)n * ldb, K), beta);
}

/* Two or more cores: a persistent helper thread takes the upper half of the weight rows
   (each thread streams its own rows: one core does not saturate memory bandwidth). Decode
   steps issue a product every few tens of microseconds, so both sides spin on atomics for a
   while before sleeping: a condition-variable wake-up alone costs as much as a product.
   Only one product is split at a time; a concurrent caller finds the helper busy and
   computes alone. */
typedef struct packed packed_t;
typedef void (*range_fn)(void *ctx, int i0, int i1);
typedef struct { int M, N, K; f32 alpha, beta; const f32 *A, *B; f32 *C; int lda, ldb, ldc;
                 const packed_t *P; range_fn fn; void *ctx; } job_t;
static void packed_rows(const job_t *j, int n0, int n1);
static void run_rows(const job_t *j, int n0, int n1) {
  if (j->fn) { j->fn(j->ctx, n0, n1); return; }
  if (j->P) { packed_rows(j, n0, n1); return; }
  small_m_nt(j->M, n1 - n0, j->K, j->alpha, j->A, j->lda, j->B + (long)n0 * j->ldb, j->ldb,
             j->beta, j->C + n0, j->ldc);
}
static pthread_mutex_t split_mu = PTHREAD_MUTEX_INITIALIZER, sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static job_t job;
static int job_half, job_seq, done_seq, helper_started, split_threads = 1;
/* Set while OpenBLAS runs a product on its own threads: the helper sleeps at once instead
   of spinning against them (on 2 cores a spinning helper cost OpenBLAS a 4 ms time slice). */
static int helper_parked;
#define SPLIT_MIN_WORK (1L << 19)   /* multiply-adds below which splitting does not pay */
#define SPIN_ROUNDS 200000          /* ~1 ms of polling before the helper sleeps */

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static void *helper_main(void *unused) {
  (void)unused;
  int seen = 0;
  for (;;) {
    int spins = 0;
    while (__atomic_load_n(&job_seq, __ATOMIC_ACQUIRE) == seen) {
      if (++spins < SPIN_ROUNDS && !__atomic_load_n(&helper_parked, __ATOMIC_RELAXED)) { relax(); continue; }
      pthread_mutex_lock(&sleep_mu);
      while (__atomic_load_n(&job_seq, __ATOMIC_ACQUIRE) == seen) pthread_cond_wait(&wake_cv, &sleep_mu);
      pthread_mutex_unlock(&sleep_mu);
    }
    seen = __atomic_load_n(&job_seq, __ATOMIC_ACQUIRE);
    run_rows(&job, job_half, job.N);
    __atomic_store_n(&done_seq, seen, __ATOMIC_RELEASE);
  }
  return 0;
}

void kvserve_blas_set_threads(int n) { split_threads = n > 1 ? 2 : 1; }

/* Output columns [0, N) of ``j``, split between this thread and the helper. */
static void split_rows(const job_t *j, long work) {
  if (split_threads < 2 || work < SPLIT_MIN_WORK || j->N < (j->fn ? 2 : 8) || pthread_mutex_trylock(&split_mu)) {
    run_rows(j, 0, j->N);
    return;
  }
  if (!helper_started) {
    pthread_t t;
    helper_started = pthread_create(&t, 0, helper_main, 0) == 0 ? 1 : -1;
    if (helper_started == 1) pthread_detach(t);
  }
  if (helper_started != 1) {
    pthread_mutex_unlock(&split_mu);
    run_rows(j, 0, j->N);
    return;
  }
  job = *j;
  job_half = j->fn ? j->N / 2 : (j->N / 2) & ~3;
  int seq = job_seq + 1;
  pthread_mutex_lock(&sleep_mu);
  __atomic_store_n(&job_seq, seq, __ATOMIC_RELEASE);
  pthread_cond_signal(&wake_cv);
  pthread_mutex_unlock(&sleep_mu);
  run_rows(j, 0, job_half);
  while (__atomic_load_n(&done_seq, __ATOMIC_ACQUIRE) != seq) relax();
  pthread_mutex_unlock(&split_mu);
}

/* fn(ctx, i0, i1) over [0, n), half of it on the helper thread when ``work`` (multiply-adds)
   pays for the hand-off: other CPU kernels (kernels/cpu_attention.cpp) share the one helper
   rather than start threads that would spin against it. */
void kvserve_parallel(range_fn fn, void *ctx, int n, long work) {
  job_t j = {0};
  j.N = n; j.fn = fn; j.ctx = ctx;
  split_rows(&j, work);
}

/* ---- Decode products that read a model's packed codes ----------------------------------
   A 4-bit model served as dense float32 (fastest for prefill, see weights.py) streams 8x
   the bytes it stores on every decode step, and a decode step of a small model on a CPU is
   bound by exactly that stream. Python registers, for each dense weight, the codes it was
   dequantized from (``kvserve_packed_add``); a product of at most SMALL_M rows against a
   registered weight reads the codes instead, dequantizing 32 weights at a time in
   registers: the same weight values (scale * q + bias), a fifth of the bytes.
   Codes are laid out for the vector loads: 4-bit, each 32 weights in 16 bytes, byte i
   holding weight i (low nibble) and weight i + 16 (high); 8-bit, one byte per weight.
   Scales and biases are float32, one per group of G weights (a multiple of 32). */
struct packed { const f32 *dense; int N, K, G, bits; const unsigned char *codes; const f32 *scales, *biases; };
#define PACKED_SLOTS 8192
#define TOMB ((const f32 *)1)
static packed_t slots[PACKED_SLOTS];
static int packed_live;
static pthread_rwlock_t packed_mu = PTHREAD_RWLOCK_INITIALIZER;
static unsigned long long packed_calls;
unsigned long long kvserve_packed_calls(void) { return packed_calls; }
int kvserve_packed_live(void) { return packed_live; }

static unsigned slot_of(const f32 *p) { return (unsigned)(((unsigned long)p >> 4) * 2654435761u) % PACKED_SLOTS; }

/* 1 when added, 0 when the table is full or the shape is not one the kernel takes. */
int kvserve_packed_add(const f32 *dense, int N, int K, int G, int bits, const unsigned char *codes,
                       const f32 *scales, const f32 *biases) {
  if ((bits != 4 && bits != 8) || G <= 0 || G % 32 || K % G || N <= 0) return 0;
  int ok = 0;
  pthread_rwlock_wrlock(&packed_mu);
  if (packed_live < PACKED_SLOTS / 2) {
    unsigned s = slot_of(dense);
    while (slots[s].dense && slots[s].dense != TOMB && slots[s].dense != dense) s = (s + 1) % PACKED_SLOTS;
    if (slots[s].dense != dense) packed_live++;
    slots[s] = (packed_t){dense, N, K, G, bits, codes, scales, biases};
    ok = 1;
  }
  pthread_rwlock_unlock(&packed_mu);
  return ok;
}

/* Called before the codes are freed; a product running against them finishes first. */
void kvserve_packed_remove(const f32 *dense) {
  pthread_rwlock_wrlock(&packed_mu);
  for (unsigned s = slot_of(dense); slots[s].dense; s = (s + 1) % PACKED_SLOTS)
    if (slots[s].dense == dense) { slots[s].dense = TOMB; packed_live--; break; }
  pthread_rwlock_unlock(&packed_mu);
}

static const packed_t *packed_find(const f32 *B, int N, int K, int ldb) {
  for (unsigned s = slot_of(B); slots[s].dense; s = (s + 1) % PACKED_SLOTS)
    if (slots[s].dense == B) return slots[s].N == N && slots[s].K == K && ldb == K ? &slots[s] : 0;
  return 0;
}

typedef float v16f __attribute__((vector_size(64)));
typedef unsigned v16u __attribute__((vector_size(64)));
static v16f ld16(const f32 *p) { v16f v; __builtin_memcpy(&v, p, sizeof v); return v; }
static f32 hsum16(v16f v) {
#if defined(__AVX512F__)
  __m512 w;
  __builtin_memcpy(&w, &v, sizeof w);
  return _mm512_reduce_add_ps(w);
#else
  f32 s = 0;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
#endif
}

/* 16 bytes zero-extended to 16 lanes; compilers scalarize the generic conversion. */
static v16u widen16(const unsigned char *c) {
  v16u u;
#if defined(__AVX512F__)
  __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
  __builtin_memcpy(&u, &w, sizeof u);
#elif defined(__AVX2__)
  __m256i w[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c)),
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8)))};
  __builtin_memcpy(&u, w, sizeof u);
#else
  for (int i = 0; i < 16; i++) u[i] = c[i];
#endif
  return u;
}

/* 32 weights from their codes: 4-bit (16 bytes, weight i and i + 16 in byte i) or 8-bit. */
static void dequant32(const unsigned char *c, int bits, v16f s, v16f b, v16f *lo, v16f *hi) {
  v16u u = widen16(c);
  if (bits == 4) {
    *lo = __builtin_convertvector(u & 15, v16f) * s + b;
    *hi = __builtin_convertvector(u >> 4, v16f) * s + b;
  } else {
    *lo = __builtin_convertvector(u, v16f) * s + b;
    *hi = __builtin_convertvector(widen16(c + 16), v16f) * s + b;
  }
}

/* R activation rows (from row m) against output rows [n0, n1): each weight is dequantized
   once per R activation rows. BITS is a constant, so each variant has no branch inside. */
#define PACKED_ROWS(R, BITS)                                                               \
  static void packed_##R##_##BITS(const job_t *j, int m, int n0, int n1) {                 \
    const packed_t *P = j->P;                                                              \
    const int groups = P->K / P->G, row_bytes = P->K * BITS / 8;                           \
    const f32 *a = j->A + (long)m * j->lda;                                                \
    for (int n = n0; n < n1; n++) {                                                        \
      const unsigned char *c = P->codes + (long)n * row_bytes;                             \
      const f32 *sc = P->scales + (long)n * groups, *bi = P->biases + (long)n * groups;    \
      v16f acc[R] = {{0}};                                                                 \
      for (int g = 0, k = 0; g < groups; g++) {                                            \
        v16f s = {0}, b = {0};                                                             \
        s += sc[g]; b += bi[g];                                                            \
        for (int e = k + P->G; k < e; k += 32, c += BITS * 4) {                            \
          v16f lo, hi;                                                                     \
          dequant32(c, BITS, s, b, &lo, &hi);                                              \
          for (int r = 0; r < R; r++) { /* two chained multiply-adds */                    \
            acc[r] += lo * ld16(a + (long)r * j->lda + k);                                 \
            acc[r] += hi * ld16(a + (long)r * j->lda + k + 16);                            \
          }                                                                                \
        }                                                                                  \
      }                                                                                    \
      for (int r = 0; r < R; r++) put(j->C + (long)(m + r) * j->ldc + n, j->alpha, hsum16(acc[r]), j->beta); \
    }                                                                                      \
  }
PACKED_ROWS(1, 4) PACKED_ROWS(2, 4) PACKED_ROWS(3, 4) PACKED_ROWS(4, 4)
PACKED_ROWS(5, 4) PACKED_ROWS(6, 4) PACKED_ROWS(7, 4) PACKED_ROWS(8, 4)
PACKED_ROWS(1, 8) PACKED_ROWS(2, 8) PACKED_ROWS(3, 8) PACKED_ROWS(4, 8)
PACKED_ROWS(5, 8) PACKED_ROWS(6, 8) PACKED_ROWS(7, 8) PACKED_ROWS(8, 8)
typedef void (*packed_fn)(const job_t *, int, int, int);
static const packed_fn packed_fns[2][8] = {
    {packed_1_4, packed_2_4, packed_3_4, packed_4_4, packed_5_4, packed_6_4, packed_7_4, packed_8_4},
    {packed_1_8, packed_2_8, packed_3_8, packed_4_8, packed_5_8, packed_6_8, packed_7_8, packed_8_8}};

/* Activation rows in blocks of 8, then the rest in one block: every block reads and
   dequantizes the weights once, so 5 rows (a verify step of 4 proposals, or a batch of 5)
   take one pass over the codes, not 4 + 1. */
static void packed_rows(const job_t *j, int n0, int n1) {
  for (int m = 0; m < j->M;) {
    int r = j->M - m >= 8 ? 8 : j->M - m;
    packed_fns[j->P->bits == 8][r - 1](j, m, n0, n1);
    m += r;
  }
}

/* 1 when B is a registered weight and the product was computed from its codes. */
static int packed_product(int ta, int tb, int M, int N, int K, f32 alpha, const f32 *A, int lda,
                          const f32 *B, int ldb, f32 beta, f32 *C, int ldc) {
  if (ta != NoTrans || tb != Trans || M > SMALL_M || !packed_live) return 0;
  pthread_rwlock_rdlock(&packed_mu);
  const packed_t *P = packed_find(B, N, K, ldb);
  if (P) {
    job_t j = {M, N, K, alpha, beta, A, B, C, lda, ldb, ldc, P, 0, 0};
    split_rows(&j, (long)M * N * K);
    __atomic_fetch_add(&packed_calls, 1, __ATOMIC_RELAXED);
  }
  pthread_rwlock_unlock(&packed_mu);
  return P != 0;
}

static unsigned long long small_calls;
unsigned long long kvserve_blas_small_calls(void) { return small_calls; }

/* Time spent in products, for profiles of a step (bench/step_profile.py). */
static unsigned long long product_ns;
unsigned long long kvserve_blas_product_ns(void) { return product_ns; }
static unsigned long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long long)t.tv_sec * 1000000000ull + t.tv_nsec;
}

static void sgemm_row_major(int ta, int tb, int M, int N, int K, f32 alpha, const f32 *A, int lda,
                            const f32 *B, int ldb, f32 beta, f32 *C, int ldc);

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, f32 alpha,
                 const f32 *A, int lda, const f32 *B, int ldb, f32 beta,
                 f32 *C, int ldc) {
  unsigned long long start = now_ns();
  if (order == ColMajor) /* same product, seen as row-major C^T */
    sgemm_row_major(tb, ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
  else
    sgemm_row_major(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  __atomic_fetch_add(&product_ns, now_ns() - start, __ATOMIC_RELAXED);
}

static void sgemm_row_major(int ta, int tb, int M, int N, int K, f32 alpha, const f32 *A, int lda,
                            const f32 *B, int ldb, f32 beta, f32 *C, int ldc) {
  if (packed_product(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
  /* One row too (not sgemv): OpenBLAS's gemv sums in another order than the few-rows
     blocks, so a row alone would round differently from the same row in a batch. */
  if (ta == NoTrans && tb == Trans && M <= SMALL_M && K >= 8) {
    __atomic_fetch_add(&small_calls, 1, __ATOMIC_RELAXED);
    job_t j = {M, N, K, alpha, beta, A, B, C, lda, ldb, ldc, 0, 0, 0};
    split_rows(&j, (long)M * N * K);
    return;
  }
  if (as_gemv(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
    __atomic_fetch_add(&sgemv_calls, 1, __ATOMIC_RELAXED);
    return;
  }
  __atomic_fetch_add(&sgemm_calls, 1, __ATOMIC_RELAXED);
  __atomic_store_n(&helper_parked, 1, __ATOMIC_RELAXED);
  scipy_cblas_sgemm(RowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  __atomic_store_n(&helper_parked, 0, __ATOMIC_RELAXED);
}

void cblas_dgemm(int order, int ta, int tb, int M, int N, int K, double alpha,
                 const double *A, int lda, const double *B, int ldb,
                 double beta, double *C, int ldc) {
  scipy_cblas_dgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int M, int N, int K,
                 const void *alpha, const void *A, int lda, const void *B,
                 int ldb, const void *beta, void *C, int ldc) {
  scipy_cblas_cgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
