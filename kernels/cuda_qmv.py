"""Quantized weights times a few rows of activations on NVIDIA GPUs (``mx.fast.cuda_kernel``).

A decode step multiplies every weight matrix by one row of activations per running
request: M = 1 to 8 rows; a short prompt chunk or a speculative step's verification, by up
to 64. MLX's CUDA backend serves M > 1 with its tiled tensor-core
GEMM (``qmm_sm80``), whose 64-row tiles are mostly empty at M = 8: a Llama-3-8B shape with
4-bit weights spent 26.2 of its 33.6 ms decode step there on an H200 (3.87 GB of weights
at 150 GB/s; docs/benchmarks/gpu-serve.md, ninth round). This kernel puts the M rows in the
8 columns of one ``mma.sync.m16n8k16`` and 16 rows of the weights in its 16 rows, so the
tensor cores do the N K M multiply-adds and the product is bound by the weights' bytes:

    block b:        outputs n0 = 16 b ... n0 + 15, SPLIT warps splitting K
    superblock:     4 runs of 128 / bits values (4 packed words: one 16-byte load each);
                    warp w takes superblocks w, w + SPLIT, ... (the next one loaded while
                    the tensor cores work on this one)
    lane (g, t):    g = lane / 4, t = lane % 4: run t of rows n0 + g and n0 + g + 8 of W
                    (its group's scale and bias with it), dequantized to f16 / bf16 pairs
                    by ``AffineRun`` (the attention kernels' decoder), and the same values
                    of activation row g (rows >= M read row 0; their columns are dropped)
    column tiles:   M > 8 rows take TILES = 2, 4 or 8 mma steps per A fragment, one per 8
                    rows (``tiles_for``): the weights are decoded once for all of them, and
                    row 8 c + g's activations are loaded for tile c as it is multiplied
    mma step:       the pairs (p, p + 4) of each word (4 bits; (p, p + 2) at 8 bits) are the
                    A fragment's pairs, in any order as long as B's pairs follow it: the
                    activations' pairs are rebuilt in that order with one byte permute each
    reduction:      the SPLIT warps' 16 x 8 TILES partial sums added through shared memory

K is a whole number of runs (``serves_weights``); where it is not a whole number of
superblocks, the last one's missing runs multiply zeros. The A values are rounded once to the activation
dtype (as MLX's GEMM does) and summed in float32, in another order than MLX's kernels, so
results agree to rounding (``tests/test_kernels_cuda.py`` checks them on a GPU).

Worked example: a 4-bit ``nn.QuantizedLinear`` of 4096 -> 14336 (group 64), 8 rows: 896
blocks of 8 warps (``split_for``); each warp takes 4 of the row's 32 superblocks, each
lane 2 x 16 bytes of weights and 64 bytes of activations per superblock, and runs 8 mma
steps on each.

The previous kernel, one warp per output on CUDA cores, read all M rows of activations for
each row of weights (32 times the weights' bytes at M = 8, from L1 and L2): Llama-3-8B's
products summed to 13 ms a step at M = 8 on an H200, 2.6 ms with this one. With column
tiles, 16 and 32 rows took 1.7-8.5x less time than MLX's GEMM on those shapes (an H100,
thirteenth round); at 64 rows the widest matrices are about even (gate/up 206 against 231
us, the head 342 against 303) and o and down 3.3-3.4x faster, so ``MAX_ROWS`` is 64.

Affine modes only (MLX's default), 4 or 8 bits (8 in float16 only: 128 + 255 is not exact
in bfloat16, see ``Magic``), groups of 32, 64 or 128, 1 <= M <= ``MAX_ROWS``: ``serves``
says where (one row only for large matrices); elsewhere the caller keeps
``mx.quantized_matmul``.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from kvserve.kernels.cuda_programs import cuda_kernel

from kvserve.kernels.cuda_layout import kernel_name, on_cuda
from kvserve.kernels.cuda_mma_header import MMA_HEADER
from kvserve.kernels.cuda_source import CORE_HEADER

MAX_ROWS = 64
BITS = (4, 8)
GROUPS = (32, 64, 128)
SPLITS = (1, 2, 4, 8, 16)  # warps per block that bench/gpu_qmv.py compares
MAX_SPLIT_TILES = 64  # warps x column tiles: their partial sums fill 32 KB of shared memory

HEADER = CORE_HEADER + MMA_HEADER + r"""
template <typename P> struct Pointee;                // the activations' type, from x's pointer
template <typename E> struct Pointee<const E*> { using type = E; };

// One superblock's share of a lane: run t of its two rows of W and of its activation row
// (activation rows of the first column tile only: the others are read when multiplied).
template <typename T, int B, int GS>
struct QmvRuns {
  static constexpr int N = 128 / B, P = N / 2, PPW = 16 / B;   // values, pairs, pairs a word
  using Run = kvt::AffineRun<T, B, GS, N, 4>;
  Run a, b;
  uint32_t x[N / 2];                                 // N activations, two a word
  int e = -1;                                        // the run's first value; -1: past K
  __device__ __forceinline__ void load(const uint32_t* wa, const T* sa, const T* za,
                                       const uint32_t* wb, const T* sb, const T* zb,
                                       const T* xrow, int e0, int K) {
    const bool in = e0 < K;                          // past K: zeros times any finite weights
    e = in ? e0 : -1;
    a.load(wa, sa, za, in ? e0 : 0);
    b.load(wb, sb, zb, in ? e0 : 0);
    load_x(xrow, x);
  }
  __device__ __forceinline__ void load_x(const T* xrow, uint32_t* w) const {
    if (e >= 0) {
      kvs::load_words<N / 2, 4>(reinterpret_cast<const uint32_t*>(xrow + e), w);
    } else {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) w[i] = 0u;
    }
  }
  // d[c]: column tile c (activation rows 8 c ... 8 c + 7); the weights are decoded once
  // for all CT tiles. rows[c]: lane's activation row of tile c (tile 0's is loaded).
  template <int CT>
  __device__ __forceinline__ void mma(float (*d)[4], const T* const* rows) const {
    uint32_t pa[P], pb[P];
    a.decode(pa, nullptr);
    b.decode(pb, nullptr);
    tile(d[0], pa, pb, x);
#pragma unroll
    for (int c = 1; c < CT; ++c) {
      uint32_t xc[N / 2];
      load_x(rows[c], xc);
      tile(d[c], pa, pb, xc);
    }
  }
  static __device__ __forceinline__ void tile(float* d, const uint32_t* pa, const uint32_t* pb,
                                              const uint32_t* xw) {
    uint32_t px[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {                    // pair i = (word m, p): values
      const int m = i / PPW, p = i % PPW;            // (2 PPW m + p, 2 PPW m + p + PPW)
      px[i] = __byte_perm(xw[PPW * m + p / 2], xw[PPW * m + p / 2 + PPW / 2], p % 2 ? 0x7632 : 0x5410);
    }
#pragma unroll
    for (int s = 0; s < P / 2; ++s) {
      const uint32_t av[4] = {pa[2 * s], pb[2 * s], pa[2 * s + 1], pb[2 * s + 1]};
      const uint32_t bv[2] = {px[2 * s], px[2 * s + 1]};
      kvt::Act<T>::mma(d, av, bv);
    }
  }
};
"""
BODY = r"""
  constexpr int B = NBITS, GS = GROUP, KS = SPLIT, CT = TILES;
  using T = typename Pointee<decltype(x)>::type;
  using Runs = QmvRuns<T, B, GS>;
  constexpr int RUN = Runs::N;
  __shared__ float partial[KS * CT * 128];
  const int M = x_shape[0], K = x_shape[1], NO = w_shape[0];
  const int KW = K * B / 32, G = K / GS, SB = (K + 4 * RUN - 1) / (4 * RUN);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16;
  // Rows past N or M read row 0: they only feed outputs that are never written.
  const int ra = n0 + g < NO ? n0 + g : 0, rb = n0 + g + 8 < NO ? n0 + g + 8 : 0;
  const uint32_t* wa = w + (size_t)ra * KW;
  const uint32_t* wb = w + (size_t)rb * KW;
  const T* rows[CT];
#pragma unroll
  for (int c = 0; c < CT; ++c) rows[c] = x + (size_t)(8 * c + g < M ? 8 * c + g : 0) * K;
  float d[CT][4];
#pragma unroll
  for (int c = 0; c < CT; ++c) d[c][0] = d[c][1] = d[c][2] = d[c][3] = 0.f;
  Runs cur, nxt;
  if (warp < SB)
    cur.load(wa, scales + (size_t)ra * G, biases + (size_t)ra * G, wb, scales + (size_t)rb * G,
             biases + (size_t)rb * G, rows[0], warp * 4 * RUN + t * RUN, K);
  for (int sb = warp; sb < SB; sb += KS) {
    if (sb + KS < SB)
      nxt.load(wa, scales + (size_t)ra * G, biases + (size_t)ra * G, wb, scales + (size_t)rb * G,
               biases + (size_t)rb * G, rows[0], (sb + KS) * 4 * RUN + t * RUN, K);
    cur.template mma<CT>(d, rows);
    cur = nxt;
  }
  // d[c]: outputs n0 + g and n0 + g + 8, each times x rows 8 c + 2 t and 8 c + 2 t + 1;
  // kept as partial[warp][m][n - n0], so each row's 16 outputs are written together.
  float* mine = partial + warp * CT * 128;
#pragma unroll
  for (int c = 0; c < CT; ++c) {
    const int m = 8 * c + 2 * t;
    mine[m * 16 + g] = d[c][0];
    mine[(m + 1) * 16 + g] = d[c][1];
    mine[m * 16 + g + 8] = d[c][2];
    mine[(m + 1) * 16 + g + 8] = d[c][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < CT * 128; i += KS * 32) {
    const int n = n0 + i % 16, m = i / 16;
    if (n >= NO || m >= M) continue;
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k) v += partial[k * CT * 128 + i];
    y[(size_t)m * NO + n] = static_cast<T>(v);
  }
"""


def serves(x: mx.array, w: mx.array, scales: mx.array, group_size: int, bits: int, mode: str,
           transpose: bool = True) -> bool:
    """Where ``quantized_matmul`` runs here: a CUDA GPU, weights ``serves_weights`` takes,
    and the rows ``serves_rows`` takes."""
    return (transpose and serves_weights(w, scales, group_size, bits, mode)
            and serves_rows(x, scales, w.shape[0] * w.shape[1] * 32 // bits) and on_cuda())


def serves_weights(w: mx.array, scales: mx.array, group_size: int, bits: int, mode: str) -> bool:
    """Output-major affine weights of ``BITS`` bits in groups of ``GROUPS``, float16 or
    bfloat16 scales: what a layer can check once, when it is loaded."""
    return (mode == "affine" and bits in BITS and group_size in GROUPS and w.ndim == 2
            and w.dtype == mx.uint32 and scales.dtype in (mx.float16, mx.bfloat16)
            and (w.shape[1] * 32 // bits) % group_size == 0 and w.shape[1] % 4 == 0
            and not (bits == 8 and scales.dtype == mx.bfloat16))


# Below this many weights a product is a few microseconds either way, and one row goes to
# MLX's matrix-vector kernel: its call costs the host less than a custom kernel's, which is
# what a one-stream step of a small model waits on.
ONE_ROW_WEIGHTS = 1 << 24


def serves_rows(x: mx.array, scales: mx.array, weights: int) -> bool:
    """A decode step's rows in the scales' dtype: 2 to ``MAX_ROWS``, or one where the matrix
    holds at least ``ONE_ROW_WEIGHTS`` values (MLX's one-row kernel read Llama-3-8B's
    matrices at 400-920 GB/s, this one at 1.5-2.4 TB/s). Longer prompt chunks are not
    this kernel's.

        >>> x = mx.zeros((1, 4096), mx.float16)
        >>> serves_rows(x, x, 4096 * 4096), serves_rows(x, x, 576 * 3072)
        (True, False)
    """
    rows = x.size // max(x.shape[-1], 1)
    return x.dtype == scales.dtype and (2 if weights < ONE_ROW_WEIGHTS else 1) <= rows <= MAX_ROWS


@functools.cache
def _kernel(bits: int, group_size: int, split: int, tiles: int):
    body = (BODY.replace("NBITS", str(bits)).replace("GROUP", str(group_size))
            .replace("SPLIT", str(split)).replace("TILES", str(tiles)))
    return cuda_kernel(name=kernel_name(f"kvs_qmv_mma_{bits}_{group_size}_{split}_{tiles}", HEADER, body),
                               input_names=["x", "w", "scales", "biases"], output_names=["y"],
                               source=body, header=HEADER)


def tiles_for(rows: int) -> int:
    """Column tiles of 8 activation rows a kernel multiplies, a power of two (one compiled
    kernel per count: 9-16 rows take 2 tiles, 17-32 take 4, 33-64 take 8).

        >>> [tiles_for(m) for m in (1, 8, 9, 16, 17, 33, 64)]
        [1, 1, 2, 2, 4, 8, 8]
    """
    return 1 << max(0, (rows - 1) // 8).bit_length()


def split_for(K: int, N: int, bits: int, tiles: int = 1) -> int:
    """Warps per block for a (K -> N) product: 16 where the outputs make few blocks (N <
    8192: fewer than 512 blocks of 16), 8 where they make many, and never fewer than two
    superblocks (4 x 128 / bits values) a warp. Measured on an H200 over Llama-3-8B's shapes
    (docs/benchmarks/gpu-serve.md, twelfth round): 16 warps were fastest for 4096 outputs
    and 8 for 28672 and 49152. The warps' partial sums (``tiles`` x 512 bytes each) stay
    within 32 KB of shared memory: at most ``MAX_SPLIT_TILES // tiles`` warps.

        >>> split_for(4096, 4096, 4), split_for(4096, 28672, 4), split_for(576, 960, 4)
        (16, 8, 2)
        >>> split_for(4096, 4096, 4, tiles=8)
        8
    """
    superblocks = -(-K * bits // 512)
    return min(16 if N < 8192 else 8, MAX_SPLIT_TILES // tiles, max(1, superblocks // 2))


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, bits: int, split: int | None = None) -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)`` for
    the few rows ``serves`` allows: (..., K) -> (..., N). ``split``: warps per block, one
    of ``SPLITS`` (default ``split_for``)."""
    K, N = x.shape[-1], w.shape[0]
    rows = x.size // K
    tiles = tiles_for(rows)
    split = split or split_for(K, N, bits, tiles)
    (y,) = _kernel(bits, group_size, split, tiles)(
        inputs=[x.reshape(rows, K), w, scales, biases],
        grid=(-(-N // 16) * split * 32, 1, 1), threadgroup=(split * 32, 1, 1),
        output_shapes=[(rows, N)], output_dtypes=[x.dtype])
    return y.reshape(*x.shape[:-1], N)
